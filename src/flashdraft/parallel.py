"""How training spreads the drafter over its processes (train.parallel): no torch, so that the planner and
the checks before the first job decide it as the trainer does."""

from __future__ import annotations


def parallel_mode(name: str, params: int, world: int, gpu_memory: int | None) -> str:
    """single (one process), ddp or fsdp. auto: fsdp when one full copy of the training state (fp32
    weights and gradients, AdamW's two moments: 16 bytes per parameter) would take over a third of the
    GPU's memory (`gpu_memory` bytes, None on CPU): the activations of a step take about twice the state
    (docs/architecture.md has the 8B-shaped drafter's figures), and the frozen target head needs room too."""
    if name not in ("auto", "ddp", "fsdp"):
        raise ValueError(f"train.parallel must be auto, ddp or fsdp, not {name!r}")
    if world == 1:
        return "single"
    if name != "auto":
        return name
    return "fsdp" if gpu_memory is not None and 16 * params > gpu_memory / 3 else "ddp"
