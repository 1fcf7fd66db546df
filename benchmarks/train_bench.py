"""What the training benchmarks share (train_drafter.py, train_profile.py, fp8_curves.py, fp8_parity.py,
loss_head.py): the presets with their run sizes, the setup in --work (a target directory holding the
preset's config, the toy tokenizer and a random embedding and LM head, and one random hidden-state shard:
train_drafter.py's docstring describes both), the drafter and train configs of a preset, the FLOPs of a
training step, and the trainer's processes, launched as the workflow launches them and watched through
their log lines.
"""

from __future__ import annotations

import ast
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from shapes import PRESETS as SHAPES
from transformers import Qwen3Config

from flashdraft.config import DrafterConfig, needs_last_hidden
from flashdraft.hidden import ShardMeta, manifest_path
from flashdraft.hidden_write import open_shard, write_manifest
from flashdraft.launch import launch_argv
from flashdraft.loss import num_anchor_slots, sample_anchors
from flashdraft.toy import build_tokenizer, task_conversations
from flashdraft.train_step import load_spec

REPO = Path(__file__).resolve().parents[1]
# the benchmark presets (shapes.py) with the training runs' sizes: samples in the shard, optimizer steps,
# steps per metrics row, seconds a process may take
PRESETS = {
    "tiny": {**SHAPES["tiny"], "samples": 8, "steps": 12, "log_every": 3, "timeout": 600},
    "qwen3-8b": {**SHAPES["qwen3-8b"], "samples": 8, "steps": 30, "log_every": 5, "timeout": 900},
}
AGE = re.compile(r"^\[\s*([\d.]+) s\] ")  # io.log's stamp: the logging process's age
FIRST_STEP = re.compile(r"bucket (\d+): first step ([\d.]+) s \((?:compiled, caches (\{.*\})|eager)\)")
# the trainer's log lines, in order, and what is done by the time each appears (seconds since launch);
# worker_started_s (the launcher's share: launch to the worker process's start) comes from the process age
# the first of them carries
MILESTONES = {
    "imports done": "imports_done_s",  # + scripts/train.py's imports
    "started ": "dist_ready_s",  # + the process group (NCCL/gloo) up
    "train: ": "data_opened_s",  # + load_spec, HiddenStore
    "compile cache: ": "cache_loaded_s",  # + the warmup's artifacts loaded (or none)
    "new run in ": "model_built_s",  # + drafter built and on the device, target head, DDP, optimizer
    "resumed from ": "model_built_s",  # the same, and the checkpoint loaded (a resumed run)
    ": first step ": "first_step_done_s",  # + the first batch and the first step (compile or cache hits)
}


# ---------------------------------------------------------------------------------------------------------
# setup: target directory and hidden-state shard


def setup(preset: dict, work: Path) -> dict:
    """Target dir + one shard in `work`; skipped when `work/setup.json` records the same parameters."""
    params = {k: preset[k] for k in ("target", "mask_token_id", "drafter", "seq_len", "samples")}
    # the target's last hidden state too where either side of a comparison trains on it (DSpark)
    last = preset.get("last_hidden", False) or needs_last_hidden(drafter_config(preset))
    params["last_hidden"] = last
    marker = work / "setup.json"
    if marker.exists() and json.loads(marker.read_text()) == params:
        print(f"setup: reusing {work}", flush=True)
        return params
    t0 = time.perf_counter()
    shutil.rmtree(work / "target", ignore_errors=True)
    shutil.rmtree(work / "hidden", ignore_errors=True)
    target = work / "target"
    cfg = preset["target"]
    Qwen3Config(**cfg, tie_word_embeddings=False).save_pretrained(target)
    build_tokenizer(task_conversations(50, 0), 512).save_pretrained(target)
    g = torch.Generator().manual_seed(0)
    shape = (cfg["vocab_size"], cfg["hidden_size"])
    head = {
        k: (torch.randn(shape, generator=g, dtype=torch.bfloat16) * 0.02)
        for k in ("model.embed_tokens.weight", "lm_head.weight")
    }
    save_file(head, target / "model.safetensors", metadata={"format": "pt"})
    del head
    spec = load_spec(target, drafter_config(preset))
    width, s = spec.num_features * spec.hidden_size, preset["seq_len"]
    path = work / "hidden" / "shard-00000.arrow"
    meta = ShardMeta(
        target="random",
        target_layer_ids=spec.target_layer_ids,
        hidden_size=spec.hidden_size,
        dtype="bfloat16",
        last_hidden=last,
    )
    with open_shard(path, meta) as w:
        for i in range(preset["samples"]):
            ids = torch.randint(0, spec.mask_token_id, (s,), generator=g).tolist()
            lh = torch.randn(s, spec.hidden_size, generator=g, dtype=torch.bfloat16) if last else None
            w.write(
                f"r{i}",
                ids,
                [1] * s,
                torch.randn(s, width, generator=g, dtype=torch.bfloat16),
                last_hidden=lh,
            )
    write_manifest(manifest_path(path), w)
    marker.write_text(json.dumps(params))
    print(
        f"setup: target and {preset['samples']} samples x {s} tokens x {width} features "
        f"({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return params


def drafter_config(preset: dict) -> DrafterConfig:
    return DrafterConfig(**preset["drafter"], mask_token_id=preset["mask_token_id"])


def train_config(preset: dict, steps: int, log_every: int) -> dict:
    s = preset["seq_len"]
    return {
        "max_steps": steps,
        "batch_tokens": preset["rows"] * s,
        "buckets": [s],
        "max_anchors": preset["max_anchors"],
        "compile": True,
        "attention": preset["attention"],
        "dtype": preset["dtype"],
        "checkpoint_every": 10**9,
        "keep_checkpoints": 1,
        "log_every": log_every,
        "lr": 1e-4,
        "val_samples": 0,
    }


# ---------------------------------------------------------------------------------------------------------
# FLOPs


def flops(preset: dict, spec, draws: int = 64) -> dict:
    """Matmul FLOPs of one sample's forward by part (the formula: train_drafter.py's docstring), and per
    trained token."""
    s, b = preset["seq_len"], spec.block_size
    h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    nh, nkv = spec.num_heads, spec.num_kv_heads
    k, v = spec.num_features, spec.vocab_size
    anchors, valid = sample_anchors(
        torch.ones(draws, s), preset["max_anchors"], b, torch.Generator().manual_seed(0)
    )
    a = float(valid.sum(1).double().mean())  # valid anchors per sample
    pairs = float((b * (anchors + b) * valid).sum(1).double().mean())  # visible query-key pairs
    q = a * b
    layer = {
        "q_o": 2 * 2 * q * h * nh * d,
        "k_v": 2 * 2 * (s + q) * h * nkv * d,
        "mlp": 2 * 3 * q * h * i,
        "attention": 2 * 2 * nh * d * pairs,
    }
    fwd = {
        "fc": 2 * s * (k * h) * h,
        **{n: spec.num_layers * x for n, x in layer.items()},
        "lm_head": 2 * a * (b - 1) * h * v,
    }
    total = sum(fwd.values())
    required = 3 * total - fwd["fc"] - fwd["lm_head"]
    return {
        "formula": "forward matmul FLOPs per sample: fc 2*S*(K*H)*H; per layer q,o 2*2*Q*H*nh*d, k,v "
        "2*2*(S+Q)*H*nkv*d, MLP 2*3*Q*H*I, attention 2*2*nh*d*P (P = visible query-key pairs, "
        "B*(a+B) per anchor a); LM head 2*A*(B-1)*H*V; Q = A*B. Training = 3 x forward (LM-head "
        "checkpoint recompute not counted); required_grads: fc and LM head 2x (no input grad)",
        "seq_len": s,
        "anchors": a,
        "anchor_slots": num_anchor_slots(s, preset["max_anchors"], b),
        "visible_pairs": pairs,
        "forward_per_sample": fwd,
        "forward_per_sample_total": total,
        "train_per_token": 3 * total / s,
        "train_per_token_required_grads": required / s,
    }


# ---------------------------------------------------------------------------------------------------------
# processes


def descendants(pid: int) -> list[int]:
    """Every live process under `pid` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class Proc:
    """A launched command: stdout to a log file, stderr streamed line by line into another, watching for
    the trainer's first-step line (time since launch, its seconds and cache counters)."""

    live: list[Proc] = []  # stopped on the way out, whatever ends the benchmark

    def __init__(self, name: str, cmd: list[str], env: dict, logs: Path):
        self.name, self.logs = name, logs
        self.out_log, self.err_log = logs / f"{name}.stdout", logs / f"{name}.stderr"
        self.first: dict | None = None
        self.milestones: dict[str, float] = {}
        self.cache_loaded = False
        self.t0 = time.perf_counter()
        with open(self.out_log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True
            )
        Proc.live.append(self)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        with open(self.err_log, "w") as f:
            for line in self.proc.stderr:
                t = time.perf_counter() - self.t0
                f.write(line)
                f.flush()
                if "compile cache: loaded" in line:
                    self.cache_loaded = True
                age = AGE.match(line)
                if age and "worker_started_s" not in self.milestones:
                    self.milestones["worker_started_s"] = max(0.0, round(t - float(age[1]), 2))
                for prefix, key in MILESTONES.items():
                    if prefix in line and key not in self.milestones:
                        self.milestones[key] = round(t, 2)
                m = FIRST_STEP.search(line)
                if m and self.first is None:
                    self.first = {
                        "launch_to_first_step_s": round(t, 2),
                        "first_step_s": float(m[2]),
                        "counters": ast.literal_eval(m[3]) if m[3] else None,
                        "milestones": self.milestones,
                    }

    def wait_for(self, done, timeout: float) -> bool:
        """Until done() or the process ends (then done() once more); False when it ended without."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if done():
                return True
            if self.proc.poll() is not None:
                self.reader.join(10)
                return done()
            time.sleep(0.2)
        raise TimeoutError(f"{self.name}: not done after {timeout:.0f} s")

    def stop(self):
        """Kill the launcher and every process under it: the measurement is taken. (A SIGTERM would have
        the trainer save a checkpoint first, ~13 GB for the 8B-shaped drafter.)"""
        if self.proc.poll() is None:
            for pid in [self.proc.pid, *descendants(self.proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()
        self.reader.join(10)

    def tail(self, chars: int = 4000) -> str:
        out = self.out_log.read_text()[-chars // 4 :] if self.out_log.exists() else ""
        err = self.err_log.read_text()[-chars:] if self.err_log.exists() else ""
        return f"--- {self.out_log}\n{out}\n--- {self.err_log}\n{err}"


def base_env(preset: dict, inductor: Path) -> dict:
    """A fresh, empty Inductor (and Triton) cache dir for one process tree, as on a fresh node: the
    warmup's own Inductor dir, where a warm trainer compiles, is removed too (the trainer recreates it
    from inductor.tar)."""
    meta = inductor.parent.parent / "compile_cache" / "meta.json"
    if meta.exists() and (warmup_dir := json.loads(meta.read_text()).get("inductor_dir")):
        shutil.rmtree(warmup_dir, ignore_errors=True)
    shutil.rmtree(inductor, ignore_errors=True)
    inductor.mkdir(parents=True)
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(inductor),
        "TRITON_CACHE_DIR": str(inductor / "triton"),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPYCACHEPREFIX": str(inductor.parent.parent / "pycache"),
    }  # as the workflow's stages
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if preset["device"] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["OMP_NUM_THREADS"] = "1"  # Inductor's CPU kernels (and the cache key) depend on the thread count
    return env


def launch(preset: dict, world: int, cfg: dict, work: Path, run: str, shards: list[str], extra=()) -> list:
    cuda = preset["device"] == "cuda"  # virtual: each rank sees its GPU as cuda:0, as the cache keys need
    cmd = launch_argv(sys.executable, REPO / "scripts" / "train.py", world, virtual=cuda)  # as the workflow
    out = work / "runs" / run
    shutil.rmtree(out, ignore_errors=True)
    return cmd + [
        "--cfg",
        json.dumps(cfg),
        "--drafter-cfg",
        json.dumps(drafter_json(preset)),
        "--target",
        str(work / "target"),
        "--checkpoints",
        str(out / "checkpoints"),
        "--metrics",
        str(out / "metrics.csv"),
        "--out",
        str(out / "drafter"),
        *extra,
        *shards,
    ]


def drafter_json(preset: dict) -> dict:
    return {**preset["drafter"], "mask_token_id": preset["mask_token_id"]}


def live_rows(run_dir: Path) -> list[dict]:
    """The rows the trainer has appended so far to its live metrics CSV (complete lines only)."""
    found = list(run_dir.glob("checkpoints/*/metrics.csv"))
    if not found:
        return []
    text = found[0].read_text()
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines = lines[:-1]
    return list(csv.DictReader(lines))


class Failed(Exception):
    pass


def check(proc: Proc, ok: bool, what: str):
    if not ok:
        print(f"\n{proc.name} failed ({what}, exit {proc.proc.poll()}):\n{proc.tail()}", file=sys.stderr)
        raise Failed(f"{proc.name}: {what} (exit {proc.proc.poll()}); logs {proc.err_log}")
