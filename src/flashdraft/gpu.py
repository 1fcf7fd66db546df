"""GPU leases: hand concurrent jobs distinct GPUs with one flock'd lock file per GPU.

Snakemake's `resources: gpu=N` only counts; it never says *which* GPU a job gets (snakemake #281).
A job runs its command as `python -m flashdraft.gpu --gpus N -- CMD...`: the lease takes N free GPUs,
exports CUDA_VISIBLE_DEVICES so CMD sees them as cuda:0..N-1, and execs CMD, which inherits the
locks: they are released when it exits (the kernel drops flocks even on kill -9). When a scheduler
(SLURM) has already set CUDA_VISIBLE_DEVICES, those GPUs are ours alone: we use them and lock nothing.

The lock dir is this user's own by default (`<tmp>/flashdraft-gpu-locks-<uid>`, mode 0700). Another one
(`gpus.lock_dir`) must be a directory, not a link, that only its owner or, for a group shared by several
users' jobs, its group can write. Lock files are opened without following links, and only a lock file of
our own is rewritten with the holder's pid.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .errors import UserError, cli


def visible_gpus() -> list[str]:
    """GPU ids this process may use, without importing torch (fast, and safe before a fork)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip() and g.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def gpu_capabilities() -> list[tuple[str, str, tuple[int, int] | None]]:
    """(index, name, compute capability or None when unknown) of each GPU visible_gpus() gives, from
    nvidia-smi, without importing torch; [] when nvidia-smi is missing or fails (nothing known)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        query = ["nvidia-smi", "--query-gpu=index,uuid,name,compute_cap", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:  # a driver too old for compute_cap, or no GPU
        return []
    return select_visible(parse_capabilities(out.stdout), os.environ.get("CUDA_VISIBLE_DEVICES"))


def gpu_memory_bytes() -> int | None:
    """The memory of the smallest GPU visible_gpus() gives, in bytes, from nvidia-smi without importing
    torch; None when nvidia-smi is missing or fails (nothing known)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        query = ["nvidia-smi", "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    rows = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[2].isdigit():
            rows.append((parts[0], parts[1], int(parts[2]) * 2**20, None))  # MiB
    sizes = [mib for _, mib, _ in select_visible(rows, os.environ.get("CUDA_VISIBLE_DEVICES"))]
    return min(sizes) if sizes else None


def parse_capabilities(text: str) -> list[tuple[str, str, str, tuple[int, int] | None]]:
    """nvidia-smi's `index, uuid, name, compute_cap` CSV lines as (index, uuid, name, (major, minor))."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        index, uuid, cap = parts[0], parts[1], parts[-1]
        name = ", ".join(parts[2:-1])
        try:
            major, minor = (int(x) for x in cap.split("."))
            rows.append((index, uuid, name, (major, minor)))
        except ValueError:  # [N/A]
            rows.append((index, uuid, name, None))
    return rows


def select_visible(rows, env: str | None) -> list[tuple[str, str, tuple[int, int] | None]]:
    """The rows CUDA_VISIBLE_DEVICES (`env`: indices or UUID prefixes; None: all) leaves visible, as
    (index, name, capability)."""
    if env is None:
        return [(i, name, cap) for i, _, name, cap in rows]
    picked = []
    for g in (g.strip() for g in env.split(",")):
        if not g or g == "-1":
            break  # CUDA ignores what follows an invalid entry
        for i, uuid, name, cap in rows:
            if g == i or (g.startswith("GPU-") and uuid.startswith(g)):
                picked.append((i, name, cap))
                break
    return picked


def default_lock_dir() -> Path:
    """This user's own lock dir in the node's temp dir: no other user can put a file or a link in it."""
    return Path(tempfile.gettempdir()) / f"flashdraft-gpu-locks-{os.getuid()}"


def open_lock_dir(path) -> Path:
    """`path`, created (mode 0700) if missing, once it is known to be a directory, not a link, that nobody
    but its owner, or a group of ours, can write; a UserError names it otherwise."""
    path = Path(path)
    where = f"config key gpus.lock_dir: {path}"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except FileExistsError:
        raise UserError(f"{where} is a file; point gpus.lock_dir at a directory") from None
    except OSError as e:
        raise UserError(f"{where}: cannot create it ({e.strerror}); point gpus.lock_dir elsewhere") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{where} is a link or not a directory; point gpus.lock_dir at a directory itself")
    if st.st_mode & stat.S_IWOTH:
        raise UserError(
            f"{where} is writable by every user, who could plant lock files or links there; "
            "use a directory of your own (the default) or one of a group (chmod 2770)"
        )
    ours = st.st_uid == os.getuid()
    group = st.st_gid in {os.getgid(), *os.getgroups()} and st.st_mode & stat.S_IWGRP
    if not (ours or group):
        raise UserError(
            f"{where} belongs to user id {st.st_uid} and is not writable by a group of yours; "
            "leave gpus.lock_dir unset (this user's own) or use a group directory (chmod 2770)"
        )
    return path


def open_lock_file(path: Path):
    """The lock file at `path`, opened without following a link: created group-writable (mode 0660 whatever
    the umask, so that the other users of a group lock dir can open it too), or opened read-only when it is
    another user's that we may not write (a flock needs no write access)."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o660)
        mode = "r+"
    except PermissionError:
        try:
            fd, mode = os.open(path, os.O_RDONLY | flags), "r"
        except OSError as e:
            raise UserError(
                f"GPU lock file {path}: {e.strerror}; make it writable by the group of "
                "gpus.lock_dir (chmod 660) or remove it"
            ) from None
    except OSError as e:
        why = "a link there is refused" if e.errno == errno.ELOOP else e.strerror
        raise UserError(f"GPU lock file {path}: {why}; remove it") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UserError(f"GPU lock file {path} is not a regular file; remove it")
    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != 0o660:
        os.fchmod(fd, 0o660)  # the umask took the group's write: give it back
    return os.fdopen(fd, mode)


class Lease:
    """Holds flocks on `n` GPU lock files under `lock_dir` until released."""

    def __init__(
        self,
        n: int,
        lock_dir: str | None = None,
        pool: list[str] | None = None,
        poll_s: float = 2.0,
        timeout_s: float | None = None,
    ):
        self.lock_dir = Path(lock_dir) if lock_dir else default_lock_dir()
        self.n, self.poll_s, self.timeout_s = n, poll_s, timeout_s
        self.pool = pool  # GPU ids to choose from (default: all visible)
        self.gpus: list[str] = []
        self._files = []

    def acquire(self) -> list[str]:
        if self.n == 0:
            return []
        if "CUDA_VISIBLE_DEVICES" in os.environ:  # a scheduler chose for us
            ids = visible_gpus()
            if len(ids) < self.n:
                raise RuntimeError(f"asked for {self.n} GPU(s) but CUDA_VISIBLE_DEVICES={ids}")
            self.gpus = ids[: self.n]
            return self.gpus
        ids = self.pool if self.pool is not None else visible_gpus()
        if len(ids) < self.n:
            raise RuntimeError(f"asked for {self.n} GPU(s) but only {len(ids)} visible: {ids}")
        open_lock_dir(self.lock_dir)
        start, warned = time.monotonic(), False
        while True:
            for gid in ids:
                if len(self._files) == self.n:
                    break
                if gid in self.gpus:
                    continue
                f = open_lock_file(self.lock_dir / f"gpu{gid}.lock")
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    f.close()
                    continue
                if os.fstat(f.fileno()).st_uid == os.getuid():  # the holder's pid, for whoever looks
                    f.truncate(), f.write(f"{os.getpid()}\n"), f.flush()
                self._files.append(f)
                self.gpus.append(gid)
            if len(self._files) == self.n:
                return self.gpus
            # Give back a partial set so two jobs never deadlock holding half each.
            self.release()
            if self.timeout_s is not None and time.monotonic() - start > self.timeout_s:
                raise TimeoutError(f"no {self.n} free GPU(s) among {ids} within {self.timeout_s}s")
            if not warned:
                print(f"[gpu] waiting for {self.n} free GPU(s) among {ids}", file=sys.stderr)
                warned = True
            time.sleep(self.poll_s)

    def release(self) -> None:
        for f in self._files:
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()
        self._files, self.gpus = [], []

    def keep_across_exec(self) -> None:
        """Let a program this process execs inherit the locks (Python opens files close-on-exec)."""
        for f in self._files:
            os.set_inheritable(f.fileno(), True)

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


@cli
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Run a command on N leased GPUs (0: on the CPU).")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--lock-dir", default=None, help="default: this user's own, " + str(default_lock_dir()))
    p.add_argument(
        "--pool", default=None, help="comma-separated GPU ids to choose from (default: all visible)"
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command given")
    pool = args.pool.split(",") if args.pool else None
    lease = Lease(args.gpus, args.lock_dir, pool=pool)
    lease.acquire()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(lease.gpus))
    print(
        f"[gpu] {args.gpus} GPU(s) leased: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}",
        file=sys.stderr,
        flush=True,
    )
    # Become the command rather than wait for it: a signal for this job (Snakemake's, SLURM's) reaches
    # the command itself, and the inherited locks live as long as it does. A waiting parent would die
    # on SIGTERM and free its GPUs while the orphaned command still ran on them.
    lease.keep_across_exec()
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as e:
        p.error(f"cannot run {cmd[0]!r}: {e}")


if __name__ == "__main__":
    main()
