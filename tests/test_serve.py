"""The openai regenerate backend over real HTTP against the real server (flashdraft.serve), toy target."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import toy_prompt_set

from flashdraft.config import RegenerateConfig, to_json
from flashdraft.regenerate import regenerate
from flashdraft.serve import Server

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 6


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """A random tiny toy target and a prompt set of 40 toy prompts."""
    return toy_prompt_set(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(data, one_thread):
    srv = Server(str(data / "target"), port=0, dtype="float32")  # port 0: a free port
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(srv):
    return f"http://127.0.0.1:{srv.server_address[1]}/v1"


def _openai(base_url, **kw):
    kw = dict(dict(concurrency=4, part_rows=6, backoff_s=0.01), **kw)
    return RegenerateConfig(backend="openai", base_url=base_url, max_new_tokens=TOKENS, **kw)


def _run(data, out_dir, cfg):
    out = out_dir / "train.parquet"
    s = regenerate(cfg, str(data / "target"), "float32", str(data / "prompts/train.parquet"), str(out),
                   str(out_dir / "parts"))
    return s, pq.read_table(out)


@pytest.fixture(scope="module")
def hf_reference(data):
    """The hf backend unbatched (as the server generates), greedy."""
    return _run(data, data / "hf", RegenerateConfig(max_new_tokens=TOKENS, batch_size=1))[1]


def test_models_and_bad_requests(server):
    with urllib.request.urlopen(_url(server) + "/models") as r:
        assert json.loads(r.read())["data"][0]["id"] == server.name
    req = urllib.request.Request(_url(server) + "/chat/completions", data=b'{"messages": []}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 400 and "messages" in json.loads(e.value.read())["error"]["message"]


def test_openai_equals_hf(data, server, hf_reference, tmp_path):
    stats, table = _run(data, tmp_path, _openai(_url(server)))
    assert stats["rows"] == 40 and stats["errors"] == 0 and stats["length"] > 0
    ids = table.column("id").to_pylist()
    assert len(set(ids)) == 40
    assert table.equals(hf_reference)  # answers, token counts, finish reasons, prompt order
    assert pq.read_table(tmp_path / "errors.parquet").num_rows == 0


def test_retries_recover_injected_503(data, server, hf_reference, tmp_path):
    before = server.requests
    server.fail_every = 3  # sequential requests: every 3rd fails once, its retry succeeds
    try:
        _, table = _run(data, tmp_path, _openai(_url(server), concurrency=1, max_retries=2))
    finally:
        server.fail_every = 0
    assert server.requests - before > 50  # 40 answers and about 20 injected failures
    assert table.equals(hf_reference)


def test_client_errors_are_not_retried(data, server, tmp_path):
    before = server.requests
    with pytest.raises(RuntimeError, match="HTTP 404: The model `nope` does not exist"):
        _run(data, tmp_path, _openai(_url(server), model="nope", concurrency=1))
    # stopped once 3 of 40 (> 5%) failed, each tried once (plus the one request in flight then)
    assert 3 <= server.requests - before <= 4
    reasons = pq.read_table(tmp_path / "errors.parquet").column("reason").to_pylist()
    assert len(reasons) == 3 and all("does not exist" in r for r in reasons)


def test_unreachable_server_fails_clearly_then_resumes(data, server, hf_reference, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RuntimeError, match=r"rows failed.*127\.0\.0\.1:\d+/v1/chat/completions.*refused"):
        _run(data, tmp_path, _openai(f"http://127.0.0.1:{port}/v1", max_retries=1))
    assert not (tmp_path / "train.parquet").exists()
    assert pq.read_table(tmp_path / "errors.parquet").num_rows > 2
    # give-ups are not committed: with the server back (at another address), a rerun answers them all
    assert sum(pq.read_table(p).num_rows for p in (tmp_path / "parts").glob("part-*.parquet")) == 0
    _, table = _run(data, tmp_path, _openai(_url(server)))
    assert table.equals(hf_reference)


def test_kill_and_rerun_script(data, server, hf_reference, tmp_path):
    cfg = _openai(_url(server), concurrency=2, part_rows=3)
    out, parts = tmp_path / "train.parquet", tmp_path / "parts"
    cmd = [sys.executable, str(ROOT / "scripts/regenerate.py"), "--cfg", to_json(cfg),
           "--target", str(data / "target"), "--dtype", "float32",
           "--prompts", str(data / "prompts/train.parquet"), "--out", str(out), "--work-dir", str(parts)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    while not list(parts.glob("part-*.parquet")) and proc.poll() is None:
        time.sleep(0.02)
    with server.lock:  # hold generation: the kill lands mid-run, with requests in flight
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    first = sum(pq.read_table(p).num_rows for p in parts.glob("part-*.parquet"))
    assert not out.exists() and 3 <= first < 40
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    assert "40 rows" in done.stdout
    table = pq.read_table(out)
    assert sorted(table.column("id").to_pylist()) == sorted(set(table.column("id").to_pylist()))
    assert table.equals(hf_reference)
