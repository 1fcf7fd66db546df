"""A user mistake ends a script with one line naming what to fix, and no traceback (--verbose shows it)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import one_line_error, run_python

REPO = Path(__file__).resolve().parents[1]


def target_cfg(path, **kw) -> str:
    """The `target` config section of the target at `path` as a stage's --target-cfg."""
    from flashdraft.config import TargetConfig, to_json

    return to_json(TargetConfig(path=str(path), **kw))


def run_script(script, *args):
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, str(REPO / "scripts" / script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def expand(tmp_path, path, *extra):
    cfg = json.dumps({"sources": [{"name": "mine", "path": str(path)}]})
    return run_script("prompts.py", "--cfg", cfg, "--out-dir", tmp_path / "out", *extra)


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("empty.json", b"", "is empty"),
        ("truncated.json", b'[{"prompt": "What is', "is not valid JSON"),
        (
            "latin1.json",
            json.dumps([{"prompt": "café"}]).replace("\\u00e9", "\xe9").encode("latin-1"),
            "is not UTF-8",
        ),
        ("fake.parquet", b"this is not parquet\n" * 10, "is not a readable parquet file"),
    ],
)
def test_unreadable_source(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_bytes(content)
    line = one_line_error(expand(tmp_path, path))
    assert line.startswith("prompts: error: source 'mine': ") and str(path) in line
    assert expected in line


@pytest.mark.parametrize(
    "path, split, expected",
    [
        ("no-such-user/no-such-dataset", "train", "Couldn't reach 'no-such-user/no-such-dataset' on the Hub"),
        ("EMPTY", "train", "doesn't contain any data files"),
        ("DATA", "nope", "Bad split: nope. Available splits: ['train']"),
    ],
    ids=["unknown-hub-id", "folder-without-data-files", "unknown-split"],
)
def test_hf_dataset_that_cannot_be_loaded(tmp_path, monkeypatch, path, split, expected):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network: the hub answers nothing
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "DATA").mkdir()
    (tmp_path / "DATA" / "train.jsonl").write_text(json.dumps({"prompt": "Hi"}) + "\n")
    path = str(tmp_path / path) if path.isupper() else path
    cfg = json.dumps({"sources": [{"name": "mine", "path": path, "format": "hf", "split": split}]})
    line = one_line_error(run_script("prompts.py", "--cfg", cfg, "--out-dir", tmp_path / "out"))
    assert line.startswith(f"prompts: error: source 'mine': cannot read the HF dataset {path!r}")
    assert expected in line


def test_verbose_shows_the_traceback(tmp_path):
    path = tmp_path / "empty.json"
    path.write_bytes(b"")
    proc = expand(tmp_path, path, "--verbose")
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "UserError" in proc.stderr


def test_disk_preflight_refusal(tmp_path):
    from flashdraft.config import ToyConfig
    from flashdraft.toy import build_toy_target

    build_toy_target(ToyConfig(steps=0, num_docs=200), str(tmp_path / "target"))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    pq.write_table(pa.Table.from_pylist([{"id": "a", "messages": messages}]), tmp_path / "data.parquet")
    out = tmp_path / "hidden" / "shard-00000.arrow"
    proc = run_script(
        "hidden_shard.py",
        "--cfg",
        json.dumps({"disk_margin": 1e18}),
        "--target-cfg",
        target_cfg(tmp_path / "target", dtype="float32"),
        "--data",
        tmp_path / "data.parquet",
        "--shard",
        0,
        "--num-shards",
        1,
        "--out",
        out,
    )
    line = one_line_error(proc)
    assert "not enough disk space in" in line and str(out.parent) in line and " bytes) are free" in line
    assert not out.exists()


def small_disk(path, size="16k"):
    """A tmpfs of `size` mounted at `path` (root only); unmount it with umount."""
    path.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("needs root and tmpfs to fill a disk")
    return path


def test_disk_full_names_the_file(tmp_path):
    mnt = small_disk(tmp_path / "small")
    try:
        proc = run_script("toy_sources.py", "--cfg", json.dumps({"source_rows": 200}), "--out-dir", mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    line = one_line_error(proc)
    assert f"{mnt}/sharegpt.jsonl: no space left on device" in line


def precompute(tmp_path, out, cfg: dict):
    """scripts/hidden_shard.py on 8 conversations of about 450 tokens, with a random toy target."""
    from flashdraft.config import ToyConfig
    from flashdraft.toy import build_toy_target

    build_toy_target(ToyConfig(steps=0, num_docs=200), str(tmp_path / "target"))
    messages = [{"role": "user", "content": "Hi " * 200}, {"role": "assistant", "content": "Hello " * 200}]
    rows = [{"id": f"r{i}", "messages": messages} for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data.parquet")
    return run_script(
        "hidden_shard.py",
        "--cfg",
        json.dumps(cfg),
        "--target-cfg",
        target_cfg(tmp_path / "target", dtype="float32"),
        "--data",
        tmp_path / "data.parquet",
        "--shard",
        0,
        "--num-shards",
        1,
        "--out",
        out,
    )


def test_disk_preflight_says_small_sizes_in_a_fitting_unit(tmp_path):
    mnt = small_disk(tmp_path / "small", "64k")
    try:
        proc = precompute(tmp_path, mnt / "shard-00000.arrow", {})
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    line = one_line_error(proc)
    assert re.search(r"hidden states need about [\d.]+ [kMG]B \(\d+ bytes", line), line
    assert "but only 65.5 kB (65536 bytes) are free" in line


def test_disk_full_in_the_hidden_writer_thread(tmp_path):
    """The hidden-state rows are written by a background thread: its ENOSPC is still one line."""
    mnt = small_disk(tmp_path / "small", "256k")
    try:
        # a negative margin lets the preflight pass: the rows themselves fill the disk
        proc = precompute(tmp_path, mnt / "shard-00000.arrow", {"disk_margin": -0.99, "batch_tokens": 256})
        left = sorted(p.name for p in mnt.iterdir())
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    line = one_line_error(proc)
    assert line == (
        f"hidden_shard: error: {mnt}/shard-00000.arrow: no space left on device; free space "
        "there (or move results/) and rerun"
    )
    assert "shard-00000.arrow" not in left


def test_target_that_needs_remote_code(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    auto_map = {"AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}
    (target / "config.json").write_text(json.dumps({"model_type": "mine", "auto_map": auto_map}))
    messages = [{"role": "user", "content": "Hi"}]
    pq.write_table(
        pa.Table.from_pylist([{"id": "a", "source": "s", "messages": messages}]), tmp_path / "prompts.parquet"
    )
    proc = run_script(
        "regenerate.py",
        "--cfg",
        json.dumps({"enabled": False}),
        "--target-cfg",
        target_cfg(target),
        "--prompts",
        tmp_path / "prompts.parquet",
        "--out",
        tmp_path / "out.parquet",
        "--work-dir",
        tmp_path / "w",
    )
    line = one_line_error(proc)
    assert str(target / "config.json") in line and "needs remote code" in line and "modeling_mine" in line


def test_a_failed_script_exits_even_when_a_thread_would_keep_it():
    """A script whose main raises while a non-daemon thread never ends (a stuck reader, a worker pool)
    still exits, with every thread's stack on stderr, instead of holding its process (and GPU)."""
    code = (
        "import threading\n"
        "import flashdraft.errors as errors\n"
        "errors.EXIT_GRACE_S = 1\n"
        "@errors.cli\n"
        "def main(argv):\n"
        "    threading.Thread(target=threading.Event().wait, name='stuck').start()\n"
        "    raise RuntimeError('broken')\n"
        "main()\n"
    )
    p = run_python(code)
    assert p.returncode == 1
    assert "RuntimeError: broken" in p.stderr
    assert "Thread 0x" in p.stderr and "in wait" in p.stderr  # the stuck thread's stack


def test_a_stop_that_library_code_wraps_in_an_error_still_exits_as_the_stop():
    """SIGTERM raises SystemExit in the stage; code it interrupts may wrap that in an error of its own
    (Inductor around its compile, an import stopped in a class body): the script still exits 143, no
    traceback."""
    code = (
        "import os, signal, time\n"
        "import flashdraft.errors as errors\n"
        "from flashdraft.io import exit_on_stop_signals\n"
        "@errors.cli\n"
        "def main(argv):\n"
        "    exit_on_stop_signals()\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(10)\n"
        "    except SystemExit as e:\n"
        "        raise RuntimeError('compile failed') from e\n"
        "main()\n"
    )
    p = run_python(code)
    assert p.returncode == 143, p.stderr
    assert "Traceback" not in p.stderr and "stopped by signal 15 (RuntimeError on the way out)" in p.stderr


@pytest.mark.parametrize("wrapped", [False, True], ids=["raised", "wrapped-by-a-compile"])
def test_running_out_of_gpu_memory_is_one_line_naming_stage_prediction_and_keys(tmp_path, wrapped):
    """torch's OutOfMemoryError in a stage (or Inductor's error around it) ends it with one line: the
    stage, its predicted peak, the memory there and the keys to lower; --verbose keeps the traceback."""
    from flashdraft.shapes import QWEN3_8B

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **QWEN3_8B}))
    raise_it = "raise RuntimeError('compile failed: ' + str(e)) from e" if wrapped else "raise e"
    code = (
        "import torch\n"
        "from flashdraft import errors, memory\n"
        "from flashdraft.config import Config, TargetConfig, TrainConfig\n"
        "@errors.cli\n"
        "def main(argv):\n"
        f"    memory.on_oom('warmup', Config(train=TrainConfig(batch_tokens=16384), target=TargetConfig("
        f"path={str(tmp_path)!r})), 3, peak_of='train')\n"
        "    e = torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 3.00 GiB.')\n"
        f"    {raise_it}\n"
        "import sys\n"
        "main(sys.argv[1:])\n"
    )
    p = run_python(code)
    line = one_line_error(p)
    expected = (
        r"-c: error: stage warmup ran out of GPU memory: predicted peak [\d.]+ GiB \(bucket \d+, \d+ "
        r"rows a forward, ddp\), the GPU's memory; lower train\.batch_anchors, train\.batch_tokens, "
        r"train\.max_anchors \(python -m flashdraft\.plan .*\)"
    )
    assert re.fullmatch(expected, line), line
    verbose = run_python(code.replace("main(sys.argv[1:])", "main(['--verbose'])"))
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr and "OutOfMemoryError" in verbose.stderr


# ---- a failed job on the workflow's console (flashdraft.errors.FailureConsole) ----

TRACEBACK = """\
[gpu] 0 GPU(s) leased: CUDA_VISIBLE_DEVICES=''
Traceback (most recent call last):
  File "scripts/evaluate.py", line 47, in <module>
    main()
TypeError: unsupported operand type(s) for /: 'Tensor' and 'NoneType'
"""
RANKS = "[rank0]: train: error: bad shard\n[rank1]: train: error: bad shard\nChildFailedError:\n  rank: 0\n"


@pytest.mark.parametrize(
    "log, cause, expected",
    [
        (
            "read mine: 200 rows\nprompts: error: no usable prompt in any source\n",
            None,
            "failed: prompts: error: no usable prompt in any source",
        ),
        (RANKS, None, "failed: train: error: bad shard"),
        ("prompts: error: a\nprompts: error: b\n", None, "failed:\n  prompts: error: a\n  prompts: error: b"),
        (
            TRACEBACK,
            None,
            "failed (a crash: the traceback is in its log): TypeError: unsupported operand type(s) "
            "for /: 'Tensor' and 'NoneType'",
        ),
        (
            "step 1\rstep 2\rstep 3\n",
            "exit status 137: killed by SIGKILL",
            "failed (exit status 137: killed by SIGKILL): its log ends: step 3",
        ),
        ("", "exit status 2", "failed (exit status 2): nothing in its log"),
    ],
    ids=["one-line-error", "every-rank-says-it", "several-problems", "crash", "killed", "empty-log"],
)
def test_a_failed_job_is_the_error_its_log_ends_with_and_the_log(tmp_path, log, cause, expected):
    from flashdraft.errors import job_failure

    (tmp_path / "prompts.log").write_text(log)
    path = str(tmp_path / "prompts.log")
    assert job_failure("prompts", [path], cause) == f"rule prompts {expected}\n  log: {path}"


@pytest.mark.parametrize(
    "message, cause",
    [
        ("Command 'x > l.log 2>&1' returned non-zero exit status 1.", None),
        ("Command 'x' returned non-zero exit status 143.", "exit status 143: killed by SIGTERM"),
        ("Command 'x' returned non-zero exit status 3.", "exit status 3"),
        ("Command 'x' died with <Signals.SIGKILL: 9>.", "killed by SIGKILL"),
        (None, None),
    ],
)
def test_how_a_job_s_command_ended(message, cause):
    from flashdraft.errors import exit_cause

    assert exit_cause(message) == cause


def test_the_console_says_a_failed_job_once_and_leaves_the_rest_to_the_complete_log(tmp_path):
    """Snakemake's exception (with the command), its error block for the job (at once and again at the
    end), its last words: one account of the job on the console, the rest to the formatter it wraps."""
    import logging

    from flashdraft.errors import RUN_FAILED, FailureConsole

    log = tmp_path / "prompts.log"
    log.write_text("prompts: error: no usable prompt\n")
    console = FailureConsole(logging.Formatter("inner: %(message)s"))

    def say(msg, **extra):
        return console.format(logging.makeLogRecord({"msg": msg, "levelno": logging.ERROR, **extra}))

    command = (
        f"RuleException:\nCalledProcessError in file x:\nCommand 'cmd > {log} 2>&1' returned "
        "non-zero exit status 143."
    )
    job = {"event": "job_error", "jobid": 2, "rule_name": "prompts", "rule_msg": None, "log": [str(log)]}
    complete = "Complete log(s): /w/.snakemake/log/x.log"
    assert say(command, event="error", exception="RuleException") == ""
    assert say("Error in rule prompts, jobid: 2", **job) == (
        "rule prompts failed (exit status 143: killed by SIGTERM): prompts: error: no usable prompt\n"
        f"  log: {log}"
    )
    assert say("Shutting down.") == "inner: Shutting down."
    assert say("Exiting because a job execution failed. Look below for error messages") == ""
    assert say("Error in rule prompts, jobid: 2", **job) == ""
    assert console.failed == {2: "prompts"}
    assert say(complete) == f"inner: {complete}"
    console.summarized = True  # the workflow's own last lines said where that log is
    assert say(complete) == ""
    assert say(f"WorkflowError:\n{RUN_FAILED}.", event="error", exception="WorkflowError") == ""
    other = say("WorkflowError:\nsomething else", event="error", exception="WorkflowError")
    assert other == "inner: WorkflowError:\nsomething else"
