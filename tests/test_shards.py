"""Which sample goes to which shard (shards.py): one stable assignment, and a shard of one split needs only
its source shards of another."""

import math

import pytest

from flashdraft.shards import shard_of, shard_sources


@pytest.mark.parametrize("hidden, regen", [(2, 2), (4, 2), (2, 4), (6, 4), (3, 5), (40, 8)])
def test_a_hidden_shard_needs_only_its_source_shards(hidden, regen):
    """Every row of hidden shard i lies in one of shard_sources(i, ...), and each regeneration shard
    feeds some hidden shard: the DAG's edges lose no row."""
    ids = [f"row{i}" for i in range(3000)]
    for i in range(hidden):
        sources = shard_sources(i, hidden, regen)
        assert {shard_of(x, regen) for x in ids if shard_of(x, hidden) == i} <= set(sources)
        assert len(sources) == regen // math.gcd(hidden, regen)
    assert {j for i in range(hidden) for j in shard_sources(i, hidden, regen)} == set(range(regen))


def test_shard_assignment_is_pinned_and_uses_every_shard():
    # pinned values: the assignment must not change between processes, machines or Python versions
    assert [shard_of(f"s{i}", 4) for i in range(8)] == [1, 0, 2, 1, 3, 1, 0, 1]
    assert {shard_of(str(i), 5) for i in range(200)} == set(range(5))
