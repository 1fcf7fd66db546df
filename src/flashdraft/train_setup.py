"""A training job and its set-up: `TrainJob` (what scripts/train.py reads from its command line), `Run`
(what the loop in train.py works with) and `setup`, which builds the run from the job: the drafter's
spec, the checks on its data, the run's step count, the parallel mode, the compiled step, the optimizer
and schedule, the checkpointer and the state to resume from.

setup starts the slow reads (checkpoint, the target's head, the first micro-batches) in threads before it
imports compile_cache, which brings Dynamo's seconds of imports; then Triton's per-process set-up runs in a
thread while the compile cache loads: a process's start-up is on the critical path of every stream-mode
chunk.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .batches import Collate, epoch_steps, micro_per_step, steps_left
from .checkpoint import (
    Checkpointer,
    Position,
    checkpoint_dirs,
    read_state,
    record_run,
    saved_position,
    start_reading,
)
from .config import DrafterConfig, TrainConfig, check_validation
from .distributed import Dist, barrier, gpu_bytes, log, parallel_mode, parallelize
from .errors import UserError
from .io import background
from .model import DrafterSpec, meta_drafter
from .train_data import TrainData, check_stores
from .train_step import Step, build_step, frozen_head, initial_weights, load_spec, resolve
from .validate import Validator


def lr_factor(step: int, total: int, warmup_ratio: float) -> float:
    """Linear warmup over warmup_ratio of the steps, then cosine to 0 (step counts from 0)."""
    warmup = int(round(warmup_ratio * total))
    if step < warmup:
        return (step + 1) / warmup
    progress_ = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress_)))


@dataclass
class TrainJob:
    """One training job, as scripts/train.py reads it from its command line."""

    cfg: TrainConfig
    drafter: DrafterConfig
    target: Path  # the target's HF directory
    data: TrainData
    checkpoints: Path  # resumable state goes to <checkpoints>/<run key>/
    metrics: Path | None = None  # the final metrics CSV (a job that exports)
    out: Path | None = None  # the export's directory
    compile_cache: Path | None = None  # the warmup's directory
    stop_at: int | None = None  # save a checkpoint after this step and return without exporting


@dataclass
class Run:
    """What the loop works with, built by setup()."""

    d: Dist
    cfg: TrainConfig
    spec: DrafterSpec
    data: TrainData
    run_dir: Path
    step: Step  # step.model: what runs the step (the drafter, DDP's wrapper or the sharded drafter)
    drafter: torch.nn.Module
    sharded: bool  # FSDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    checkpointer: Checkpointer
    micro_per_step: int  # micro-batches per optimizer step, over all ranks
    collate: Collate
    total: int  # the run's steps
    stop: int  # this job's last step (a chunk's end in stream mode)
    ahead: tuple | None  # the first epoch's (micro-batch plan, step_batches), its loader reading since setup
    val: Validator | None = None  # train.val_samples: the held-out samples (None: no validation)
    first_step_done: tuple | None = None  # (process age, time) when this job's first step ended


def total_steps(cfg: TrainConfig, lengths: list[int], world: int, at: Position | None) -> int:
    """The run's optimizer steps. One micro-batch per process: a run resumed on another process count
    changes the global batch, so its steps are counted from where it is."""
    total = cfg.max_steps or steps_left(lengths, cfg, world)
    if at and not cfg.max_steps and at.world != world and not cfg.global_batch_tokens:
        total = at.step + steps_left(lengths, cfg, world, at.epoch, at.cursor)
    check_validation(cfg, steps=total)  # before anything trains
    if total == 0:  # nothing would train: the export would be the initial weights
        raise UserError(
            f"training would take 0 optimizer steps: the {len(lengths)} training samples fill fewer "
            f"micro-batches than one step takes ({micro_per_step(cfg, world)}, train.global_batch_tokens / "
            "train.batch_tokens); lower train.global_batch_tokens, or train on more samples (prompts.total, "
            "train.val_samples)"
        )
    return total


def setup(d: Dist, job: TrainJob, run: Path) -> tuple[Run, dict]:
    """The run and its state by name (checkpoint.read_state): a fresh one, or the latest checkpoint's
    (resume: model, optimizer, schedule, the position, the metrics' rows and open window, the best)."""
    cfg, data = job.cfg, job.data
    spec = load_spec(job.target, job.drafter, data.tokenizer_length)
    check_stores(data, spec, job.drafter)
    lengths = data.lengths
    log(
        d,
        f"train: {len(lengths)} samples, {sum(lengths)} tokens{data.where()}, {d.world} process(es) on "
        f"{d.device}",
    )
    if d.main:
        data.begin(run)  # a stream chunk: a checkpoint to start from exists
    barrier(d)
    found = checkpoint_dirs(run)
    latest = found[-1] if found else None
    at = saved_position(latest) if latest else Position(world=d.world)
    total = total_steps(cfg, lengths, d.world, at if latest else None)
    # the slow reads start first: the checkpoint, the target's head and the first micro-batches are read
    # while Dynamo is imported, the compile cache loads and the drafter is built
    params = sum(p.numel() for p in meta_drafter(spec).parameters())  # for the parallel mode
    mode = parallel_mode(cfg.parallel, params, d.world, gpu_bytes(d.device))
    sharded = mode == "fsdp"
    reading = start_reading(latest, d.device if d.device.type == "cuda" and not sharded else None)
    amp = resolve(cfg, d.device).amp_dtype
    head = background(frozen_head, job.target, d.device, amp, name="head-reader")
    stop = data.stop(total)
    collate = Collate(cfg.buckets, cfg.batch_tokens, amp or torch.float32)
    ahead = (
        epoch_steps(data.store, lengths, cfg, at.epoch, at.cursor, stop - at.step, d, collate)
        if at.step < stop
        else None
    )
    # Dynamo: seconds of imports
    from .compile_cache import cache_key, load_compile_cache, set_compile_workers, warm_triton

    triton = warm_triton(d.device) if cfg.compile else None
    warm = cfg.compile and load_compile_cache(job.compile_cache, cache_key(cfg, spec, d.device), d)
    # drafter.init_from starts a run; a resumed one (a later chunk) takes its checkpoint's weights instead
    init = initial_weights(job.drafter, spec) if latest is None else None
    if init is not None:
        log(d, f"drafter: starting from drafter.init_from {job.drafter.init_from}")
    step = build_step(cfg, spec, job.target, d.device, init, head, job.drafter)
    drafter = step.model
    step.model = parallelize(drafter, mode, d.device)
    if mode != "single":
        log(d, f"parallel: {mode} ({cfg.parallel}), {d.world} processes")
    if cfg.compile:
        # the warmup compiles the unsharded step; FSDP's hooks split the graph elsewhere, so its ranks compile
        workers = set_compile_workers(warm and not sharded, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        log(
            d,
            f"compile workers per process: {workers}"
            + (" (FSDP: the warmup's graphs do not apply)" if warm and sharded else ""),
        )
    optimizer = torch.optim.AdamW(
        drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=d.device.type == "cuda"
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, cfg.warmup_ratio))
    if d.main:  # every check passed: the run starts (or goes on) here
        record_run(run, cfg, job.drafter, data.shards, data.fingerprint)
    ckpt = Checkpointer(run, d, drafter, optimizer, scheduler, sharded, cfg.keep_checkpoints, data.protect)
    hidden_dtype = step.amp_dtype or torch.float32
    val = None if data.val_store is None else Validator(data.val_store, cfg, d, hidden_dtype)
    g = micro_per_step(cfg, d.world)
    r = Run(
        d,
        cfg,
        spec,
        data,
        run,
        step,
        drafter,
        sharded,
        optimizer,
        scheduler,
        ckpt,
        g,
        collate,
        total,
        stop,
        ahead,
        val,
    )
    if triton is not None:
        with contextlib.suppress(Exception):  # the first step meets the same error, where torch reports it
            triton.result()
    state = {"position": Position(world=d.world), "metrics": None, "best": None}
    if latest:
        state = read_state(ckpt.resume(latest, reading))
        at = state["position"]
        log(d, f"resumed from {latest}: step {at.step}/{total}, saved by {at.world} rank(s)")
    else:
        log(d, f"new run in {run}: {total} steps")
    log(
        d,
        f"global batch: {g} micro-batches of {cfg.batch_tokens} tokens, {-(-g // d.world)} or fewer per "
        f"process and step",
    )
    return r, state
