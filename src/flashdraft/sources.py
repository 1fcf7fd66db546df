"""Prompt sources -> messages: every file type (jsonl, json, parquet, Arrow, a Hugging Face dataset) and
record shape (ShareGPT, OpenAI messages, Alpaca, prompt/response) read into normalized
[{role, content}, ...] turns, or a reason why a row cannot be; and MESSAGES, the Arrow type those turns
are stored as in every stage's files.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .chat import prompt_messages
from .config import SourceConfig
from .errors import UserError

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))  # the stored turns
EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
}
SHAPE_KEYS = [
    ("conversations", "sharegpt"),
    ("messages", "messages"),
    ("instruction", "alpaca"),
    ("prompt", "prompt"),
]


@dataclass
class ParseError:
    """A source row that could not even be read as a record (bad UTF-8, unparseable JSON)."""

    reason: str
    raw: str


class Rejected(Exception):
    """A record that was read but cannot become a prompt; the message is the recorded reason."""


def source_format(src: SourceConfig) -> str:
    if src.format != "auto":
        return src.format
    fmt = EXTENSIONS.get(Path(src.path).suffix.lower())
    if fmt is None:
        raise UserError(f"source {src.name!r}: cannot tell the format of {src.path!r}; set `format`")
    return fmt


def load_source(src: SourceConfig):
    """Yield (row_index, record dict or ParseError) for every row of a local source file."""
    fmt = source_format(src)
    if fmt == "hf":  # a hub id (cached or online) or a local folder of data files, streamed row by row
        import datasets

        try:
            yield from enumerate(datasets.load_dataset(src.path, split=src.split, streaming=True))
        except Exception as e:  # no such dataset, split or data files, offline, a file it cannot parse
            raise UserError(
                f"source {src.name!r}: cannot read the HF dataset {src.path!r} (split {src.split!r}): "
                f"{type(e).__name__}: {e}; fix prompts.sources[{src.name}].path or split (a hub id, or a "
                "folder of data files), or its network access"
            ) from e
        return
    if not Path(src.path).is_file():
        raise UserError(f"source {src.name!r}: no file at {src.path!r}; fix prompts.sources[{src.name}].path")
    if fmt == "jsonl":
        with open(src.path, "rb") as f:
            for i, line in enumerate(f):
                try:
                    text = line.decode("utf-8-sig" if i == 0 else "utf-8")  # a BOM may open the file
                except UnicodeDecodeError:
                    yield i, ParseError("bad utf-8", line[:200].decode("utf-8", "replace"))
                    continue
                if not text.strip():
                    continue
                try:
                    yield i, json.loads(text)
                except json.JSONDecodeError:
                    yield i, ParseError("unparseable json", text)
    elif fmt == "json":
        data = _read_json(src)
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
            data = next(iter(data.values()))  # {"data": [...]} wrappers
        if not isinstance(data, list):
            raise UserError(f"source {src.name!r}: {src.path} must hold a JSON list of records")
        yield from enumerate(data)
    elif fmt in ("parquet", "arrow"):
        i = 0
        for batch in _record_batches(src.path, fmt, src.name):
            for rec in batch.to_pylist():
                yield i, rec
                i += 1
    else:
        raise UserError(f"source {src.name!r}: unknown format {fmt!r}")


def _read_json(src: SourceConfig):
    """A whole .json source; a file that is not UTF-8 JSON is the user's to fix, so say where and how."""
    with open(src.path, "rb") as f:
        raw = f.read()
    if not raw.strip():
        raise UserError(f"source {src.name!r}: {src.path} is empty; fill it with a JSON list of records")
    try:
        return json.loads(raw.decode("utf-8-sig"))  # a BOM may open the file
    except UnicodeDecodeError as e:
        raise UserError(
            f"source {src.name!r}: {src.path} is not UTF-8 (byte {e.start}); re-save it as UTF-8"
        ) from e
    except json.JSONDecodeError as e:
        raise UserError(
            f"source {src.name!r}: {src.path} is not valid JSON ({e}; truncated?); repair or re-download it"
        ) from e


def _record_batches(path: str, fmt: str, name: str):
    if fmt == "parquet":
        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise UserError(
                f"source {name!r}: {path} is not a readable parquet file ({e}); repair it or set its `format`"
            ) from e
        yield from pf.iter_batches(batch_size=4096)
        return
    with pa.memory_map(path) as f:  # Arrow IPC file, else stream (what `datasets` writes)
        try:
            reader = pa.ipc.open_file(f)
            yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            f.seek(0)
            try:
                stream = pa.ipc.open_stream(f)
            except pa.ArrowInvalid as e:
                raise UserError(
                    f"source {name!r}: {path} is not an Arrow IPC file or stream ({e}); repair it or set its "
                    "`format`"
                ) from e
            yield from stream


# A lone UTF-16 surrogate: valid in JSON ("\ud800"), in scraped dumps too, but no UTF-8 can hold it.
SURROGATE = re.compile("[\ud800-\udfff]")


def _text(value) -> str:
    """NFC, trailing whitespace of every line dropped, outer whitespace stripped."""
    if not isinstance(value, str):
        raise Rejected("non-string content")
    if SURROGATE.search(value):
        raise Rejected("bad unicode")
    text = unicodedata.normalize("NFC", value)
    text = re.sub(r"[ \t\r\f\v]+(?=\n)", "", text).replace("\r\n", "\n").strip()
    if not text:
        raise Rejected("empty content")
    return text


def _turn(turn) -> dict:
    if not isinstance(turn, dict):
        raise Rejected("malformed turn")
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if not isinstance(role, str) or role.strip().lower() not in ROLES:
        raise Rejected("unknown role")
    return {"role": ROLES[role.strip().lower()], "content": _text(content)}


def _optional(value) -> str | None:
    """An optional answer/input field: absent, None or "" mean none."""
    if value is None or value == "":
        return None
    return _text(value)


def to_messages(record, shape: str = "auto", fields: dict[str, str] | None = None) -> list[dict]:
    """One source record -> normalized [{role, content}, ...]; raises Rejected with the reason."""
    if not isinstance(record, dict):
        raise Rejected("not a record")
    if fields:  # {source field: canonical field}
        record = {fields.get(k, k): v for k, v in record.items()}
    if shape == "auto":
        shape = next((s for k, s in SHAPE_KEYS if k in record), "unknown")
    if shape in ("sharegpt", "messages"):
        turns = record.get("conversations" if shape == "sharegpt" else "messages")
        if not isinstance(turns, list) or not turns:
            raise Rejected("no turns")
        messages = [_turn(t) for t in turns]
    elif shape == "alpaca":
        user = _text(record.get("instruction"))
        extra = _optional(record.get("input"))
        messages = [{"role": "user", "content": f"{user}\n\n{extra}" if extra else user}]
        if (answer := _optional(record.get("output"))) is not None:
            messages.append({"role": "assistant", "content": answer})
    elif shape == "prompt":
        messages = [{"role": "user", "content": _text(record.get("prompt"))}]
        if (answer := _optional(record.get("response"))) is not None:
            messages.append({"role": "assistant", "content": answer})
    else:
        raise Rejected("unknown shape")
    if not any(m["role"] == "user" for m in prompt_messages(messages)):
        raise Rejected("no user turn")
    return messages


def first_rows_problem(src: SourceConfig, rows: int = 20) -> str | None:
    """Before any job: a local source's first `rows` rows read as the prompts stage reads them. A line
    naming the source when it cannot be read, or when none of them gives a conversation (its `shape` or
    `fields` do not fit the file), so that the prompts job is not started (and its earlier outputs not
    deleted) for a mistake seen in a few rows; None when one row gives a conversation or the file is
    empty (the stage says so)."""
    key = f"config key prompts.sources[{src.name}]"
    reasons = Counter()
    try:
        for n, (_, rec) in enumerate(load_source(src)):
            if n == rows:
                break
            try:
                if isinstance(rec, ParseError):
                    raise Rejected(rec.reason)
                to_messages(rec, src.shape, src.fields)
                return None
            except Rejected as e:
                reasons[str(e)] += 1
    except UserError as e:
        return f"{key}: {e}"
    if not reasons:
        return None
    ((most, _),) = reasons.most_common(1)
    return (
        f"{key}: none of the first {reasons.total()} rows of {src.path} gives a prompt (most "
        f"often: {most}); set its shape (sharegpt, messages, alpaca, prompt) or map its fields "
        "(docs/data.md)"
    )
