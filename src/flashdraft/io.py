"""Small shared I/O helpers: atomic writes, progress bars, the log line, dtype names (and CPU means
float32), bytes per hidden-state token, byte sizes as config strings ("2TB") and back, device choice."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from . import errors
from .errors import disk_full, disk_full_error

# The dtype names configs use -> torch's names for them; the schema's enums are checked against these
# (tests/test_config.py).
TORCH_NAMES = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float8_e4m3": "float8_e4m3fn",
}
DTYPES = ("float32", "bfloat16", "float16")  # what a model runs in: target.dtype, train.dtype
STORAGE_DTYPES = ("bfloat16", "float32", "float8_e4m3")  # what a hidden-state shard stores: hidden.dtype
FP8 = "float8_e4m3"
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float8_e4m3": 1}  # bytes of one stored value


@dataclass(frozen=True)
class StorageDtype:
    """What a hidden-state shard stores (config key hidden.dtype), parsed once from its name."""

    name: str  # the name configs, manifests and shard metadata spell: "bfloat16", "float32", "float8_e4m3"
    itemsize: int  # bytes of one stored value
    quantized: bool  # fp8: values x / scale, with one float32 scale per token

    @classmethod
    def of(cls, dtype: str | StorageDtype) -> StorageDtype:
        """The storage dtype named `dtype` (one already parsed is returned as is); ValueError otherwise."""
        if isinstance(dtype, StorageDtype):
            return dtype
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"hidden.dtype {dtype!r} is not supported; use one of {sorted(STORAGE_DTYPES)}")
        return _STORAGE[dtype]

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, TORCH_NAMES[self.name])

    def bytes_per_token(self, num_features: int, hidden_size: int, last_hidden: bool = False) -> int:
        """Bytes one token takes in a shard: its K*H features and, when the shard holds it, the target's
        last hidden state (H more), each column with a float32 scale when quantized; int32 id, int8 mask."""
        columns = [num_features * hidden_size] + ([hidden_size] if last_hidden else [])
        return sum(width * self.itemsize + (4 if self.quantized else 0) for width in columns) + 5

    def __str__(self) -> str:
        return self.name


_STORAGE = {name: StorageDtype(name, ITEMSIZE[name], name == FP8) for name in STORAGE_DTYPES}


def bytes_per_token(
    dtype: str | StorageDtype, num_features: int, hidden_size: int, last_hidden: bool = False
) -> int:
    """Bytes one token takes in a hidden-state shard (StorageDtype.bytes_per_token): every estimate of
    hidden-state bytes (the precompute preflight, the plan, stream mode's chunks) counts with it. Without
    torch, so the config and the plan can size chunks and disks."""
    return StorageDtype.of(dtype).bytes_per_token(num_features, hidden_size, last_hidden)


# "2TB", "500 GB", "1.5TiB", "2e12", "4096": decimal units are powers of 1000, binary (KiB..) of 1024
_UNITS = {
    "": 1,
    "b": 1,
    **{f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgtp")},
    **{f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgtp")},
}
_SIZE = re.compile(r"\s*(\d+\.?\d*(?:e[+-]?\d+)?|\.\d+(?:e[+-]?\d+)?)\s*([kmgtp]i?b|b)?\s*", re.IGNORECASE)


def parse_bytes(value, key: str = "size") -> int:
    """Bytes from an int or a string such as "2TB", "500GB", "1.5TiB" or "2e12" (whole bytes, rounded
    down); anything else is a ValueError naming `key`."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if not m:
        raise ValueError(
            f"{key}: {value!r} is not a size; give bytes (an integer >= 0) or a string such "
            "as 2TB, 500GB, 1.5TiB or 2e12"
        )
    from decimal import Decimal

    return int(Decimal(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def free_bytes(path) -> int:
    """Free bytes on the disk that holds `path` (its nearest existing ancestor when it is not made yet)."""
    d = Path(path).resolve()
    while not d.exists():
        d = d.parent
    return shutil.disk_usage(d).free


def human_bytes(n: float) -> str:
    """Bytes in decimal units, three significant digits: 2.05 TB, 500 GB, 12 B."""
    for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary sibling path; rename it onto `path` only if the block succeeds.

    A crash leaves no file at `path` (only a `.tmp-*` sibling that the next run ignores); a full disk is
    reported as a UserError naming `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{uuid.uuid4().hex[:8]}-{path.name}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        if disk_full(e):
            raise disk_full_error(path) from e
        raise
    finally:
        if tmp.exists():
            if tmp.is_dir():
                shutil.rmtree(tmp)
            else:
                tmp.unlink()


def write_json(path, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def file_digests(paths, cache) -> dict[str, str]:
    """`size:sha256` of each file. A digest kept in `cache` (a JSON file) is reused while the file's size,
    mtime, ctime and inode stay: a rewrite under the old mtime (cp -p, rsync -t, tar x) still moves its
    ctime, which no tool sets back."""
    cache = Path(cache)
    try:
        kept = json.loads(cache.read_text())
    except (OSError, ValueError):
        kept = {}
    out, fresh = {}, {}
    for path in map(str, paths):
        st = os.stat(path)
        key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        entry = kept.get(path)
        if not (isinstance(entry, list) and entry[:1] == [key]):
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
            entry = [key, digest.hexdigest()]
        fresh[path] = entry
        out[path] = f"{st.st_size}:{entry[1]}"
    if fresh != {p: kept.get(p) for p in fresh}:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_json(cache, {**kept, **fresh})
    return out


def write_parquet(table, path) -> None:
    """Write a pyarrow Table or pandas DataFrame atomically."""
    import pyarrow as pa  # here, not above: the config parses sizes with this module, and stays light
    import pyarrow.parquet as pq

    if not isinstance(table, pa.Table):
        table = pa.Table.from_pandas(table, preserve_index=False)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def progress(iterable=None, **kwargs):
    """tqdm with rate and ETA; in log files (no TTY) it prints a line every 10 s instead of redrawing. A job
    the workflow started also puts its status on the workflow's console (console_status)."""
    from tqdm import tqdm

    class Bar(tqdm):
        def display(self, *args, **kw):  # tqdm's own throttle (mininterval) calls it: no cost between
            if self.console is not None:
                self.console.line(console_line(self))
            return super().display(*args, **kw)

        def close(self):
            if self.console is not None and not self.disable:
                self.console.line(console_line(self), final=True)
                self.console = None
            super().close()

    tty = sys.stderr.isatty()
    kwargs.setdefault("mininterval", 0.5 if tty else 10.0)
    kwargs.setdefault("dynamic_ncols", tty)
    kwargs.setdefault("ascii", not tty)
    Bar.console = kwargs.pop("console", None) or console_status()
    return Bar(iterable, file=sys.stderr, **kwargs)


# The console of the Snakemake run that started this job (/proc/<its pid>/fd/2) and its host, set by
# workflow/rules/common.smk: a job's log takes its output, and this its status line.
CONSOLE_ENV, CONSOLE_HOST_ENV = "FLASHDRAFT_CONSOLE", "FLASHDRAFT_CONSOLE_HOST"
CONSOLE_EVERY_S = 30.0  # a long job's status line on the console, at most this often
CONSOLE_FORMAT = (
    "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) [{elapsed} elapsed, ETA {remaining}, "
    "{rate_fmt}{postfix}]"
)
CONSOLE_FORMAT_OPEN = "{desc}: {n_fmt} [{elapsed} elapsed, {rate_fmt}{postfix}]"  # no total known


class Throttle:
    """Lines at most every `every_s` seconds, none before the first `every_s` has passed (Snakemake shows the
    job's start), and the last always (`final`)."""

    def __init__(self, write, every_s: float = CONSOLE_EVERY_S, clock=time.monotonic):
        self.write, self.every_s, self.clock = write, every_s, clock
        self.last = clock()

    def line(self, text: str, final: bool = False) -> None:
        now = self.clock()
        if final or now - self.last >= self.every_s:
            self.last = now
            self.write(text)


def console_env() -> dict:
    """The environment that sends the status lines of the jobs this process starts to its stderr (on this
    host: a job elsewhere opens no path of this one); none where /proc does not show it, nor where stderr
    is a file written at its own offset (`> run.log`, not `>> run.log`): a job's line there would be
    written over."""
    import fcntl
    import socket
    import stat

    console = Path("/proc", str(os.getpid()), "fd", "2")
    if not console.exists() or (
        stat.S_ISREG(os.fstat(2).st_mode) and not fcntl.fcntl(2, fcntl.F_GETFL) & os.O_APPEND
    ):
        return {}
    return {CONSOLE_ENV: str(console), CONSOLE_HOST_ENV: socket.gethostname()}


def console_status() -> Throttle | None:
    """This job's status lines to the console of the workflow that started it, or None: outside a workflow,
    or on another host than it (a SLURM job: its output goes to the SLURM log)."""
    import socket

    path = os.environ.get(CONSOLE_ENV)
    if not path or os.environ.get(CONSOLE_HOST_ENV) != socket.gethostname():
        return None

    def write(text: str) -> None:
        try:
            with open(path, "a") as f:  # appends where the console is a file (nohup, a redirect)
                f.write(text + "\n")
        except OSError:  # the workflow has gone, or its stderr cannot be opened again (a socket)
            pass

    return Throttle(write)


def console_line(bar) -> str:
    """A bar's status in one line: its job (the script, its --shard), stage, done/total, elapsed<ETA, rate
    and postfix (training's loss and tau)."""
    fmt = CONSOLE_FORMAT if bar.total else CONSOLE_FORMAT_OPEN
    line = bar.format_meter(**{**bar.format_dict, "bar_format": fmt, "ncols": None})
    return f"[{job_label()}] " + " ".join(line.split())  # tqdm pads its rate


def job_label(argv=None) -> str:
    argv = sys.argv if argv is None else argv
    shard = argv[argv.index("--shard") + 1 :][:1] if "--shard" in argv else []
    return " ".join([Path(argv[0]).stem if argv and argv[0] else "flashdraft", *shard])


_T0 = time.perf_counter()


def process_age() -> float:
    """Seconds since this process started (from /proc on Linux, so imports count; else since this import)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # starttime
        start = ticks / os.sysconf("SC_CLK_TCK")
        return float(Path("/proc/uptime").read_text().split()[0]) - start
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _T0


def log(msg: str) -> None:
    """A line on stderr stamped with the process's age: a stage's log shows where its time goes. (stdout
    holds what a script reports as its result.)"""
    print(f"[{process_age():7.1f} s] {msg}", file=sys.stderr, flush=True)


def exit_on_stop_signals() -> None:
    """SIGTERM or Ctrl-C raise SystemExit(128 + the signal's number), as training exits: the stage
    unwinds through its cleanup (finally blocks, temporary files, a managed server); a second signal
    ends it at once."""

    def stop(signum, frame):
        signal.signal(signum, signal.SIG_DFL)
        errors.stopped_by = signum
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def background(fn, *args, name: str):
    """fn(*args) in a thread of its own, started now: its Future (`result()` waits, and raises its error)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


def torch_dtype(name: str, allowed: tuple[str, ...] = DTYPES, key: str = "dtype"):
    """The torch dtype of a config's dtype name; `allowed`: the names the config key `key` takes."""
    import torch

    if name not in allowed:
        raise ValueError(f"{key} {name!r} is not supported; use one of {sorted(allowed)}")
    return getattr(torch, TORCH_NAMES[name])


def run_dtype(name: str, dev) -> str:
    """The dtype a model runs in on `dev`: `name` on a GPU, float32 on the CPU, where bf16 and fp16 matmuls
    are slow and not what any CPU user wants."""
    return "float32" if dev.type == "cpu" else name


def device():
    """cuda:0 when a GPU is visible (the lease makes every process's GPU its cuda:0), else cpu."""
    import torch

    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def code_version(repo: Path | None = None) -> dict:
    """The commit (short) of the checkout at `repo` (default: this package's) and whether its tracked files
    have changes since; None for both where the code is not a git checkout (an installed package)."""
    repo = repo or Path(__file__).resolve().parents[2]

    def git(*args) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    changes = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if changes is None else bool(changes)}
