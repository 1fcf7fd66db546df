"""Processes and devices for training: the process group, collectives, stop signals, the parallel mode
(single, DDP or FSDP2) and a rank-aware log line."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import io
from .parallel import parallel_mode  # noqa: F401  (torch-free: the planner and the checks read it too)


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


def teardown_dist(d: Dist) -> None:
    if d.world > 1:
        dist.destroy_process_group()


def barrier(d: Dist):
    if d.world > 1:
        dist.barrier()


def all_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world > 1:
        t = t.clone()
        dist.all_reduce(t)
    return t


# ---------------------------------------------------------------------------------------------------------
# stop signals: SIGTERM (SLURM's time limit or preemption, scancel) or Ctrl-C saves a checkpoint at the
# next log step instead of losing the steps since the last one

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_signals: list[int] = []  # set by the handler; read at log steps, where every rank agrees to stop


def _on_stop_signal(signum, frame):
    if signum == signal.SIGINT and signal.SIGINT in _signals:
        raise KeyboardInterrupt  # Ctrl-C twice: stop now
    _signals.append(signum)
    if os.environ.get("RANK", "0") == "0":  # os.write: safe inside a signal handler, unlike print
        again = " (Ctrl-C again: stop now)" if signum == signal.SIGINT else ""
        os.write(
            2,
            f"{signal.Signals(signum).name}: a checkpoint at the next log step, then stop{again}\n".encode(),
        )


@contextlib.contextmanager
def stop_signals_caught():
    """Within the block a stop signal is only recorded (see stop_signal); the old handlers return after."""
    _signals.clear()
    previous = {sig: signal.signal(sig, _on_stop_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def ignore_stop_signals(worker_id: int):
    """DataLoader workers outlive the signal (SLURM signals every process of the job): the trainer stops
    at its next log step and still needs them until then."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def end_loader_workers() -> None:
    """Kill this process's DataLoader workers (its daemonic multiprocessing children) once the trainer has
    failed: they ignore stop signals, and Python's exit, which terminates (SIGTERM) and then joins them,
    would wait for them for ever while the process holds its GPU."""
    for p in multiprocessing.active_children():
        if p.daemon:
            p.kill()
            p.join()


def stop_signal(d: Dist) -> int:
    """The stop signal any rank got (SIGTERM before SIGINT), 0 if none; all ranks call it at one step."""
    got = torch.tensor([float(sig in _signals) for sig in STOP_SIGNALS], dtype=torch.float64, device=d.device)
    return next((int(sig) for sig, n in zip(STOP_SIGNALS, all_sum(got, d).tolist(), strict=True) if n), 0)


# ---------------------------------------------------------------------------------------------------------
# parallel mode


def gpu_bytes(device: torch.device) -> int | None:
    """The GPU's memory (None on the CPU)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def parallelize(drafter: torch.nn.Module, mode: str, device: torch.device) -> torch.nn.Module:
    """The module the step runs: the drafter itself (single), wrapped in DDP, or sharded in place (FSDP2)."""
    if mode == "ddp":
        # Dynamo's DDP optimizer would split the compiled graph at DDP's bucket boundaries: graphs the
        # single-process warmup never built, so every rank would miss the cache. Keep the warmup's graph.
        torch._dynamo.config.optimize_ddp = False
        ids = [device.index] if device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(drafter, device_ids=ids)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard  # here: its import takes seconds without Dynamo

        for layer in drafter.layers:  # one all-gather per layer, freed after its forward and backward
            fully_shard(layer)
        fully_shard(drafter)  # the rest: fc and the norms
    return drafter


def no_grad_sync(model, sharded: bool, skip: bool):
    """Accumulating micro-batches: skip the gradient all-reduce (DDP) or reduce-scatter (FSDP) of all
    but the step's last backward."""
    if skip and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if sharded:
        model.set_requires_gradient_sync(not skip)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------------------
# log lines


def log(d: Dist, msg: str, every_rank: bool = False) -> None:
    """A line on rank 0's stderr (or every rank's, marked with its rank), stamped with the process's age:
    the log shows where startup goes."""
    if d.main or every_rank:
        io.log(f"rank {d.rank}: {msg}" if every_rank and d.world > 1 else msg)
