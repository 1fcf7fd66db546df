"""Processes: loader workers ended on failure, DDP or FSDP by what fits (distributed.py)."""

import pytest
from conftest import run_python

from flashdraft.distributed import parallel_mode


def test_a_failed_trainer_ends_its_loader_workers_so_it_can_exit():
    """DataLoader workers ignore stop signals (the trainer handles a stop), so Python's exit, which sends
    them SIGTERM and joins them, would wait for ever after a failure: train() kills them first."""
    code = (
        "import torch\n"
        "from flashdraft.distributed import end_loader_workers, ignore_stop_signals\n"
        "loader = torch.utils.data.DataLoader(list(range(64)), batch_size=2, num_workers=2,\n"
        "                                     worker_init_fn=ignore_stop_signals)\n"
        "it = iter(loader)\n"
        "next(it)\n"
        "try:\n"
        "    raise RuntimeError('broken')\n"
        "except BaseException:\n"
        "    end_loader_workers()\n"
        "    raise\n"
    )
    p = run_python(code)
    assert p.returncode == 1 and "RuntimeError: broken" in p.stderr

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
