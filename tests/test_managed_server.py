"""The server regenerate backend: the job starts its own server and stops it however the job ends (done,
failed, SIGTERM, SIGKILL). Real processes and real HTTP on 127.0.0.1 only, toy target."""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import one_line_error, toy_prompt_set

from flashdraft.config import RegenerateConfig, TargetConfig, to_json
from flashdraft.gpu import Lease
from flashdraft.io import write_parquet
from flashdraft.managed_server import ManagedServer, ServerError, server_argv
from flashdraft.regenerate import parts_schema, regenerate

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
PY = shlex.quote(sys.executable)
STUB = f"{PY} {shlex.quote(str(ROOT / 'tests/stub_server.py'))}"
SERVE = f"{PY} -m flashdraft.serve --target {{target}} --port {{port}} --dtype float32"
TOKENS = 4
WAIT_S = 120  # bounds every wait on a process; nothing asserts that it is short
ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(autouse=True)
def _restore_no_proxy(monkeypatch):
    """A managed server adds 127.0.0.1 to this process's no_proxy: undone after each test."""
    for key in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(key, os.environ.get(key, ""))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A random tiny toy target and a prompt set of 40 toy prompts."""
    return toy_prompt_set(tmp_path_factory.mktemp("managed"))


@pytest.fixture(scope="module")
def hf_reference(data):
    """The hf backend unbatched (as flashdraft.serve generates), greedy."""
    out = data / "hf/train.parquet"
    cfg = RegenerateConfig(max_new_tokens=TOKENS, batch_size=1)
    regenerate(
        cfg, _target(data / "target"), str(data / "prompts/train.parquet"), str(out), str(data / "hf/parts")
    )
    return pq.read_table(out)


def _target(path) -> TargetConfig:
    return TargetConfig(path=str(path), dtype="float32")


def _cfg(**kw):
    kw = dict(dict(server_cmd=SERVE, server_gpus=0, concurrency=4, part_rows=6, backoff_s=0.01), **kw)
    return RegenerateConfig(backend="server", max_new_tokens=TOKENS, **kw)


def _job_cmd(data, out_dir, cfg) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "scripts/regenerate.py"),
        "--cfg",
        to_json(cfg),
        "--target-cfg",
        to_json(_target(data / "target")),
        "--prompts",
        str(data / "prompts/train.parquet"),
        "--out",
        str(out_dir / "train.parquet"),
        "--work-dir",
        str(out_dir / "parts"),
    ]


def _states(pid) -> list[str]:
    """The states of the threads of process `pid` (none when it is gone)."""
    out = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            out.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    """Whether process `pid` runs: a thread of it does (a zombie left for its reaper does not)."""
    return any(s not in "ZX" for s in _states(pid))


def _group_alive(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and _alive(stat.parent.name):
            return True
    return False


def _wait(cond, what: str):
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {WAIT_S} s")
        time.sleep(0.01)


def _server_pid(text: str) -> int | None:
    m = re.search(r"server pid (\d+) starting", text)
    return int(m[1]) if m else None


def _rows(parts: Path) -> int:
    return sum(pq.read_table(p).num_rows for p in parts.glob("part-*.parquet"))


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_default_server_listens_on_the_loopback_only():
    """The job talks to its server at 127.0.0.1; vLLM binds every interface unless told otherwise."""
    from flashdraft.config import RegenerateConfig

    argv = server_argv(RegenerateConfig().server_cmd, "t", 8123, 1)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


def test_placeholders_fill_arguments_never_a_shell():
    target = "/models/my model $(touch pwned); rm -rf ~"
    template = "srv --model {target} --port {port} --tp {gpus} --cfg '{\"a\": {\"b\": 1}}' 'at {port}'"
    assert server_argv(template, target, 8123, 2) == [
        "srv",
        "--model",
        target,
        "--port",
        "8123",
        "--tp",
        "2",
        "--cfg",
        '{"a": {"b": 1}}',
        "at 8123",
    ]
    with pytest.raises(ServerError, match=r"unknown placeholder\(s\) \['model'\]"):
        server_argv("srv {model} --port {port}", "t", 1, 1)
    with pytest.raises(ServerError, match=r"has no \{port\}"):
        server_argv("srv {target}", "t", 1, 1)
    with pytest.raises(ServerError, match="No closing quotation"):
        server_argv("srv 'x --port {port}", "t", 1, 1)


def test_lifecycle_answers_as_hf(data, hf_reference, tmp_path, monkeypatch, capsys):
    """python -m flashdraft.serve started, answering as the hf backend does, then stopped by SIGTERM; a
    target path with spaces and shell syntax reaches it as one argument and nothing runs it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    target = tmp_path / "toy target $(touch pwned)"
    target.symlink_to(data / "target")
    out, work = tmp_path / "out/train.parquet", tmp_path / "parts"
    prompts = str(data / "prompts/train.parquet")
    stats = regenerate(_cfg(), _target(target), prompts, str(out), str(work))
    assert stats["rows"] == 40 and stats["errors"] == 0
    assert pq.read_table(out).equals(hf_reference)
    pid = _server_pid(capsys.readouterr().out)
    assert pid is not None and not _alive(pid)
    assert "stopped" in (work / "server.log").read_text()  # it exited on the SIGTERM, not a SIGKILL
    assert not list(tmp_path.rglob("pwned"))
    # everything answered: a rerun writes the output again and starts no server (this one would fail)
    broken = _cfg(server_cmd=f"{PY} -c 'raise SystemExit(9)' {{port}}")
    assert regenerate(broken, _target(target), prompts, str(out), str(work))["rows"] == 40
    assert _server_pid(capsys.readouterr().out) is None


def test_stop_kills_the_whole_process_group(tmp_path):
    """A server that ignores SIGTERM, with a worker that ignores it too: SIGKILLed after the grace."""
    pidfile = tmp_path / "worker.pid"
    cmd = f"{STUB} stubborn {{port}} {shlex.quote(str(pidfile))}"
    with ManagedServer(cmd, "unused", log_path=tmp_path / "server.log", stop_grace_s=0.5) as srv:
        pid, worker = srv.proc.pid, int(pidfile.read_text())
        assert _alive(pid) and _alive(worker)
    assert srv.proc is None and not _alive(pid) and not _alive(worker)


def test_sigkill_sigterm_then_resume(data, hf_reference, tmp_path, monkeypatch):
    """SIGKILL of the job: the parent-death signal stops its server, which holds the job's GPU lease
    until it is gone. SIGTERM of the job: it stops its server, exits 143. Parts kept; a rerun finishes."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the lease then locks GPU 0 itself
    cfg, parts, locks = _cfg(concurrency=1, part_rows=2), tmp_path / "parts", tmp_path / "locks"
    cmd = _job_cmd(data, tmp_path, cfg)

    def start(name, prefix=()):
        log = tmp_path / f"{name}.log"
        with open(log, "w") as f:
            job = subprocess.Popen([*prefix, *cmd], stdout=f, stderr=subprocess.STDOUT, env=ENV)
        _wait(lambda: _server_pid(log.read_text()) or job.poll() is not None, f"{name}: server start")
        assert job.poll() is None, log.read_text()
        return job, _server_pid(log.read_text())

    # 1. the job under a GPU lease, SIGKILLed; its server is frozen meanwhile, so it cannot end on its own
    lease = [
        sys.executable,
        "-m",
        "flashdraft.gpu",
        "--gpus",
        "1",
        "--pool",
        "0",
        "--lock-dir",
        str(locks),
        "--",
    ]
    job, pid = start("sigkill", lease)
    _wait(lambda: _rows(parts) >= 2, "committed part")
    os.kill(pid, signal.SIGSTOP)
    job.kill()
    job.wait(WAIT_S)
    fds = [os.readlink(p) for p in Path(f"/proc/{pid}/fd").iterdir()]
    assert str(locks / "gpu0.lock") in fds  # the orphaned server keeps the lease: no job gets its GPU
    with pytest.raises(TimeoutError):
        Lease(1, str(locks), pool=["0"], timeout_s=0).acquire()
    os.kill(pid, signal.SIGCONT)  # the parent-death SIGTERM it got meanwhile takes effect
    _wait(lambda: not _alive(pid), "exit of the orphaned server")
    with Lease(1, str(locks), pool=["0"], timeout_s=0) as got:
        assert got.gpus == ["0"]
    first = _rows(parts)
    assert 2 <= first < 40 and not (tmp_path / "train.parquet").exists()

    # 2. SIGTERM while the server is up (frozen, so the run cannot finish first)
    job, pid = start("sigterm")
    _wait(lambda: _rows(parts) > first, "new committed part")
    os.kill(pid, signal.SIGSTOP)
    job.send_signal(signal.SIGTERM)
    os.kill(pid, signal.SIGCONT)  # lets the request in flight finish
    assert job.wait(WAIT_S) == 128 + signal.SIGTERM
    assert not _group_alive(pid)  # the job waited for its server's whole process group
    assert "stopped" in (parts / "server.log").read_text()
    second = _rows(parts)
    assert first < second < 40 and not (tmp_path / "train.parquet").exists()

    # 3. a rerun (here in-process) answers the rest; an http_proxy of the environment (where nothing
    #    listens) is not used to reach our own server
    for key in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(key, f"http://127.0.0.1:{_dead_port()}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    stats = regenerate(
        cfg,
        _target(data / "target"),
        str(data / "prompts/train.parquet"),
        str(tmp_path / "train.parquet"),
        str(parts),
    )
    assert stats["rows"] == 40 and stats["errors"] == 0
    assert pq.read_table(tmp_path / "train.parquet").equals(hf_reference)


# Stand-ins for a broken server: tiny commands, no model. Each: (server_cmd, more config, error message).
BAD = {
    "exits_at_once": (
        f"{PY} -c 'print(\"CUDA out of memory\"); raise SystemExit(3)' --port {{port}}",
        {},
        r"the server exited with status 3 before it answered GET http://127\.0\.0\.1:\d+/v1/models",
    ),
    "unknown_executable": (
        "flashdraft-no-such-server --port {port}",
        {},
        r"regenerate\.server_cmd: cannot run 'flashdraft-no-such-server': No such file",
    ),
    "port_in_use": (
        f'{PY} -c \'open("started", "w")\' {{port}}',
        {"server_port": "busy"},
        r"regenerate\.server_port \d+ is already in use",
    ),
    "never_healthy": (
        f"{PY} -c 'import time; time.sleep(600)' {{port}}",
        {"server_timeout_s": 1},
        r"the server did not answer GET http://127\.0\.0\.1:\d+/v1/models within "
        r"regenerate\.server_timeout_s=1 s \(last: .*refused",
    ),
    "answers_garbage": (
        f"{STUB} garbage {{port}}",
        {},
        r"GET http://127\.0\.0\.1:\d+/v1/models answered b'<html>it works!</html>', "
        r"not an OpenAI model list",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_server_fails_clearly_keeping_parts(case, data, hf_reference, tmp_path):
    cmd, extra, message = BAD[case]
    work = tmp_path / "parts"
    work.mkdir()
    # a part an interrupted run committed before (three answers of the hf run)
    part = work / "part-00000.parquet"
    rows = [dict(r, error=None) for r in hf_reference.slice(0, 3).to_pylist()]
    write_parquet(pa.Table.from_pylist(rows, schema=parts_schema(error=True)), part)
    committed = part.read_bytes()
    with socket.create_server(("127.0.0.1", 0)) as busy:  # listening: its port is in use
        if extra.get("server_port") == "busy":
            extra = {"server_port": busy.getsockname()[1]}
        job = subprocess.run(
            _job_cmd(data, tmp_path, _cfg(server_cmd=cmd, **extra)),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
            env=ENV,
        )
    assert job.returncode == 1
    assert re.search(f"^regenerate: error: {message}", one_line_error(job))
    assert part.read_bytes() == committed and sorted(p.name for p in work.glob("part-*")) == [part.name]
    assert not (tmp_path / "train.parquet").exists()
    pid = _server_pid(job.stdout)
    assert (pid is None) == (case in ("unknown_executable", "port_in_use"))
    assert pid is None or not _group_alive(pid)
    if case == "exits_at_once":  # the log tail is quoted
        assert "  | CUDA out of memory" in job.stderr
    assert not (tmp_path / "started").exists()  # a port in use: nothing was started


def test_a_server_that_dies_mid_run_is_reported_at_once(data, tmp_path):
    """The job's server killed while the job uses it: the job stops at once, saying its server exited
    (and how) after the server's log tail, instead of retrying the dead port until its retries run out.
    The answers committed before are kept."""
    # retries that would take minutes to run out, each ending in "Connection refused"
    cfg, parts, log = (
        _cfg(concurrency=2, part_rows=2, max_retries=5, backoff_s=30),
        tmp_path / "parts",
        tmp_path / "job.log",
    )
    with open(log, "w") as f:
        job = subprocess.Popen(_job_cmd(data, tmp_path, cfg), stdout=f, stderr=subprocess.STDOUT, env=ENV)
    try:
        _wait(lambda: _server_pid(log.read_text()) or job.poll() is not None, "server start")
        pid = _server_pid(log.read_text())
        assert pid is not None, log.read_text()
        _wait(lambda: _rows(parts) >= 2 or job.poll() is not None, "committed part")
        os.kill(pid, signal.SIGKILL)
        code = job.wait(WAIT_S)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    text = log.read_text()
    assert code == 1, text
    last = [line for line in text.splitlines() if line.strip()][-1]
    server_log = re.escape(str(parts / "server.log"))
    assert re.fullmatch(
        rf"regenerate: error: the job's server \(pid {pid}\) was killed by SIGKILL while the "
        r"job was using it at http://127\.0\.0\.1:\d+/v1 \(the server's last log lines are "
        rf"above, all of it in {server_log}\)",
        last,
    ), last
    assert "Traceback" not in text and "retries" not in text and "refused" not in text
    tail = text[text.index(f"last lines of {parts / 'server.log'}:") :]
    assert re.search(r"^  \| .*serving .* on http://127\.0\.0\.1:\d+/v1$", tail, re.M), tail
    assert text.count("last lines of") == 1  # printed once, though two requests were in flight
    assert 2 <= _rows(parts) < 40 and not (tmp_path / "train.parquet").exists()
    assert not _group_alive(pid)
