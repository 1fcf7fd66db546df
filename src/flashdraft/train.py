"""Drafter training: one process per device (torchrun), DDP, token-budget micro-batches, checkpoints.

Data order is a pure function of (seed, epoch): each epoch's seeded permutation is cut into micro-batches
of one length bucket each (rows = batch_tokens // bucket), the same list on every rank. An optimizer
step takes G = global_batch_tokens // batch_tokens micro-batches [cursor, cursor + G) (G = world when
train.global_batch_tokens is 0); rank r takes cursor + r, cursor + r + world, ... and accumulates their
gradients (as torchtitan fills its global batch), so a step sees the same data on any number of
processes. A sample's anchors are
drawn from its own generator, seeded by (seed, epoch, sample index), whatever batch it lands in. So a
resumed run replays exactly what an uninterrupted one would have seen, and a resume on another number of
processes continues from the same micro-batch. The model has no other randomness (no dropout), so that
is all the RNG state a resume needs.
Model and optimizer are replicated (DDP) or sharded (FSDP2, `train.parallel`); checkpoints hold the full
state dicts either way, so they depend on neither the world size nor the mode. Each micro-batch's loss
is divided by the whole global batch's normalizer (summed over its micro-batches and ranks before the
first forward), so the gradient is the global batch's, whatever its split; the logged loss is the
weighted mean over all ranks and steps since the last log.

torch.compile is not thread-safe: everything compiled runs on the main thread of this process; data
loading uses DataLoader worker processes on GPU and the main thread on CPU.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .config import DrafterConfig, TrainConfig, to_json
from .hidden import HiddenStore, manifest_path
from .io import atomic_path, progress, torch_dtype
from .model import (
    DFlashDrafter,
    DrafterSpec,
    block_labels,
    dflash_loss,
    export_drafter,
    load_target_head,
    loss_normalizer,
    resolve_attention,
    sample_anchors,
    stats_size,
    summarize,
)

# ---------------------------------------------------------------------------------------------------------
# processes and devices


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_dist() -> Dist:
    """torch.distributed from torchrun's environment (gloo on CPU, nccl on GPU); one process otherwise.

    Each rank should see its GPU as cuda:0 (per-process CUDA_VISIBLE_DEVICES or torchrun
    --virtual-local-rank): the compile cache's keys hold the device index, so only then do the warmup's
    entries hit on every rank. With all GPUs visible, rank r uses cuda:LOCAL_RANK."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        dev = torch.device("cuda", 0 if torch.cuda.device_count() == 1 else local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if "RANK" not in os.environ:
        return Dist(device=dev)
    cuda = dev.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", device_id=dev if cuda else None)
    return Dist(dist.get_rank(), dist.get_world_size(), dev)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_signals: list[int] = []  # set by the handler; read at log steps, where every rank agrees to stop


def _on_stop_signal(signum, frame):
    if signum == signal.SIGINT and signal.SIGINT in _signals:
        raise KeyboardInterrupt  # Ctrl-C twice: stop now
    _signals.append(signum)
    if os.environ.get("RANK", "0") == "0":  # os.write: safe inside a signal handler, unlike print
        again = " (Ctrl-C again: stop now)" if signum == signal.SIGINT else ""
        os.write(2, f"{signal.Signals(signum).name}: a checkpoint at the next log step, then stop{again}\n"
                 .encode())


def _ignore_stop_signals(worker_id: int):
    """DataLoader workers outlive the signal (SLURM signals every process of the job): the trainer stops
    at its next log step and still needs them until then."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def stop_signal(d: Dist) -> int:
    """The stop signal any rank got (SIGTERM before SIGINT), 0 if none; all ranks call it at one step."""
    got = torch.tensor([float(sig in _signals) for sig in STOP_SIGNALS], dtype=torch.float64, device=d.device)
    return next((int(sig) for sig, n in zip(STOP_SIGNALS, _all_sum(got, d).tolist(), strict=True) if n), 0)


def _barrier(d: Dist):
    if d.world > 1:
        dist.barrier()


def _all_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world > 1:
        t = t.clone()
        dist.all_reduce(t)
    return t


def gpu_bytes(device: torch.device) -> int | None:
    """The GPU's memory (None on the CPU)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def parallel_mode(name: str, params: int, world: int, gpu_memory: int | None) -> str:
    """single (one process), ddp or fsdp. auto: fsdp when one full copy of the training state (fp32
    weights and gradients, AdamW's two moments: 16 bytes per parameter) would take over a third of the
    GPU's memory (`gpu_memory` bytes, None on CPU): the activations of a step take about twice the state (the
    8B-shaped drafter: 16.8 GB of state, 47 GB at its peak), and the frozen target head needs room too."""
    if name not in ("auto", "ddp", "fsdp"):
        raise ValueError(f"train.parallel must be auto, ddp or fsdp, not {name!r}")
    if world == 1:
        return "single"
    if name != "auto":
        return name
    return "fsdp" if gpu_memory is not None and 16 * params > gpu_memory / 3 else "ddp"


# ---------------------------------------------------------------------------------------------------------
# data: buckets, the per-epoch micro-batch plan, collation


def bucket_for(length: int, buckets: list[int]) -> int:
    """The smallest bucket that fits; longer samples are truncated to the largest."""
    for b in sorted(buckets):
        if length <= b:
            return b
    return max(buckets)


def micro_per_step(cfg: TrainConfig, world: int) -> int:
    """Micro-batches in one optimizer step, over all ranks: global_batch_tokens // batch_tokens, or one
    per rank when global_batch_tokens is 0 (then the global batch grows with the process count)."""
    if not cfg.global_batch_tokens:
        return world
    g, rem = divmod(cfg.global_batch_tokens, cfg.batch_tokens)
    if rem or g < world:
        raise ValueError(
            f"train.global_batch_tokens ({cfg.global_batch_tokens}) must be a multiple of train.batch_tokens "
            f"({cfg.batch_tokens}) and hold at least one micro-batch per process ({world}): "
            f"use {cfg.batch_tokens * max(world, g or 1)} or lower train.batch_tokens"
        )
    return g


def rows_per_batch(bucket: int, batch_tokens: int) -> int:
    return max(1, batch_tokens // bucket)


def epoch_batches(lengths: list[int], cfg: TrainConfig, epoch: int) -> list[list[int]]:
    """This epoch's micro-batches (sample indices), identical on every rank: the seeded permutation is
    dealt into per-bucket batches of rows_per_batch rows, emitted as they fill (partial ones at the end)."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    pending: dict[int, list[int]] = {}
    out = []
    for i in order:
        b = bucket_for(lengths[i], cfg.buckets)
        pending.setdefault(b, []).append(i)
        if len(pending[b]) == rows_per_batch(b, cfg.batch_tokens):
            out.append(pending.pop(b))
    out += [pending[b] for b in sorted(pending)]
    return out


def anchor_seeds(seed: int, epoch: int, samples: list[int], rows: int) -> list[int | None]:
    """One anchor seed per row of a micro-batch: fixed by (seed, epoch, sample index), so a sample's
    anchors do not depend on which samples share its batch, its rank, or the number of processes (as
    SpecForge made them); padding rows get None."""
    base = (seed * 1_000_003 + epoch) * 10_000_019
    return [base + i for i in samples] + [None] * (rows - len(samples))


class Collate:
    """Pads a micro-batch to its bucket: input_ids, loss_mask, hidden [rows, bucket, K*H]; counts tokens.

    Rows beyond the samples are all padding (no anchors), so every batch of a bucket has one shape."""

    def __init__(self, buckets, batch_tokens, hidden_dtype):
        self.buckets, self.batch_tokens, self.hidden_dtype = buckets, batch_tokens, hidden_dtype

    def __call__(self, samples: list[dict]) -> dict:
        s = bucket_for(max(len(x["input_ids"]) for x in samples), self.buckets)
        rows = rows_per_batch(s, self.batch_tokens)
        width = samples[0]["hidden"].shape[-1]
        ids = torch.zeros(rows, s, dtype=torch.long)
        mask = torch.zeros(rows, s)
        hidden = torch.zeros(rows, s, width, dtype=self.hidden_dtype)
        tokens = 0
        for r, x in enumerate(samples):
            n = min(len(x["input_ids"]), s)
            ids[r, :n] = x["input_ids"][:n]
            mask[r, :n] = x["loss_mask"][:n].float()
            hidden[r, :n] = x["hidden"][:n].to(self.hidden_dtype)
            tokens += n
        return {"input_ids": ids, "loss_mask": mask, "hidden": hidden, "tokens": tokens, "bucket": s}


def batch_loader(store, batches: list[list[int]], collate: Collate, device: torch.device):
    """Collated micro-batches in order. On GPU, DataLoader worker processes read and pad ahead of the
    step (pinned memory); on CPU the main thread does it (no spare cores to give a worker).

    Four batches in flight: one takes a worker well under two steps, and each is pinned by a thread of
    this process (an 8B-shaped batch is ~0.5 GB, pinned anew at the start), beside the first step."""
    if device.type != "cuda":
        return (collate([store[i] for i in b]) for b in batches)
    return torch.utils.data.DataLoader(
        store, batch_sampler=batches, collate_fn=collate, num_workers=2, prefetch_factor=2,
        pin_memory=True, persistent_workers=False, worker_init_fn=_ignore_stop_signals,
    )


# ---------------------------------------------------------------------------------------------------------
# the training step (shared with the compile warmup, so both compile the same graphs)


@dataclass
class Step:
    """Everything one forward+backward needs besides the batch."""

    model: torch.nn.Module  # the drafter, compiled in place, maybe wrapped in DDP
    spec: DrafterSpec
    embed: torch.Tensor  # frozen target embedding [V, H]
    head: torch.Tensor  # frozen target LM head [V, H]
    gamma: float
    objective: str  # decay | dpace (train.loss)
    dpace_alpha: float
    attention: str  # flex | sdpa
    max_anchors: int
    device: torch.device
    amp_dtype: torch.dtype | None  # autocast dtype (GPU), None: plain float32 (CPU)


def load_spec(target_dir, drafter_cfg: DrafterConfig) -> DrafterSpec:
    from transformers import AutoConfig, AutoTokenizer

    from .target import read_target_config

    read_target_config(target_dir)  # refuses remote code before transformers sees the directory
    config = AutoConfig.from_pretrained(target_dir)
    return DrafterSpec.from_target(config, AutoTokenizer.from_pretrained(target_dir), drafter_cfg)


def build_step(cfg: TrainConfig, spec: DrafterSpec, target_dir, device: torch.device) -> Step:
    """A seeded fp32 drafter on `device` (compiled in place when cfg.compile) and the target's frozen head."""
    torch.manual_seed(cfg.seed)
    with torch.device(device):  # initialized where it runs: an 8B-shaped drafter takes ~30 s on one CPU core
        drafter = DFlashDrafter(spec)
    if cfg.compile:
        # one graph per length bucket: dynamic=False keeps shapes static, buckets bound the recompiles
        drafter.compile(dynamic=False)
    amp = torch_dtype(cfg.dtype) if device.type == "cuda" and cfg.dtype != "float32" else None
    embed, head = load_target_head(target_dir)
    embed, head = (t.to(device, amp or torch.float32) for t in (embed, head))
    gamma, attention = cfg.loss_gamma(spec.block_size), resolve_attention(cfg.attention, device)
    return Step(drafter, spec, embed, head, gamma, cfg.loss, cfg.dpace_alpha, attention, cfg.max_anchors,
                device, amp)


def anchors_for(step: Step, loss_mask, generator=None, seeds=None):
    anchors, valid = sample_anchors(loss_mask, step.max_anchors, step.spec.block_size, generator, seeds)
    return anchors.to(step.device), valid.to(step.device)


def batch_normalizer(step: Step, batch: dict, anchors, valid) -> torch.Tensor:
    """This micro-batch's share of the loss normalizer (`loss_normalizer`), known before its forward."""
    ids, mask = (batch[k].to(step.device, non_blocking=True) for k in ("input_ids", "loss_mask"))
    _, weights, _ = block_labels(ids, mask, anchors, valid, step.spec.block_size, step.gamma)
    return loss_normalizer(weights, valid, step.objective).double()


def forward_backward(step: Step, batch: dict, anchors, valid, normalizer=None):
    """Loss, backward; returns (detached loss, stats). The optimizer step is the caller's. normalizer:
    what the summed weighted CE is divided by (None: this batch's own, `loss_normalizer`)."""
    dev = step.device
    ids, mask, hidden = (batch[k].to(dev, non_blocking=True) for k in ("input_ids", "loss_mask", "hidden"))
    with torch.autocast(dev.type, dtype=step.amp_dtype or torch.bfloat16, enabled=step.amp_dtype is not None):
        loss, stats = dflash_loss(step.model, ids, mask, hidden, anchors, valid, step.embed, step.head,
                                  step.gamma, step.attention, objective=step.objective,
                                  dpace_alpha=step.dpace_alpha, normalizer=normalizer)
    loss.backward()
    return loss.detach(), stats


def cache_counters() -> dict:
    """Compile-cache hits and misses so far in this process (FX graph and AOTAutograd caches)."""
    from torch._dynamo.utils import counters

    keys = [("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
            ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss")]
    return {k: int(counters[group][k]) for group, k in keys}


def cache_key(cfg: TrainConfig, spec: DrafterSpec, device: torch.device) -> dict:
    """What the compiled graphs depend on; the warmup writes it to meta.json and training compares."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "torch": torch.__version__, "device": name, "spec": asdict(spec), "buckets": sorted(cfg.buckets),
        "batch_tokens": cfg.batch_tokens, "max_anchors": cfg.max_anchors, "compile": cfg.compile,
        "attention": resolve_attention(cfg.attention, device),
        "dtype": cfg.dtype if device.type == "cuda" else "float32",
        # Inductor's CPU kernels are generated for the intra-op thread count
        "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
    }


INDUCTOR_FILES = "inductor.tar"  # the warmup's Inductor cache dir, next to artifacts.bin


def inductor_cache_dir() -> Path:
    """The Inductor cache dir this process compiles into (TORCHINDUCTOR_CACHE_DIR or torch's default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def merge_inductor_files(tar_path, dest: Path) -> int:
    """Unpack the warmup's Inductor files into `dest`, keeping the files already there; returns how many
    were added. Each file is written under a temporary name and renamed, so ranks that share a cache dir
    never read another rank's half-written file. They hold what the Mega-Cache blob does not carry, such
    as the compiled C++ kernels of CPU graphs, which a fresh dir would otherwise build again (~20 s)."""
    added, root = 0, dest.resolve()
    with tarfile.open(tar_path) as tar:
        for member in tar:
            target = (root / member.name).resolve()
            if not member.isfile() or not target.is_relative_to(root) or target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
            with tar.extractfile(member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.chmod(tmp, member.mode & 0o777)
            os.replace(tmp, target)
            added += 1
    return added


def load_compile_cache(cache_dir, key: dict, d: Dist) -> bool:
    """Load the warmup's Mega-Cache blob into this process's compile caches, if there is one; True when
    it was loaded and its key matches (every graph should hit)."""
    if not cache_dir or not (Path(cache_dir) / "artifacts.bin").exists():
        log(d, f"compile cache: none at {cache_dir}; compiling from scratch")
        return False
    blob = Path(cache_dir) / "artifacts.bin"
    meta = Path(cache_dir) / "meta.json"
    info = json.loads(meta.read_text()) if meta.exists() else {}
    theirs = info.get("key", {})
    differ = sorted(k for k in key if theirs.get(k) != key[k])
    if differ:
        log(d, f"compile cache: warmup key differs in {differ}; expect cache misses")
    if blob.stat().st_size == 0:
        why = "training shards the drafter (FSDP)" if info.get("fsdp") else "compile: false"
        log(d, f"compile cache: empty (the warmup compiled nothing: {why})")
        return False
    torch.compiler.load_cache_artifacts(blob.read_bytes())
    files, dest = Path(cache_dir) / INDUCTOR_FILES, inductor_cache_dir()
    added = merge_inductor_files(files, dest) if files.exists() else 0
    log(d, f"compile cache: loaded {blob} ({blob.stat().st_size} bytes); {added} Inductor files added to "
           f"{dest}")
    return not differ


def set_compile_workers(warm: bool, local_world: int) -> int:
    """Size Inductor's pool of compile worker processes, unless TORCHINDUCTOR_COMPILE_THREADS does.

    By default every process starts min(32, cores) workers, each importing torch, at its first compile:
    on a node of N ranks that is N pools fighting over the cores. A warm rank compiles nothing (its
    kernels load from the cache in-process), so it starts none, and its first step's tracing keeps the
    CPU; a cold rank gets its share of the cores."""
    from torch._inductor import config

    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        config.compile_threads = 1 if warm else max(1, min(32, cores // max(1, local_world)))
    return config.compile_threads


# ---------------------------------------------------------------------------------------------------------
# schedule, run key, checkpoints


def lr_factor(step: int, total: int, warmup_ratio: float) -> float:
    """Linear warmup over warmup_ratio of the steps, then cosine to 0 (step counts from 0)."""
    warmup = int(round(warmup_ratio * total))
    if step < warmup:
        return (step + 1) / warmup
    progress_ = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress_)))


def run_key(cfg: TrainConfig, drafter_cfg: DrafterConfig, shards: list[str]) -> str:
    """Short hash of both configs and the shard manifests: a changed config never resumes an old run."""
    same_run = {k: v for k, v in asdict(cfg).items() if k != "parallel"}  # DDP and FSDP resume each other
    h = hashlib.sha256((json.dumps(same_run, sort_keys=True) + to_json(drafter_cfg)).encode())
    for path in shards:
        m = manifest_path(path)
        h.update(m.read_bytes() if m.exists() else str(Path(path).stat().st_size).encode())
    return h.hexdigest()[:12]


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (an interrupted save leaves only a `.tmp-*` sibling)."""
    return sorted(p for p in run_dir.glob("step-*") if (p / "state.json").exists())


def full_state(drafter, optimizer, sharded: bool) -> tuple[dict, dict]:
    """Model and optimizer state dicts in torch's one-process formats, whatever holds them. Sharded
    (FSDP) they are gathered: a collective, every rank calls it and rank 0 gets them (the others get
    empty dicts). So checkpoints and exports do not depend on the world size or on DDP vs FSDP."""
    if not sharded:
        return drafter.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, optim = get_state_dict(drafter, optimizer,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    index = {name: i for i, (name, _) in enumerate(drafter.named_parameters())}  # names -> torch's ids
    return model, _rekey(optim, index) if optim else optim


def _rekey(optim: dict, key: dict) -> dict:
    """An optimizer state dict with its parameter keys mapped through `key` (names <-> torch's ids)."""
    return {"state": {key[k]: v for k, v in optim["state"].items()},
            "param_groups": [{**g, "params": [key[k] for k in g["params"]]} for g in optim["param_groups"]]}


def load_full_state(drafter, optimizer, model: dict, optim: dict, sharded: bool) -> None:
    """The inverse of full_state: every rank loads the full dicts and keeps its shards."""
    if not sharded:
        drafter.load_state_dict(model)
        optimizer.load_state_dict(optim)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = dict(enumerate(name for name, _ in drafter.named_parameters()))  # torch's ids -> names
    set_state_dict(drafter, optimizer, model_state_dict=model, optim_state_dict=_rekey(optim, names),
                   options=StateDictOptions(full_state_dict=True))


def save_checkpoint(run_dir: Path, model: dict, optim: dict, scheduler, state: dict, keep: int) -> Path:
    """model/optim: full_state's dicts."""
    path = run_dir / f"step-{state['step']:08d}"
    with atomic_path(path) as tmp:
        tmp.mkdir(parents=True)
        torch.save(model, tmp / "model.pt")
        opt = {"optimizer": optim, "scheduler": scheduler.state_dict()}
        torch.save(opt, tmp / "optim.pt")
        (tmp / "state.json").write_text(json.dumps(state))
    for old in checkpoint_dirs(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(path: Path, drafter, optimizer, scheduler, device, sharded: bool) -> dict:
    # weights_only: tensors and plain Python values only, so a checkpoint cannot run code when loaded
    # (explicit: the default depends on the torch version and on TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD)
    opt = torch.load(path / "optim.pt", map_location=device, weights_only=True)
    model = torch.load(path / "model.pt", map_location=device, weights_only=True)
    load_full_state(drafter, optimizer, model, opt["optimizer"], sharded)
    scheduler.load_state_dict(opt["scheduler"])
    return json.loads((path / "state.json").read_text())


METRIC_KEYS = ["step", "epoch", "loss", "acc"]


def metric_fields(block_size: int) -> list[str]:
    pos = [f"acc_pos_{k}" for k in range(1, block_size)]
    return METRIC_KEYS + pos + ["sim_tau", "lr", "grad_norm", "tokens_per_s"]


def tensorboard(log_dir: Path, step: int, d: Dist):
    """A TensorBoard writer on rank 0 next to the checkpoints; `purge_step` drops the events a killed
    run logged after its last checkpoint, as the live CSV does."""
    if not d.main:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the tensorboard package is optional: the CSV has every number
        log(d, "tensorboard not installed; metrics go to CSV only")
        return None
    return SummaryWriter(str(log_dir), purge_step=step + 1 if step else None)  # `step` is checkpointed


def write_metrics(path, rows: list[dict], fields: list[str]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


# ---------------------------------------------------------------------------------------------------------
# the loop


_T0 = time.perf_counter()


def process_age() -> float:
    """Seconds since this process started (Linux: from /proc, so imports count), else since this import."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # starttime
        start = ticks / os.sysconf("SC_CLK_TCK")
        return float(Path("/proc/uptime").read_text().split()[0]) - start
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _T0


def log(d: Dist, msg: str, every_rank: bool = False) -> None:
    """A line on rank 0's stderr (or every rank's, marked with its rank), stamped with the process's age:
    the log shows where startup goes."""
    if d.main or every_rank:
        who = f"rank {d.rank}: " if every_rank and d.world > 1 else ""
        print(f"[{process_age():7.1f} s] {who}{msg}", file=sys.stderr, flush=True)


def compile_phases(top: int = 6) -> str:
    """The slowest compile phases so far in this process, summed (Dynamo's own timers), for the log."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    phases = sorted(((float(v), k) for k, v in zip(names, values, strict=True)), reverse=True)[:top]
    return ", ".join(f"{k} {v:.2f} s" for v, k in phases)


def steps_left(lengths, cfg: TrainConfig, world: int, epoch: int = 0, cursor: int = 0) -> int:
    """Optimizer steps from data position (epoch, cursor) to the end of cfg.epochs."""
    left, g = 0, micro_per_step(cfg, world)
    for e in range(epoch, cfg.epochs):
        left += (len(epoch_batches(lengths, cfg, e)) - (cursor if e == epoch else 0)) // g
    return left


def no_grad_sync(model, sharded: bool, skip: bool):
    """Accumulating micro-batches: skip the gradient all-reduce (DDP) or reduce-scatter (FSDP) of all
    but the step's last backward."""
    if skip and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if sharded:
        model.set_requires_gradient_sync(not skip)
    return contextlib.nullcontext()


def train(cfg: TrainConfig, drafter_cfg: DrafterConfig, target_dir, shards: list[str], checkpoints,
          metrics_path, out_dir, compile_cache=None, stop_at: int | None = None) -> dict:
    """Train (or resume) and export; returns a summary. `stop_at`: save a checkpoint after that step and
    return without exporting (a deliberate preemption)."""
    d = setup_dist()
    # SIGTERM (SLURM's time limit or preemption, scancel) or Ctrl-C saves a checkpoint at the next log
    # step instead of losing the steps since the last one
    _signals.clear()
    previous = {sig: signal.signal(sig, _on_stop_signal) for sig in STOP_SIGNALS}
    try:
        return _train(d, cfg, drafter_cfg, target_dir, shards, Path(checkpoints), metrics_path, out_dir,
                      compile_cache, stop_at)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if d.world > 1:
            dist.destroy_process_group()


def _train(d: Dist, cfg: TrainConfig, drafter_cfg, target_dir, shards, checkpoints: Path, metrics_path,
           out_dir, compile_cache, stop_at):
    log(d, f"started {d.world} process(es); rank 0 on {d.device}")
    spec = load_spec(target_dir, drafter_cfg)
    store = HiddenStore(shards)
    if store.layer_ids != spec.target_layer_ids or store.hidden_size != spec.hidden_size:
        raise ValueError(
            f"hidden shards hold layers {store.layer_ids} (H={store.hidden_size}) but the drafter wants "
            f"{spec.target_layer_ids} (H={spec.hidden_size}); recompute the hidden states"
        )
    lengths = [store.num_tokens(i) for i in range(len(store))]
    run_dir = checkpoints / run_key(cfg, drafter_cfg, shards)
    log(d, f"train: {len(store)} samples, {sum(lengths)} tokens, {d.world} process(es) on {d.device}")

    warm = cfg.compile and load_compile_cache(compile_cache, cache_key(cfg, spec, d.device), d)
    step_fn = build_step(cfg, spec, target_dir, d.device)
    drafter = step_fn.model
    params = sum(p.numel() for p in drafter.parameters())
    mode = parallel_mode(cfg.parallel, params, d.world, gpu_bytes(d.device))
    sharded = mode == "fsdp"
    if mode == "ddp":
        # Dynamo's DDP optimizer would split the compiled graph at DDP's bucket boundaries: graphs the
        # single-process warmup never built, so every rank would miss the cache. Keep the warmup's graph.
        torch._dynamo.config.optimize_ddp = False
        ids = [d.device.index] if d.device.type == "cuda" else None
        step_fn.model = torch.nn.parallel.DistributedDataParallel(drafter, device_ids=ids)
    elif sharded:
        from torch.distributed.fsdp import fully_shard

        for layer in drafter.layers:  # one all-gather per layer, freed after its forward and backward
            fully_shard(layer)
        fully_shard(drafter)  # the rest: fc and the norms
    if mode != "single":
        log(d, f"parallel: {mode} ({cfg.parallel}), {d.world} processes")
    if cfg.compile:
        # the warmup compiles the unsharded step; FSDP's hooks split the graph elsewhere, so its ranks compile
        workers = set_compile_workers(warm and not sharded, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        log(d, f"compile workers per process: {workers}" + (" (FSDP: the warmup's graphs do not apply)"
                                                             if warm and sharded else ""))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fused=d.device.type == "cuda")
    g = micro_per_step(cfg, d.world)
    total = cfg.max_steps or steps_left(lengths, cfg, d.world)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, cfg.warmup_ratio))

    # resume: model, optimizer, schedule, data position, logged rows and the open metrics window
    state = {"step": 0, "epoch": 0, "cursor": 0, "rows": [], "window": None}
    found = checkpoint_dirs(run_dir)
    if found:
        state = load_checkpoint(found[-1], drafter, optimizer, scheduler, d.device, sharded)
        if not cfg.max_steps and state["world"] != d.world and not cfg.global_batch_tokens:
            # one micro-batch per process: another process count changes the global batch
            total = state["step"] + steps_left(lengths, cfg, d.world, state["epoch"], state["cursor"])
        log(d, f"resumed from {found[-1]}: step {state['step']}/{total}, saved by {state['world']} rank(s)")
    else:
        log(d, f"new run in {run_dir}: {total} steps")
    log(d, f"global batch: {g} micro-batches of {cfg.batch_tokens} tokens, {-(-g // d.world)} or fewer per "
           f"process and step")
    step, epoch, cursor, rows = state["step"], state["epoch"], state["cursor"], state["rows"]
    width = stats_size(spec.block_size) + 1  # + tokens
    # summed stats since the last log; a resumed window lives on rank 0 (the ranks' sum is what counts)
    window = torch.zeros(width, dtype=torch.float64, device=d.device)
    if state["window"] and d.main:
        window += torch.tensor(state["window"], dtype=torch.float64, device=d.device)
    fields = metric_fields(spec.block_size)
    live_csv = run_dir / "metrics.csv"
    if d.main:
        write_metrics(live_csv, rows, fields)  # drops rows a killed run logged after its last checkpoint
    tb = tensorboard(run_dir / "tensorboard", step, d)

    collate = Collate(cfg.buckets, cfg.batch_tokens, step_fn.amp_dtype or torch.float32)
    seen_buckets: set[int] = set()
    bar = progress(total=total, initial=step, desc="train", unit="step", disable=not d.main)
    t_window = time.perf_counter()
    drafter.train()
    while step < total:
        batches = epoch_batches(lengths, cfg, epoch)
        if len(batches) < g:
            raise ValueError(f"{len(batches)} micro-batches per epoch, fewer than one global batch ({g}): "
                             "lower train.batch_tokens or train.global_batch_tokens, or add data")
        n = min((len(batches) - cursor) // g, total - step)
        # step i: micro-batches cursor + i*g + [rank, rank + world, ...] (every rank has one: g >= world)
        mine = [[cursor + i * g + j for j in range(d.rank, g, d.world)] for i in range(max(0, n))]
        loader = iter(batch_loader(store, [batches[k] for ks in mine for k in ks], collate, d.device))
        for ks in mine:
            micro = [next(loader) for _ in ks]
            anchors = [anchors_for(step_fn, b["loss_mask"],
                                   seeds=anchor_seeds(cfg.seed, epoch, batches[k], len(b["loss_mask"])))
                       for k, b in zip(ks, micro, strict=True)]
            # the global batch's normalizer; DDP and FSDP average gradients over ranks, hence / world
            mine_norm = sum(batch_normalizer(step_fn, b, *av) for b, av in zip(micro, anchors, strict=True))
            norm = _all_sum(mine_norm, d) / d.world
            t_step, firsts = time.perf_counter(), []
            for j, (batch, (a, v)) in enumerate(zip(micro, anchors, strict=True)):
                first = batch["bucket"] not in seen_buckets
                # after a bucket's first step its graph exists: a recompile now is a bug, or an eager fallback
                stance = torch.compiler.set_stance("fail_on_recompile") if cfg.compile and not first else None
                sync = no_grad_sync(step_fn.model, sharded, skip=j < len(micro) - 1)
                with stance or contextlib.nullcontext(), sync:
                    loss, stats = forward_backward(step_fn, batch, a, v, norm.float())
                window[:-1] += stats.double()
                window[-1] += batch["tokens"]
                if first:
                    seen_buckets.add(batch["bucket"])
                    firsts.append(batch["bucket"])
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
            if sharded:
                grad_norm = grad_norm.full_tensor()  # a DTensor: the norm over every rank's shards
            lr = scheduler.get_last_lr()[0]  # the rate this step uses
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step, cursor = step + 1, cursor + g
            bar.update(1)
            for bucket in firsts:
                if d.device.type == "cuda":
                    torch.cuda.synchronize(d.device)
                took = time.perf_counter() - t_step
                what = f"compiled, caches {cache_counters()}" if cfg.compile else "eager"
                log(d, f"bucket {bucket}: first step {took:.1f} s ({what})")
                if d.world > 1:  # DDP syncs the backward: a rank that started late shows up as a long step
                    log(d, f"bucket {bucket}: step began at {process_age() - took:.1f} s, took "
                           f"{took:.1f} s", every_rank=True)
                if cfg.compile:
                    log(d, f"compile phases: {compile_phases()}", every_rank=True)

            if step % cfg.log_every == 0 or step == total:
                summed = _all_sum(window, d).cpu()
                dt, t_window = time.perf_counter() - t_window, time.perf_counter()
                row = {"step": step, "epoch": round(epoch + cursor / len(batches), 4),
                       **summarize(summed[:-1], spec.block_size), "lr": lr, "grad_norm": float(grad_norm),
                       "tokens_per_s": float(summed[-1]) / max(dt, 1e-9)}
                rows.append(row)
                window.zero_()
                if d.main:
                    with open(live_csv, "a", newline="") as f:
                        csv.DictWriter(f, fieldnames=fields).writerow(row)
                    bar.set_postfix(loss=f"{row['loss']:.3f}", tau=f"{row['sim_tau']:.2f}", refresh=False)
                if tb is not None:
                    for k, v in row.items():
                        if k != "step":
                            tb.add_scalar(f"train/{k}", v, step)
                    tb.flush()

            signalled = stop_signal(d) if step % cfg.log_every == 0 and step < total else 0
            stopping = bool(signalled) or (stop_at is not None and step >= stop_at)
            if step % cfg.checkpoint_every == 0 or step == total or stopping:
                ck = {"step": step, "epoch": epoch, "cursor": cursor, "world": d.world, "rows": rows,
                      "window": _all_sum(window, d).tolist(), "spec": asdict(spec)}
                model, optim = full_state(drafter, optimizer, sharded)
                if d.main:
                    save_checkpoint(run_dir, model, optim, scheduler, ck, cfg.keep_checkpoints)
                _barrier(d)
            if stopping:
                bar.close()
                if tb is not None:
                    tb.close()
                why = f"on {signal.Signals(signalled).name}" if signalled else "as asked (--stop-at)"
                log(d, f"stopped {why} after step {step}, checkpoint saved; rerun the same command to resume "
                       f"from {run_dir}")
                return {"step": step, "stopped": True, "signal": signalled, "run_dir": str(run_dir),
                        "rows": rows}
        if step < total:
            epoch, cursor = epoch + 1, 0
    bar.close()
    if tb is not None:
        tb.close()

    model = full_state(drafter, optimizer, sharded)[0]
    if d.main:
        export_drafter(drafter, spec, out_dir, dtype=step_fn.amp_dtype, state=model)
        write_metrics(metrics_path, rows, fields)
        log(d, f"exported {out_dir} after {step} steps; metrics in {metrics_path}")
    _barrier(d)
    return {"step": step, "stopped": False, "run_dir": str(run_dir), "rows": rows,
            "compile_cache": cache_counters()}
