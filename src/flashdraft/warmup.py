"""Compile warmup: one process, main thread, compiles the training step for every length bucket and
saves the compile caches as one Mega-Cache blob that every training rank loads before its first step.

The step is train.forward_backward on random data of the real shapes (rows x bucket x K*H, the same
anchor slots), so its graphs are exactly the ones training asks for. Caches skip Inductor code
generation and autotuning, not Dynamo tracing: a rank still traces, then hits.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from .config import DrafterConfig, TrainConfig
from .hidden import manifest_path
from .io import atomic_path, device, write_json
from .train import (
    anchors_for,
    build_step,
    cache_counters,
    cache_key,
    forward_backward,
    load_spec,
    rows_per_batch,
)


def feature_width(shards: list[str]) -> int | None:
    """K*H as the hidden-state manifests record it (None when no manifest exists yet)."""
    widths = set()
    for path in shards:
        m = manifest_path(path)
        if m.exists():
            meta = json.loads(m.read_text())
            widths.add(int(meta["num_features"]) * int(meta["hidden_size"]))
    if len(widths) > 1:
        raise ValueError(f"hidden shards disagree on the feature width: {sorted(widths)}")
    return widths.pop() if widths else None


def random_batch(bucket: int, rows: int, width: int, vocab: int, dtype, generator) -> dict:
    return {
        "input_ids": torch.randint(0, vocab, (rows, bucket), generator=generator),
        "loss_mask": torch.ones(rows, bucket),
        "hidden": torch.randn(rows, bucket, width, generator=generator).to(dtype),
        "tokens": rows * bucket,
        "bucket": bucket,
    }


def warmup(cfg: TrainConfig, drafter_cfg: DrafterConfig, target_dir, shards: list[str], out_dir) -> dict:
    """Compile (or, with compile: false, only check) the step per bucket; write artifacts.bin + meta.json."""
    dev = device()
    spec = load_spec(target_dir, drafter_cfg)
    width = spec.num_features * spec.hidden_size
    stored = feature_width(shards)
    if stored is not None and stored != width:
        raise ValueError(f"hidden shards hold {stored} features per token, the drafter expects {width}")
    step = build_step(cfg, spec, target_dir, dev)
    key = cache_key(cfg, spec, dev)
    g = torch.Generator().manual_seed(cfg.seed)
    seconds = {}
    for bucket in sorted(set(cfg.buckets)):
        batch = random_batch(bucket, rows_per_batch(bucket, cfg.batch_tokens), width, spec.vocab_size,
                             step.amp_dtype or torch.float32, g)
        anchors, valid = anchors_for(step, batch["loss_mask"], g)
        t0 = time.perf_counter()
        loss, _ = forward_backward(step, batch, anchors, valid)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        seconds[bucket] = round(time.perf_counter() - t0, 3)
        step.model.zero_grad(set_to_none=True)
        print(f"warmup: bucket {bucket}: fwd+bwd {seconds[bucket]:.1f} s, loss {loss.item():.3f}, "
              f"caches {cache_counters()}", file=sys.stderr, flush=True)
    blob = b""
    if cfg.compile:
        artifacts = torch.compiler.save_cache_artifacts()
        blob = artifacts[0] if artifacts is not None else b""
        print(f"warmup: saved {len(blob)} bytes of compile caches", file=sys.stderr)
    else:
        print("warmup: compile is false; nothing to compile, writing an empty artifacts.bin", file=sys.stderr)
    out = Path(out_dir)
    with atomic_path(out / "artifacts.bin") as tmp:
        tmp.write_bytes(blob)
    meta = {"key": key, "compile": cfg.compile, "seconds": seconds, "counters": cache_counters(),
            "artifact_bytes": len(blob)}
    write_json(out / "meta.json", meta)
    return meta
