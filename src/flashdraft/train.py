"""Drafter training: one process per device (torchrun), DDP or FSDP2, token-budget micro-batches,
checkpoints. A job (`TrainJob`: the configs, the target, its data, directories, where to stop) is set up,
then the loop below runs; the pieces live by concern:

- train_setup.py: the job, the run it sets up (drafter, parallel mode, optimizer, checkpointer, resume);
- train_data.py: what the job trains on (store mode's shards, a stream-mode chunk, a stream run every
  chunk trained): the seam the loop asks where to start, stop, what to prune and what to export, so it
  never asks which mode it runs in; the job's result (`TrainResult`);
- distributed.py: process group, collectives, stop signals, the parallel mode;
- batches.py: buckets, each epoch's micro-batch plan, a rank's share of the global batch, the loader;
- train_step.py: the drafter, the target's frozen head, one forward+backward (shared with the warmup);
- compile_cache.py: the warmup's caches, their key and loading;
- checkpoint.py: run key, full state dicts, save/load; metrics.py: the logged rows; export.py: the export.

Each micro-batch's loss is divided by the whole global batch's normalizer (summed over its micro-batches
and ranks before the first forward), so the gradient is the global batch's, whatever its split. A
resumed run replays exactly what an uninterrupted one would have seen, on any number of processes.

torch.compile is not thread-safe: everything compiled runs on the main thread of this process; data
loading uses DataLoader worker processes on GPU and the main thread on CPU.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from .batches import anchor_seeds, epoch_steps
from .checkpoint import Position, checkpoint_step
from .config import TrainConfig
from .distributed import (
    Dist,
    all_sum,
    barrier,
    end_loader_workers,
    log,
    no_grad_sync,
    setup_dist,
    stop_signal,
    stop_signals_caught,
    teardown_dist,
)
from .errors import UserError
from .export import export_checkpoint, export_run
from .io import process_age
from .metrics import MetricsLogger
from .train_data import TrainResult, run_dir
from .train_setup import Run, TrainJob, setup
from .train_step import anchors_for, batch_normalizer, forward_backward, row_slices
from .validate import Best, due


def global_normalizer(run: Run, micro: list[dict], anchors: list) -> torch.Tensor:
    """The loss normalizer of the whole global batch (a collective); DDP and FSDP average gradients over
    ranks, hence / world."""
    mine = sum(batch_normalizer(run.step, b, *av) for b, av in zip(micro, anchors, strict=True))
    return (all_sum(mine, run.d) / run.d.world).float()


def accumulate(
    run: Run, micro: list[dict], anchors: list, norm, metrics: MetricsLogger, seen: set[int]
) -> list[int]:
    """Forward and backward of this rank's micro-batches of one step (each in its row slices under
    train.batch_anchors), their gradients summed; returns the buckets that ran for the first time."""
    firsts = []
    passes = [
        p for batch, (a, v) in zip(micro, anchors, strict=True) for p in row_slices(run.step, batch, a, v)
    ]
    for j, (batch, a, v) in enumerate(passes):
        first = batch["bucket"] not in seen
        # after a bucket's first pass its graph exists: a recompile now is a bug, or an eager fallback
        stance = torch.compiler.set_stance("fail_on_recompile") if run.cfg.compile and not first else None
        sync = no_grad_sync(run.step.model, run.sharded, skip=j < len(passes) - 1)
        with stance or contextlib.nullcontext(), sync:
            _, stats = forward_backward(run.step, batch, a, v, norm)
        metrics.add(stats, batch["tokens"])
        if first:
            seen.add(batch["bucket"])
            firsts.append(batch["bucket"])
    return firsts


def log_first_steps(run: Run, buckets: list[int], t_step: float) -> None:
    """A bucket's first step compiles (or loads) its graph: how long it took, and the caches' counters."""
    from .compile_cache import cache_counters, compile_phases

    d = run.d
    for bucket in buckets:
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        took = time.perf_counter() - t_step
        what = f"compiled, caches {cache_counters()}" if run.cfg.compile else "eager"
        log(d, f"bucket {bucket}: first step {took:.1f} s ({what})")
        if d.device.type == "cuda":  # the peak so far: the optimizer state exists from the first step on
            gib = torch.cuda.max_memory_allocated(d.device) / 2**30
            log(
                d,
                f"bucket {bucket}: peak GPU memory {gib:.2f} GiB allocated, "
                f"{torch.cuda.max_memory_reserved(d.device) / 2**30:.2f} GiB reserved",
            )
        if d.world > 1:  # DDP syncs the backward: a rank that started late shows up as a long step
            log(
                d,
                f"bucket {bucket}: step began at {process_age() - took:.1f} s, took {took:.1f} s",
                every_rank=True,
            )
        if run.cfg.compile:
            log(d, f"compile phases: {compile_phases()}", every_rank=True)


def check_finite(row: dict, cfg: TrainConfig, run_dir: Path) -> None:
    """Stop at a logged step whose loss or gradient norm is not finite (every rank sees the same row):
    training on would only export NaN weights."""
    if math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]):
        return
    raise UserError(
        f"the loss is {row['loss']} and the gradient norm {row['grad_norm']} at step {row['step']}: training "
        f"diverged; lower train.lr ({cfg.lr}) or check drafter.init_from's weights, then rerun (the "
        f"checkpoints before this step stay in {run_dir})"
    )


def optimizer_step(run: Run) -> tuple[float, torch.Tensor]:
    """Clip, step, zero the gradients and advance the schedule; returns the rate this step used and the
    gradient norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), run.cfg.grad_clip)
    if run.sharded:
        grad_norm = grad_norm.full_tensor()  # a DTensor: the norm over every rank's shards
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    return lr, grad_norm


def after_step(
    run: Run, job: TrainJob, at: Position, epoch_len: int, lr: float, grad_norm, metrics, best: Best | None
) -> TrainResult | None:
    """Validation, the logged row, the checkpoint and a stop after optimizer step `at.step`; returns the
    job's summary when it stops here (a signal, --stop-at), else None."""
    cfg, d, step = run.cfg, run.d, at.step
    val_row = (
        run.val.evaluate(run.step, run.drafter, run.sharded)
        if run.val and due(cfg, step, run.total)
        else None
    )
    if val_row:
        best.update(step, val_row, run.checkpointer.model_state)
    if step % cfg.log_every == 0 or step == run.total or val_row:
        row = metrics.log(step, round(at.epoch + at.cursor / epoch_len, 4), lr, float(grad_norm), val_row)
        check_finite(row, cfg, run.run_dir)
    signalled = stop_signal(d) if step % cfg.log_every == 0 and step < run.total else 0
    stopping = bool(signalled) or (job.stop_at is not None and step >= job.stop_at)
    if step % cfg.checkpoint_every == 0 or step == run.stop or stopping:
        run.checkpointer.save(
            {
                "position": asdict(at),
                "metrics": metrics.state_dict(),
                "best": best.state_dict() if best else None,
                "spec": asdict(run.spec),
            },
            wait=stopping,
        )
    if not stopping:
        return None
    why = f"on {signal.Signals(signalled).name}" if signalled else "as asked (--stop-at)"
    log(
        d,
        f"stopped {why} after step {step}, checkpoint saved; rerun the same command to resume from "
        f"{run.run_dir}",
    )
    return TrainResult(step, str(run.run_dir), metrics.rows, stopped=True, signal=signalled)


def train_steps(
    run: Run, job: TrainJob, at: Position, metrics: MetricsLogger, best: Best | None
) -> TrainResult | None:
    """The loop, from `at` to the job's stop; returns the summary of a job stopped early, else None."""
    cfg, seen = run.cfg, set()
    while at.step < run.stop:
        batches, steps = run.ahead or epoch_steps(
            run.data.store, run.data.lengths, cfg, at.epoch, at.cursor, run.stop - at.step, run.d, run.collate
        )
        run.ahead = None
        for ks, micro in steps:
            anchors = [
                anchors_for(
                    run.step,
                    b["loss_mask"],
                    seeds=anchor_seeds(cfg.seed, at.epoch, batches[k], len(b["loss_mask"])),
                )
                for k, b in zip(ks, micro, strict=True)
            ]
            norm = global_normalizer(run, micro, anchors)
            t_step = time.perf_counter()
            firsts = accumulate(run, micro, anchors, norm, metrics, seen)
            lr, grad_norm = optimizer_step(run)
            at.step, at.cursor = at.step + 1, at.cursor + run.micro_per_step
            metrics.bar.update(1)
            log_first_steps(run, firsts, t_step)
            run.first_step_done = run.first_step_done or (process_age(), time.time())
            if (stopped := after_step(run, job, at, len(batches), lr, grad_norm, metrics, best)) is not None:
                return stopped
        if (len(batches) - at.cursor) // run.micro_per_step == 0 and at.step < run.total:  # epoch done
            at.epoch, at.cursor = at.epoch + 1, 0
    return None


def train(job: TrainJob) -> TrainResult:
    """Train (or resume) and export; returns the job's result. job.stop_at: save a checkpoint after that
    step and return without exporting (a deliberate preemption). SIGTERM or Ctrl-C stops at the next log
    step with a checkpoint. A stream chunk (train_data.ChunkData) trains its steps and exports nothing;
    stream mode's train job (train_data.PlanData) trains nothing and exports the run's last checkpoint."""
    d = setup_dist()
    try:
        with stop_signals_caught():
            return _train(d, job)
    except BaseException:
        end_loader_workers()
        raise
    finally:
        teardown_dist(d)


def trained_already(d: Dist, job: TrainJob, run: Path, past: Path) -> TrainResult:
    """A job whose steps the run has passed trains nothing and removes nothing but what its end supersedes
    (what the finished job prunes), and exports the run where its mode does (stream mode's train job, from
    the last checkpoint). A stream chunk run again (a train key the chunks do not depend on, a plan made
    again when an earlier train.seed comes back, --forcerun, a job stopped at the chunk's last step) is
    one: the checkpoints inside it go."""
    data = job.data
    barrier(d)  # every rank has looked before rank 0 removes anything
    if d.main:
        data.finish(run, 0)
    barrier(d)
    step = data.stop(checkpoint_step(past))
    log(
        d,
        f"{data.name} is trained already: {past} holds step {checkpoint_step(past)}, at or past its end "
        f"(step {step}); nothing to train",
    )
    rows = data.export(lambda: export_checkpoint(d, job, run, past))
    barrier(d)
    return TrainResult(
        step, str(run), rows or [], **data.summary(), seconds=process_age(), trained_already=str(past)
    )


def _train(d: Dist, job: TrainJob) -> TrainResult:
    log(d, f"started {d.world} process(es); rank 0 on {d.device}")
    cfg, data = job.cfg, job.data
    data.check(cfg, d.world)
    run_path = run_dir(job.checkpoints, cfg, job.drafter, data)
    if (past := data.trained(run_path)) is not None:
        return trained_already(d, job, run_path, past)
    run, state = setup(d, job, run_path)
    at = replace(state["position"], world=d.world)  # saved by this job's processes from here on
    metrics = MetricsLogger(
        run_path,
        d,
        run.spec.block_size,
        at.step,
        run.total,
        **(state["metrics"] or {}),
        val=bool(cfg.val_samples),
        kind=run.spec.family,
    )
    best = Best(run_path, d, state.get("best"), run.step.amp_dtype) if cfg.val_samples else None
    run.drafter.train()
    try:
        if (stopped := train_steps(run, job, at, metrics, best)) is not None:
            return stopped
    finally:
        metrics.close()
        run.checkpointer.wait()  # the last save reaches the disk, even when the loop failed
    from .compile_cache import cache_counters

    peak = torch.cuda.max_memory_allocated(d.device) if d.device.type == "cuda" else None
    if peak is not None:
        log(
            d,
            f"peak GPU memory {peak / 2**30:.2f} GiB allocated, "
            f"{torch.cuda.max_memory_reserved(d.device) / 2**30:.2f} GiB reserved",
            every_rank=True,
        )
    if d.main:
        data.finish(run_path, cfg.keep_checkpoints)
    data.export(
        lambda: export_run(
            d,
            job,
            run.spec,
            run_path,
            run.checkpointer.model_state(),
            best,
            at.step,
            metrics.rows,
            run.step.amp_dtype,
            run.drafter,
        )
    )
    barrier(d)
    log(d, f"trained to step {at.step} of {run.total}{data.where()}")
    done = run.first_step_done or (None, None)
    return TrainResult(
        at.step,
        str(run_path),
        metrics.rows,
        compile_cache=cache_counters(),
        peak_gpu_bytes=peak,
        **data.summary(),
        first_step_done_s=done[0],
        first_step_done_at=done[1],
        seconds=process_age(),
    )
