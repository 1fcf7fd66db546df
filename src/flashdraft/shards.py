"""Which sample goes to which shard: one stable assignment for every sharded stage.

Regeneration and hidden-state precompute both split the samples by `shard_of`, possibly into different
counts. A sample in hidden shard i (of H) can then only be in a regeneration shard j (of R) with
j = i (mod gcd(H, R)), so a hidden shard waits for those regeneration shards alone.
"""

from __future__ import annotations

import hashlib
from math import gcd


def shard_of(sample_id: str, num_shards: int) -> int:
    """Stable sample -> shard assignment (Python's hash() is salted per process, so use sha1)."""
    digest = hashlib.sha1(str(sample_id).encode()).digest()
    return int.from_bytes(digest[:8], "little") % num_shards


def shard_sources(shard: int, num_shards: int, num_sources: int) -> list[int]:
    """The shards of a `num_sources`-way split that can hold rows of `shard` of a `num_shards`-way one."""
    g = gcd(num_shards, num_sources)
    return [j for j in range(num_sources) if j % g == shard % g]
