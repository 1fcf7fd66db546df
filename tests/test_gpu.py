"""GPU leases. No GPU exists here, so the tests name the GPU ids (`pool`); the flock logic is real."""

import os
import subprocess
import sys
import time

import pytest

from flashdraft.gpu import Lease, visible_gpus

LEASE = [sys.executable, "-m", "flashdraft.gpu"]


def test_concurrent_leases_get_distinct_gpus(tmp_path):
    a = Lease(2, tmp_path, pool=["0", "1", "2"])
    b = Lease(1, tmp_path, pool=["0", "1", "2"])
    assert a.acquire() == ["0", "1"]
    assert b.acquire() == ["2"]
    c = Lease(1, tmp_path, pool=["0", "1", "2"], poll_s=0.05, timeout_s=0.3)
    with pytest.raises(TimeoutError, match="no 1 free GPU"):
        c.acquire()
    a.release()
    assert c.acquire() == ["0"]
    b.release(), c.release()


def test_processes_wait_for_a_free_gpu_and_locks_die_with_them(tmp_path):
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = LEASE + ["--gpus", "1", "--pool", "0,1", "--lock-dir", str(tmp_path), "--",
                   sys.executable, "-c", "import os,time; t=time.time(); time.sleep(1); "
                   "print(os.environ['CUDA_VISIBLE_DEVICES'], t, time.time())"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    runs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    runs = [(gpu, float(t0), float(t1)) for gpu, t0, t1 in runs]
    assert {gpu for gpu, _, _ in runs} == {"0", "1"}
    for i, (g1, s1, e1) in enumerate(runs):  # jobs that ran at the same time had different GPUs
        for g2, s2, e2 in runs[i + 1:]:
            assert g1 != g2 or e1 <= s2 or e2 <= s1
    # A killed holder leaves no stale lock: the kernel drops flocks with the process.
    holder = subprocess.Popen(LEASE + ["--gpus", "2", "--pool", "0,1", "--lock-dir", str(tmp_path), "--",
                                       sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    time.sleep(1.5)
    holder.kill(), holder.wait()
    lease = Lease(2, tmp_path, pool=["0", "1"], poll_s=0.05, timeout_s=10)
    assert lease.acquire() == ["0", "1"]
    lease.release()


def test_scheduler_assignment_is_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert visible_gpus() == ["5", "7"]
    with Lease(2, tmp_path) as lease:
        assert lease.gpus == ["5", "7"]
    assert not list(tmp_path.iterdir())  # nothing locked: the scheduler owns these GPUs
    with pytest.raises(RuntimeError, match="asked for 3"):
        Lease(3, tmp_path).acquire()


def test_zero_gpus_runs_on_cpu(tmp_path):
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run(LEASE + ["--gpus", "0", "--lock-dir", str(tmp_path), "--", sys.executable, "-c",
                                  "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))"],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "''"
