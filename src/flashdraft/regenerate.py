"""Regenerate assistant answers with the target itself, resumable by sample id.

The drafter must learn the target's own distribution, not the dataset's answers. Three backends: `hf`
(in-process decoding: the static-cache engine of decode.py, or HF generate), `openai` (concurrent
requests to any OpenAI-compatible server) and `server` (the same requests to a server this job starts
and stops itself, see managed_server.py). All commit results as atomic parquet parts in a work dir; a
restart reads the ids already there and skips them, so a killed run loses at most the part in progress.
A failed row is committed with its cause: `answer` (the server's error or a malformed answer) is retried
by every rerun, `prompt` (the row itself: a chat template that cannot render it, a prompt that with
max_new_tokens is longer than the target's positions, a generate that fails on it alone) only with
`regenerate.retry_failed: true`. The final file is the parts in prompt order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .chat import prompt_messages, render
from .chat_client import ChatClient, GiveUp
from .config import RegenerateConfig, TargetConfig, stage_params, to_json
from .errors import UserError, rerun_command
from .hf_config import past_positions, read_target_config
from .io import log, progress, write_json, write_parquet
from .managed_server import ManagedServer, ServerError
from .shards import shard_of
from .sources import MESSAGES
from .target import generate, load_for_generate

FLUSH_S = 30.0  # openai backend: commit a part at least this often, so a crash loses little
# settings of how to reach the server, not of what it answers: changing them keeps committed parts
TRANSPORT_KEYS = (
    "base_url",
    "api_key_env",
    "concurrency",
    "max_retries",
    "timeout_s",
    "backoff_s",
    "server_cmd",
    "server_gpus",
    "server_port",
    "server_timeout_s",
)
# settings of how the answers are computed and committed, not of what they are: they keep committed parts
ENGINE_KEYS = ("engine", "batch_size", "shards", "part_rows", "retry_failed")


@dataclasses.dataclass(frozen=True)
class Regenerated:
    """One regenerated row as the parts and the final file hold it (parts_schema's columns): the prompt and
    the target's answer, or (`failed`) the prompt and why it failed."""

    id: str
    source: str
    messages: list[dict]  # the prompt, then the answer as one assistant message (none when failed)
    response_tokens: int
    finish_reason: str  # stop | length | error
    error: str | None = None
    cause: str | None = None  # a failed row's: answer (retried by every rerun) | prompt (see the docstring)

    @classmethod
    def answered(cls, row: dict, prompt: list[dict], answer: str, n_tokens: int, finish: str) -> Regenerated:
        return cls(
            row["id"],
            row["source"],
            prompt + [{"role": "assistant", "content": answer.strip()}],
            n_tokens,
            finish,
        )

    @classmethod
    def failed(cls, row: dict, reason: str, cause: str) -> Regenerated:
        return cls(row["id"], row["source"], prompt_messages(row["messages"]), 0, "error", reason, cause)

    def row(self) -> dict:
        return dataclasses.asdict(self)


def parts_schema(error: bool):
    fields = [
        ("id", pa.string()),
        ("source", pa.string()),
        ("messages", MESSAGES),
        ("response_tokens", pa.int32()),
        ("finish_reason", pa.string()),
    ]
    return pa.schema(fields + ([("error", pa.string()), ("cause", pa.string())] if error else []))


def generate_batch(
    model, tokenizer, rows: list[dict], cfg: RegenerateConfig, eos: list[int]
) -> list[Regenerated]:
    """Answer a batch of prompt rows."""
    prompts = [prompt_messages(r["messages"]) for r in rows]
    out = generate(
        model,
        tokenizer,
        prompts,
        cfg.max_new_tokens,
        cfg.temperature,
        cfg.thinking,
        eos,
        cfg.top_p,
        cfg.top_k,
    )
    return [
        Regenerated.answered(row, prompt, answer, n, finish)
        for row, prompt, (answer, _, n, finish) in zip(rows, prompts, out, strict=True)
    ]


def _safe_batch(model, tokenizer, rows, cfg, eos) -> list[Regenerated]:
    """A failing batch is retried row by row; a row that still fails becomes an error row."""
    try:
        return generate_batch(model, tokenizer, rows, cfg, eos)
    except Exception:
        pass
    out = []
    for row in rows:
        try:
            out += generate_batch(model, tokenizer, [row], cfg, eos)
        except Exception as e:  # recorded, and the run fails later if there are too many
            out.append(Regenerated.failed(row, f"{type(e).__name__}: {e}", "prompt"))
    return out


@dataclasses.dataclass
class Answered:
    """What a backend reports once it has answered the pending rows (the answers themselves go into the
    parts as they come): the rows it gave up on (not committed: a rerun asks again), when decoding began
    (after loading), the sequences decoded at once, and the one-off setup before that clock."""

    gave_up: list[Regenerated]
    start: float
    batch: int | None = None
    setup_s: float = 0.0


@dataclasses.dataclass
class Pending:
    """The rows a backend answers, and what it reports into: `parts` (committed answers), `bar`, the
    errors so far and the most the stage tolerates."""

    rows: list[dict]
    order: dict[str, int]  # a row's place in the prompt set
    parts: _Parts
    bar: object
    errors: int
    max_errors: float


def _past_positions(model, n: int, cfg: RegenerateConfig) -> str | None:
    """Why a prompt of `n` tokens cannot be answered within the target's positions (None: it can). Past
    max_position_embeddings a model gives garbage, not an error, and the static engine would size every
    slot to the longest prompt."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if not past_positions(n, cfg.max_new_tokens, limit):
        return None
    return (
        f"longer than the target's positions: the prompt is {n} tokens, with regenerate.max_new_tokens "
        f"({cfg.max_new_tokens}) {n + cfg.max_new_tokens}, over its max_position_embeddings ({limit})"
    )


def _run_hf(cfg, target, dtype, todo: Pending) -> Answered:
    model, tokenizer, eos = load_for_generate(target, dtype)
    from .step import unsupported

    why = "regenerate.engine: hf" if cfg.engine == "generate" else unsupported(model)
    if why is None:
        return _run_static(cfg, model, tokenizer, eos, todo)
    if cfg.engine == "static":
        raise UserError(f"regenerate.engine 'static' cannot run {target}: {why}; use 'auto' or 'hf'")
    log(f"regenerate: HF generate, in fixed batches ({why})")
    pending, parts, batch = todo.rows, todo.parts, cfg.batch_size or 16
    # batches are fixed over the whole sorted prompt list (longest first, so memory errors show early),
    # and parts hold whole batches: a resumed run forms exactly the batches an uninterrupted one does
    texts = [render(tokenizer, prompt_messages(r["messages"]), True, cfg.thinking) for r in pending]
    lengths = {
        r["id"]: len(ids)
        for r, ids in zip(pending, tokenizer(texts, add_special_tokens=False)["input_ids"], strict=True)
    }
    too_long = [r for r in pending if _past_positions(model, lengths[r["id"]], cfg)]
    if too_long:  # recorded and counted, like any prompt that cannot be answered; in a part of their own,
        # so the batches' parts stay as an uninterrupted run forms them
        parts.add(
            [Regenerated.failed(r, _past_positions(model, lengths[r["id"]], cfg), "prompt") for r in too_long]
        )
        parts.flush()
        todo.bar.update(len(too_long))
        dropped = {r["id"] for r in too_long}
        pending = [r for r in pending if r["id"] not in dropped]
    pending.sort(key=lambda r: (-lengths[r["id"]], todo.order[r["id"]]))
    parts.rows_per_part = max(1, cfg.part_rows // batch) * batch
    answered = Answered([], time.monotonic(), batch)
    for i in range(0, len(pending), batch):
        parts.add(_safe_batch(model, tokenizer, pending[i : i + batch], cfg, eos))
        todo.bar.update(len(pending[i : i + batch]))
    return answered


def _run_static(cfg, model, tokenizer, eos, todo: Pending) -> Answered:
    """The static-cache engine (flashdraft.decode): rows are committed as they finish, in parts of
    `part_rows` (or every FLUSH_S seconds), so a crash loses at most a part's worth of answers."""
    import torch

    from .decode import SlotDecoder, auto_slots

    pending, parts, bar = todo.rows, todo.parts, todo.bar
    rows, prompts, ids = [], [], []
    for r in pending:
        try:
            prompt = prompt_messages(r["messages"])
            text = render(tokenizer, prompt, add_generation_prompt=True, thinking=cfg.thinking)
            row_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        except Exception as e:  # a row the chat template cannot render: recorded, the others go on
            parts.add([Regenerated.failed(r, f"{type(e).__name__}: {e}", "prompt")])
            bar.update(1)
            continue
        why = _past_positions(model, len(row_ids), cfg)
        if why is not None:  # recorded too: it must not size every slot
            parts.add([Regenerated.failed(r, why, "prompt")])
            bar.update(1)
            continue
        rows.append(r)
        prompts.append(prompt)
        ids.append(row_ids)
    if not rows:
        return Answered([], time.monotonic())
    max_len = max(map(len, ids)) + cfg.max_new_tokens
    slots = cfg.batch_size or (auto_slots(model, max_len) if model.device.type == "cuda" else 32)
    slots = min(slots, len(rows))
    decoder = SlotDecoder(
        model, slots, max_len, eos, tokenizer.pad_token_id, cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k
    )
    log(
        f"regenerate: static-cache engine, {slots} slots of {decoder.max_len} positions, "
        f"CUDA graphs {'on' if decoder.graphs.on else 'off'}, "
        f"compiled step {'on' if decoder.compiled else 'off'}"
    )
    parts.flush_s = FLUSH_S
    t = time.monotonic()
    decoder.prepare()  # a one-off per job, reported apart from the decode rate
    answered = Answered([], time.monotonic(), slots, time.monotonic() - t)
    for i, tokens, finish in decoder.run(ids, cfg.max_new_tokens):
        answer = tokenizer.decode(tokens, skip_special_tokens=True)
        parts.add([Regenerated.answered(rows[i], prompts[i], answer, len(tokens), finish)])
        bar.update(1)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return answered


def _ask(row, client: ChatClient, cfg, model, count) -> tuple[Regenerated, bool]:
    """One prompt -> (its row, whether to commit it). Give-ups are not committed: a rerun retries them."""
    prompt = prompt_messages(row["messages"])
    body = {
        "model": model,
        "messages": prompt,
        "max_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "chat_template_kwargs": {"enable_thinking": cfg.thinking},
        **sampling_fields(cfg),
    }
    try:
        reply = client.chat(body)
        n = reply.completion_tokens
        # servers count the end-of-turn token of a stopped answer; the hf backend does not
        n = count(reply.text.strip()) if n is None else n - (reply.finish == "stop")
        return Regenerated.answered(row, prompt, reply.text, n, reply.finish), True
    except GiveUp as e:
        return Regenerated.failed(row, str(e), "answer"), False
    except ServerError:  # the job's own server exited: nothing more can be answered
        raise
    except Exception as e:  # a bad request or answer: committed, and retried by a rerun
        return Regenerated.failed(row, f"{type(e).__name__}: {e}", "answer"), True


def sampling_fields(cfg: RegenerateConfig) -> dict:
    """A request's top_p and top_k, only where set (off, they are not sent: a server's own defaults apply,
    and a server that knows no top_k is not sent one)."""
    return {**({"top_p": cfg.top_p} if cfg.top_p < 1 else {}), **({"top_k": cfg.top_k} if cfg.top_k else {})}


def _run_openai(cfg, target, dtype, todo: Pending, server_gone=None) -> Answered:
    """Answer the pending rows by concurrent requests to an OpenAI-compatible server at
    regenerate.base_url. Stops early once the errors exceed the most the stage tolerates: it fails
    anyway, so spare the server. `server_gone`: see ChatClient; its error stops the run at once."""
    from transformers import AutoTokenizer

    if not cfg.base_url:
        raise UserError(
            "regenerate.backend 'openai' needs regenerate.base_url, e.g. http://127.0.0.1:8000/v1"
        )
    tokenizer, lock = AutoTokenizer.from_pretrained(target), threading.Lock()

    def count(text):  # fast tokenizers are not thread-safe
        with lock:
            return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    headers = {"Content-Type": "application/json"}
    if os.environ.get(cfg.api_key_env or ""):
        headers["Authorization"] = f"Bearer {os.environ[cfg.api_key_env]}"
    client = ChatClient(cfg.base_url, headers, cfg.max_retries, cfg.timeout_s, cfg.backoff_s, server_gone)
    parts, bar, errors, max_errors = todo.parts, todo.bar, todo.errors, todo.max_errors
    parts.flush_s, gave_up, start = FLUSH_S, [], time.monotonic()
    # at most `concurrency` requests in flight, the next sent only once one returns: when the
    # errors pass the limit, nothing more goes out than what is already in flight
    queue, running = iter(todo.rows), set()
    ex = ThreadPoolExecutor(cfg.concurrency)

    def send(n):
        for r in itertools.islice(queue, n):
            running.add(ex.submit(_ask, r, client, cfg, cfg.model or target, count))

    try:
        send(cfg.concurrency)
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            running -= done
            for f in done:
                row, commit = f.result()
                if commit:
                    parts.add([row])
                else:
                    gave_up.append(row)
                bar.update(1)
                errors += row.error is not None
            if errors > max_errors:
                log(f"regenerate: {errors} failed rows, more than the stage tolerates; stopping")
                break
            send(len(done))
    finally:
        ex.shutdown(cancel_futures=True)  # in-flight requests run out
    return Answered(gave_up, start)


def _run_server(cfg, target, dtype, todo: Pending) -> Answered:
    """regenerate.backend server: our own OpenAI-compatible server, started for the job and stopped on
    the way out whatever happens."""
    with _managed_server(cfg, target, Path(todo.parts.work)) as srv:
        return _run_openai(dataclasses.replace(cfg, base_url=srv.base_url), target, dtype, todo, srv.exited)


# regenerate.backend -> the function that answers the pending rows
BACKENDS = {"hf": _run_hf, "openai": _run_openai, "server": _run_server}


def _managed_server(cfg: RegenerateConfig, target: str, work: Path):
    return ManagedServer(
        cfg.server_cmd, target, cfg.server_gpus, cfg.server_port, cfg.server_timeout_s, work / "server.log"
    )


def _part_number(path: Path) -> int:
    return int(path.stem.split("-")[1])


class _Parts:
    """The committed parts of a work dir: rows are buffered and written as one atomic part file."""

    def __init__(self, work: Path, rows_per_part: int):
        self.work, self.rows_per_part, self.flush_s = work, rows_per_part, None
        self.next = 1 + max(map(_part_number, work.glob("part-*.parquet")), default=-1)
        self.buf, self.rows, self.t = [], [], time.monotonic()

    def add(self, rows: list[Regenerated]):
        self.buf += [r.row() for r in rows]
        late = self.flush_s is not None and time.monotonic() - self.t > self.flush_s
        if len(self.buf) >= self.rows_per_part or (late and self.buf):
            self.flush()

    def flush(self):
        if self.buf:
            table = pa.Table.from_pylist(self.buf, schema=parts_schema(error=True))
            write_parquet(table, self.work / f"part-{self.next:05d}.parquet")
            self.rows, self.next, self.buf = self.rows + self.buf, self.next + 1, []
        self.t = time.monotonic()


def _read_parts(work: Path, wanted: set[str]) -> list[dict]:
    """The committed rows of `wanted` ids; a row retried later is in a later part, which wins."""
    rows = {}
    for part in sorted(work.glob("part-*.parquet"), key=_part_number):  # atomic writes: each is complete
        for r in pq.read_table(part).to_pylist():
            if r["id"] in wanted:
                rows[r["id"]] = r
    return list(rows.values())


def _retried(row: dict, retry_failed: bool) -> bool:
    """Whether a committed row is answered again: a failed one whose cause may have gone (the server's
    answer; parts from before causes were recorded have none), or any failed one with retry_failed."""
    return row["error"] is not None and (retry_failed or row.get("cause") != "prompt")


def work_key(target_path, dtype: str, cfg: dict, prompt_ids: list[str]) -> dict:
    """What a work dir's parts were answered with: the target by content (its config and a fingerprint of
    each weight file: name, size, first and last MiB), not by path, and the prompts by their ids, so a
    moved checkout or target, or another path to them, keeps the parts answered so far."""
    h = hashlib.sha256(json.dumps(read_target_config(target_path), sort_keys=True).encode())
    for f in sorted(Path(target_path).glob("*.safetensors")) + sorted(Path(target_path).glob("*.bin")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    ids = hashlib.sha256("\n".join(sorted(prompt_ids)).encode()).hexdigest()
    return {"target": h.hexdigest(), "dtype": dtype, "cfg": cfg, "prompt_ids": ids}


def _prepare_work_dir(work: Path, key: dict, before: dict | None = None) -> None:
    """Parts made with another target or config are stale: clear them instead of mixing answers. A work
    dir keyed the way earlier versions keyed it (`before`) is taken over under the new key."""
    meta = work / "meta.json"
    if meta.exists() and (held := json.loads(meta.read_text())) != key:
        if held != before:
            log(f"regenerate: {work} holds parts of another target/config; starting over")
            shutil.rmtree(work)
        else:
            write_json(meta, key)
    work.mkdir(parents=True, exist_ok=True)
    if not meta.exists():
        write_json(meta, key)


def _finish(
    rows: list[dict],
    errors: list[dict],
    out: str,
    max_fraction: float,
    total: int | None = None,
    err_path=None,
    work: Path | None = None,
) -> dict:
    err_path = err_path or Path(out).parent / "errors.parquet"
    err_schema = pa.schema([("id", pa.string()), ("source", pa.string()), ("reason", pa.string())])
    write_parquet(pa.Table.from_pylist(errors, schema=err_schema), err_path)
    total = total or len(rows) + len(errors)
    if errors and len(errors) > max_fraction * total:
        again = (
            ""
            if work is None
            else (
                f"; the answers so far are kept in {work}/: fix the cause and rerun "
                f"({rerun_command()}), which "
                "retries the rows the server failed (regenerate.retry_failed: true retries every failed row)"
            )
        )
        raise UserError(
            f"{len(errors)} of {total} rows failed (> {max_fraction:.0%}, regenerate.max_error_fraction); "
            f"reasons in {err_path}, first: {errors[0]['reason']}{again}"
        )
    write_parquet(pa.Table.from_pylist(rows, schema=parts_schema(error=False)), out)
    stop = sum(r["finish_reason"] == "stop" for r in rows)
    return {"rows": len(rows), "errors": len(errors), "stop": stop, "length": len(rows) - stop}


def copy_original(
    prompt_rows: list[dict], tokenizer, out: str, max_error_fraction: float, err_path=None
) -> dict:
    """Regeneration disabled: keep each conversation's own answers (rows without one become errors)."""
    rows, errors = [], []
    for r in prompt_rows:
        answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        if not answers:
            errors.append(
                {
                    "id": r["id"],
                    "source": r["source"],
                    "reason": "no assistant answer and regeneration disabled",
                }
            )
            continue
        n = len(tokenizer(answers[0], add_special_tokens=False)["input_ids"])
        rows.append(Regenerated(r["id"], r["source"], r["messages"], n, "stop").row())
    return _finish(rows, errors, out, max_error_fraction, err_path=err_path)


def regenerate(
    cfg: RegenerateConfig,
    target: TargetConfig,
    prompts_path: str,
    out: str,
    work_dir: str,
    shard: int = 0,
    num_shards: int = 1,
    errors_path=None,
) -> dict:
    """Answer the prompts of `prompts_path` in shard `shard` of `num_shards` (`shards.shard_of`, the
    assignment the hidden-state shards use) with the target (`target.path`, run in `target.dtype`); write
    `out` and the failed rows to `errors_path` (default: errors.parquet beside `out`)."""
    path, dtype = target.path, target.dtype  # what the backends load the model from
    prompt_rows = pq.read_table(prompts_path, columns=["id", "source", "messages"]).to_pylist()
    order = {r["id"]: i for i, r in enumerate(prompt_rows)}
    if len(order) != len(prompt_rows):
        raise ValueError(f"{prompts_path}: sample ids are not unique")
    if num_shards > 1:
        prompt_rows = [r for r in prompt_rows if shard_of(r["id"], num_shards) == shard]
    read_target_config(path)  # every backend loads its tokenizer: refuse remote code first
    if not cfg.enabled:
        from transformers import AutoTokenizer

        return copy_original(
            prompt_rows, AutoTokenizer.from_pretrained(path), out, cfg.max_error_fraction, errors_path
        )
    if cfg.backend not in BACKENDS:
        raise ValueError(
            f"regenerate.backend {cfg.backend!r} is not supported; use one of "
            f"{', '.join(map(repr, BACKENDS))}"
        )

    work = Path(work_dir)
    # keys added later are left out at their unset value, as in the stage's params: parts stay ours
    key = {
        k: v
        for k, v in stage_params("regenerate", json.loads(to_json(cfg))).items()
        if k not in TRANSPORT_KEYS + ENGINE_KEYS
    }
    # before keys held the resolved paths of the target and the prompts: a work dir of that kind is
    # still ours when those paths match
    before = {
        "target": str(Path(path).resolve()),
        "dtype": dtype,
        "cfg": key,
        "prompts": str(Path(prompts_path).resolve()),
    }
    _prepare_work_dir(work, work_key(path, dtype, key, [r["id"] for r in prompt_rows]), before)
    done = [r for r in _read_parts(work, set(order)) if not _retried(r, cfg.retry_failed)]
    done_ids = {r["id"] for r in done}
    pending = [r for r in prompt_rows if r["id"] not in done_ids]
    gave_up, generated = [], {}
    if pending:
        parts = _Parts(work, cfg.part_rows)
        desc = f"regenerate {shard}/{num_shards}" if num_shards > 1 else "regenerate"
        bar = progress(total=len(prompt_rows), initial=len(done), desc=desc, unit="prompt")
        todo = Pending(
            pending,
            order,
            parts,
            bar,
            sum(r["error"] is not None for r in done),
            cfg.max_error_fraction * len(prompt_rows),
        )
        try:
            answered = BACKENDS[cfg.backend](cfg, path, dtype, todo)
        finally:
            parts.flush()  # what finished is kept, even when the run fails
            bar.close()
        done += parts.rows
        gave_up = answered.gave_up
        generated = {
            "new_tokens": sum(r["response_tokens"] for r in parts.rows),
            "generate_s": time.monotonic() - answered.start,
            "batch": answered.batch,  # sequences decoded at once (hf backend)
            "setup_s": answered.setup_s,  # static engine's compile and capture, before the clock
        }

    done += [r.row() for r in gave_up]
    done.sort(key=lambda r: order[r["id"]])
    rows = [{k: v for k, v in r.items() if k not in ("error", "cause")} for r in done if r["error"] is None]
    errors = [
        {"id": r["id"], "source": r["source"], "reason": r["error"]} for r in done if r["error"] is not None
    ]
    return _finish(rows, errors, out, cfg.max_error_fraction, len(prompt_rows), errors_path, work) | generated
