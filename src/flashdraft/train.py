"""Drafter training: one process per device (torchrun), DDP or FSDP2, token-budget micro-batches,
checkpoints. Setup, then the loop; the pieces live by concern:

- distributed.py: process group, collectives, stop signals, the parallel mode;
- batches.py: buckets, each epoch's micro-batch plan, a rank's share of the global batch, the loader;
- train_step.py: the drafter, the target's frozen head, one forward+backward (shared with the warmup);
- compile_cache.py: the warmup's caches, their key and loading;
- checkpoint.py: run key, full state dicts, save/load; metrics.py: the logged rows.

Each micro-batch's loss is divided by the whole global batch's normalizer (summed over its micro-batches
and ranks before the first forward), so the gradient is the global batch's, whatever its split. A
resumed run replays exactly what an uninterrupted one would have seen, on any number of processes.

torch.compile is not thread-safe: everything compiled runs on the main thread of this process; data
loading uses DataLoader worker processes on GPU and the main thread on CPU. A process's start-up is on
the critical path of every stream-mode chunk: setup starts the slow reads (checkpoint, the target's head,
the first micro-batches) in threads before it imports compile_cache, which brings Dynamo's seconds of
imports; then Triton's per-process set-up runs in a thread while the compile cache loads.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .batches import Collate, anchor_seeds, epoch_steps, micro_per_step, steps_left
from .checkpoint import (
    Checkpointer,
    checkpoint_dirs,
    checkpoint_step,
    chunk_resume_point,
    chunk_trained,
    prune_chunk,
    record_run,
    run_key,
    saved_position,
    start_reading,
)
from .config import DrafterConfig, TrainConfig, check_validation, needs_last_hidden
from .distributed import (
    Dist,
    all_sum,
    barrier,
    end_loader_workers,
    gpu_bytes,
    log,
    no_grad_sync,
    parallel_mode,
    parallelize,
    setup_dist,
    stop_signal,
    stop_signals_caught,
    teardown_dist,
)
from .errors import UserError
from .hidden import HiddenStore, require_last_hidden
from .io import background, process_age, write_json
from .metrics import MetricsLogger
from .model import DrafterSpec, export_drafter, meta_drafter
from .stream import Chunk, Plan, planned_store
from .train_step import (
    Step,
    anchors_for,
    batch_normalizer,
    build_step,
    forward_backward,
    frozen_head,
    initial_weights,
    load_spec,
    resolve,
)
from .validate import Best, Validator, due, export_choice, split_store


def lr_factor(step: int, total: int, warmup_ratio: float) -> float:
    """Linear warmup over warmup_ratio of the steps, then cosine to 0 (step counts from 0)."""
    warmup = int(round(warmup_ratio * total))
    if step < warmup:
        return (step + 1) / warmup
    progress_ = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress_)))


@dataclass
class Run:
    """What the loop works with, built by setup()."""

    d: Dist
    cfg: TrainConfig
    spec: DrafterSpec
    store: HiddenStore
    lengths: list[int]  # tokens per sample
    step_fn: Step  # step_fn.model: what runs the step (the drafter, DDP's wrapper or the sharded drafter)
    drafter: torch.nn.Module
    sharded: bool  # FSDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    checkpointer: Checkpointer
    g: int  # micro-batches per optimizer step, over all ranks
    collate: Collate
    stop: int  # this job's last step (a chunk's end in stream mode)
    ahead: tuple | None  # the first epoch's (micro-batch plan, step_batches), its loader reading since setup
    val: Validator | None = None  # train.val_samples: the held-out samples (None: no validation)


def setup(d: Dist, cfg: TrainConfig, drafter_cfg: DrafterConfig, target_dir, shards, checkpoints: Path,
          compile_cache, plan: Plan | None = None, chunk: Chunk | None = None,
          val_shards=None) -> tuple[Run, int, dict]:
    """The run, its step count and its state: a fresh one, or the latest checkpoint's (resume: model,
    optimizer, schedule, data position, logged rows and the open metrics window). Stream mode (`plan`):
    the run's samples are the plan's, `shards` hold the samples of `chunk` (none for the export), and a
    chunk starts from the checkpoint where the previous chunk ended. Validation (train.val_samples): store
    mode keeps the split out of the shards' samples; stream mode's plan did, `val_shards` hold it."""
    spec = load_spec(target_dir, drafter_cfg, plan.tokenizer_length if plan else None)
    if plan is None:
        store, val_store = split_store(HiddenStore(shards), cfg)
        lengths = [store.num_tokens(i) for i in range(len(store))]
    else:
        plan.check(cfg, d.world)
        store = planned_store(plan, chunk, shards) if chunk else None
        val_store = plan.val_store(val_shards) if chunk and cfg.val_samples else None
        lengths = plan.lengths
    if needs_last_hidden(drafter_cfg):  # the family's loss reads the target's last hidden state
        for s in (store, val_store):
            if s is not None:
                require_last_hidden(s, drafter_cfg.family)
    mismatch = store is not None and (store.layer_ids, store.hidden_size) != (spec.target_layer_ids,
                                                                               spec.hidden_size)
    if mismatch:
        raise ValueError(
            f"hidden shards hold layers {store.layer_ids} (H={store.hidden_size}) but the drafter wants "
            f"{spec.target_layer_ids} (H={spec.hidden_size}); recompute the hidden states"
        )
    run_dir = checkpoints / run_key(cfg, drafter_cfg, shards, plan.fingerprint if plan else None)
    where = f", {chunk.name} (steps {chunk.start_step}..{chunk.end_step})" if chunk else ""
    log(d, f"train: {len(lengths)} samples, {sum(lengths)} tokens{where}, {d.world} process(es) on "
           f"{d.device}")
    if chunk is not None:  # not trained (trained_already): its starting point is the latest checkpoint
        if d.main:
            chunk_resume_point(run_dir, chunk.start_step, chunk.end_step, plan.chunks)
        barrier(d)
    found = checkpoint_dirs(run_dir)
    latest = found[-1] if found else None
    g = micro_per_step(cfg, d.world)
    total = cfg.max_steps or steps_left(lengths, cfg, d.world)
    at = saved_position(latest) if latest else {"step": 0, "epoch": 0, "cursor": 0, "world": d.world}
    if latest and not cfg.max_steps and at["world"] != d.world and not cfg.global_batch_tokens:
        # one micro-batch per process: another process count changes the global batch
        total = at["step"] + steps_left(lengths, cfg, d.world, at["epoch"], at["cursor"])
    check_validation(cfg, steps=total)  # before anything trains
    if total == 0:  # nothing would train: the export would be the initial weights
        raise UserError(
            f"training would take 0 optimizer steps: the {len(lengths)} training samples fill fewer "
            f"micro-batches than one step takes ({g}, train.global_batch_tokens / train.batch_tokens); lower "
            "train.global_batch_tokens, or train on more samples (prompts.total, train.val_samples)")
    # the slow reads start first: the checkpoint, the target's head and the first micro-batches are read
    # while Dynamo is imported, the compile cache loads and the drafter is built
    params = sum(p.numel() for p in meta_drafter(spec).parameters())  # for the parallel mode
    mode = parallel_mode(cfg.parallel, params, d.world, gpu_bytes(d.device))
    if mode == "fsdp" and spec.family != "dflash":  # its loss reads whole head weights, not FSDP's shards
        raise UserError(f"drafter.family {spec.family} trains with train.parallel ddp (or one process), not "
                        f"fsdp ({cfg.parallel}); set train.parallel: ddp")
    sharded = mode == "fsdp"
    reading = start_reading(latest, d.device if d.device.type == "cuda" and not sharded else None)
    amp = resolve(cfg, d.device).amp_dtype
    head = background(frozen_head, target_dir, d.device, amp, name="head-reader")
    stop = min(total, chunk.end_step) if chunk else total  # this job's last step
    collate = Collate(cfg.buckets, cfg.batch_tokens, amp or torch.float32)
    ahead = epoch_steps(store, lengths, cfg, at["epoch"], at["cursor"], stop - at["step"], d,
                        collate) if store is not None and at["step"] < stop else None
    # Dynamo: seconds of imports
    from .compile_cache import cache_key, load_compile_cache, set_compile_workers, warm_triton

    triton = warm_triton(d.device) if cfg.compile else None
    warm = cfg.compile and load_compile_cache(compile_cache, cache_key(cfg, spec, d.device), d)
    # drafter.init_from starts a run; a resumed one (a later chunk) takes its checkpoint's weights instead
    init = initial_weights(drafter_cfg, spec) if latest is None else None
    if init is not None:
        log(d, f"drafter: starting from drafter.init_from {drafter_cfg.init_from}")
    step_fn = build_step(cfg, spec, target_dir, d.device, init, head, drafter_cfg)
    drafter = step_fn.model
    step_fn.model = parallelize(drafter, mode, d.device)
    if mode != "single":
        log(d, f"parallel: {mode} ({cfg.parallel}), {d.world} processes")
    if cfg.compile:
        # the warmup compiles the unsharded step; FSDP's hooks split the graph elsewhere, so its ranks compile
        workers = set_compile_workers(warm and not sharded, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        log(d, f"compile workers per process: {workers}" + (" (FSDP: the warmup's graphs do not apply)"
                                                             if warm and sharded else ""))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fused=d.device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, cfg.warmup_ratio))
    ends = frozenset(c.end_step for c in plan.chunks) if plan else frozenset()  # where chunks start again
    if d.main:  # every check passed: the run starts (or goes on) here
        record_run(run_dir, cfg, drafter_cfg, shards, plan.fingerprint if plan else None)
    ckpt = Checkpointer(run_dir, d, drafter, optimizer, scheduler, sharded, cfg.keep_checkpoints, ends)
    val = Validator(val_store, cfg, d, step_fn.amp_dtype or torch.float32) if val_store is not None else None
    run = Run(d, cfg, spec, store, lengths, step_fn, drafter, sharded, optimizer, scheduler, ckpt, g, collate,
              stop, ahead, val)

    if triton is not None:
        with contextlib.suppress(Exception):  # the first step meets the same error, where torch reports it
            triton.result()
    state = {"step": 0, "epoch": 0, "cursor": 0, "rows": [], "window": None}
    if latest:
        state = ckpt.resume(latest, reading)
        log(d, f"resumed from {latest}: step {state['step']}/{total}, saved by {state['world']} rank(s)")
    else:
        log(d, f"new run in {run_dir}: {total} steps")
    log(d, f"global batch: {g} micro-batches of {cfg.batch_tokens} tokens, {-(-g // d.world)} or fewer per "
           f"process and step")
    return run, total, state


def global_normalizer(run: Run, micro: list[dict], anchors: list) -> torch.Tensor:
    """The loss normalizer of the whole global batch (a collective); DDP and FSDP average gradients over
    ranks, hence / world."""
    mine = sum(batch_normalizer(run.step_fn, b, *av) for b, av in zip(micro, anchors, strict=True))
    return (all_sum(mine, run.d) / run.d.world).float()


def accumulate(run: Run, micro: list[dict], anchors: list, norm, metrics: MetricsLogger,
               seen: set[int]) -> list[int]:
    """Forward and backward of this rank's micro-batches of one step, their gradients summed; returns the
    buckets that ran for the first time."""
    firsts = []
    for j, (batch, (a, v)) in enumerate(zip(micro, anchors, strict=True)):
        first = batch["bucket"] not in seen
        # after a bucket's first step its graph exists: a recompile now is a bug, or an eager fallback
        stance = torch.compiler.set_stance("fail_on_recompile") if run.cfg.compile and not first else None
        sync = no_grad_sync(run.step_fn.model, run.sharded, skip=j < len(micro) - 1)
        with stance or contextlib.nullcontext(), sync:
            _, stats = forward_backward(run.step_fn, batch, a, v, norm)
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
        if d.world > 1:  # DDP syncs the backward: a rank that started late shows up as a long step
            log(d, f"bucket {bucket}: step began at {process_age() - took:.1f} s, took {took:.1f} s",
                every_rank=True)
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
        f"checkpoints before this step stay in {run_dir})")


def write_export_info(out: Path, chosen: dict, split: dict | None, run_dir: Path) -> None:
    """export.json (which step of which run was exported and why) and, with validation, val_split.json (its
    samples) beside the metrics."""
    write_json(out / "export.json", {**chosen, "run": run_dir.name})  # its checkpoints/<run>
    if split is not None:
        write_json(out / "val_split.json", split)


def train(cfg: TrainConfig, drafter_cfg: DrafterConfig, target_dir, shards: list[str], checkpoints,
          metrics_path, out_dir, compile_cache=None, stop_at: int | None = None, plan=None,
          chunk: str | None = None, val_shards=None) -> dict:
    """Train (or resume) and export; returns a summary. `stop_at`: save a checkpoint after that step and
    return without exporting (a deliberate preemption). SIGTERM or Ctrl-C stops at the next log step
    with a checkpoint. Stream mode: `plan` (the data plan's directory) and `chunk` (a chunk's name in it,
    epoch-EEE/chunk-CCCCC) train that chunk's steps from `shards` and save; `plan` without `chunk`
    exports the trained run. `val_shards`: stream mode's validation shard (train.val_samples)."""
    d = setup_dist()
    try:
        with stop_signals_caught():
            return _train(d, cfg, drafter_cfg, target_dir, shards, Path(checkpoints), metrics_path, out_dir,
                          compile_cache, stop_at, plan, chunk, val_shards)
    except BaseException:
        end_loader_workers()
        raise
    finally:
        teardown_dist(d)


def trained_already(d: Dist, cfg: TrainConfig, drafter_cfg: DrafterConfig, shards, checkpoints: Path,
                    plan: Plan, chunk: Chunk) -> dict | None:
    """A chunk whose run dir holds a checkpoint at or past its end is trained: its job, run again (a train
    key the chunks do not depend on, a plan made again when an earlier train.seed comes back, --forcerun, a
    job stopped at the chunk's last step), trains nothing and removes nothing but the checkpoints inside
    the chunk, which its end supersedes (what the finished job prunes). Returns its summary, else None."""
    plan.check(cfg, d.world)
    run_dir = checkpoints / run_key(cfg, drafter_cfg, shards, plan.fingerprint)
    past = chunk_trained(run_dir, chunk.end_step)
    if past is None:
        return None
    barrier(d)  # every rank has looked before rank 0 removes anything
    if d.main:
        prune_chunk(run_dir, chunk.start_step, chunk.end_step)
    barrier(d)
    log(d, f"{chunk.name} is trained already: {past} holds step {checkpoint_step(past)}, at or past the "
           f"chunk's steps {chunk.start_step}..{chunk.end_step}; nothing to train")
    return {"step": chunk.end_step, "stopped": False, "run_dir": str(run_dir), "rows": [],
            "compile_cache": {}, "chunk": asdict(chunk), "first_step_done_s": None,
            "first_step_done_at": None, "seconds": process_age(), "trained_already": str(past)}


def _train(d: Dist, cfg: TrainConfig, drafter_cfg, target_dir, shards, checkpoints: Path, metrics_path,
           out_dir, compile_cache, stop_at, plan_dir, chunk_name, val_shards=None):
    log(d, f"started {d.world} process(es); rank 0 on {d.device}")
    plan = Plan(plan_dir) if plan_dir else None
    chunk = plan.named(chunk_name) if plan and chunk_name else None
    if chunk is not None and (done := trained_already(d, cfg, drafter_cfg, shards, checkpoints, plan, chunk)):
        return done
    run, total, state = setup(d, cfg, drafter_cfg, target_dir, shards, checkpoints, compile_cache, plan,
                              chunk, val_shards)
    step, epoch, cursor, g, stop = state["step"], state["epoch"], state["cursor"], run.g, run.stop
    if plan and not chunk and step < total:
        raise UserError(f"the run is trained to step {step} of {total}: train every chunk of the plan "
                        f"{plan_dir} first (the train_chunk jobs)")
    metrics = MetricsLogger(run.checkpointer.run_dir, d, run.spec.block_size, step, total, state["rows"],
                            state["window"], val=bool(cfg.val_samples), kind=run.spec.family)
    best = (Best(run.checkpointer.run_dir, d, state.get("best"), run.step_fn.amp_dtype) if cfg.val_samples
            else None)
    seen: set[int] = set()
    first_step_done = None
    run.drafter.train()
    try:
        while step < stop:
            batches, steps = run.ahead or epoch_steps(run.store, run.lengths, cfg, epoch, cursor,
                                                      stop - step, d, run.collate)
            run.ahead = None
            for ks, micro in steps:
                anchors = [anchors_for(run.step_fn, b["loss_mask"],
                                       seeds=anchor_seeds(cfg.seed, epoch, batches[k], len(b["loss_mask"])))
                           for k, b in zip(ks, micro, strict=True)]
                norm = global_normalizer(run, micro, anchors)
                t_step = time.perf_counter()
                firsts = accumulate(run, micro, anchors, norm, metrics, seen)
                grad_norm = torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), cfg.grad_clip)
                if run.sharded:
                    grad_norm = grad_norm.full_tensor()  # a DTensor: the norm over every rank's shards
                lr = run.scheduler.get_last_lr()[0]  # the rate this step uses
                run.optimizer.step()
                run.optimizer.zero_grad(set_to_none=True)
                run.scheduler.step()
                step, cursor = step + 1, cursor + g
                metrics.bar.update(1)
                log_first_steps(run, firsts, t_step)
                first_step_done = first_step_done or (process_age(), time.time())

                val_row = run.val.evaluate(run.step_fn, run.drafter, run.sharded) if (
                    run.val and due(cfg, step, total)) else None
                if val_row:
                    best.update(step, val_row, run.checkpointer.model_state)
                if step % cfg.log_every == 0 or step == total or val_row:
                    row = metrics.log(step, round(epoch + cursor / len(batches), 4), lr, float(grad_norm),
                                      val_row)
                    check_finite(row, cfg, run.checkpointer.run_dir)
                signalled = stop_signal(d) if step % cfg.log_every == 0 and step < total else 0
                stopping = bool(signalled) or (stop_at is not None and step >= stop_at)
                if step % cfg.checkpoint_every == 0 or step == stop or stopping:
                    run.checkpointer.save({"step": step, "epoch": epoch, "cursor": cursor, "world": d.world,
                                           "rows": metrics.rows, "window": metrics.window_state(),
                                           "spec": asdict(run.spec),
                                           **({"best": best.state()} if best else {})}, wait=stopping)
                if stopping:
                    why = f"on {signal.Signals(signalled).name}" if signalled else "as asked (--stop-at)"
                    log(d, f"stopped {why} after step {step}, checkpoint saved; rerun the same command to "
                           f"resume from {run.checkpointer.run_dir}")
                    return {"step": step, "stopped": True, "signal": signalled,
                            "run_dir": str(run.checkpointer.run_dir), "rows": metrics.rows}
            if (len(batches) - cursor) // g == 0 and step < total:  # the epoch's last whole step is done
                epoch, cursor = epoch + 1, 0
    finally:
        metrics.close()
        run.checkpointer.wait()  # the last save reaches the disk, even when the loop failed
    from .compile_cache import cache_counters

    if chunk:
        if d.main:
            prune_chunk(run.checkpointer.run_dir, chunk.start_step, chunk.end_step, cfg.keep_checkpoints)
        barrier(d)
        log(d, f"trained {chunk.name}: steps {chunk.start_step}..{step} of {total}")
        return {"step": step, "stopped": False, "run_dir": str(run.checkpointer.run_dir),
                "rows": metrics.rows, "compile_cache": cache_counters(), "chunk": asdict(chunk),
                "first_step_done_s": first_step_done and first_step_done[0],
                "first_step_done_at": first_step_done and first_step_done[1], "seconds": process_age(),
                "trained_already": None}
    model = run.checkpointer.model_state()
    chosen = export_choice(cfg, best, step)
    if chosen["step"] != step:
        model = best.weights()
    if d.main:
        export_drafter(run.drafter, run.spec, out_dir, dtype=run.step_fn.amp_dtype, state=model)
        metrics.write(metrics_path)
        split = run.val.split() if run.val else plan.val_split() if plan and cfg.val_samples else None
        write_export_info(Path(metrics_path).parent, chosen, split, run.checkpointer.run_dir)
        log(d, f"exported {out_dir}: step {chosen['step']} of {step} ({chosen['why']}); metrics in "
               f"{metrics_path}")
    barrier(d)
    return {"step": step, "stopped": False, "run_dir": str(run.checkpointer.run_dir), "rows": metrics.rows,
            "compile_cache": cache_counters()}
