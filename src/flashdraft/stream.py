"""Stream mode (`hidden.mode: stream`): each epoch's training data cut into chunks of whole optimizer
steps, whose hidden states exist on disk only while the chunk waits for or is in training.

- `hidden_tokens`: one job per hidden shard tokenizes its samples, in the order a store-mode shard holds
  them, so both modes number the run's samples alike (results/tokens/shard-NNNNN.parquet).
- `data_plan`: the run's plan, from the samples' lengths alone: every epoch's micro-batches
  (batches.epoch_batches, as store-mode training makes them) cut greedily into chunks of whole steps
  whose hidden-state tokens fit hidden.chunk_tokens (or half of hidden.disk_budget: one chunk trains while
  the next one is written). results/plan/plan.json, samples.parquet, epoch-EEE/chunk-CCCCC.parquet.
- `hidden_chunk`: one part of a chunk's samples through the target, into an ordinary hidden shard.

Training then runs one job per chunk (train.py --plan --chunk), each resuming from the previous one's
checkpoint; train_data.Plan is what those jobs read.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from .batches import epoch_batches, micro_per_step, steps_left
from .config import (
    PLAN_TRAIN_KEYS,
    DrafterConfig,
    HiddenConfig,
    TargetConfig,
    TrainConfig,
    check_validation,
    feature_layers,
    stream_chunk_tokens,
    stream_least,
)
from .config import STREAM_RING as RING
from .config import STREAM_ROW_BYTES as ROW_BYTES
from .errors import UserError
from .holdout import val_split
from .io import StorageDtype, bytes_per_token, human_bytes, log, write_json, write_parquet
from .train_data import FORMAT, Chunk, Plan, chunk_name

# ------------------------------------------------------------------------------------------- tokenize


def hidden_tokens(
    target_path, data_parquet, shard: int, num_shards: int, hidden_cfg: HiddenConfig, out
) -> dict:
    """Tokenize hidden shard `shard`'s samples into `out` (parquet: id, input_ids, loss_mask, num_tokens),
    in the row order precompute gives a store-mode shard."""
    from transformers import AutoTokenizer

    from .hf_config import read_target_config
    from .precompute import token_batches, tokenize_shard

    read_target_config(target_path)  # refuses remote code before transformers sees the directory
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    samples, truncated, skipped = tokenize_shard(
        tokenizer, data_parquet, shard, num_shards, hidden_cfg.max_length
    )
    order = [i for b in token_batches([len(s[1]) for s in samples], hidden_cfg.batch_tokens) for i in b]
    write_tokens(
        [samples[i] for i in order],
        out,
        {
            "shard": shard,
            "num_shards": num_shards,
            "truncated": truncated,
            "skipped": skipped,
            "tokenizer_length": len(tokenizer),
        },
    )
    stats = {
        "shard": shard,
        "samples": len(order),
        "tokens": sum(len(samples[i][1]) for i in order),
        "truncated": truncated,
        "skipped": skipped,
    }
    log(f"tokens shard {shard}: {stats}")
    return stats


def write_tokens(samples, out, meta: dict) -> None:
    import pyarrow as pa

    table = pa.table(
        {
            "id": pa.array([s[0] for s in samples], pa.string()),
            "input_ids": pa.array([list(s[1]) for s in samples], pa.list_(pa.int32())),
            "loss_mask": pa.array([list(s[2]) for s in samples], pa.list_(pa.int8())),
            "num_tokens": pa.array([len(s[1]) for s in samples], pa.int32()),
        }
    ).replace_schema_metadata({"flashdraft.tokens": json.dumps(meta)})
    write_parquet(table, out)


def read_samples(tokens_files, columns=("id", "num_tokens")):
    """The run's samples in store order (shard after shard) as one pyarrow Table of `columns`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa.concat_tables([pq.read_table(f, columns=list(columns)) for f in tokens_files])


# ----------------------------------------------------------------------------------------------- plan


def cut_chunks(step_sizes: list[int], capacity: int) -> list[tuple[int, int]]:
    """Greedy cut of one epoch's steps (their sizes) into runs [a, b) of whole steps within `capacity`."""
    cuts, start, used = [], 0, 0
    for s, t in enumerate(step_sizes):
        if used and used + t > capacity:
            cuts.append((start, s))
            start, used = s, 0
        used += t
    if start < len(step_sizes):
        cuts.append((start, len(step_sizes)))
    return cuts


def data_plan(
    target_path,
    tokens_files: list[str],
    hidden_cfg: HiddenConfig,
    drafter_cfg: DrafterConfig,
    train_cfg: TrainConfig,
    world: int,
    out_dir,
    last_hidden: bool = False,
) -> dict:
    """Write the run's plan into `out_dir`; returns plan.json's content. `last_hidden`: the chunks' shards
    hold the target's last hidden state too (config.needs_last_hidden), so a token takes more bytes."""
    from .hf_config import read_target_config, target_num_layers

    target = read_target_config(target_path)
    layer_ids = feature_layers(target_num_layers(target), drafter_cfg)
    hidden_size = target.get("hidden_size") or target["text_config"]["hidden_size"]
    width = len(layer_ids) * hidden_size
    per_token = bytes_per_token(hidden_cfg.dtype, len(layer_ids), hidden_size, last_hidden)
    chunk_tokens = stream_chunk_tokens(hidden_cfg, per_token)
    key = "hidden.chunk_tokens" if hidden_cfg.chunk_tokens else "hidden.disk_budget"

    out = Path(out_dir)
    table = read_samples(tokens_files, ("id", "num_tokens"))
    ids, lengths = table.column("id").to_pylist(), table.column("num_tokens").to_pylist()
    shard_of_row = [s for s, f in enumerate(tokens_files) for _ in range(_rows(f))]
    tokens_rows = list(range(len(ids)))  # each sample's row in the tokens files, shard after shard
    val_bytes = 0
    if train_cfg.val_samples and ids:  # the validation samples leave the run's numbering: never trained on
        held = set(val_split(ids, train_cfg.val_samples, train_cfg.seed))
        val = [r for r in tokens_rows if ids[r] in held]
        _write_rows(out / "val.parquet", val, ids, lengths, shard_of_row)
        val_bytes = sum(lengths[r] for r in val) * per_token + len(val) * ROW_BYTES
        if not hidden_cfg.chunk_tokens:  # the validation shard stays on disk beside the ring of chunks
            chunk_tokens = max(0, hidden_cfg.disk_budget - val_bytes) // (RING * per_token)
        tokens_rows = [r for r in tokens_rows if ids[r] not in held]
        ids, lengths, shard_of_row = ([x[r] for r in tokens_rows] for x in (ids, lengths, shard_of_row))
    if not ids:
        raise UserError(
            f"no training samples in {', '.join(map(str, tokens_files))}: every sample was "
            "skipped (no answer token within hidden.max_length); see the hidden_tokens logs"
        )
    g = micro_per_step(train_cfg, world)
    total = train_cfg.max_steps or steps_left(lengths, train_cfg, world)
    check_validation(train_cfg, steps=total)

    chunks, step = [], 0
    for epoch in range(train_cfg.epochs):
        if step >= total:
            break
        batches = epoch_batches(lengths, train_cfg, epoch)
        if len(batches) < g:
            raise UserError(
                f"{len(batches)} micro-batches per epoch, fewer than one global batch ({g}): "
                "lower train.batch_tokens or train.global_batch_tokens, or add data"
            )
        steps = min(len(batches) // g, total - step)
        step_rows = [[i for b in batches[s * g : (s + 1) * g] for i in b] for s in range(steps)]
        step_bytes = [sum(lengths[i] for i in r) * per_token + len(r) * ROW_BYTES for r in step_rows]
        if max(step_bytes) > chunk_tokens * per_token:  # the check before any job bounds this from the config
            need, least = stream_least(max(step_bytes), per_token, val_bytes)  # with the rows' allowance
            raise UserError(
                f"config key {key}: a chunk of {chunk_tokens} hidden-state tokens cannot hold one optimizer "
                f"step of epoch {epoch} ({need} tokens' worth); "
                + (
                    f"set hidden.chunk_tokens >= {need}"
                    if key == "hidden.chunk_tokens"
                    else f"set hidden.disk_budget >= {human_bytes(least)} ({least} bytes: {RING} "
                    f"chunks of one step" + (" and the validation shard)" if val_bytes else ")")
                )
            )
        for c, (a, b) in enumerate(cut_chunks(step_bytes, chunk_tokens * per_token)):
            rows = [(s, k, i) for s in range(a, b) for k in range(s * g, (s + 1) * g) for i in batches[k]]
            tokens = sum(lengths[i] for _, _, i in rows)
            chunks.append(
                Chunk(epoch, c, len(chunks), step + a, step + b, len(rows), tokens, sum(step_bytes[a:b]))
            )
            write_parquet(_chunk_table(rows, step, ids, lengths), out / f"{chunk_name(epoch, c)}.parquet")
        step += steps

    _write_rows(out / "samples.parquet", tokens_rows, ids, lengths, shard_of_row, renumber=True)
    train = {k: getattr(train_cfg, k) for k in PLAN_TRAIN_KEYS}
    plan = {
        "format": FORMAT,
        "world": world,
        "micro_per_step": g,
        "total_steps": total,
        "train": train,
        "samples": len(ids),
        "tokens": sum(lengths),
        "target_layer_ids": layer_ids,
        "width": width,
        "last_hidden": last_hidden,
        "dtype": hidden_cfg.dtype,
        "bytes_per_token": per_token,
        "chunk_tokens": chunk_tokens,
        "chunk_tokens_from": key,
        "disk_budget": hidden_cfg.disk_budget,
        "ring": RING,
        "peak_bytes": _peak_bytes(chunks) + val_bytes,
        "val_bytes": val_bytes,
        "tokens_files": [str(f) for f in tokens_files],
        "tokenizer_length": tokenizer_length(tokens_files[0]),
        "fingerprint": fingerprint(ids, lengths, train, world, chunk_tokens),
        "chunks": [asdict(c) for c in chunks],
    }
    write_json(out / "plan.json", plan)
    per_epoch = [sum(c.epoch == e for c in chunks) for e in range(train_cfg.epochs)]
    log(
        f"plan: {len(ids)} samples, {sum(lengths)} tokens, {total} steps; chunks of <= {chunk_tokens} tokens "
        f"(from {key}), {len(chunks)} chunks ({per_epoch} per epoch); hidden states on disk at most "
        f"{human_bytes(plan['peak_bytes'])} ({RING} chunks)"
    )
    return plan


def _write_rows(path, rows, ids, lengths, shard_of_row, renumber=False) -> None:
    """samples.parquet (`renumber`: ids etc. are already the run's, index is the run's numbering) or
    val.parquet: each sample's row in the tokens files (`row`), id, tokens and tokens shard."""
    import pyarrow as pa

    pick = range(len(rows)) if renumber else rows
    cols = {"index": pa.array(range(len(rows)), pa.int64())} if renumber else {}
    write_parquet(
        pa.table(
            {
                **cols,
                "row": pa.array(rows, pa.int64()),
                "id": pa.array([ids[i] for i in pick], pa.string()),
                "num_tokens": pa.array([lengths[i] for i in pick], pa.int32()),
                "tokens_shard": pa.array([shard_of_row[i] for i in pick], pa.int32()),
            }
        ),
        path,
    )


def _rows(parquet_file) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(parquet_file).metadata.num_rows


def tokenizer_length(tokens_file) -> int | None:
    """len(tokenizer) as hidden_tokens found it: where the MASK row goes unless drafter.mask_token_id sets
    it. Kept in the plan so that no training job loads the tokenizer (and imports transformers)."""
    import pyarrow.parquet as pq

    meta = pq.read_schema(tokens_file).metadata or {}
    return json.loads(meta.get(b"flashdraft.tokens", b"{}")).get("tokenizer_length")


def _chunk_table(rows, epoch_start_step: int, ids, lengths):
    import pyarrow as pa

    return pa.table(
        {
            "step": pa.array([epoch_start_step + s for s, _, _ in rows], pa.int64()),  # the run's step
            "micro_batch": pa.array([k for _, k, _ in rows], pa.int32()),  # in the epoch's plan
            "sample": pa.array([i for _, _, i in rows], pa.int64()),  # the run's sample index
            "id": pa.array([ids[i] for _, _, i in rows], pa.string()),
            "num_tokens": pa.array([lengths[i] for _, _, i in rows], pa.int32()),
        }
    )


def _peak_bytes(chunks: list[Chunk]) -> int:
    """The most hidden-state bytes on disk at once: any RING consecutive chunks of the run."""
    sizes = [c.bytes for c in chunks]
    return max((sum(sizes[i : i + RING]) for i in range(len(sizes))), default=0)


def fingerprint(ids, lengths, train: dict, world: int, chunk_tokens: int) -> str:
    h = hashlib.sha256(json.dumps([train, world, chunk_tokens], sort_keys=True).encode())
    for i, n in zip(ids, lengths, strict=True):
        h.update(f"{i}\0{n}\0".encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------- chunk shards


def part_samples(samples: list[int], part: int, parts: int) -> list[int]:
    """Part `part` of `parts` of a chunk's samples: every parts-th of them in sorted order (the epoch's
    permutation already mixes lengths, so the parts' tokens come out even)."""
    return sorted(set(samples))[part::parts]


def hidden_chunk(
    target: TargetConfig,
    plan_dir,
    epoch: int,
    chunk: int,
    part: int,
    parts: int,
    hidden_cfg: HiddenConfig,
    drafter_cfg: DrafterConfig,
    out_arrow,
    last_hidden: bool = False,
) -> dict:
    """Forward part `part` of `parts` of a chunk's samples through the target into the shard `out_arrow`
    (and its manifest); returns the manifest."""
    plan = Plan(plan_dir)
    c = plan.find(epoch, chunk)
    rows = plan.tokens_rows(part_samples(plan.chunk_samples(c), part, parts))
    return precompute_rows(
        target,
        plan,
        rows,
        hidden_cfg,
        drafter_cfg,
        out_arrow,
        desc=f"hidden {c.name} part {part}/{parts}",
        counts={"epoch": epoch, "chunk": chunk, "part": part, "parts": parts},
        last_hidden=last_hidden,
    )


def precompute_rows(
    target: TargetConfig,
    plan: Plan,
    rows: list[int],
    hidden_cfg: HiddenConfig,
    drafter_cfg: DrafterConfig,
    out_arrow,
    desc: str,
    counts: dict,
    last_hidden: bool = False,
) -> dict:
    """Rows `rows` of the plan's tokens files through the target into the shard `out_arrow` (with
    `last_hidden`, the target's last hidden state too: precompute.write_hidden)."""
    from .io import device
    from .precompute import write_hidden
    from .target import load_target

    StorageDtype.of(hidden_cfg.dtype)  # fail before loading the model
    samples = token_rows(plan.meta["tokens_files"], rows)
    model, tokenizer = load_target(str(target.path), target.dtype, device())
    return write_hidden(
        model,
        tokenizer,
        target.path,
        samples,
        out_arrow,
        hidden_cfg,
        drafter_cfg,
        desc=desc,
        counts=counts,
        last_hidden=last_hidden,
    )


def token_rows(files, rows: list[int]) -> list[tuple]:
    """(id, input_ids, loss_mask) of rows `rows` of the tokens files (numbered shard after shard)."""
    import pyarrow as pa

    starts = [0]
    for f in files:
        starts.append(starts[-1] + _rows(f))
    samples = []
    for s, f in enumerate(files):
        mine = [i - starts[s] for i in rows if starts[s] <= i < starts[s + 1]]
        if mine:
            t = read_samples([f], ("id", "input_ids", "loss_mask")).take(pa.array(mine, pa.int64()))
            samples += zip(
                t.column("id").to_pylist(),
                t.column("input_ids").to_pylist(),
                t.column("loss_mask").to_pylist(),
                strict=True,
            )
    return samples


def hidden_val(
    target: TargetConfig,
    plan_dir,
    hidden_cfg: HiddenConfig,
    drafter_cfg: DrafterConfig,
    out_arrow,
    last_hidden: bool = False,
) -> dict:
    """The validation samples of the plan (train.val_samples) through the target, into one shard that
    lives through every chunk; returns its manifest."""
    plan = Plan(plan_dir)
    ids, rows, _ = plan.val_samples()
    return precompute_rows(
        target,
        plan,
        rows,
        hidden_cfg,
        drafter_cfg,
        out_arrow,
        desc="hidden validation",
        counts={"val_samples": len(ids)},
        last_hidden=last_hidden,
    )
