"""Prompt sources -> normalized, cleaned, deduplicated, mixed train/eval prompt sets.

Every source row ends up either in the pool (normalized messages with a stable id) or in rejects with a
reason; stats.json counts both per source, so a user sees where rows went.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .chat import prompt_messages
from .config import PromptsConfig, SourceConfig
from .io import write_json, write_parquet

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
        raise ValueError(f"source {src.name!r}: cannot tell the format of {src.path!r}; set `format`")
    return fmt


def load_source(src: SourceConfig):
    """Yield (row_index, record dict or ParseError) for every row of a local source file."""
    fmt = source_format(src)
    if fmt == "hf":
        raise NotImplementedError(
            f"source {src.name!r}: format 'hf' (Hugging Face datasets) is not supported yet; "
            f"export {src.path!r} to parquet or jsonl and point `path` at the file"
        )
    if not Path(src.path).is_file():
        raise FileNotFoundError(f"source {src.name!r}: no file at {src.path!r}")
    if fmt == "jsonl":
        with open(src.path, "rb") as f:
            for i, line in enumerate(f):
                try:
                    text = line.decode("utf-8")
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
        with open(src.path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
            data = next(iter(data.values()))  # {"data": [...]} wrappers
        if not isinstance(data, list):
            raise ValueError(f"source {src.name!r}: {src.path} must hold a JSON list of records")
        yield from enumerate(data)
    elif fmt in ("parquet", "arrow"):
        i = 0
        for batch in _record_batches(src.path, fmt):
            for rec in batch.to_pylist():
                yield i, rec
                i += 1
    else:
        raise ValueError(f"source {src.name!r}: unknown format {fmt!r}")


def _record_batches(path: str, fmt: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if fmt == "parquet":
        yield from pq.ParquetFile(path).iter_batches(batch_size=4096)
        return
    with pa.memory_map(path) as f:  # Arrow IPC file, else stream (what `datasets` writes)
        try:
            reader = pa.ipc.open_file(f)
            yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            f.seek(0)
            yield from pa.ipc.open_stream(f)


def _text(value) -> str:
    """NFC, trailing whitespace of every line dropped, outer whitespace stripped."""
    if not isinstance(value, str):
        raise Rejected("non-string content")
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


def sample_id(messages: list[dict]) -> str:
    blob = json.dumps(messages, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def prompt_text(messages: list[dict]) -> str:
    """The text the target is prompted with: every turn before the first assistant answer."""
    return "\n\n".join(m["content"] for m in prompt_messages(messages))


def _quotas(sizes: dict[str, int], weights: dict[str, float], n: int) -> dict[str, int]:
    """Split n rows over sources by weight; a source with too few rows gives its share to the others."""
    quota = dict.fromkeys(sizes, 0)
    active = [s for s in sizes if weights[s] > 0 and sizes[s] > 0]
    left = n
    while left > 0 and active:
        wsum = sum(weights[s] for s in active)
        share = {s: left * weights[s] / wsum for s in active}
        full = [s for s in active if sizes[s] - quota[s] <= share[s]]
        if full:
            for s in full:
                left -= sizes[s] - quota[s]
                quota[s] = sizes[s]
            active = [s for s in active if s not in full]
            continue
        base = {s: int(share[s]) for s in active}
        by_remainder = sorted(active, key=lambda s: (base[s] - share[s], s))  # largest remainder first
        for s in by_remainder[: left - sum(base.values())]:
            base[s] += 1
        for s in active:
            quota[s] += base[s]
        left = 0
    return quota


def _table(rows: list[dict]):
    import pyarrow as pa

    schema = pa.schema(
        [
            ("id", pa.string()),
            ("source", pa.string()),
            ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("prompt", pa.string()),
            ("prompt_chars", pa.int32()),
            ("num_turns", pa.int32()),
        ]
    )
    return pa.Table.from_pylist(rows, schema=schema)


def expand(cfg: PromptsConfig, out_dir: str) -> dict:
    """Read, clean, dedup and mix every source; write train/eval/rejects parquet and stats.json."""
    import pyarrow as pa

    if not cfg.sources:
        raise ValueError("prompts.sources is empty: list at least one prompt source")
    names = [s.name for s in cfg.sources]
    if len(set(names)) != len(names):
        raise ValueError(f"prompts.sources: duplicate source names {names}")
    pool: dict[str, list[dict]] = {}
    seen: set[str] = set()
    rejects, stats = [], {}
    for src in cfg.sources:
        st = stats[src.name] = {"read": 0, "kept": 0, "rejected": Counter(), "duplicates": 0}
        rows = pool[src.name] = []
        for i, rec in load_source(src):
            st["read"] += 1
            try:
                if isinstance(rec, ParseError):
                    raise Rejected(rec.reason)
                messages = to_messages(rec, src.shape, src.fields)
                prompt = prompt_text(messages)
                if len(prompt) < cfg.min_chars:
                    raise Rejected("too short")
                if len(prompt) > cfg.max_chars:
                    raise Rejected("too long")
            except Rejected as e:
                st["rejected"][str(e)] += 1
                raw = (
                    rec.raw
                    if isinstance(rec, ParseError)
                    else json.dumps(rec, ensure_ascii=False, default=str)
                )
                rejects.append({"source": src.name, "row": i, "reason": str(e), "raw": raw[:200]})
                continue
            sid = sample_id(messages)
            if sid in seen:
                st["duplicates"] += 1
                continue
            seen.add(sid)
            st["kept"] += 1
            rows.append(
                {
                    "id": sid,
                    "source": src.name,
                    "messages": messages,
                    "prompt": prompt,
                    "prompt_chars": len(prompt),
                    "num_turns": len(messages),
                }
            )

    # mix: per-source quotas by weight, a seeded sample inside each source, then one seeded shuffle
    want = cfg.total + cfg.eval_count
    weights = {s.name: s.weight for s in cfg.sources}
    quota = _quotas({k: len(v) for k, v in pool.items()}, weights, want)
    picked = []
    for name, rows in pool.items():
        picked += random.Random(f"{cfg.seed}:{name}").sample(rows, quota[name])
    if not picked:
        raise ValueError(f"no usable prompt in any source; see {out_dir}/rejects.parquet")
    random.Random(cfg.seed).shuffle(picked)
    n_eval = min(cfg.eval_count, len(picked) // 2)  # a small pool still leaves half for training
    eval_rows, train_rows = picked[:n_eval], picked[n_eval:]

    for name, st in stats.items():
        st["rejected"] = dict(sorted(st["rejected"].items()))
        st["sampled_train"] = sum(r["source"] == name for r in train_rows)
        st["sampled_eval"] = sum(r["source"] == name for r in eval_rows)
    totals = {
        k: sum(st[k] for st in stats.values())
        for k in ("read", "kept", "duplicates", "sampled_train", "sampled_eval")
    }
    totals["rejected"] = sum(sum(st["rejected"].values()) for st in stats.values())
    summary = {
        "sources": stats,
        "totals": totals,
        "requested_train": cfg.total,
        "requested_eval": cfg.eval_count,
        "pool": sum(len(v) for v in pool.values()),
    }
    if len(picked) < want:
        summary["note"] = (
            f"pool of {len(picked)} unique prompts is smaller than total + eval_count = {want}; "
            "took all of them"
        )

    out = Path(out_dir)
    write_parquet(_table(train_rows), out / "train.parquet")
    write_parquet(_table(eval_rows), out / "eval.parquet")
    reject_schema = pa.schema(
        [("source", pa.string()), ("row", pa.int64()), ("reason", pa.string()), ("raw", pa.string())]
    )
    write_parquet(pa.Table.from_pylist(rejects, schema=reject_schema), out / "rejects.parquet")
    write_json(out / "stats.json", summary)
    return summary
