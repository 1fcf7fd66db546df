"""The validation split (train.val_samples) from sample ids alone: which samples are held out, and each
held-out sample's anchor seed. No torch: stream mode's data plan job (on a CPU) holds out what training
validates on."""

from __future__ import annotations

import hashlib

from .config import TrainConfig, check_validation


def _hash(*parts) -> bytes:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).digest()


def val_split(ids: list[str], n: int, seed: int) -> list[str]:
    """The validation samples: the `n` ids whose hash with `seed` is smallest, in id order."""
    if not n:
        return []
    check_validation(TrainConfig(val_samples=n), samples=len(ids))
    return sorted(sorted(ids, key=lambda sid: _hash(seed, sid))[:n])


def split_record(ids: list[str], seed: int) -> dict:
    """The split as val_split.json holds it, for a user to inspect: its size, seed and sorted ids."""
    return {"val_samples": len(ids), "seed": seed, "ids": sorted(ids)}


def anchor_seed(sample_id: str) -> int:
    """A validation sample's anchor seed: from its id alone, the same in every step, run and seed."""
    return int.from_bytes(_hash("val-anchors", sample_id)[:8], "little") >> 1
