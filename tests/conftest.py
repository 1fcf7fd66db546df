import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

# Two test workers share the cores, each starting jobs that run as many OpenMP threads as its `--cores`:
# threads that spin while they wait for work then take the cores from the other worker's threads (a toy
# target trained by two jobs at once took 31 s each against 16 s). Waiting threads sleep instead; the
# numbers computed are the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
SNAKEFILE = REPO / "workflow" / "Snakefile"

# ---- the suite's shape: `slow` marks what starts a DAG, torchrun or SLURM, and those modules run first ----

# A real Snakemake run (dry runs too), a torchrun launch, a SLURM job or daemon: what `make test-fast` skips.
HEAVY = re.compile(
    r"(^|[\s/])(snakemake|torchrun|sbatch|srun|slurmctld|slurmd|slurmdbd)(\s|$)"
    r"|-m (snakemake|torch\.distributed\.run)(\s|$)"
)
_running: list = []  # the test item whose setup, call or teardown runs now


def pytest_collection_modifyitems(config, items):
    """Modules with the most `slow` tests first, the rest in their own order: with two workers
    (`-n 2 --dist loadfile --no-loadscope-reorder`), the long modules start at once and the short ones fill
    in behind them, so neither worker ends long after the other."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    first = {path: i for i, path in enumerate(p for p, _ in slow.most_common())}
    items.sort(key=lambda item: first.get(item.path, len(first)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


class _MarkedPopen(subprocess.Popen):
    """Refuses, in a test not marked `slow`, to start Snakemake, torchrun or SLURM (see HEAVY)."""

    def __init__(self, args, *rest, **kw):
        words = args if isinstance(args, str | bytes | os.PathLike) else " ".join(map(str, args))
        item = _running[-1] if _running else None
        if item is not None and not item.get_closest_marker("slow") and HEAVY.search(str(words)):
            raise AssertionError(
                f"{item.nodeid} starts `{str(words)[:120]}`: mark it `slow` "
                "(a real DAG, torchrun or SLURM; `make test-fast` skips those)"
            )
        super().__init__(args, *rest, **kw)


subprocess.Popen = _MarkedPopen


# The workflow keeps its jobs' bytecode in the work dir's .snakemake/pycache unless PYTHONPYCACHEPREFIX is
# set (rules/common.smk): every new work dir's first jobs would compile torch's, transformers' and Dynamo's
# sources again (~8 s of CPU per process that imports them first, over a hundred MB). The DAG runs share one
# prefix for the session (both workers), under the `session_dir` below; small_run keeps its own, as a
# user's run does (test_jobs_keep_their_bytecode_where_the_environment_forbids_writing_it).
_session: list[Path] = []


@pytest.fixture(scope="session", autouse=True)
def session_dir(tmp_path_factory):
    """A directory both test workers share for the session: the parent of an xdist worker's base temp."""
    root = tmp_path_factory.getbasetemp()
    _session.append(root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root)
    yield _session[-1]
    _session.clear()


def shared_pycache(env: dict) -> dict:
    """`env` with the jobs' bytecode in the session's shared cache, PYTHONDONTWRITEBYTECODE unset so that
    the Snakemake process keeps its own there too (its jobs unset it whatever this says)."""
    env = {**env, "PYTHONPYCACHEPREFIX": str(_session[-1] / "pycache")} if _session else dict(env)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def snakemake(
    workdir,
    *args,
    config=None,
    check=True,
    timeout=1800,
    env=None,
    snakefile=SNAKEFILE,
    entry=("-m", "snakemake"),
    own_pycache=False,
):
    """Run the real workflow with this interpreter's Snakemake in `workdir` (`env`: extra variables;
    `entry`: how this interpreter starts Snakemake; `own_pycache`: the jobs keep their bytecode in the work
    dir, as the workflow does by itself, not in the session's shared cache)."""
    cmd = [sys.executable, *entry, "-s", str(snakefile), "-d", str(workdir), *args]
    if config is not None:
        cmd += ["--configfile", str(config)]
    env = dict(os.environ if own_pycache else shared_pycache(os.environ), PYTHONUNBUFFERED="1", **(env or {}))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def run_python(code: str, timeout: float = 120):
    """`python -c code` in a fresh process with this checkout's flashdraft importable."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout
    )


def one_line_error(proc) -> str:
    """The one line a user error prints, last on stderr (after any progress lines); asserts the exit
    status and that no traceback was printed."""
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert [line for line in lines if ": error: " in line] == lines[-1:], proc.stderr
    return lines[-1]


def job_counts(output: str) -> dict[str, int]:
    """Parse the 'Job stats' table of a Snakemake (dry) run into {rule: count}."""
    counts, inside = {}, False
    for line in output.splitlines():
        if line.startswith("Job stats"):
            inside = True
            continue
        if inside:
            parts = line.split()
            if not parts or parts[0] == "total":
                if counts:
                    break
                continue
            if len(parts) == 2 and parts[1].isdigit():
                counts[parts[0]] = int(parts[1])
    return counts


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run thousands of small ops: a second intra-op thread gains little and costs much
    when other processes share the cores."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def toy_prompt_set(root, num_docs: int = 200, total: int = 40):
    """A random tiny toy target (root/target) and `total` toy prompts expanded into root/prompts."""
    from flashdraft import prompts, toy
    from flashdraft.config import PromptsConfig, SourceConfig, ToyConfig

    toy.build_toy_target(ToyConfig(steps=0, num_docs=num_docs), str(root / "target"))
    paths = toy.write_toy_sources(ToyConfig(source_rows=30), str(root / "sources"))
    cfg = PromptsConfig(
        total=total, eval_count=0, sources=[SourceConfig(name=k, path=v) for k, v in paths.items()]
    )
    prompts.expand(cfg, str(root / "prompts"))
    return root


def toy_hidden_shards(
    root,
    drafter: dict,
    shards: int = 2,
    rows: int = 24,
    seed: int = 0,
    stride: int = 3,
    name: str = "shard",
    last_hidden: bool = False,
) -> list[str]:
    """A random toy target (root/target) and real hidden-state shards of learnable token patterns (token
    j of a sample: start + stride * j, modulo 97); another `seed` or `stride` gives other data for the
    same target. `last_hidden`: the shards hold a random last_hidden column [n, H] too (the rows' other
    values are then drawn differently)."""
    import torch

    from flashdraft.config import DrafterConfig, ToyConfig
    from flashdraft.hidden import ShardMeta, manifest_path
    from flashdraft.hidden_write import open_shard, write_manifest
    from flashdraft.toy import build_toy_target
    from flashdraft.train_step import load_spec

    if not (root / "target").exists():
        build_toy_target(ToyConfig(steps=0, num_docs=200), str(root / "target"))
    spec = load_spec(root / "target", DrafterConfig(**drafter))
    g = torch.Generator().manual_seed(seed)
    width = spec.num_features * spec.hidden_size
    paths = []
    for s in range(shards):
        path = root / f"{name}-{s:05d}.arrow"
        meta = ShardMeta(
            target="toy",
            target_layer_ids=spec.target_layer_ids,
            hidden_size=spec.hidden_size,
            dtype="bfloat16",
            last_hidden=last_hidden,
        )
        with open_shard(path, meta) as w:
            for i in range(rows):
                n = int(torch.randint(40, 300, (1,), generator=g))  # some longer than the largest bucket
                start = int(torch.randint(0, 50, (1,), generator=g))
                ids = [(start + stride * j) % 97 + 10 for j in range(n)]  # an arithmetic pattern: learnable
                mask = [0] * (n // 3) + [1] * (n - n // 3)  # a "prompt" third, then the "answer"
                h = torch.randn(n, width, generator=g).to(torch.bfloat16)
                last = torch.randn(n, spec.hidden_size, generator=g).bfloat16() if last_hidden else None
                w.write(f"s{s}-{i}", ids, mask, h, last_hidden=last)
        write_manifest(manifest_path(path), w)
        paths.append(str(path))
    return paths


def cache_misses(counters: dict) -> int:
    """All compile-cache misses in a trainer's counters (FX graph, AOTAutograd)."""
    return sum(v for k, v in counters.items() if k.endswith("_miss"))


def production_sources(work) -> None:
    """config/production.yaml's three prompt sources under `work`/data, one conversation each in its shape
    (what the checks before any job read of them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = Path(work) / "data"
    data.mkdir(parents=True, exist_ok=True)
    turn = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]
    (data / "sharegpt.jsonl").write_text(json.dumps({"conversations": turn}) + "\n")
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "Hi"}]]}), data / "ultrachat.parquet")
    (data / "alpaca.json").write_text(json.dumps([{"instruction": "Hi", "input": "", "output": "Hello"}]))


def write_config(path, overrides=None, base=REPO / "config" / "config.yaml"):
    cfg = yaml.safe_load(Path(base).read_text())
    for key, value in (overrides or {}).items():
        section, _, name = key.partition(".")
        if name:
            cfg.setdefault(section, {})[name] = value
        else:
            cfg[section] = value
    Path(path).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


# A smaller embedded default for the end-to-end test: the same stages on less data.
SMALL = {
    "toy.num_docs": 800,
    "toy.steps": 80,
    "toy.source_rows": 60,
    "prompts.total": 96,
    "prompts.eval_count": 4,
    "regenerate.max_new_tokens": 24,
    "hidden.max_length": 128,
    "train.buckets": [128],
    "train.checkpoint_every": 5,
    "train.log_every": 1,
    "eval.num_prompts": 4,
    "eval.max_new_tokens": 24,
}


@pytest.fixture(scope="session")
def small_toy(session_dir):
    """A work dir holding the small config's toy target (results/toy/target, its job's log and benchmark, and
    Snakemake's record of the job), made by the real toy_target job once for the session, by whichever
    worker asks first: the DAG runs on the small config's toy (small_run, test_stream's) start from a copy
    (copy_toy), in which Snakemake finds the toy target up to date."""
    import fcntl

    work = session_dir / "small-toy"
    with open(session_dir / "small-toy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits for the one making it
        if not (work / "done").exists():
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            config = write_config(work / "config.yaml", SMALL)
            snakemake(work, "--cores", "2", "results/toy/target", config=config)
            (work / "done").touch()
    return work


def copy_toy(toy, work):
    """The small toy target's work dir (small_toy) copied into `work`."""
    shutil.copytree(
        toy,
        work,
        symlinks=True,
        dirs_exist_ok=True,
        ignore=lambda d, names: {"done", "config.yaml"} & set(names) if Path(d) == toy else set(),
    )
    return work


@pytest.fixture(scope="session")
def small_run(tmp_path_factory, small_toy):
    """The real DAG, run once to the end on the small config; tests inspect its artifacts. The toy target
    is small_toy's, made by the same job on the same config."""
    work = copy_toy(small_toy, tmp_path_factory.mktemp("dag"))
    config = write_config(work / "config.yaml", SMALL)
    # as in images that forbid bytecode: the jobs keep theirs in the workflow's cache all the same
    proc = snakemake(
        work, "--cores", "2", config=config, env={"PYTHONDONTWRITEBYTECODE": "1"}, own_pycache=True
    )
    return work, config, proc


def headless_dom(html_path, tmp_path, script: str = "") -> str:
    """Open a local HTML file in headless Chromium, run its scripts (and `script`), return the DOM."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        pytest.skip("no Chromium on this machine (.ci/run installs Debian's chromium)")
    page = Path(html_path)
    if script:
        page = Path(tmp_path) / f"with-script-{page.name}"
        page.write_text(Path(html_path).read_text() + f"<script>{script}</script>")
    cmd = [
        exe,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--virtual-time-budget=10000",
        "--dump-dom",
        page.resolve().as_uri(),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout


@pytest.fixture(scope="module")
def train_shards(tmp_path_factory):
    """A random (untrained) toy target and two real hidden-state shards of learnable token patterns, for the
    training tests: (its directory, the shard paths)."""
    from train_helpers import DRAFTER

    root = tmp_path_factory.mktemp("train")
    return root, toy_hidden_shards(root, DRAFTER)


@pytest.fixture(scope="module")
def setup():
    """The tiny drafter (model_helpers.tiny_spec) and a batch of two rows for the drafter and loss tests:
    (drafter, ids, loss_mask, hidden, embed, head, anchors, valid)."""
    import torch
    from model_helpers import MASK, V, tiny_spec

    from flashdraft.model import DFlashDrafter

    torch.manual_seed(0)
    spec = tiny_spec()
    drafter = DFlashDrafter(spec).eval()
    s = 40
    ids = torch.randint(0, MASK, (2, s))
    loss_mask = torch.zeros(2, s)
    loss_mask[0, 10:] = 1
    loss_mask[1, 5:30] = 1
    hidden = torch.randn(2, s, 2 * 64)
    embed, head = torch.randn(V, 64), torch.randn(V, 64) * 0.1
    anchors = torch.full((2, 16), -1)
    anchors[0, :3] = torch.tensor([12, 20, 30])
    anchors[1, :2] = torch.tensor([6, 25])
    return drafter, ids, loss_mask, hidden, embed, head, anchors, anchors >= 0
