"""A minimal OpenAI-compatible chat-completions server for a local HF model, one generate at a time.

Enough of the API for the `openai` regenerate backend: POST /v1/chat/completions and GET /v1/models.
It answers exactly as the `hf` backend does (same chat rendering, same generate), so it is the reference
server for tests and a fallback where vLLM or SGLang are not installed. `fail_every=N` answers every
N-th chat request with HTTP 503 instead: a real failure mode to exercise clients' retries.
`python -m flashdraft.serve --target DIR --port N` runs it (a `regenerate.server_cmd` too); SIGTERM or
Ctrl-C stops it cleanly.

Requests are checked before any work: a body over `max_body` bytes is a 413, a bad Content-Length, a
body that is not a JSON object, or a field out of range (max_tokens in 1..`max_tokens_limit`, a
temperature >= 0, a top_p in (0, 1], a top_k >= 0) is a 400; so is a conversation the chat template
cannot answer (a role other than system, user, assistant; no user turn; an assistant turn last), text
that is not Unicode (a lone UTF-16 surrogate), a prompt that with max_tokens runs past the model's
max_position_embeddings, and `stream: true` (not supported). Error bodies are OpenAI's: {"error":
{"message", "type", "code"}}. A client that stalls mid-request is dropped after `request_timeout` seconds,
so it cannot hold a thread forever.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .chat import render
from .config import TargetConfig
from .io import log
from .target import generate, load_for_generate

MAX_BODY = 1 << 20  # bytes; a chat request is far smaller
MAX_TOKENS_LIMIT = 32768
DEFAULT_MAX_TOKENS = 256
REQUEST_TIMEOUT = 60.0  # seconds a client may stall while sending its request
ROLES = ("system", "user", "assistant")  # the roles the regeneration's prompts hold (flashdraft.sources)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_type(value) -> str:
    """What a client sent, in JSON's words."""
    names = {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def _check_message(i: int, m) -> None:
    """messages[i] is {role: one of ROLES, content: a string of Unicode text}, or ValueError says why."""
    if not isinstance(m, dict):
        raise ValueError(
            f"`messages[{i}]` must be an object with a string `role` and `content`, got {_json_type(m)}"
        )
    for key in ("role", "content"):
        if not isinstance(m.get(key), str):
            got = _json_type(m[key]) if key in m else "none"
            raise ValueError(f"`messages[{i}].{key}` must be a string, got {got}")
    if m["role"] not in ROLES:
        raise ValueError(
            f"`messages[{i}].role` must be one of {', '.join(map(repr, ROLES))}, got {m['role'][:40]!r}"
        )
    # JSON's \ud800 escapes decode to lone surrogates: no text a tokenizer can encode
    bad = re.search("[\ud800-\udfff]", m["content"])
    if bad:
        raise ValueError(
            f"bad unicode in message {i}: a lone UTF-16 surrogate ({ascii(bad[0])[1:-1]}) in `content`"
        )


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        target: str,
        host: str = "127.0.0.1",
        port: int = 8000,
        dtype: str = TargetConfig.dtype,
        name: str | None = None,
        fail_every: int = 0,
        max_tokens_limit: int = MAX_TOKENS_LIMIT,
        max_body: int = MAX_BODY,
        request_timeout: float = REQUEST_TIMEOUT,
    ):
        self.model, self.tokenizer, self.eos = load_for_generate(target, dtype)
        self.name, self.fail_every = name or target, fail_every
        self.max_tokens_limit, self.max_body = max_tokens_limit, max_body
        self.request_timeout = request_timeout
        self.lock = threading.Lock()  # one model: generate calls run one at a time
        self.count_lock, self.requests = threading.Lock(), 0
        super().__init__((host, port), Handler)

    def complete(self, req: dict) -> dict:
        if req.get("model", self.name) != self.name:
            raise LookupError(f"The model `{req['model']}` does not exist; this server has `{self.name}`.")
        if req.get("stream"):
            raise ValueError("`stream: true` is not supported by this server; leave `stream` out or false")
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("`messages` must be a non-empty list")
        for i, m in enumerate(messages):
            _check_message(i, m)
        if not any(m["role"] == "user" for m in messages):
            raise ValueError("`messages` has no user turn: there is nothing to answer")
        if messages[-1]["role"] == "assistant":  # answered already; continuing an answer is not supported
            raise ValueError(
                f"the conversation ends with an assistant turn (messages[{len(messages) - 1}]): "
                "there is nothing to answer; end it with a user turn"
            )
        max_tokens = self._max_tokens(req)
        temperature = req.get("temperature")
        temperature = 1.0 if temperature is None else temperature
        if not _number(temperature) or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"`temperature` must be a number >= 0, got {temperature!r}")
        top_p, top_k = req.get("top_p"), req.get("top_k")
        top_p = 1.0 if top_p is None else top_p
        if not _number(top_p) or not 0 < top_p <= 1:
            raise ValueError(f"`top_p` must be a number in (0, 1], got {top_p!r}")
        top_k = 0 if top_k is None or top_k == -1 else top_k  # -1: off, as vLLM spells it
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise ValueError(f"`top_k` must be an integer >= 0 (0 or -1: off), got {top_k!r}")
        kwargs = req.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ValueError(f"`chat_template_kwargs` must be an object, got {kwargs!r}")
        thinking = bool(kwargs.get("enable_thinking", False))
        with self.lock:  # the tokenizer is not thread-safe either
            self._check_length(messages, max_tokens, thinking)
            [(answer, n_prompt, n, finish)] = generate(
                self.model,
                self.tokenizer,
                [messages],
                max_tokens,
                float(temperature),
                thinking,
                self.eos,
                float(top_p),
                top_k,
            )
        return {
            "object": "chat.completion",
            "model": self.name,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": finish}
            ],
            # like vLLM and SGLang, the end-of-turn token that stopped the answer counts as generated
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n + (finish == "stop"),
                "total_tokens": n_prompt + n + (finish == "stop"),
            },
        }

    def _check_length(self, messages: list[dict], max_tokens: int, thinking: bool) -> None:
        """Positions past max_position_embeddings give garbage, not an error: refuse a prompt that with
        the answer it asks room for would need them (as vLLM refuses one past its max_model_len)."""
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if not limit:
            return
        text = render(self.tokenizer, messages, add_generation_prompt=True, thinking=thinking)
        n = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if n > limit:
            raise ValueError(
                f"the prompt is {n} tokens, over the model's max_position_embeddings of "
                f"{limit}; shorten the messages"
            )
        if n + max_tokens > limit:
            raise ValueError(
                f"the prompt ({n} tokens) and max_tokens ({max_tokens}) are {n + max_tokens} "
                f"tokens, over the model's max_position_embeddings of {limit}; shorten the "
                "messages or lower max_tokens"
            )

    def _max_tokens(self, req: dict) -> int:
        """max_completion_tokens (the newer name) else max_tokens; absent or null: the default. Checked,
        not `or`-chained, so 0 is refused instead of silently becoming the default."""
        key = "max_completion_tokens" if req.get("max_completion_tokens") is not None else "max_tokens"
        value = req.get(key)
        if value is None:
            return DEFAULT_MAX_TOKENS
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= self.max_tokens_limit:
            raise ValueError(f"`{key}` must be an integer in 1..{self.max_tokens_limit}, got {value!r}")
        return value


class Handler(BaseHTTPRequestHandler):
    server: Server

    def setup(self):
        self.timeout = self.server.request_timeout  # the socket's timeout, set by StreamRequestHandler.setup
        super().setup()

    def _send(self, code: int, body: dict):
        data = json.dumps(body).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client went away: nothing to answer
            pass

    def _error(self, code: int, message: str):
        kind = "server_error" if code >= 500 else "invalid_request_error"  # OpenAI's error types
        self._send(code, {"error": {"message": message, "type": kind, "code": code}})

    def do_GET(self):
        if self.path.rstrip("/") == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": self.server.name, "object": "model"}]})
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self):
        if self.path.rstrip("/") != "/v1/chat/completions":
            return self._error(404, f"no route {self.path}")
        srv = self.server
        with srv.count_lock:
            srv.requests += 1
            n = srv.requests
        length = (self.headers.get("Content-Length") or "0").strip()
        if not re.fullmatch(r"[0-9]+", length):
            self.close_connection = True  # the body's end is unknown: this connection cannot go on
            return self._error(400, f"Content-Length must be a non-negative integer, got {length!r}")
        if int(length) > srv.max_body:
            self.close_connection = True  # the body stays unread
            return self._error(413, f"request body of {length} bytes is over the limit of {srv.max_body}")
        try:
            body = self.rfile.read(int(length))
        except TimeoutError:
            self.close_connection = True
            return self._error(408, f"request body not received within {srv.request_timeout} s")
        try:
            req = json.loads(body)
        except ValueError as e:
            return self._error(400, f"invalid JSON: {e}")
        if not isinstance(req, dict):
            return self._error(400, f"the request body must be a JSON object, got {type(req).__name__}")
        if srv.fail_every and n % srv.fail_every == 0:
            return self._error(503, f"injected failure (request {n}, fail_every={srv.fail_every})")
        try:
            self._send(200, srv.complete(req))
        except LookupError as e:
            self._error(404, str(e))
        except (ValueError, TypeError) as e:
            self._error(400, str(e))
        except Exception as e:
            self._error(500, f"{type(e).__name__}: {e}")

    def log_message(self, format, *args):  # one line per request is noise at thousands of requests
        pass


def _stop(signum, frame):
    raise KeyboardInterrupt  # leaves serve_forever (or the model load) through the finally below


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description="Serve a local HF model over a minimal OpenAI-compatible chat-completions API "
        "(greedy by default)."
    )
    ap.add_argument("--target", required=True, help="HF model directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dtype", default=TargetConfig.dtype)
    ap.add_argument("--name", default=None, help="model name clients send (default: --target)")
    ap.add_argument("--fail-every", type=int, default=0, help="answer every N-th request with 503 (tests)")
    ap.add_argument(
        "--max-tokens-limit",
        type=int,
        default=MAX_TOKENS_LIMIT,
        help="largest max_tokens a request may ask for (larger: HTTP 400)",
    )
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)  # a managed server is stopped with SIGTERM
    srv = None
    try:
        srv = Server(
            args.target, args.host, args.port, args.dtype, args.name, args.fail_every, args.max_tokens_limit
        )
        log(f"serving {srv.name} on http://{args.host}:{srv.server_address[1]}/v1")
        srv.serve_forever()
    except KeyboardInterrupt:
        log("stopped")
    finally:
        if srv is not None:
            srv.server_close()


if __name__ == "__main__":
    main()
