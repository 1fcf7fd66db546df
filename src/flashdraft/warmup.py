"""Compile warmup: one process, main thread, compiles the training step for every length bucket and
saves the compile caches as one Mega-Cache blob that every training rank loads before its first step.

The step is train.forward_backward on random data of the real shapes (rows x bucket x K*H, the same
anchor slots), so its graphs are exactly the ones training asks for. Inductor compiles into a fresh
cache dir whose files are saved as inductor.tar next to the blob: training unpacks them into its own
Inductor dir, which gives it what the blob lacks (the compiled C++ kernels of CPU graphs). The caches
skip Inductor code generation and autotuning, not Dynamo tracing: a rank still traces, then hits.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from .config import DrafterConfig, TrainConfig
from .hidden import manifest_path
from .io import atomic_path, device, write_json
from .model import DFlashDrafter
from .train import (
    INDUCTOR_FILES,
    anchors_for,
    build_step,
    cache_counters,
    cache_key,
    forward_backward,
    gpu_bytes,
    load_spec,
    parallel_mode,
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


@contextlib.contextmanager
def fresh_inductor_dir():
    """Inductor compiles into a new, empty cache dir for the block, so that dir holds exactly this
    warmup's files (training unpacks them, see train.merge_inductor_files)."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="flashdraft-inductor-") as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp
        try:
            yield Path(tmp)
        finally:
            if before is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def pack_inductor_dir(src: Path, tar_path: Path) -> int:
    """Tar the Inductor dir's files (not Triton's cache: the FX-graph entries carry their kernels, and its
    dirs are per device index) atomically; returns the file count."""
    files = sorted(p for p in src.rglob("*") if p.is_file() and "triton" not in p.relative_to(src).parts
                   and not p.name.endswith(".lock"))
    with atomic_path(tar_path) as tmp, tarfile.open(tmp, "w") as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(src)))
    return len(files)


def warmup(cfg: TrainConfig, drafter_cfg: DrafterConfig, target_dir, shards: list[str], out_dir,
           world: int = 1) -> dict:
    """Compile (or, with compile: false, only check) the step per bucket; write artifacts.bin, inductor.tar
    and meta.json. `world`: the training's process count; when it shards the drafter (FSDP), nothing is
    compiled or run here (its graphs are not the unsharded step's, and one GPU may not hold that step)."""
    with fresh_inductor_dir() as inductor:
        return _warmup(cfg, drafter_cfg, target_dir, shards, Path(out_dir), inductor, world)


def _warmup(cfg: TrainConfig, drafter_cfg: DrafterConfig, target_dir, shards, out: Path, inductor: Path,
            world: int):
    dev = device()
    spec = load_spec(target_dir, drafter_cfg)
    width = spec.num_features * spec.hidden_size
    stored = feature_width(shards)
    if stored is not None and stored != width:
        raise ValueError(f"hidden shards hold {stored} features per token, the drafter expects {width}")
    key = cache_key(cfg, spec, dev)
    with torch.device("meta"):  # counted, not allocated
        params = sum(p.numel() for p in DFlashDrafter(spec).parameters())
    sharded = parallel_mode(cfg.parallel, params, world, gpu_bytes(dev)) == "fsdp"
    if sharded:
        print(f"warmup: training shards the drafter over {world} processes (FSDP); its graphs are not this "
              "unsharded step's, so nothing is compiled here and every rank compiles", file=sys.stderr)
    step = None if sharded else build_step(cfg, spec, target_dir, dev)
    g = torch.Generator().manual_seed(cfg.seed)
    seconds = {}
    for bucket in [] if sharded else sorted(set(cfg.buckets)):
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
    if cfg.compile and not sharded:
        artifacts = torch.compiler.save_cache_artifacts()
        blob = artifacts[0] if artifacts is not None else b""
        print(f"warmup: saved {len(blob)} bytes of compile caches", file=sys.stderr)
    elif not cfg.compile:
        print("warmup: compile is false; nothing to compile, writing an empty artifacts.bin", file=sys.stderr)
    with atomic_path(out / "artifacts.bin") as tmp:
        tmp.write_bytes(blob)
    files = pack_inductor_dir(inductor, out / INDUCTOR_FILES)  # empty when nothing was compiled
    meta = {"key": key, "compile": cfg.compile, "fsdp": sharded, "seconds": seconds,
            "counters": cache_counters(), "artifact_bytes": len(blob), "inductor_files": files,
            "inductor_bytes": (out / INDUCTOR_FILES).stat().st_size}
    write_json(out / "meta.json", meta)
    return meta
