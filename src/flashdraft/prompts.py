"""Prompt expansion: the sources' messages (sources.py) cleaned, deduplicated, mixed (and augmented) into
train/eval prompt sets.

Every source row ends up in the pool (normalized messages with a stable id), in rejects with a reason, or
counted as an exact or near duplicate of an earlier prompt; stats.json/stats.parquet count all of them per
source, so a user sees where rows went. Memory stays bounded: kept rows are spooled to an Arrow file in the
output directory and only hashes, source indices and MinHash signatures stay in memory.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .chat import prompt_messages, render
from .config import PromptsConfig
from .dedup import MinHasher, near_duplicates
from .errors import UserError, disk_full, disk_full_error
from .hf_config import past_positions, read_target_config, target_max_positions
from .io import atomic_path, log, progress, write_json, write_parquet
from .sources import MESSAGES, ParseError, Rejected, load_source, to_messages


def sample_id(messages: list[dict]) -> str:
    blob = json.dumps(messages, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def prompt_hash(messages: list[dict]) -> int:
    """Exact-dedup key: the prompt turns only, since answers are regenerated anyway."""
    blob = json.dumps(prompt_messages(messages), ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return int.from_bytes(hashlib.blake2b(blob.encode("utf-8"), digest_size=8).digest(), "little")


def prompt_text(messages: list[dict]) -> str:
    """The text the target is prompted with: every turn before the first assistant answer."""
    return "\n\n".join(m["content"] for m in prompt_messages(messages))


def augment_messages(messages: list[dict], template: str) -> list[dict]:
    """The prompt turns with `template` applied to the last user turn; the answer is dropped, since it
    answered a different question."""
    out = [dict(m) for m in prompt_messages(messages)]
    last = max(i for i, m in enumerate(out) if m["role"] == "user")
    out[last]["content"] = template.replace("{prompt}", out[last]["content"]).strip()
    return out


def _row(messages: list[dict], source: str, augmented: bool = False) -> dict:
    prompt = prompt_text(messages)
    return {
        "id": sample_id(messages),
        "source": source,
        "messages": messages,
        "prompt": prompt,
        "prompt_chars": len(prompt),
        "num_turns": len(messages),
        "augmented": augmented,
    }


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, zlib.crc32(name.encode("utf-8"))])


def quotas(sizes: dict[str, int], weights: dict[str, float], n: int) -> dict[str, int]:
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


CHUNK = 8192  # rows per spool batch, signature batch and output row group


def _schema():
    return pa.schema(
        [
            ("id", pa.string()),
            ("source", pa.string()),
            ("messages", MESSAGES),
            ("prompt", pa.string()),
            ("prompt_chars", pa.int32()),
            ("num_turns", pa.int32()),
            ("augmented", pa.bool_()),  # a template variant made to fill the mix; it has no answer
        ]
    )


def _table(rows: list[dict]):
    return pa.Table.from_pylist(rows, schema=_schema())


class _Rejects:
    """rejects.parquet written in row groups as rows arrive."""

    def __init__(self, path):
        self.schema = pa.schema(
            [("source", pa.string()), ("row", pa.int64()), ("reason", pa.string()), ("raw", pa.string())]
        )
        self.writer, self.rows, self.reasons = pq.ParquetWriter(path, self.schema), [], Counter()

    def add(self, row: dict):
        self.rows.append(row)
        self.reasons[row["reason"]] += 1
        if len(self.rows) >= CHUNK:
            self.flush()

    def flush(self):
        self.writer.write_table(pa.Table.from_pylist(self.rows, schema=self.schema))
        self.rows = []

    def close(self):
        self.flush()
        self.writer.close()


NO_ANSWER = "no assistant answer (regenerate.enabled is false)"
NO_RENDER = "the target's chat template cannot render it"


class TargetFit:
    """Whether a prompt fits the target: its tokens as the target's chat template renders it (with the
    generation prompt, as regeneration and evaluation give it; each `thinking` mode they render it in, the
    longest counting) leave room for one answer token within its max_position_embeddings
    (hf_config.past_positions, the test regeneration makes with regenerate.max_new_tokens). A longer one
    would size every slot of the static engines to itself, or fail downstream."""

    def __init__(self, target, thinking: bool = False):
        from transformers import AutoTokenizer

        self.limit = target_max_positions(read_target_config(target))  # refuses remote code first
        self.tokenizer = AutoTokenizer.from_pretrained(str(target))
        self.modes = sorted({False, thinking})  # evaluation renders without thinking
        self.too_long = f"longer than the target's positions ({self.limit})"

    def check(self, messages: list[dict]) -> None:
        """Raise Rejected with the reason when the prompt of `messages` does not fit."""
        if not self.limit:
            return
        for thinking in self.modes:
            try:
                text = render(self.tokenizer, prompt_messages(messages), True, thinking)
                # a token covers a byte of the text at least (byte-level BPE, byte fallback; one more for a
                # dummy prefix): a text this short fits, and most are, so they need no tokenizing
                if len(text.encode("utf-8")) + 2 <= self.limit:
                    continue
                n = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            except Exception as e:  # a row this template cannot render: no stage could prompt the target
                raise Rejected(NO_RENDER) from e
            if past_positions(n, 1, self.limit):
                raise Rejected(self.too_long)


def _read_pool(
    cfg: PromptsConfig,
    spool: str,
    rejects: _Rejects,
    need_answers: bool = False,
    fit: TargetFit | None = None,
):
    """Pass 1: read, clean and exact-dedup every source; kept rows go to the spool file in order.
    `need_answers`: rows without an assistant answer are rejected (nothing will answer them). `fit`: rows
    whose prompt does not fit the target are rejected (tokenized once per new prompt: a duplicate of a kept
    one fits).
    Returns (stats, source index per spooled row, MinHash signatures or None, prompt hashes seen)."""
    hasher = MinHasher(cfg.near_dup_num_perm, cfg.near_dup_ngram) if cfg.near_dup else None
    seen: set[int] = set()
    stats, src_idx, sigs, buf = {}, [], [], []
    with pa.OSFile(spool, "wb") as f, pa.ipc.new_file(f, _schema()) as writer:

        def flush(si):
            if buf:
                writer.write_table(_table(buf))
                src_idx.append(np.full(len(buf), si, np.int32))
                if hasher:
                    sigs.append(hasher.signatures([r["prompt"] for r in buf]))
                buf.clear()

        for si, src in enumerate(cfg.sources):
            st = stats[src.name] = {"read": 0, "kept": 0, "rejected": Counter(), "duplicates": 0}
            for i, rec in progress(load_source(src), desc=f"read {src.name}", unit=" rows"):
                st["read"] += 1
                try:
                    if isinstance(rec, ParseError):
                        raise Rejected(rec.reason)
                    messages = to_messages(rec, src.shape, src.fields)
                    if need_answers and not any(m["role"] == "assistant" for m in messages):
                        raise Rejected(NO_ANSWER)
                    prompt = prompt_text(messages)
                    if len(prompt) < cfg.min_chars:
                        raise Rejected("too short")
                    if len(prompt) > cfg.max_chars:
                        raise Rejected("too long")
                    key = prompt_hash(messages)
                    if fit is not None and key not in seen:
                        fit.check(messages)
                except Rejected as e:
                    st["rejected"][str(e)] += 1
                    raw = (
                        rec.raw
                        if isinstance(rec, ParseError)
                        else json.dumps(rec, ensure_ascii=False, default=str)
                    )
                    raw = raw[:200].encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates
                    rejects.add({"source": src.name, "row": i, "reason": str(e), "raw": raw})
                    continue
                if key in seen:
                    st["duplicates"] += 1
                    continue
                seen.add(key)
                st["kept"] += 1
                buf.append(_row(messages, src.name))
                if len(buf) >= CHUNK:
                    flush(si)
            flush(si)
    src = np.concatenate(src_idx) if src_idx else np.zeros(0, np.int32)
    sig = np.concatenate(sigs) if sigs else None
    return stats, src, sig, seen


def _augment(cfg, pool, train_idx, src, seen, templates) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Pick (base row, template) pairs from training rows only (eval stays disjoint), by source weight,
    each giving a prompt not seen before. Returns base spool rows, template indices, count per source."""
    gap = cfg.total - len(train_idx)
    names = [s.name for s in cfg.sources]
    counts = dict.fromkeys(names, 0)
    if gap <= 0 or not templates:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), counts
    n_tpl = len(templates)
    train_src = src[train_idx]
    bases = {n: train_idx[train_src == si] for si, n in enumerate(names)}
    quota = quotas(
        {n: len(b) * n_tpl for n, b in bases.items()}, {s.name: s.weight for s in cfg.sources}, gap
    )
    out_b, out_t = [], []
    for name, base in bases.items():
        if not quota[name]:
            continue
        order = _rng(cfg.seed, f"augment:{name}").permutation(base)
        cand_b, cand_t = (
            np.tile(order, n_tpl),
            np.repeat(np.arange(n_tpl), len(order)),
        )  # template by template
        for c in range(0, len(cand_b), CHUNK):
            b, t = cand_b[c : c + CHUNK], cand_t[c : c + CHUNK]
            for bi, ti, rec in zip(b, t, pool.take(b).column("messages").to_pylist(), strict=True):
                key = prompt_hash(augment_messages(rec, templates[ti]))
                if key not in seen:  # a variant that already exists would be an exact duplicate
                    seen.add(key)
                    out_b.append(bi)
                    out_t.append(ti)
                    counts[name] += 1
                    if counts[name] == quota[name]:
                        break
            if counts[name] == quota[name]:
                break
    return np.array(out_b, np.int64), np.array(out_t, np.int64), counts


def _write(pool, base: np.ndarray, tpl: np.ndarray, templates: list[str], path):
    """Write pool rows `base` (tpl < 0: as is, else augmented with templates[tpl]) in row groups."""
    with atomic_path(path) as tmp, pq.ParquetWriter(tmp, _schema()) as w:
        for c in range(0, max(len(base), 1), CHUNK):
            b, t = base[c : c + CHUNK], tpl[c : c + CHUNK]
            chunk = pool.take(pa.array(b, pa.int64()))
            if (t >= 0).any():
                rows = chunk.to_pylist()
                for k in np.flatnonzero(t >= 0):
                    rows[k] = _row(
                        augment_messages(rows[k]["messages"], templates[t[k]]), rows[k]["source"], True
                    )
                chunk = _table(rows)
            w.write_table(chunk)


def expand(
    cfg: PromptsConfig, out_dir: str, need_answers: bool = False, target=None, thinking: bool = False
) -> dict:
    """Read, clean, dedup (exact, then near) and mix every source; write train/eval/rejects parquet,
    stats.json and stats.parquet.

    `need_answers` (regeneration disabled: training uses the sources' own answers): keep only rows with
    an assistant answer, and augment nothing, since an augmented prompt has no answer. `target` (its HF
    directory): reject the prompts that do not fit it (TargetFit; `thinking`: regenerate.thinking)."""
    if not cfg.sources:
        raise UserError("prompts.sources is empty: list at least one prompt source")
    names = [s.name for s in cfg.sources]
    if len(set(names)) != len(names):
        raise UserError(f"prompts.sources: duplicate source names {names}; give each a unique name")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fit = None if target is None else TargetFit(target, thinking)
    with tempfile.TemporaryDirectory(dir=out, prefix=".tmp-spool-") as tmp:
        with atomic_path(out / "rejects.parquet") as rejects_tmp:
            rejects = _Rejects(rejects_tmp)
            try:
                stats, src, sig, seen = _read_pool(cfg, f"{tmp}/pool.arrow", rejects, need_answers, fit)
            except OSError as e:  # the spool's temporary name would tell the user nothing
                if disk_full(e):
                    raise disk_full_error(out) from e
                raise
            finally:
                rejects.close()
        # an empty file is most likely a failed download or export: say so instead of mixing without it
        warnings = [
            f"source {s.name!r}: {s.path} has no rows; it contributes no prompts"
            for s in cfg.sources
            if stats[s.name]["read"] == 0
        ]
        for w in warnings:
            log(f"warning: {w}")
        near = near_duplicates(sig, cfg.near_dup_threshold) if sig is not None else np.zeros(len(src), bool)
        del sig
        near_by_src = np.bincount(src[near], minlength=len(names))
        alive = np.flatnonzero(~near)

        # mix: per-source quotas by weight, a seeded sample inside each source, then one seeded shuffle
        want = cfg.total + cfg.eval_count
        weights = {s.name: s.weight for s in cfg.sources}
        pools = {n: alive[src[alive] == si] for si, n in enumerate(names)}
        quota = quotas({n: len(p) for n, p in pools.items()}, weights, want)
        picked = np.concatenate([_rng(cfg.seed, n).permutation(p)[: quota[n]] for n, p in pools.items()])
        if not len(picked):
            # the reasons in the line itself: a failed job's outputs (rejects.parquet too) are removed
            keys = {
                "too short": f"under prompts.min_chars {cfg.min_chars}",
                "too long": f"over prompts.max_chars {cfg.max_chars}",
            }
            top = (
                "; ".join(
                    f"{n} {r}" + (f" ({keys[r]})" if r in keys else "")
                    for r, n in rejects.reasons.most_common(3)
                )
                or "no rows read"
            )
            raise UserError(f"no usable prompt in any source (rejected: {top})")
        picked = _rng(cfg.seed, "mix").permutation(picked)
        n_eval = min(cfg.eval_count, len(picked) // 2)  # a small pool still leaves half for training
        eval_idx, train_idx = picked[:n_eval], picked[n_eval:]

        with pa.memory_map(f"{tmp}/pool.arrow") as mm:
            pool = pa.ipc.open_file(mm).read_all()
            templates = [] if need_answers else cfg.augment
            aug_b, aug_t, augmented = _augment(cfg, pool, train_idx, src, seen, templates)
            del seen
            base = np.concatenate([train_idx, aug_b])
            tpl = np.concatenate([np.full(len(train_idx), -1), aug_t])
            order = _rng(cfg.seed, "train").permutation(len(base)) if len(aug_b) else np.arange(len(base))
            _write(pool, base[order], tpl[order], cfg.augment, out / "train.parquet")
            _write(pool, eval_idx, np.full(n_eval, -1), cfg.augment, out / "eval.parquet")
            del pool

    train_by_src = np.bincount(src[train_idx], minlength=len(names))
    eval_by_src = np.bincount(src[eval_idx], minlength=len(names))
    for si, (name, st) in enumerate(stats.items()):
        st["rejected"] = dict(sorted(st["rejected"].items()))
        st["near_duplicates"] = int(near_by_src[si])
        st["kept"] -= st["near_duplicates"]
        st["augmented"] = augmented[name]
        st["sampled_train"] = int(train_by_src[si]) + augmented[name]  # augmented rows included
        st["sampled_eval"] = int(eval_by_src[si])
    keys = ("read", "kept", "duplicates", "near_duplicates", "augmented", "sampled_train", "sampled_eval")
    totals = {k: sum(st[k] for st in stats.values()) for k in keys}
    totals["rejected"] = sum(sum(st["rejected"].values()) for st in stats.values())
    summary = {
        "sources": stats,
        "totals": totals,
        "requested_train": cfg.total,
        "requested_eval": cfg.eval_count,
        "pool": len(alive),
        "need_answers": need_answers,
    }
    if fit is not None:  # what the prompts were measured against, and how many did not fit
        summary["target"] = {
            "path": str(target),
            "max_position_embeddings": fit.limit,
            "too_long": sum(st["rejected"].get(fit.too_long, 0) for st in stats.values()),
        }
    if warnings:
        summary["warnings"] = warnings
    if totals["sampled_train"] + n_eval < want:
        summary["note"] = (
            f"pool of {len(picked)} unique prompts (+{totals['augmented']} augmented) is smaller than "
            f"total + eval_count = {want}; took all of them"
            + (" (no augmentation: regenerate.enabled is false)" if need_answers and cfg.augment else "")
        )
    write_json(out / "stats.json", summary)
    write_parquet(_stats_table(stats), out / "stats.parquet")
    return summary


def _stats_table(stats: dict):
    """stats.parquet: one row per source; rejected is the total, rejected_by_reason the breakdown."""
    ints = ["read", "kept", "rejected", "duplicates", "near_duplicates", "augmented"]
    ints += ["sampled_train", "sampled_eval"]
    schema = pa.schema(
        [("source", pa.string())]
        + [(k, pa.int64()) for k in ints]
        + [("rejected_by_reason", pa.map_(pa.string(), pa.int64()))]
    )
    rows = [
        {
            **{k: st[k] for k in ints if k != "rejected"},
            "source": name,
            "rejected": sum(st["rejected"].values()),
            "rejected_by_reason": list(st["rejected"].items()),
        }
        for name, st in stats.items()
    ]
    return pa.Table.from_pylist(rows, schema=schema)
