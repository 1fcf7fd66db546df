"""GPU leases: hand concurrent jobs distinct GPUs with one flock'd lock file per GPU.

Snakemake's `resources: gpu=N` only counts; it never says *which* GPU a job gets (snakemake #281).
A job runs its command as `python -m flashdraft.gpu --gpus N -- CMD...`: the lease takes N free GPUs,
exports CUDA_VISIBLE_DEVICES so CMD sees them as cuda:0..N-1, and execs CMD, which inherits the
locks: they are released when it exits (the kernel drops flocks even on kill -9). When a scheduler
(SLURM) has already set CUDA_VISIBLE_DEVICES, those GPUs are ours alone: we use them and lock nothing.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


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


class Lease:
    """Holds flocks on `n` GPU lock files under `lock_dir` until released."""

    def __init__(self, n: int, lock_dir: str, pool: list[str] | None = None, poll_s: float = 2.0,
                 timeout_s: float | None = None):
        self.n, self.lock_dir, self.poll_s, self.timeout_s = n, Path(lock_dir), poll_s, timeout_s
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
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        start, warned = time.monotonic(), False
        while True:
            for gid in ids:
                if len(self._files) == self.n:
                    break
                if gid in self.gpus:
                    continue
                f = open(self.lock_dir / f"gpu{gid}.lock", "a+")
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    f.close()
                    continue
                f.seek(0), f.truncate(), f.write(f"{os.getpid()}\n"), f.flush()
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Run a command on N leased GPUs (0: on the CPU).")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--lock-dir", default="/tmp/flashdraft-gpu-locks")
    p.add_argument("--pool", default=None,
                   help="comma-separated GPU ids to choose from (default: all visible)")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command given")
    pool = args.pool.split(",") if args.pool else None
    lease = Lease(args.gpus, args.lock_dir, pool=pool)
    lease.acquire()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(lease.gpus))
    print(f"[gpu] {args.gpus} GPU(s) leased: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}",
          file=sys.stderr, flush=True)
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
