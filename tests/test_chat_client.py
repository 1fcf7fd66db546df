"""The chat-completions client (chat_client.py) over real HTTP: against the repository's own server
(flashdraft.serve, a random tiny toy target) and servers that misbehave (stub_server.py's)."""

import json
import socket
import threading
from http.server import HTTPServer

import pytest
from stub_server import Garbage, Models

from flashdraft import toy
from flashdraft.chat_client import ChatClient, GiveUp, Reply
from flashdraft.config import ToyConfig
from flashdraft.serve import Server

pytestmark = pytest.mark.usefixtures("one_thread")

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, one_thread):
    target = tmp_path_factory.mktemp("chat_client") / "target"
    toy.build_toy_target(ToyConfig(steps=0, num_docs=200), str(target))
    srv = Server(str(target), port=0, dtype="float32", name="toy")  # port 0: a free port
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def url(srv) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}/v1"


def client(base_url: str, **kw) -> ChatClient:
    kw = {
        "headers": {"Content-Type": "application/json"},
        "max_retries": 2,
        "timeout_s": 60.0,
        "backoff_s": 0.001,
        **kw,
    }
    return ChatClient(base_url, **kw)


def body(**kw) -> dict:
    return {"model": "toy", "messages": MESSAGES, "max_tokens": 3, "temperature": 0, **kw}


def sent(srv) -> int:
    with srv.count_lock:
        return srv.requests


@pytest.fixture
def failing(server):
    """Set the server's injected 503s (every n-th request), and take them off after the test."""

    def fail(every: int):
        server.fail_every = every

    yield fail
    server.fail_every = 0


@pytest.fixture
def stub():
    """A misbehaving server on a free port, from one of stub_server.py's handlers: its base URL."""
    servers = []

    def start(handler) -> str:
        srv = HTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/v1/"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def canned(reply: dict) -> type:
    """A stub handler answering every request with `reply` as JSON, status 200."""
    fields = {"body": json.dumps(reply).encode(), "content_type": "application/json"}
    return type("Canned", (Garbage,), fields)


def closed_port() -> int:
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_completion_is_read_into_a_reply(server):
    before = sent(server)
    c = client(url(server) + "/")
    assert c.url == url(server) + "/chat/completions"
    reply = c.chat(body())
    assert isinstance(reply, Reply) and isinstance(reply.text, str) and reply.finish in ("stop", "length")
    # the server counts a stopped answer's end-of-turn token
    assert reply.completion_tokens == 3 if reply.finish == "length" else 1 <= reply.completion_tokens <= 3
    assert c.chat(body()) == reply  # greedy: the same answer
    assert sent(server) - before == 2


def test_a_transient_failure_is_retried(server, failing):
    before = sent(server)
    failing(before + 1)  # the next request is answered 503, its retry is not
    assert client(url(server), max_retries=1).chat(body()).finish in ("stop", "length")
    assert sent(server) - before == 2


@pytest.mark.parametrize("retries", [0, 2])
def test_spent_retries_give_up_with_the_server_s_message(server, failing, retries):
    before = sent(server)
    failing(1)  # every request: 503
    with pytest.raises(
        GiveUp,
        match=rf"/v1/chat/completions: HTTP 503: injected failure .*\(after {retries} "
        "retries\\)",
    ):
        client(url(server), max_retries=retries).chat(body())
    assert sent(server) - before == retries + 1


@pytest.mark.parametrize(
    "request_body, message",
    [
        (body(model="nope"), "HTTP 404: The model `nope` does not exist; this server has `toy`."),
        (body(max_tokens=0), "HTTP 400: `max_tokens` must be an integer in 1..32768, got 0"),
        (body(messages=[]), "HTTP 400: `messages` must be a non-empty list"),
    ],
    ids=["unknown-model", "max-tokens-0", "no-messages"],
)
def test_a_request_s_own_fault_is_one_error_not_retried(server, request_body, message):
    before = sent(server)
    with pytest.raises(ValueError) as e:
        client(url(server)).chat(request_body)
    assert str(e.value) == message
    assert sent(server) - before == 1


def test_no_server_gives_up_naming_the_address_and_the_cause():
    port = closed_port()
    address = rf"^http://127\.0\.0\.1:{port}/v1/chat/completions"
    with pytest.raises(GiveUp, match=address + r": URLError: .*refused.*\(after 1 retries\)$"):
        client(f"http://127.0.0.1:{port}/v1", max_retries=1).chat(body())


def test_a_server_that_is_gone_ends_the_retries_at_once():
    port, asked = closed_port(), []

    def gone(answer):
        def server_gone():
            asked.append(answer)
            return answer

        return server_gone

    with pytest.raises(RuntimeError, match="the server exited"):
        client(
            f"http://127.0.0.1:{port}/v1", max_retries=3, server_gone=gone(RuntimeError("the server exited"))
        ).chat(body())
    assert len(asked) == 1
    asked.clear()
    with pytest.raises(GiveUp):  # still running (None): each attempt asks again
        client(f"http://127.0.0.1:{port}/v1", max_retries=3, server_gone=gone(None)).chat(body())
    assert asked == [None] * 4


def test_a_silent_server_times_out_and_is_retried():
    with socket.socket() as s:  # accepts connections (the backlog) and never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        port = s.getsockname()[1]
        with pytest.raises(GiveUp, match=r"timed out \(after 1 retries\)"):
            client(f"http://127.0.0.1:{port}/v1", max_retries=1, timeout_s=0.2).chat(body())


def test_what_the_client_sends(stub):
    """One POST to base_url/chat/completions with the client's headers and the body as JSON."""
    seen = []

    class Echo(Garbage):
        def do_POST(self):
            data = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(
                (
                    self.command,
                    self.path,
                    self.headers["Authorization"],
                    self.headers["Content-Type"],
                    json.loads(data),
                )
            )
            self.body = json.dumps(
                {
                    "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
                    "usage": {"completion_tokens": 2},
                }
            ).encode()
            super().do_GET()

    base = stub(Echo)
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-test"}
    request = body(top_p=0.9, top_k=20, chat_template_kwargs={"enable_thinking": False})
    assert client(base, headers=headers).chat(request) == Reply("hi", "stop", 2)
    assert seen == [("POST", "/v1/chat/completions", "Bearer sk-test", "application/json", request)]


@pytest.mark.parametrize(
    "handler, error",
    [
        (
            Garbage,
            "answered b'<html>it works!</html>', not JSON: is regenerate.base_url an OpenAI-compatible",
        ),
        (Models, "not a chat completion (choices[0].message)"),
        (canned({"choices": []}), "not a chat completion (choices[0].message)"),
        (
            canned({"choices": [{"message": {"content": "x"}, "finish_reason": "tool_calls"}]}),
            "finish_reason 'tool_calls'",
        ),
    ],
    ids=["html", "model-list", "no-choice", "tool-calls"],
)
def test_a_reply_that_is_no_chat_completion_is_an_error(stub, handler, error):
    with pytest.raises(ValueError) as e:
        client(stub(handler)).chat(body())
    assert error in str(e.value)


@pytest.mark.parametrize(
    "reply, read",
    [
        (
            {"choices": [{"message": {"content": "ok"}, "finish_reason": "length"}]},
            Reply("ok", "length", None),
        ),
        (
            {"choices": [{"message": {"content": None}, "finish_reason": "stop"}], "usage": None},
            Reply("", "stop", None),
        ),
    ],
    ids=["no-usage", "null-content"],
)
def test_a_reply_without_usage_or_text_is_read(stub, reply, read):
    assert client(stub(canned(reply))).chat(body()) == read
