"""The benchmark scripts against the library they measure: each one that runs on a CPU runs here, at its
smallest setting, as a subprocess writing into the test's directory, and must exit 0 with its result file
in the envelope (benchmarks/harness.py: `benchmark`, `argv`, `commit`, `machine`). The others need a GPU
or a whole Snakemake DAG of many minutes (NOT_RUN says which and why); they, and every other script, are
still imported and parse `--help`, so a broken import or argument shows here.

The training benchmarks (train_drafter.py, train_profile.py, fp8_curves.py) share one work dir, as they do
by default: the target, the shard and the trainer's bytecode are made once.
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))
from harness import ENVELOPE  # noqa: E402

NO_COMPILE = '{"compile": false}'  # the trainer eager: a compile on the CPU takes longer than the run

# script: its arguments at its smallest setting (and --out); {work}: its work dir, {train}: the training
# benchmarks' shared one
RUNS = {
    "checkpoint_io": ["--preset", "tiny", "--repeats", "1", "--work", "{work}"],
    "eval_decode": ["--preset", "tiny", "--prompts", "1", "--prompt-len", "16", "--new-tokens", "8"],
    "expand_prompts": ["--rows", "2000", "--total", "2000", "--eval-count", "20"],
    "loss_head": ["--preset", "tiny", "--repeats", "1"],
    "memory": ["--preset", "tiny", "--only", "eager 128x2", "--work", "{work}"],  # no GPU: measures none
    "make_run_stages": ["--results", "{work}"],  # a results/benchmarks tree written by the test
    "precompute_hidden": [
        "--mode",
        "gpu",
        "--preset",
        "tiny",
        "--tokens",
        "2000",
        "--min-len",
        "64",
        "--max-len",
        "128",
        "--batch-tokens",
        "1024",
        "--work",
        "{work}",
    ],
    "regenerate": [
        "--mode",
        "gpu",
        "--preset",
        "tiny",
        "--prompts",
        "4",
        "--new-tokens",
        "8",
        "--min-len",
        "16",
        "--max-len",
        "32",
        "--batch",
        "4",
        "--baseline-batch",
        "4",
        "--work",
        "{work}",
    ],
    # one process (no torchrun), throughput only: the cold and resumed starts are more of the same launches
    "train_drafter": [
        "--preset",
        "tiny",
        "--gpus",
        "1",
        "--steps",
        "2",
        "--log-every",
        "1",
        "--runs",
        "throughput",
        "--set",
        NO_COMPILE,
        "--work",
        "{train}",
    ],
    "train_profile": [
        "--preset",
        "tiny",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--set",
        NO_COMPILE,
        "--work",
        "{train}",
    ],
    "fp8_curves": ["--preset", "tiny", "--steps", "2", "--val-every", "1", "--work", "{train}"],
}
NOT_RUN = {
    "compile_variants": "compiling the training step on the CPU is what it measures: two fresh processes "
    "compile, about 45 s at its smallest setting, half this file's budget",
    "decode_step": "a static-engine decode step as a CUDA graph: needs a GPU",
    "side_by_side": "another benchmark twice a side, this checkout against an earlier commit's: its figures "
    "need a GPU (at --preset tiny --only train_drafter --repeats 1 it runs on a CPU in 40 s)",
    "family_quality": "the whole DAG on the embedded default, 3 variants x 3 seeds (an hour on 2 cores)",
    "figures": "writes the docs' figures, not a result: tests/test_docs.py runs it",
    "fp8_gate": "tests/test_fp8_gate.py runs it on the committed results",
    "fp8_parity": "tests/test_fp8_gate.py runs it at --preset tiny",
    "fp8_quality": "the whole DAG on the embedded default per dtype and seed (12 minutes on 2 cores)",
    "recipe_ablation": "the whole DAG on the embedded default, 5 variants x 3 seeds (half an hour)",
    "stream_rehearsal": "the whole stream-mode DAG (5 minutes at --preset tiny)",
    "train_quality": "the whole DAG per variant and seed, training on a GPU",
    "val_vs_eval": "the whole DAG on the embedded default per seed and loss (6 minutes a seed)",
}


def scripts() -> list[str]:
    """The runnable benchmark scripts: the files of benchmarks/ with a __main__ block (the others, shapes.py,
    harness.py, train_bench.py, ..., are their shared modules)."""
    return sorted(f.stem for f in BENCH.glob("*.py") if '__name__ == "__main__"' in f.read_text())


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), "CUDA_VISIBLE_DEVICES": ""}


def test_every_script_is_run_here_or_says_why_not():
    assert sorted([*RUNS, *NOT_RUN]) == scripts()
    assert not set(RUNS) & set(NOT_RUN)


@pytest.fixture(scope="module")
def train_work(tmp_path_factory, session_dir):
    """The training benchmarks' work dir; its trainer processes keep their bytecode in the session's shared
    cache (conftest.shared_pycache), as the DAG tests' jobs do, not in a new one of their own."""
    work = tmp_path_factory.mktemp("train-bench")
    (session_dir / "pycache").mkdir(exist_ok=True)
    (work / "pycache").symlink_to(session_dir / "pycache", target_is_directory=True)
    return work


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_the_script_runs_on_a_cpu_and_writes_its_result_in_the_envelope(name, tmp_path, train_work):
    work, out = tmp_path / "work", tmp_path / f"{name}.json"
    if name == "make_run_stages":  # what a finished `make run` leaves: a benchmark file per job
        for job, seconds in (("prompts", 2.5), ("train/chunk-0", 1.5)):
            tsv = work / "benchmarks" / f"{job}.tsv"
            tsv.parent.mkdir(parents=True)
            tsv.write_text(f"s\tmax_rss\n{seconds}\t100\n")
    args = [{"{work}": str(work), "{train}": str(train_work)}.get(a, a) for a in RUNS[name]]
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), *args, "--out", str(out)],
        cwd=tmp_path,
        env={**env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(out.read_text())
    assert all(k in result for k in ENVELOPE), sorted(result)
    assert result["benchmark"] == name
    assert result["argv"][0] == f"benchmarks/{name}.py" and result["argv"][1:] == [*args, "--out", str(out)]
    assert result["commit"]  # this checkout's
    assert result["machine"]["device"].endswith("cores)")  # the CPU's model and core count
    assert isinstance(result["params"], dict)


@pytest.mark.slow
def test_every_script_imports_and_parses_help():
    """Each script run as `python SCRIPT --help`, all in one process (one import of torch): its imports
    resolve and its arguments parse."""
    code = (
        "import runpy, sys\n"
        f"sys.path.insert(0, {str(BENCH)!r})\n"
        "for path in sys.argv[1:]:\n"
        "    sys.argv = [path, '--help']\n"
        "    try:\n"
        "        runpy.run_path(path, run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (path, e.code)\n"
        "    else:\n"
        "        raise AssertionError(f'{path}: --help did not exit')\n"
        "    print('ok', path)\n"
    )
    paths = [str(BENCH / f"{name}.py") for name in scripts()]
    proc = subprocess.run(
        [sys.executable, "-c", code, *paths], env=env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.count("\nok ") + proc.stdout.startswith("ok ") == len(paths), proc.stdout


@pytest.mark.parametrize("ref", ["--output={victim}", "no-such-commit"])
def test_side_by_side_a_ref_naming_no_commit_is_one_line_and_writes_no_file(ref, tmp_path):
    """`--ref=--output=FILE` is a ref, never `git archive`'s option (which would truncate FILE); a ref that
    names no commit is one line naming --ref, before any benchmark runs."""
    victim = tmp_path / "keep.txt"
    victim.write_text("kept\n")
    ref = ref.format(victim=victim)
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "side_by_side.py"),
            f"--ref={ref}",
            "--preset",
            "tiny",
            "--only",
            "train_drafter",
            "--repeats",
            "1",
            "--out",
            str(tmp_path / "out.json"),
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert victim.read_text() == "kept\n"
    assert proc.returncode == 1 and not (tmp_path / "out.json").exists(), proc.stderr[-3000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(f"--ref {ref}:"), proc.stderr
