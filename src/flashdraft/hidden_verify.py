"""Verifying hidden-state shards: `verify_shard` checks a shard against its manifest (size, checksum,
metadata, counts) and itself (every row's lengths, sizes and finite values); `move_aside` moves a bad one
and its manifest out of the way of a rebuild, kept for inspection.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from .hidden import FORMAT, HiddenStore, binary_columns, manifest_path
from .hidden_write import CHECKSUM_CHUNK, file_checksum


def _sizes(batch, name: str) -> np.ndarray:
    """Bytes per row of a large_binary column, from its offsets."""
    col = batch.column(name)
    return np.diff(np.frombuffer(col.buffers()[1], np.int64)[col.offset : col.offset + len(batch) + 1])


def verify_shard(arrow_path, manifest_file=None, max_errors=20) -> dict:
    """Check a shard against its manifest and itself; every error names the shard (and the row)."""
    arrow_path = Path(arrow_path)
    manifest_file = Path(manifest_file) if manifest_file else manifest_path(arrow_path)
    errors = []
    result = {"shard": str(arrow_path), "ok": False, "errors": errors}

    def err(msg):
        errors.append(f"{arrow_path}: {msg}")

    for p in (arrow_path, manifest_file):
        if not p.exists():
            err(f"missing file {p}")
    if errors:
        return result
    try:
        manifest = json.loads(manifest_file.read_text())
    except ValueError as e:
        err(f"manifest {manifest_file} is not valid JSON: {e}")
        return result
    if not isinstance(manifest, dict):
        err(f"manifest {manifest_file} holds {type(manifest).__name__}, not a JSON object")
        return result
    if manifest.get("format") != FORMAT:
        err(f"manifest format {manifest.get('format')!r}, expected {FORMAT!r}")
    size = arrow_path.stat().st_size
    if size != manifest.get("bytes"):
        err(f"file has {size} bytes, manifest says {manifest.get('bytes')}")
    if manifest.get("checksum_chunk_bytes") != CHECKSUM_CHUNK:
        got = manifest.get("checksum_chunk_bytes")
        err(f"manifest checksum_chunk_bytes {got}, expected {CHECKSUM_CHUNK}")
    digest = file_checksum(arrow_path)
    if digest != manifest.get("sha256_tree"):
        err(f"checksum (sha256_tree) {digest} does not match the manifest's {manifest.get('sha256_tree')}")
    try:
        store = HiddenStore([arrow_path])
    except (pa.ArrowException, OSError, ValueError, KeyError) as e:
        err(f"cannot be read as a hidden shard: {e}")
        return result
    listed = {**manifest, "last_hidden": manifest.get("last_hidden", False)}  # absent: a shard without it
    for k, v in store.meta.compared().items():
        if v != listed.get(k):
            err(f"schema metadata {k}={v!r} but manifest says {listed.get(k)!r}")
    if len(store) != manifest.get("rows"):
        err(f"{len(store)} rows, manifest says {manifest.get('rows')}")
    if int(store.lengths.sum()) != manifest.get("tokens"):
        err(f"{int(store.lengths.sum())} tokens, manifest says {manifest.get('tokens')}")

    meta = store.meta
    fp8, itemsize = meta.dtype.quantized, meta.dtype.itemsize
    # (values column, its fp8 scale column, values per token)
    checked = [("hidden", "scale", meta.width)]
    checked += [("last_hidden", "last_scale", meta.hidden_size)] * meta.last_hidden
    row, bad_rows = 0, 0
    for batch in store._batches[0]:
        ids = batch.column("id")
        sizes = {name: _sizes(batch, name) for name in binary_columns(meta)}
        for r in range(len(batch)):
            n = batch.column("num_tokens")[r].as_py()
            problems = []
            lens = (len(batch.column("input_ids")[r]), len(batch.column("loss_mask")[r]))
            if lens != (n, n):
                problems.append(f"{lens[0]} input ids and {lens[1]} mask values for num_tokens={n}")
            for name, scale_name, width in checked:
                sized = sizes[name][r] == n * width * itemsize
                if not sized:
                    problems.append(f"{name} has {sizes[name][r]} bytes, expected {n} x {width * itemsize}")
                if fp8 and sizes[scale_name][r] != n * 4:
                    sized = False
                    problems.append(f"{scale_name} has {sizes[scale_name][r]} bytes, expected {n} x 4")
                elif fp8 and sized:
                    scale = store._column(0, batch, r, scale_name, torch.float32)
                    if not (torch.isfinite(scale) & (scale > 0)).all():
                        problems.append(f"{scale_name} has values that are not finite and > 0")
                if sized and not torch.isfinite(store._values(0, batch, r, n, name, scale_name)).all():
                    problems.append(f"{name} has NaN or Inf values")
            if problems:
                bad_rows += 1
                if bad_rows <= max_errors:
                    err(f"row {row} (id {ids[r].as_py()!r}): " + "; ".join(problems))
            row += 1
    if bad_rows > max_errors:
        err(f"{bad_rows - max_errors} more bad rows not listed")
    result["ok"] = not errors
    return result


def move_aside(arrow_path, bad_dir=None) -> list[tuple[str, str]]:
    """Move a shard and its manifest into `bad_dir` (default: `bad/` next to the shard) as
    `<name>.<UTC time>.arrow` and `.json`, out of the way of a rebuild but kept for inspection.
    Returns the (from, to) pairs of the files that existed."""
    arrow_path = Path(arrow_path)
    bad_dir = Path(bad_dir) if bad_dir else arrow_path.parent / "bad"
    bad_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    stem, n = f"{arrow_path.stem}.{stamp}", 1
    while any((bad_dir / f"{stem}{ext}").exists() for ext in (".arrow", ".json")):  # same second
        stem, n = f"{arrow_path.stem}.{stamp}-{n}", n + 1
    moved = []
    for src in (arrow_path, manifest_path(arrow_path)):
        if src.exists():
            dst = bad_dir / f"{stem}{src.suffix}"
            os.replace(src, dst)
            moved.append((str(src), str(dst)))
    return moved
