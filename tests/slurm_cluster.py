"""A throwaway SLURM cluster on localhost from Debian's packages, for the SLURM tests.

Two slurmd nodes (n1, n2) on localhost, each with 2 stand-in GPUs (GRES on empty files), a slurmctld,
and a slurmdbd on a private MariaDB so that `sacct` works (the executor plugin reads job states from
it). Everything lives under one directory, on its own ports, with its own munged; clients find it
through SLURM_CONF and the wrappers in <root>/bin.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sacct", "squeue", "scancel", "sinfo", "sacctmgr", "sshare")
CLUSTER = "fdtest"
PARTITION = "debug"
NODES = ("n1", "n2")  # two slurmd on this machine
# Per node, as much as the SLURM profile asks of one (cpus_per_task, mem_mb): SLURM trusts the configured
# sizes (SlurmdParameters=config_overrides) and, without cgroups, enforces neither.
CPUS, MEMORY_MB = 32, 300_000


def exe(name: str) -> str:
    """A daemon or client by name (daemons live in /usr/sbin, not always on PATH)."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin") or name


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "the SLURM tests start daemons as root"
    gone = [d for d in DAEMONS + CLIENTS if exe(d) == d]
    if gone:
        return f"Debian's SLURM packages are not installed (missing {gone}; .ci/run installs them)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, ok, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ok():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not come up within {timeout}s")


class Cluster:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.procs: list[subprocess.Popen] = []
        # Jobs reach the cluster through PATH: the executor plugin drops SLURM_* variables (SLURM_CONF
        # too) before its srun, so bin/ holds client wrappers that set it (a real cluster has /etc/slurm).
        conf = self.root / "slurm.conf"
        bin_dir = self.root / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        for tool in CLIENTS:
            w = bin_dir / tool
            w.write_text(f'#!/bin/sh\nSLURM_CONF={conf} exec {exe(tool)} "$@"\n')
            w.chmod(0o755)
        self.env = dict(os.environ, SLURM_CONF=str(conf), PATH=f"{bin_dir}:{os.environ['PATH']}")
        self.munge_socket = self.root / "munge" / "munge.socket"

    def run(self, *cmd, check=True, **kw) -> subprocess.CompletedProcess:
        cmd = (exe(cmd[0]), *cmd[1:])
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check, **kw)

    def _start(self, *cmd):
        log = open(self.root / "logs" / f"{Path(cmd[0]).name}-{len(self.procs)}.log", "w")
        self.procs.append(
            subprocess.Popen(
                (exe(cmd[0]), *cmd[1:]),
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def _write_configs(self, ports: dict[str, int]):
        r = self.root
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports[n]} CPUs={CPUS} "
            f"RealMemory={MEMORY_MB} Gres=gpu:2 State=UNKNOWN"
            for n in NODES
        )
        (r / "slurm.conf").write_text(f"""\
ClusterName={CLUSTER}
SlurmctldHost=localhost
SlurmctldPort={ports["ctld"]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/logs/slurmctld.log
SlurmdLogFile={r}/logs/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={ports["dbd"]}
AccountingStoragePass={self.munge_socket}
AccountingStorageTRES=gres/gpu
AccountingStoreFlags=job_comment
JobCompType=jobcomp/none
MinJobAge=600
InactiveLimit=0
KillWait=5
{nodes}
PartitionName={PARTITION} Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")
        # Stand-in GPUs: SLURM 22.05 drops a GPU GRES without device files, so empty files play them.
        (r / "dev").mkdir(exist_ok=True)
        for i in range(2):
            (r / "dev" / f"nvidia{i}").touch()
        (r / "gres.conf").write_text(f"Name=gpu File={r}/dev/nvidia[0-1]\n")
        # slurmd loads a cgroup plugin even with proctrack/linuxproc; on cgroup v2 without systemd
        # (containers) it must not ask systemd for a scope.
        (r / "cgroup.conf").write_text("IgnoreSystemd=yes\n")
        dbd = r / "slurmdbd.conf"
        dbd.write_text(f"""\
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
DbdHost=localhost
DbdPort={ports["dbd"]}
SlurmUser=root
LogFile={r}/logs/slurmdbd.log
PidFile={r}/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports["db"]}
StorageUser=root
StorageLoc=slurm_acct_db
""")
        dbd.chmod(0o600)

    def start(self):
        r = self.root
        for d in ("logs", "state", "spool", "munge", "db"):
            (r / d).mkdir(parents=True, exist_ok=True)
        ports = {k: _free_port() for k in ("ctld", "dbd", "db", *NODES)}
        self._write_configs(ports)

        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        self._start(
            "munged",
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={self.munge_socket}",
            f"--pid-file={r}/munge/munged.pid",
            f"--log-file={r}/logs/munged.log",
            f"--seed-file={r}/munge/seed",
        )
        _wait("munged", self.munge_socket.exists)

        self.run("mariadb-install-db", "--user=root", f"--datadir={r}/db", "--skip-test-db")
        self._start(
            "mariadbd",
            "--user=root",
            f"--datadir={r}/db",
            f"--port={ports['db']}",
            "--bind-address=127.0.0.1",
            f"--socket={r}/mysqld.sock",
            f"--pid-file={r}/mysqld.pid",
            "--skip-grant-tables",
        )  # a private database on 127.0.0.1: no accounts needed
        _wait("mariadb", lambda: _listening(ports["db"]))

        self._start("slurmdbd", "-D")  # reads slurmdbd.conf next to SLURM_CONF
        _wait("slurmdbd", lambda: _listening(ports["dbd"]))
        self.run("sacctmgr", "-i", "add", "cluster", CLUSTER, check=False)
        self._start("slurmctld", "-D", "-i")
        _wait("slurmctld", lambda: _listening(ports["ctld"]))
        for n in NODES:
            (r / "spool" / n).mkdir(exist_ok=True)
            self._start("slurmd", "-D", "-N", n)
        _wait("both nodes idle", self._nodes_idle, timeout=90)
        return self

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
        return out.count("idle") == len(NODES)

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []

    def logs(self) -> str:
        logs = sorted((self.root / "logs").glob("*"))
        return "\n".join(f"== {f.name}\n{f.read_text()[-3000:]}" for f in logs)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
