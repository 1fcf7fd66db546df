"""GPU leases. No GPU exists here, so the tests name the GPU ids (`pool`); the flock logic is real."""

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import one_line_error

from flashdraft.gpu import Lease, parse_capabilities, select_visible, visible_gpus

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
    cmd = LEASE + [
        "--gpus",
        "1",
        "--pool",
        "0,1",
        "--lock-dir",
        str(tmp_path),
        "--",
        sys.executable,
        "-c",
        "import os,time; t=time.time(); time.sleep(1); "
        "print(os.environ['CUDA_VISIBLE_DEVICES'], t, time.time())",
    ]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    runs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    runs = [(gpu, float(t0), float(t1)) for gpu, t0, t1 in runs]
    assert {gpu for gpu, _, _ in runs} == {"0", "1"}
    for i, (g1, s1, e1) in enumerate(runs):  # jobs that ran at the same time had different GPUs
        for g2, s2, e2 in runs[i + 1 :]:
            assert g1 != g2 or e1 <= s2 or e2 <= s1
    # A killed holder leaves no stale lock: the kernel drops flocks with the process.
    holder = subprocess.Popen(
        LEASE
        + [
            "--gpus",
            "2",
            "--pool",
            "0,1",
            "--lock-dir",
            str(tmp_path),
            "--",
            sys.executable,
            "-c",
            "import time; print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert holder.stdout.readline().strip() == "held"  # the command runs only once both GPUs are its
    holder.kill(), holder.wait()
    lease = Lease(2, tmp_path, pool=["0", "1"], poll_s=0.05, timeout_s=10)
    assert lease.acquire() == ["0", "1"]
    lease.release()


def test_a_signal_for_the_job_reaches_the_command_which_holds_its_gpus_until_it_exits(tmp_path):
    """SIGTERM to the job's process (from Snakemake or SLURM) reaches the command itself, and its GPUs stay
    locked while it winds down: no other job starts on them before it has exited."""
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    script = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    print('winding down', flush=True); time.sleep(3); sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    job = subprocess.Popen(
        LEASE
        + ["--gpus", "1", "--pool", "0", "--lock-dir", str(tmp_path), "--", sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert job.stdout.readline().strip() == "ready"
        other = Lease(1, tmp_path, pool=["0"], poll_s=0.05, timeout_s=0.2)
        with pytest.raises(TimeoutError):
            other.acquire()
        job.send_signal(signal.SIGTERM)
        assert job.stdout.readline().strip() == "winding down"
        with pytest.raises(TimeoutError):  # still the job's while it saves its work
            other.acquire()
        assert job.wait(timeout=30) == 143
        assert other.acquire() == ["0"]
        other.release()
    finally:
        job.kill()


def test_a_command_that_cannot_start_is_named(tmp_path):
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    missing = str(tmp_path / "no-such-program")
    cmd = LEASE + ["--gpus", "1", "--pool", "0", "--lock-dir", str(tmp_path), "--", missing]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "cannot run" in proc.stderr and "no-such-program" in proc.stderr


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
    out = subprocess.run(
        LEASE
        + [
            "--gpus",
            "0",
            "--lock-dir",
            str(tmp_path),
            "--",
            sys.executable,
            "-c",
            "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert out.strip() == "''"


# ---- the lock dir: this user's own by default; links, files and other users' directories refused ----


def _cli(tmp_path, lock_dir):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.run(
        LEASE + ["--gpus", "1", "--pool", "0", "--lock-dir", str(lock_dir), "--", "true"],
        capture_output=True,
        text=True,
        env=env,
    )


def test_the_default_lock_dir_is_this_user_s_own(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with Lease(1, None, pool=["0"]) as lease:
        assert lease.gpus == ["0"]
    lock_dir = tmp_path / f"flashdraft-gpu-locks-{os.getuid()}"
    assert stat.S_IMODE(lock_dir.stat().st_mode) == 0o700 and lock_dir.stat().st_uid == os.getuid()
    assert (lock_dir / "gpu0.lock").read_text() == f"{os.getpid()}\n"


def test_a_link_planted_as_a_lock_file_is_refused_and_its_target_untouched(tmp_path):
    locks, victim = tmp_path / "locks", tmp_path / "victim"
    locks.mkdir(mode=0o700)
    victim.write_text("precious\n")
    (locks / "gpu0.lock").symlink_to(victim)
    proc = _cli(tmp_path, locks)
    assert "GPU lock file" in one_line_error(proc) and "remove it" in proc.stderr
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("kind", ["file", "link", "everyone"])
def test_an_unusable_lock_dir_is_one_line(tmp_path, kind):
    locks = tmp_path / "locks"
    if kind == "file":
        locks.write_text("")
    elif kind == "link":
        (tmp_path / "elsewhere").mkdir()
        locks.symlink_to(tmp_path / "elsewhere")
    else:
        locks.mkdir()
        locks.chmod(0o777)
    line = one_line_error(_cli(tmp_path, locks))
    assert f"gpus.lock_dir: {locks}" in line
    assert not list((tmp_path / "elsewhere").glob("*")) if kind == "link" else True


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to hand files to another user")
def test_another_user_s_lock_dir_is_refused_a_group_s_is_used_without_rewriting_its_files(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 4242, 4242)
    assert "belongs to user id 4242" in one_line_error(_cli(tmp_path, theirs))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o2770)
    os.chown(shared, 4242, os.getgid())
    (shared / "gpu0.lock").write_text("4242's\n")
    os.chown(shared / "gpu0.lock", 4242, os.getgid())
    with Lease(1, shared, pool=["0"]) as lease:
        assert lease.gpus == ["0"]
    assert (shared / "gpu0.lock").read_text() == "4242's\n"  # not ours: left as it is


SMI = """0, GPU-aaaa1111, NVIDIA A100-SXM4-80GB, 8.0
1, GPU-bbbb2222, NVIDIA H100 80GB HBM3, 9.0
2, GPU-cccc3333, NVIDIA Graphics, Device, [N/A]
"""


def test_compute_capabilities_of_the_visible_gpus():
    """nvidia-smi's index, uuid, name, compute_cap lines, narrowed to what CUDA_VISIBLE_DEVICES shows (by
    index or UUID prefix, up to an invalid entry, as CUDA reads it)."""
    rows = parse_capabilities(SMI)
    assert rows == [
        ("0", "GPU-aaaa1111", "NVIDIA A100-SXM4-80GB", (8, 0)),
        ("1", "GPU-bbbb2222", "NVIDIA H100 80GB HBM3", (9, 0)),
        ("2", "GPU-cccc3333", "NVIDIA Graphics, Device", None),
    ]
    assert select_visible(rows, None) == [(i, n, c) for i, _, n, c in rows]
    assert select_visible(rows, "1") == [("1", "NVIDIA H100 80GB HBM3", (9, 0))]
    assert select_visible(rows, "GPU-aaaa,1") == [
        ("0", "NVIDIA A100-SXM4-80GB", (8, 0)),
        ("1", "NVIDIA H100 80GB HBM3", (9, 0)),
    ]
    assert select_visible(rows, "1,-1,0") == [("1", "NVIDIA H100 80GB HBM3", (9, 0))]
    assert select_visible(rows, "") == []


def as_user(uid: int, group: int, lock_dir: Path) -> int:
    """In a child process of user `uid` (its own group, and `group`) under umask 022: a lease of GPU 0 in
    `lock_dir`, taken and given back; the child's exit status (0: it held the lock)."""
    pid = os.fork()
    if pid == 0:  # the child: no exec, so no interpreter the other user would have to read
        code = 1
        try:
            os.setgroups([group])
            os.setgid(uid)
            os.setuid(uid)
            os.umask(0o022)
            with Lease(1, lock_dir, pool=["0"], timeout_s=20) as lease:
                code = 0 if lease.gpus == ["0"] else 2
        except BaseException as e:  # noqa: BLE001
            print(f"user {uid}: {e!r}", file=sys.stderr)
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run as two other users")
def test_two_users_of_a_group_share_its_lock_dir_under_umask_022():
    """docs/cluster.md's group lock dir (chmod 2770): the first user creates the lock file under umask
    022, and a second user of the group takes the same GPU's lock after it."""
    group, users = 4250, (4243, 4244)
    top = Path(tempfile.mkdtemp(prefix="flashdraft-group-locks-", dir="/tmp"))
    try:
        top.chmod(0o755)
        shared = top / "locks"
        shared.mkdir()
        os.chown(shared, users[0], group)
        shared.chmod(0o2770)
        assert [as_user(uid, group, shared) for uid in users] == [0, 0]
        lock = shared / "gpu0.lock"
        assert stat.S_IMODE(lock.stat().st_mode) == 0o660 and lock.stat().st_gid == group
    finally:
        shutil.rmtree(top)
