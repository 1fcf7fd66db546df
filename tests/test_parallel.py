"""How training spreads the drafter over its processes (parallel.py): DDP or FSDP by what fits."""

import pytest

from flashdraft.parallel import parallel_mode


def test_parallel_mode_shards_only_what_would_not_fit():
    h200, h100 = 139 * 2**30, 79 * 2**30  # as torch reports them
    assert parallel_mode("auto", 1_050_000_000, 1, h200) == "single"  # one process: nothing to share
    assert parallel_mode("fsdp", 10, 1, None) == "single"
    for gpu in (h200, h100):  # the 8B target's drafter: 16.8 GB per copy, 47 GB at its peak
        assert parallel_mode("auto", 1_050_000_000, 8, gpu) == "ddp"
    assert parallel_mode("auto", 4_600_000_000, 8, h200) == "fsdp"  # a 70B target's (H=8192): 74 GB
    assert parallel_mode("auto", 4_600_000_000, 8, None) == "ddp"  # CPU: no GPU memory to fit
    assert parallel_mode("fsdp", 10, 2, h200) == "fsdp" and parallel_mode("ddp", 10**12, 2, h100) == "ddp"
    with pytest.raises(ValueError, match="train.parallel"):
        parallel_mode("zero3", 10, 2, None)
