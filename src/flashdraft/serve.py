"""A minimal OpenAI-compatible chat-completions server for a local HF model, one generate at a time.

Enough of the API for the `openai` regenerate backend: POST /v1/chat/completions and GET /v1/models.
It answers exactly as the `hf` backend does (same chat rendering, same generate), so it is the reference
server for tests and a fallback where vLLM or SGLang are not installed. `fail_every=N` answers every
N-th chat request with HTTP 503 instead: a real failure mode to exercise clients' retries.
`python -m flashdraft.serve --target DIR --port N` runs it (a `regenerate.server_cmd` too); SIGTERM or
Ctrl-C stops it cleanly.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .regenerate import generate, load_for_generate


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, target: str, host: str = "127.0.0.1", port: int = 8000, dtype: str = "bfloat16",
                 name: str | None = None, fail_every: int = 0):
        self.model, self.tokenizer, self.eos = load_for_generate(target, dtype)
        self.name, self.fail_every = name or target, fail_every
        self.lock = threading.Lock()  # one model: generate calls run one at a time
        self.count_lock, self.requests = threading.Lock(), 0
        super().__init__((host, port), Handler)

    def complete(self, req: dict) -> dict:
        if req.get("model", self.name) != self.name:
            raise LookupError(f"The model `{req['model']}` does not exist; this server has `{self.name}`.")
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("`messages` must be a non-empty list")
        max_tokens = req.get("max_completion_tokens") or req.get("max_tokens") or 256
        thinking = bool((req.get("chat_template_kwargs") or {}).get("enable_thinking", False))
        with self.lock:
            [(answer, n_prompt, n, finish)] = generate(
                self.model, self.tokenizer, [messages], int(max_tokens), float(req.get("temperature", 1.0)),
                thinking, self.eos,
            )
        return {
            "object": "chat.completion",
            "model": self.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                         "finish_reason": finish}],
            # like vLLM and SGLang, the end-of-turn token that stopped the answer counts as generated
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n + (finish == "stop"),
                      "total_tokens": n_prompt + n + (finish == "stop")},
        }


class Handler(BaseHTTPRequestHandler):
    server: Server

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
        self._send(code, {"error": {"message": message, "code": code}})

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
        try:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except ValueError as e:
            return self._error(400, f"invalid JSON: {e}")
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
                    "(greedy by default).")
    ap.add_argument("--target", required=True, help="HF model directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--name", default=None, help="model name clients send (default: --target)")
    ap.add_argument("--fail-every", type=int, default=0, help="answer every N-th request with 503 (tests)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)  # a managed server is stopped with SIGTERM
    srv = None
    try:
        srv = Server(args.target, args.host, args.port, args.dtype, args.name, args.fail_every)
        print(f"serving {srv.name} on http://{args.host}:{srv.server_address[1]}/v1", flush=True)
        srv.serve_forever()
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        if srv is not None:
            srv.server_close()


if __name__ == "__main__":
    main()
