"""Processes: loader workers ended on failure (distributed.py)."""

from conftest import run_python


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
