"""What the training tests share: the tiny drafter and training configs, scripts/train.py and
scripts/warmup.py command lines (under torchrun for several processes), and readers of their outputs."""

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from flashdraft.launch import torchrun_argv

REPO = Path(__file__).resolve().parents[1]

DRAFTER = {"num_layers": 2, "block_size": 8}

TRAIN = {
    "max_steps": 6,
    "lr": 3e-3,
    "max_anchors": 16,
    "batch_tokens": 512,
    "buckets": [128, 256],
    "compile": False,
    "checkpoint_every": 4,
    "log_every": 1,
    "val_samples": 0,
}


def train_cmd(root, shards, out, cfg=TRAIN, nproc=2, drafter=DRAFTER, extra=(), gpu=False):
    """scripts/train.py under torchrun (nproc > 1) or as a plain process. gpu: every rank sees its GPU as
    cuda:0 (--virtual-local-rank), as the workflow runs it."""
    script = str(REPO / "scripts" / "train.py")
    launcher = [sys.executable, script]
    if nproc > 1:
        launcher = torchrun_argv(sys.executable, script, nproc, virtual=gpu)
    args = [
        "--cfg",
        json.dumps(cfg),
        "--drafter-cfg",
        json.dumps(drafter),
        "--target",
        str(root / "target"),
        "--checkpoints",
        str(out / "checkpoints"),
        "--metrics",
        str(out / "metrics.csv"),
        "--out",
        str(out / "drafter"),
        *extra,
        *shards,
    ]
    return launcher + args


def run(cmd, env=None, gpu=False):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tests stay on the CPU (gloo) even on a GPU machine
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def read_rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def losses(rows):
    return [float(r["loss"]) for r in rows]


def tensorboard_losses(run_dir) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("train/loss")}


def warmup_cmd(root, shards, cfg, cache, drafter=DRAFTER, world=1):
    """scripts/warmup.py: compile the step once per bucket and save the caches to `cache`."""
    return [
        sys.executable,
        str(REPO / "scripts" / "warmup.py"),
        "--cfg",
        json.dumps(cfg),
        "--drafter-cfg",
        json.dumps(drafter),
        "--target",
        str(root / "target"),
        "--out-dir",
        str(cache),
        "--world",
        str(world),
        *shards,
    ]


def assert_no_autotuning(stderr: str) -> None:
    """The warm rank's slowest compile phases (logged after its first step) hold no Triton autotuning: the
    warmup's autotune results reached it."""
    phases = stderr.split("compile phases:")[1].splitlines()[0]
    assert "benchmark_all_configs" not in phases, phases


def fp8_ready(cuda: bool = True) -> bool:
    if importlib.util.find_spec("torchao") is None:
        return False
    return not cuda or torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 9)


# Dynamo / FX failures as they print: "torch._dynamo.exc....Error", "FX ... error", "error ... dynamo"
_COMPILER = r"(dynamo|\bFX\b|torch\.fx)"

COMPILE_ERROR = re.compile(rf"{_COMPILER}.*(error|exception)|(error|exception).*{_COMPILER}", re.IGNORECASE)
