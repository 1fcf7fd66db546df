"""An inference server owned by one job: started on the job's GPUs, stopped whatever way the job ends.

`ManagedServer` runs a server command (vLLM, SGLang, `python -m flashdraft.serve`) as a child process,
waits until it answers `GET /v1/models`, and stops it on exit. The command is a template split like a
shell line, but its placeholders are filled per argument and it runs without a shell: a target path
with spaces or `$(...)` stays one argument. The server gets its own process group (stopped as a
whole) and, on Linux, a parent-death signal: even a SIGKILL of the job stops it. It also keeps the
job's GPU lease (see `flashdraft.gpu`) until it has exited, so no other job is given its GPUs early.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from http.client import HTTPException
from pathlib import Path

from .errors import UserError

PLACEHOLDERS = ("target", "port", "gpus")
TAIL_LINES = 20
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
# the health probe talks to our own child on 127.0.0.1: never through an HTTP proxy
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerError(UserError):
    """The managed server could not be started or did not answer; the message says why."""


def server_argv(template: str, target: str, port: int, gpus: int) -> list[str]:
    """Split `template` like a shell line, then fill `{target}`, `{port}`, `{gpus}` inside each argument.
    Other braces (a JSON option) are left alone; an unknown `{name}` is an error."""
    try:
        args = shlex.split(template)
    except ValueError as e:
        raise ServerError(f"regenerate.server_cmd {template!r}: {e}") from None
    if not args:
        raise ServerError("regenerate.server_cmd is empty")
    unknown = sorted({m for a in args for m in re.findall(r"\{(\w+)\}", a)} - set(PLACEHOLDERS))
    if unknown:
        raise ServerError(
            f"regenerate.server_cmd {template!r}: unknown placeholder(s) {unknown}; "
            f"allowed: {list(PLACEHOLDERS)}"
        )
    if not any("{port}" in a for a in args):
        raise ServerError(
            f"regenerate.server_cmd {template!r} has no {{port}}: the server must listen "
            "on the port this job gives it"
        )
    values = {"target": str(target), "port": str(port), "gpus": str(gpus)}
    return [re.sub(r"\{(\w+)\}", lambda m: values[m[1]], a) for a in args]


def free_port() -> int:
    """A port no one listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    """Whether a program listens on `port` (any address): the bind a server would make fails.
    SO_REUSEADDR, as servers set it, so connections closing on the port do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def _lease_fds() -> list[int]:
    """The inheritable fds above stdio: the GPU lease's lock files (`Lease.keep_across_exec`). Python
    opens everything else close-on-exec, so these are the fds a shell would hand the server too."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return []
    out = []
    for fd in fds:
        try:
            if fd > 2 and os.get_inheritable(fd):
                out.append(fd)
        except OSError:  # the fd listdir itself used, closed by now
            pass
    return out


def _die_with_parent(parent: int):
    """preexec_fn: SIGTERM this child when the job dies, even by SIGKILL (prctl, Linux)."""

    def set_pdeathsig():
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the job died before the prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return set_pdeathsig if _prctl is not None else None


def _status(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


class ManagedServer:
    """Context manager: the server is up and healthy inside, stopped (process group) on the way out.

    The pdeath signal is tied to the thread that starts the server: start it from the main thread."""

    def __init__(
        self,
        cmd: str,
        target: str,
        gpus: int = 1,
        port: int = 0,
        timeout_s: float = 1800.0,
        log_path: str | Path = "server.log",
        stop_grace_s: float = 30.0,
        poll_s: float = 0.5,
    ):
        self.cmd, self.target, self.gpus = cmd, target, gpus
        self.port, self.fixed_port = port or free_port(), bool(port)
        self.timeout_s, self.log_path = timeout_s, Path(log_path)
        self.stop_grace_s, self.poll_s = stop_grace_s, poll_s
        self.argv = server_argv(cmd, target, self.port, gpus)
        self.proc: subprocess.Popen | None = None
        self._gone: ServerError | None = None
        self._gone_lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.fixed_port and port_in_use(self.port):
            raise ServerError(
                f"regenerate.server_port {self.port} is already in use by another program; "
                "free it, or set regenerate.server_port: 0 (any free port)"
            )
        _no_proxy_for_localhost()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            try:
                self.proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: stopped as a whole
                    pass_fds=_lease_fds(),
                    preexec_fn=_die_with_parent(os.getpid()),
                )
            except OSError as e:  # no such executable, not executable
                raise ServerError(
                    f"regenerate.server_cmd: cannot run {self.argv[0]!r}: {e.strerror or e}"
                ) from None
        print(
            f"regenerate: server pid {self.proc.pid} starting on port {self.port} "
            f"({shlex.join(self.argv)}); log {self.log_path}",
            flush=True,
        )
        try:
            self._wait_healthy()
        except BaseException:  # failed, timed out, or the job was stopped: no server outlives this
            self.stop()
            raise
        print(f"regenerate: server pid {self.proc.pid} answers at {self.base_url}", flush=True)

    def _wait_healthy(self) -> None:
        url, deadline, last = self.base_url + "/models", time.monotonic() + self.timeout_s, "no answer"
        while True:
            code = self.proc.poll()
            if code is not None:
                raise self._error(f"the server {_status(code)} before it answered GET {url}")
            try:
                with _direct.open(url, timeout=max(0.1, min(5.0, deadline - time.monotonic()))) as r:
                    body = r.read()
                break
            except urllib.error.HTTPError as e:  # up but not ready (503 while loading): keep waiting
                last = f"HTTP {e.code}"
                e.close()
            except (urllib.error.URLError, OSError, HTTPException) as e:  # not listening yet
                last = f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"
            if time.monotonic() > deadline:
                raise self._error(
                    f"the server did not answer GET {url} within "
                    f"regenerate.server_timeout_s={self.timeout_s:g} s (last: {last})"
                )
            time.sleep(self.poll_s)
        try:
            models = json.loads(body)
            ok = isinstance(models, dict) and isinstance(models.get("data"), list)
        except ValueError:
            ok = False
        if not ok:
            raise self._error(
                f"GET {url} answered {body[:200]!r}, not an OpenAI model list (JSON with a "
                "`data` list): is regenerate.server_cmd an OpenAI-compatible server?"
            )
        # what answered must be our server, not another program that took the port
        code = self.proc.poll()
        if code is not None:
            raise self._error(
                f"GET {url} answered, but the server {_status(code)}: another program "
                f"answers on port {self.port}"
            )

    def exited(self) -> ServerError | None:
        """While the job uses it: None if the server runs, else the error that says it exited, with its
        log's last lines (printed once, however many of the job's threads ask)."""
        with self._gone_lock:
            proc = self.proc
            if self._gone is None and proc is not None and (code := proc.poll()) is not None:
                self._gone = self._error(
                    f"the job's server (pid {proc.pid}) {_status(code)} while the job "
                    f"was using it at {self.base_url}"
                )
            return self._gone

    def _error(self, problem: str) -> ServerError:
        """The problem, after the server's last log lines (why it failed, usually) on stderr."""
        print(f"regenerate: last lines of {self.log_path}:\n{self.log_tail()}", file=sys.stderr, flush=True)
        return ServerError(f"{problem} (the server's last log lines are above, all of it in {self.log_path})")

    def log_tail(self, n: int = TAIL_LINES) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                lines = deque(f, maxlen=n)
        except OSError:
            return "  | (no log)"
        return "".join(f"  | {line}" for line in lines).rstrip("\n") or "  | (empty)"

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after `stop_grace_s`; waits until it is gone."""
        if self.proc is None:
            return
        pgid, deadline = self.proc.pid, time.monotonic() + self.stop_grace_s  # leader's pid: the group id
        _signal_group(pgid, signal.SIGTERM)
        # workers it started (tensor parallelism) may outlive it briefly: wait for the whole group
        while self.proc.poll() is None or _group_alive(pgid):
            if time.monotonic() > deadline:
                _signal_group(pgid, signal.SIGKILL)
                self.proc.wait()
                while _group_alive(pgid):  # the workers die of it too, but not at the same instant
                    time.sleep(0.05)
                break
            time.sleep(0.05)
        self.proc = None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (zombies, left for their reaper, do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return True
    return any(_state(f"/proc/{pid}/stat")[1] == pgid and _running(pid) for pid in pids)


def _state(stat_path: str) -> tuple[str, int]:
    """(state, process group) from a /proc stat file; ("X", 0) when it is gone."""
    try:
        fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()  # the name before may hold spaces
    except (OSError, IndexError):
        return "X", 0
    return fields[0], int(fields[2])


def _running(pid: str) -> bool:
    """Whether a thread of process `pid` runs: a zombie leader may still wait for its threads to exit."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any(_state(f"/proc/{pid}/task/{tid}/stat")[0] not in ("Z", "X") for tid in tids)


def _no_proxy_for_localhost() -> None:
    """The client reaches the server at 127.0.0.1: an http_proxy of the environment must not catch it."""
    for key in ("no_proxy", "NO_PROXY"):
        hosts = [h for h in os.environ.get(key, "").split(",") if h.strip()]
        if "127.0.0.1" not in hosts:
            os.environ[key] = ",".join(hosts + ["127.0.0.1"])
