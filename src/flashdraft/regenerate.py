"""Regenerate assistant answers with the target itself (HF generate), resumable by sample id.

The drafter must learn the target's own distribution, not the dataset's answers. Results are committed
as atomic parquet parts of whole batches in a work dir; a restart reads the ids already there and skips
them, so a killed run loses at most the part in progress. The final file is the parts in prompt order.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .chat import prompt_messages, render
from .config import RegenerateConfig, to_json
from .io import progress, write_json, write_parquet

MAX_ERROR_FRACTION = 0.05


def _schema(error: bool):
    import pyarrow as pa

    fields = [
        ("id", pa.string()),
        ("source", pa.string()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("response_tokens", pa.int32()),
        ("finish_reason", pa.string()),
    ]
    return pa.schema(fields + ([("error", pa.string())] if error else []))


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    for tok in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")):
        if isinstance(tok, int) and tok != tokenizer.unk_token_id and tok not in ids:
            ids.append(tok)
    return ids


def generate_batch(model, tokenizer, rows: list[dict], cfg: RegenerateConfig, eos: list[int]) -> list[dict]:
    """Answer a batch of prompt rows; returns output rows (messages = prompt + the target's answer)."""
    import torch

    prompts = [prompt_messages(r["messages"]) for r in rows]
    texts = [render(tokenizer, p, add_generation_prompt=True, thinking=cfg.thinking) for p in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    # greedy: unset the model's sampling defaults so generate does not warn that they are ignored
    sampling = (
        dict(do_sample=True, temperature=cfg.temperature)
        if cfg.temperature > 0
        else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    )
    with torch.inference_mode():
        out = model.generate(
            **enc,
            max_new_tokens=cfg.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
    results = []
    for row, prompt, new in zip(rows, prompts, out[:, enc["input_ids"].shape[1] :].tolist(), strict=True):
        stop = next((i for i, t in enumerate(new) if t in eos), None)
        tokens = new if stop is None else new[:stop]
        answer = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        results.append(
            {
                "id": row["id"],
                "source": row["source"],
                "messages": prompt + [{"role": "assistant", "content": answer}],
                "response_tokens": len(tokens),
                "finish_reason": "length" if stop is None else "stop",
                "error": None,
            }
        )
    return results


def _safe_batch(model, tokenizer, rows, cfg, eos) -> list[dict]:
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
            out.append(
                {
                    "id": row["id"],
                    "source": row["source"],
                    "messages": prompt_messages(row["messages"]),
                    "response_tokens": 0,
                    "finish_reason": "error",
                    "error": f"{type(e).__name__}: {e}",
                }
            )
    return out


def _read_parts(work: Path, wanted: set[str]) -> list[dict]:
    import pyarrow.parquet as pq

    rows = []
    for part in sorted(work.glob("part-*.parquet")):  # atomic writes: every such file is complete
        rows += [r for r in pq.read_table(part).to_pylist() if r["id"] in wanted]
    return rows


def _prepare_work_dir(work: Path, key: dict) -> None:
    """Parts made with another target or config are stale: clear them instead of mixing answers."""
    meta = work / "meta.json"
    if meta.exists() and json.loads(meta.read_text()) != key:
        print(f"regenerate: {work} holds parts of another target/config; starting over")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    if not meta.exists():
        write_json(meta, key)


def _finish(rows: list[dict], errors: list[dict], out: str) -> dict:
    import pyarrow as pa

    err_path = Path(out).parent / "errors.parquet"
    err_schema = pa.schema([("id", pa.string()), ("source", pa.string()), ("reason", pa.string())])
    write_parquet(pa.Table.from_pylist(errors, schema=err_schema), err_path)
    total = len(rows) + len(errors)
    if errors and len(errors) > MAX_ERROR_FRACTION * total:
        raise RuntimeError(
            f"regenerate: {len(errors)} of {total} rows failed (> {MAX_ERROR_FRACTION:.0%}); "
            f"reasons in {err_path}, first: {errors[0]['reason']}"
        )
    write_parquet(pa.Table.from_pylist(rows, schema=_schema(error=False)), out)
    stop = sum(r["finish_reason"] == "stop" for r in rows)
    return {"rows": len(rows), "errors": len(errors), "stop": stop, "length": len(rows) - stop}


def copy_original(prompt_rows: list[dict], tokenizer, out: str) -> dict:
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
        rows.append(
            {
                "id": r["id"],
                "source": r["source"],
                "messages": r["messages"],
                "response_tokens": n,
                "finish_reason": "stop",
            }
        )
    return _finish(rows, errors, out)


def regenerate(
    cfg: RegenerateConfig, target: str, dtype: str, prompts_path: str, out: str, work_dir: str
) -> dict:
    """Answer every prompt of `prompts_path` with the target; write `out` and errors.parquet beside it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompt_rows = pq.read_table(prompts_path, columns=["id", "source", "messages"]).to_pylist()
    order = {r["id"]: i for i, r in enumerate(prompt_rows)}
    if len(order) != len(prompt_rows):
        raise ValueError(f"{prompts_path}: sample ids are not unique")
    if not cfg.enabled:
        from transformers import AutoTokenizer

        return copy_original(prompt_rows, AutoTokenizer.from_pretrained(target), out)
    if cfg.backend != "hf":
        raise ValueError(f"regenerate.backend {cfg.backend!r} is not supported; use 'hf'")

    from .target import load_target

    work = Path(work_dir)
    _prepare_work_dir(
        work,
        {
            "target": str(Path(target).resolve()),
            "dtype": dtype,
            "cfg": json.loads(to_json(cfg)),
            "prompts": str(Path(prompts_path).resolve()),
        },
    )
    done = _read_parts(work, set(order))  # failed rows are committed too: a rerun does not retry them
    done_ids = {r["id"] for r in done}
    pending = [r for r in prompt_rows if r["id"] not in done_ids]
    if pending:
        model, tokenizer = load_target(target, dtype)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        eos = _eos_ids(model, tokenizer)
        # batches are fixed over the whole sorted prompt list (longest first, so memory errors show early),
        # and parts hold whole batches: a resumed run forms exactly the batches an uninterrupted one does
        texts = [render(tokenizer, prompt_messages(r["messages"]), True, cfg.thinking) for r in pending]
        lengths = {
            r["id"]: len(ids)
            for r, ids in zip(pending, tokenizer(texts, add_special_tokens=False)["input_ids"], strict=True)
        }
        pending.sort(key=lambda r: (-lengths[r["id"]], order[r["id"]]))
        per_part = max(1, cfg.part_rows // cfg.batch_size)
        batches = [pending[i : i + cfg.batch_size] for i in range(0, len(pending), cfg.batch_size)]
        next_part = 1 + max((int(p.stem.split("-")[1]) for p in work.glob("part-*.parquet")), default=-1)
        bar = progress(total=len(prompt_rows), initial=len(done), desc="regenerate", unit="prompt")
        buf = []
        for b, batch in enumerate(batches):
            buf += _safe_batch(model, tokenizer, batch, cfg, eos)
            bar.update(len(batch))
            if (b + 1) % per_part == 0 or b == len(batches) - 1:
                write_parquet(
                    pa.Table.from_pylist(buf, schema=_schema(error=True)),
                    work / f"part-{next_part:05d}.parquet",
                )
                done += buf
                next_part, buf = next_part + 1, []
        bar.close()

    done.sort(key=lambda r: order[r["id"]])
    rows = [{k: v for k, v in r.items() if k != "error"} for r in done if r["error"] is None]
    errors = [
        {"id": r["id"], "source": r["source"], "reason": r["error"]} for r in done if r["error"] is not None
    ]
    return _finish(rows, errors, out)
