"""The openai regenerate backend over real HTTP against the real server (flashdraft.serve), toy target."""

import http.client
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
from conftest import one_line_error, toy_prompt_set

from flashdraft.config import RegenerateConfig, TargetConfig, to_json
from flashdraft.errors import UserError
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


def _target(data) -> TargetConfig:
    return TargetConfig(path=str(data / "target"), dtype="float32")


def _run(data, out_dir, cfg):
    out = out_dir / "train.parquet"
    s = regenerate(cfg, _target(data), str(data / "prompts/train.parquet"), str(out), str(out_dir / "parts"))
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


MESSAGES = [{"role": "user", "content": "hello"}]


def _post(srv, body: bytes, length=None, send_body=True):
    """POST over a raw connection: Content-Length as given (or the body's), the body sent or not; returns
    (status, error message). A server that waits for bytes that never come fails this by the timeout."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=10)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body) if length is None else length))
        conn.endheaders(body if send_body else None)
        resp = conn.getresponse()
        data = json.loads(resp.read())
        return resp.status, data.get("error", {}).get("message", "")
    finally:
        conn.close()


@pytest.mark.parametrize(
    "body, words",
    [
        ([1, 2], "JSON object"),
        ("hello", "JSON object"),
        ({"max_tokens": 0}, "`max_tokens` must be an integer in 1..32768, got 0"),
        ({"max_tokens": -3}, "`max_tokens` must be an integer in 1..32768, got -3"),
        ({"max_completion_tokens": 0, "max_tokens": 4}, "`max_completion_tokens` must be an integer"),
        ({"max_tokens": "4"}, "`max_tokens` must be an integer"),
        ({"max_tokens": 2.5}, "`max_tokens` must be an integer"),
        ({"max_tokens": 32769}, "`max_tokens` must be an integer in 1..32768, got 32769"),
        ({"temperature": -0.5}, "`temperature` must be a number >= 0"),
        ({"temperature": "0.5"}, "`temperature` must be a number >= 0"),
        ({"top_p": 0}, "`top_p` must be a number in (0, 1], got 0"),
        ({"top_p": 1.5}, "`top_p` must be a number in (0, 1], got 1.5"),
        ({"top_k": -2}, "`top_k` must be an integer >= 0 (0 or -1: off), got -2"),
        ({"top_k": 2.5}, "`top_k` must be an integer >= 0"),
        ({"chat_template_kwargs": ["x"]}, "`chat_template_kwargs` must be an object"),
        (
            {"messages": [{"role": "user", "content": 5}]},
            "`messages[0].content` must be a string, got a number",
        ),
        (
            {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": [{"text": "hi"}]}]},
            "`messages[1].content` must be a string, got an array",
        ),
        ({"messages": [{"content": "hi"}]}, "`messages[0].role` must be a string, got none"),
        (
            {"messages": ["hi"]},
            "`messages[0]` must be an object with a string `role` and `content`, got a string",
        ),
    ],
    ids=[
        "list",
        "string",
        "max-tokens-0",
        "max-tokens-negative",
        "max-completion-tokens-0",
        "max-tokens-string",
        "max-tokens-float",
        "max-tokens-over-limit",
        "temperature-negative",
        "temperature-string",
        "top-p-0",
        "top-p-over-1",
        "top-k-negative",
        "top-k-float",
        "template-kwargs-list",
        "content-number",
        "content-array",
        "no-role",
        "message-string",
    ],
)
def test_bad_fields_are_400(server, body, words):
    if isinstance(body, dict):
        body = {"messages": MESSAGES, **body}
    code, message = _post(server, json.dumps(body).encode())
    assert code == 400 and words in message
    assert "Error" not in message and "object is not" not in message  # no Python exception text


def test_max_tokens_limit_is_a_server_option(server):
    server.max_tokens_limit = 3
    try:
        over = _post(server, json.dumps({"messages": MESSAGES, "max_tokens": 4}).encode())
        at = _post(server, json.dumps({"messages": MESSAGES, "max_tokens": 3, "temperature": 0}).encode())
    finally:
        server.max_tokens_limit = 32768
    assert over == (400, "`max_tokens` must be an integer in 1..3, got 4")
    assert at == (200, "")


@pytest.mark.parametrize(
    "length, code, words",
    [
        ("-1", 400, "Content-Length must be a non-negative integer, got '-1'"),
        ("12abc", 400, "Content-Length must be a non-negative integer, got '12abc'"),
        (str(2 << 20), 413, f"request body of {2 << 20} bytes is over the limit of {1 << 20}"),
    ],
    ids=["negative", "not-an-integer", "over-1-MiB"],
)
def test_bad_content_length_is_refused_before_reading(server, length, code, words):
    # the body is never sent: a server that tried to read it would wait until the client's timeout
    assert _post(server, b"", length=length, send_body=False) == (code, words)


def test_a_stalled_client_is_dropped(server):
    server.request_timeout = 0.2  # read when a connection starts
    try:
        # the headers promise 100 bytes, 10 come: the server answers 408 once the timeout passes
        assert _post(server, b'{"message', length=100) == (408, "request body not received within 0.2 s")
        # nothing at all after connecting: the server closes the connection (EOF, not the client's timeout)
        with socket.create_connection(server.server_address, timeout=10) as s:
            assert s.recv(1) == b""
    finally:
        server.request_timeout = 60.0
    code, _ = _post(server, json.dumps({"messages": []}).encode())  # later clients are still served
    assert code == 400


def test_openai_equals_hf(data, server, hf_reference, tmp_path):
    stats, table = _run(data, tmp_path, _openai(_url(server)))
    assert stats["rows"] == 40 and stats["errors"] == 0 and stats["length"] > 0
    ids = table.column("id").to_pylist()
    assert len(set(ids)) == 40
    assert table.equals(hf_reference)  # answers, token counts, finish reasons, prompt order
    assert pq.read_table(tmp_path / "errors.parquet").num_rows == 0


def test_top_k_1_through_the_server_is_greedy(data, server, hf_reference, tmp_path):
    """regenerate.top_k reaches the server in the request (temperature 1.5, top_k 1: the greedy answers)."""
    _, table = _run(data, tmp_path, _openai(_url(server), temperature=1.5, top_k=1))
    assert table.equals(hf_reference)


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
    with pytest.raises(UserError, match="HTTP 404: The model `nope` does not exist"):
        _run(data, tmp_path, _openai(_url(server), model="nope", concurrency=1))
    # stopped once 3 of 40 (> 5%) failed, each tried once; one request in flight, none sent after
    assert server.requests - before == 3
    reasons = pq.read_table(tmp_path / "errors.parquet").column("reason").to_pylist()
    assert len(reasons) == 3 and all("does not exist" in r for r in reasons)


def test_unreachable_server_fails_clearly_then_resumes(data, server, hf_reference, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UserError, match=r"rows failed.*127\.0\.0\.1:\d+/v1/chat/completions.*refused"):
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
    cmd = [
        sys.executable,
        str(ROOT / "scripts/regenerate.py"),
        "--cfg",
        to_json(cfg),
        "--target-cfg",
        to_json(_target(data)),
        "--prompts",
        str(data / "prompts/train.parquet"),
        "--out",
        str(out),
        "--work-dir",
        str(parts),
    ]
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


def _script(data, out_dir, cfg, **env):
    """scripts/regenerate.py as the workflow runs it (`env`: extra variables)."""
    cmd = [
        sys.executable,
        str(ROOT / "scripts/regenerate.py"),
        "--cfg",
        to_json(cfg),
        "--target-cfg",
        to_json(_target(data)),
        "--prompts",
        str(data / "prompts/train.parquet"),
        "--out",
        str(out_dir / "train.parquet"),
        "--work-dir",
        str(out_dir / "parts"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def _listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_closed_port_is_one_line(data, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = one_line_error(_script(data, tmp_path, _openai(f"http://127.0.0.1:{port}/v1", max_retries=0)))
    assert line.startswith("regenerate: error: ") and "rows failed" in line
    assert f"127.0.0.1:{port}/v1/chat/completions: URLError: [Errno 111] Connection refused" in line


def test_a_bad_server_then_a_fixed_one_recovers(data, server, hf_reference, tmp_path):
    """A server that answers HTML with status 200: the failed rows are committed with their cause and
    the stage stops in one line naming the parts and the rerun; the rerun, with the server fixed (here:
    the real one), answers them and gives the clean run's rows."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stub = subprocess.Popen([sys.executable, str(ROOT / "tests/stub_server.py"), "garbage", str(port)])
    try:
        while stub.poll() is None and not _listens(port):
            time.sleep(0.05)
        rerun = "snakemake --configfile my config.yaml --cores all"
        bad = _script(
            data, tmp_path, _openai(f"http://127.0.0.1:{port}/v1", concurrency=1), FLASHDRAFT_RERUN=rerun
        )
    finally:
        stub.terminate()
        stub.wait()
    line = one_line_error(bad)
    assert line.startswith("regenerate: error: 3 of 40 rows failed")
    assert "answered b'<html>it works!</html>', not JSON: is regenerate.base_url an OpenAI" in line
    assert f"kept in {tmp_path / 'parts'}/" in line and f"rerun ({rerun})" in line
    parts = sorted((tmp_path / "parts").glob("part-*.parquet"))
    committed = [r for part in parts for r in pq.read_table(part).to_pylist()]
    assert len(committed) == 3 and {r["cause"] for r in committed} == {"answer"}
    good = _script(data, tmp_path, _openai(_url(server)))
    assert good.returncode == 0, good.stderr
    assert "40 rows" in good.stdout and pq.read_table(tmp_path / "train.parquet").equals(hf_reference)


def _error_body(srv, body: dict) -> tuple[int, dict]:
    """POST a chat request; (status, the `error` object of the reply, {} when none)."""
    req = urllib.request.Request(
        _url(srv) + "/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()).get("error", {})
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


@pytest.mark.parametrize(
    "messages, words",
    [
        (
            [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}],
            "`messages[1].role` must be one of 'system', 'user', 'assistant', got 'robot'",
        ),
        ([{"role": "assistant", "content": "I answer nothing"}], "`messages` has no user turn"),
        (
            [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "ok"}],
            "`messages` has no user turn",
        ),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            "the conversation ends with an assistant turn (messages[1]): there is nothing to answer",
        ),
    ],
    ids=["unknown-role", "assistant-only", "system-and-assistant", "ends-with-assistant"],
)
def test_conversations_the_template_cannot_answer_are_400(server, messages, words):
    code, error = _error_body(server, {"messages": messages, "max_tokens": 2})
    assert code == 400 and error["type"] == "invalid_request_error", error
    assert words in error["message"]


def _prompt_tokens(srv, messages) -> int:
    text = srv.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(srv.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_prompt_past_the_models_positions_is_400(server):
    limit = server.model.config.max_position_embeddings
    long = [{"role": "user", "content": "7" * (4 * limit)}]  # a token per digit
    code, error = _error_body(server, {"messages": long, "max_tokens": 2})
    n = _prompt_tokens(server, long)
    assert n > 4 * limit
    assert code == 400 and error["type"] == "invalid_request_error", error
    assert error["message"] == (
        f"the prompt is {n} tokens, over the model's max_position_embeddings of {limit}; shorten the messages"
    )
    # a prompt that fits, but not with the answer it asks room for
    fits = [{"role": "user", "content": "7" * (limit - 16)}]
    n = _prompt_tokens(server, fits)
    assert limit - 16 < n < limit
    code, error = _error_body(server, {"messages": fits, "max_tokens": limit})
    assert code == 400 and error["message"] == (
        f"the prompt ({n} tokens) and max_tokens ({limit}) are {n + limit} tokens, over the model's "
        f"max_position_embeddings of {limit}; shorten the messages or lower max_tokens"
    )
    code, _ = _error_body(server, {"messages": fits, "max_tokens": limit - n, "temperature": 0})
    assert code == 200  # exactly at the limit


def test_stream_is_400(server):
    code, error = _error_body(server, {"messages": MESSAGES, "max_tokens": 2, "stream": True})
    assert code == 400 and error["type"] == "invalid_request_error", error
    assert error["message"] == "`stream: true` is not supported by this server; leave `stream` out or false"
    assert _error_body(server, {"messages": MESSAGES, "max_tokens": 2, "stream": False})[0] == 200


def test_a_lone_surrogate_is_400(server):
    # json.dumps writes "\ud800" as its escape: valid JSON, but no Unicode text
    bad = [{"role": "system", "content": "fine"}, {"role": "user", "content": "broken \ud800 here"}]
    code, error = _error_body(server, {"messages": bad, "max_tokens": 2})
    assert code == 400 and error["type"] == "invalid_request_error", error
    assert error["message"] == "bad unicode in message 1: a lone UTF-16 surrogate (\\ud800) in `content`"


def test_error_bodies_have_an_openai_type(server):
    code, error = _error_body(server, {"messages": MESSAGES, "model": "nope"})
    assert code == 404 and error["type"] == "invalid_request_error" and error["code"] == 404
    server.fail_every = 1
    try:
        code, error = _error_body(server, {"messages": MESSAGES})
    finally:
        server.fail_every = 0
    assert code == 503 and error["type"] == "server_error"
