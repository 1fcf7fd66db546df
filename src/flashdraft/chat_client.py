"""A client of an OpenAI-compatible chat-completions server (vLLM, SGLang, `python -m flashdraft.serve`):
one POST with retries, and the answer read out of its reply. The regeneration backends `openai` and
`server` use it; it knows nothing of prompts sets, parts or rows."""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.client import HTTPException


class GiveUp(Exception):
    """Retries exhausted on a transient failure (server down, overloaded, timing out)."""


@dataclass(frozen=True)
class Reply:
    """A chat completion's answer: its text, why it ended (stop | length) and the server's count of its
    tokens (None where the server gives none; servers count the end-of-turn token of a stopped answer)."""

    text: str
    finish: str
    completion_tokens: int | None


@dataclass(frozen=True)
class ChatClient:
    """POSTs to `base_url`/chat/completions: retried with exponential backoff and jitter on connection
    errors, timeouts, 429 and 5xx (up to `max_retries`, then GiveUp); any other HTTP error is the
    request's own fault and raises ValueError at once with the server's message. `server_gone`, for a
    server the job runs itself: after a connection error, the exception to raise at once (the server
    process has exited) instead of retrying a port nothing will answer on again, or None while it runs."""

    base_url: str
    headers: dict
    max_retries: int
    timeout_s: float
    backoff_s: float
    server_gone: Callable[[], Exception | None] | None = None

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def chat(self, body: dict) -> Reply:
        """One chat completion; ValueError names what is wrong with a reply that is not one."""
        resp = self.post(body)
        try:
            choice = resp["choices"][0]
            text, finish = choice["message"].get("content") or "", choice["finish_reason"]
        except (KeyError, IndexError, TypeError, AttributeError):
            raise ValueError(
                f"{self.url} answered {json.dumps(resp)[:100]}, not a chat completion (choices[0].message)"
            ) from None
        if finish not in ("stop", "length"):
            raise ValueError(f"finish_reason {finish!r}")
        return Reply(text, finish, (resp.get("usage") or {}).get("completion_tokens"))

    def post(self, body: dict) -> dict:
        data, url = json.dumps(body).encode(), self.url
        for attempt in range(self.max_retries + 1):
            wait = min(60.0, self.backoff_s * 2**attempt) * (0.5 + random.random())
            try:
                req = urllib.request.Request(url, data=data, headers=self.headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    answer = r.read()
                try:
                    return json.loads(answer)
                except ValueError:
                    raise ValueError(
                        f"{url} answered {answer[:100]!r}, not JSON: is regenerate.base_url an "
                        "OpenAI-compatible server?"
                    ) from None
            except urllib.error.HTTPError as e:
                reason = f"HTTP {e.code}: {server_message(e)}"
                if e.code != 429 and e.code < 500:
                    raise ValueError(reason) from None
                after = e.headers.get("Retry-After", "")
                wait = max(wait, min(60.0, float(after))) if after.isdigit() else wait
            except (urllib.error.URLError, OSError, HTTPException) as e:  # refused, reset, timed out
                reason = f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"
                gone = self.server_gone() if self.server_gone is not None else None
                if gone is not None:
                    raise gone from None
            if attempt < self.max_retries:
                time.sleep(wait)
        raise GiveUp(f"{url}: {reason} (after {self.max_retries} retries)")


def server_message(e: urllib.error.HTTPError) -> str:
    """An HTTP error's message as OpenAI-compatible servers put it ({"error": {"message": ...}}), else
    the start of its body."""
    body = e.read().decode(errors="replace")
    try:
        return json.loads(body)["error"]["message"]
    except Exception:
        return body[:500] or e.reason
