"""What every benchmark script shares: the machine it ran on, the code it ran, one timer, and the envelope
of its result file.

- `machine()`: the device (the CUDA device's name, or the CPU's model and core count), the CUDA and driver
  versions where there is a GPU, the CPU and its threads, torch, transformers, python and the platform.
- `code_version()`: the commit of this checkout and whether its tracked files have changes.
- `time_it(fn, warmup=, repeats=, number=)`: `fn` timed between CUDA synchronisations: seconds per call
  of each repeat, their median and spread.
- `write_result(path, result, params, goals)`: the script's result as it is, plus the envelope: top-level
  `benchmark` (the script's name), `argv` (its command line, the script's path from the repository root),
  `commit`, `dirty`, `machine`, and `params` and `goals` where given.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from flashdraft import io

REPO = Path(__file__).resolve().parents[1]
ENVELOPE = ("benchmark", "argv", "commit", "dirty", "machine")


# ---------------------------------------------------------------------------------------------------------
# where and what ran


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def driver_version() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it (None without it)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine(device=None) -> dict:
    """Where a benchmark ran. `device`: what it measured on ("cuda", "cuda:1", "cpu"; default the GPU where
    one is visible): a run on the CPU of a machine with a GPU is described by its CPU."""
    import torch

    cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    cores = os.cpu_count()
    out = {"device": torch.cuda.get_device_name(device) if cuda else f"{cpu_model()} ({cores} cores)"}
    if cuda:
        out |= {
            "gpus_visible": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
            "driver": driver_version(),
        }
    return out | {
        "cpu": cpu_model(),
        "cpu_cores": cores,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def code_version() -> dict:
    """This checkout's commit (short) and `dirty`: whether its tracked files have changes since."""
    return io.code_version(REPO)


# ---------------------------------------------------------------------------------------------------------
# the timer


def sync(device=None) -> None:
    """Wait for the work queued on the CUDA device (`device`, default the current one where CUDA is in use);
    nothing on the CPU."""
    import torch

    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Seconds per call, one value per repeat, and what the last call returned."""

    seconds: list[float]
    out: object = None

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread_s(self) -> float:
        """The largest minus the smallest repeat."""
        return max(self.seconds) - min(self.seconds)


def time_it(fn: Callable, *, warmup: int = 1, repeats: int = 5, number: int = 1, device=None) -> Timing:
    """`fn()` called `warmup` times untimed (compiles, lazy inits), then `repeats` times `number` calls, each
    repeat between two synchronisations of the CUDA device: the seconds per call of each repeat."""
    out = None
    for _ in range(warmup):
        out = fn()
    seconds = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        for _ in range(number):
            out = fn()
        sync(device)
        seconds.append((time.perf_counter() - t) / number)
    return Timing(seconds, out)


# ---------------------------------------------------------------------------------------------------------
# the result file


def command_line() -> list[str]:
    """sys.argv with the script as its path from the repository root (benchmarks/NAME.py)."""
    script = Path(sys.argv[0]).resolve()
    head = str(script.relative_to(REPO)) if script.is_relative_to(REPO) else sys.argv[0]
    return [head, *sys.argv[1:]]


def write_json(path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def write_result(
    path, result: dict, params: dict | None = None, goals: dict | None = None, device=None
) -> dict:
    """Write `result` to `path` (JSON) in the envelope and return what was written: the script's keys as
    they are, and `benchmark`, `argv`, `commit`, `dirty`, `machine` (machine(device)), `params` and `goals`
    where given. A key of the envelope the result holds already is an error: the envelope says it."""
    mine = [*ENVELOPE, *(["params"] if params is not None else []), *(["goals"] if goals is not None else [])]
    clash = [k for k in mine if k in result]
    if clash:
        raise ValueError(f"{path}: the result has the envelope's keys {clash}")
    envelope = {
        "benchmark": Path(sys.argv[0]).stem,
        "argv": command_line(),
        **code_version(),
        "machine": machine(device),
    }
    data = {**envelope, **result}
    if params is not None:
        data["params"] = params
    if goals is not None:
        data["goals"] = goals
    write_json(path, data)
    return data
