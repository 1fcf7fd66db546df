"""Training data: length buckets, each epoch's micro-batch plan, the global batch's share of a rank,
collation and the loader.

Data order is a pure function of (seed, epoch): each epoch's seeded permutation is cut into micro-batches
of one length bucket each (rows = batch_tokens // bucket), the same list on every rank. An optimizer
step takes G = global_batch_tokens // batch_tokens micro-batches [cursor, cursor + G) (G = world when
train.global_batch_tokens is 0); rank r takes cursor + r, cursor + r + world, ... and accumulates their
gradients (as torchtitan fills its global batch), so a step sees the same data on any number of
processes. A sample's anchors are drawn from its own generator, seeded by (seed, epoch, sample index),
whatever batch it lands in.
"""

from __future__ import annotations

import torch

from .config import TrainConfig, micro_per_step, rows_per_batch
from .distributed import Dist, ignore_stop_signals


def bucket_for(length: int, buckets: list[int]) -> int:
    """The smallest bucket that fits; longer samples are truncated to the largest."""
    for b in sorted(buckets):
        if length <= b:
            return b
    return max(buckets)


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


def steps_left(lengths, cfg: TrainConfig, world: int, epoch: int = 0, cursor: int = 0) -> int:
    """Optimizer steps from data position (epoch, cursor) to the end of cfg.epochs."""
    left, g = 0, micro_per_step(cfg, world)
    for e in range(epoch, cfg.epochs):
        left += (len(epoch_batches(lengths, cfg, e)) - (cursor if e == epoch else 0)) // g
    return left


def rank_share(cursor: int, steps: int, g: int, rank: int, world: int) -> list[list[int]]:
    """The micro-batches (indices into the epoch's plan) this rank runs in each of the next `steps` steps:
    step i takes cursor + i*g + [rank, rank + world, ...] (every rank has one: g >= world)."""
    return [[cursor + i * g + j for j in range(rank, g, world)] for i in range(max(0, steps))]


def anchor_seeds(seed: int, epoch: int, samples: list[int], rows: int) -> list[int | None]:
    """One anchor seed per row of a micro-batch: fixed by (seed, epoch, sample index), so a sample's
    anchors do not depend on which samples share its batch, its rank, or the number of processes (as
    SpecForge made them); padding rows get None."""
    base = (seed * 1_000_003 + epoch) * 10_000_019
    return [base + i for i in samples] + [None] * (rows - len(samples))


class Collate:
    """Pads a micro-batch to its bucket: input_ids, loss_mask, hidden [rows, bucket, K*H], and when the
    samples carry it (a store with the target's last hidden state) last_hidden [rows, bucket, H]; counts
    tokens.

    Rows beyond the samples are all padding (no anchors), so every batch of a bucket has one shape."""

    def __init__(self, buckets, batch_tokens, hidden_dtype):
        self.buckets, self.batch_tokens, self.hidden_dtype = buckets, batch_tokens, hidden_dtype

    def __call__(self, samples: list[dict]) -> dict:
        s = bucket_for(max(len(x["input_ids"]) for x in samples), self.buckets)
        rows = rows_per_batch(s, self.batch_tokens)
        ids = torch.zeros(rows, s, dtype=torch.long)
        mask = torch.zeros(rows, s)
        padded = {
            k: torch.zeros(rows, s, samples[0][k].shape[-1], dtype=self.hidden_dtype)
            for k in ("hidden", "last_hidden")
            if k in samples[0]
        }
        tokens = 0
        for r, x in enumerate(samples):
            n = min(len(x["input_ids"]), s)
            ids[r, :n] = x["input_ids"][:n]
            mask[r, :n] = x["loss_mask"][:n].float()
            for k, t in padded.items():
                t[r, :n] = x[k][:n].to(self.hidden_dtype)
            tokens += n
        return {"input_ids": ids, "loss_mask": mask, **padded, "tokens": tokens, "bucket": s}


def batch_loader(store, batches: list[list[int]], collate: Collate, device: torch.device):
    """Collated micro-batches in order. On GPU, DataLoader worker processes read and pad ahead of the
    step (pinned memory); on CPU the main thread does it (no spare cores to give a worker).

    Four batches in flight: one takes a worker well under two steps, and each is pinned by a thread of
    this process, beside the first step."""
    if device.type != "cuda":
        return (collate([store[i] for i in b]) for b in batches)
    return torch.utils.data.DataLoader(
        store,
        batch_sampler=batches,
        collate_fn=collate,
        num_workers=2,
        prefetch_factor=2,
        pin_memory=True,
        persistent_workers=False,
        worker_init_fn=ignore_stop_signals,
    )


def step_batches(store, batches: list[list[int]], share: list[list[int]], collate: Collate, device):
    """Per optimizer step, this rank's (plan indices, collated micro-batches), read ahead by batch_loader,
    whose workers start reading at this call, not at the first step."""
    loader = iter(batch_loader(store, [batches[k] for ks in share for k in ks], collate, device))
    return ((ks, [next(loader) for _ in ks]) for ks in share)


def epoch_steps(
    store,
    lengths: list[int],
    cfg: TrainConfig,
    epoch: int,
    cursor: int,
    steps: int,
    d: Dist,
    collate: Collate,
):
    """`epoch`'s micro-batch plan and step_batches for up to `steps` optimizer steps from `cursor`."""
    batches, g = epoch_batches(lengths, cfg, epoch), micro_per_step(cfg, d.world)
    if len(batches) < g:
        raise ValueError(
            f"{len(batches)} micro-batches per epoch, fewer than one global batch "
            f"({g}): lower train.batch_tokens or train.global_batch_tokens, or add data"
        )
    share = rank_share(cursor, min((len(batches) - cursor) // g, steps), g, d.rank, d.world)
    return batches, step_batches(store, batches, share, collate, d.device)
