"""The compile cache: the warmup that fills it, its key, its files, its counters and loading it.

The warmup runs in one process, on its main thread (torch.compile is not thread-safe), and compiles the
training step for every length bucket: train_step.forward_backward on random data of the real shapes
(rows x bucket x K*H, the same anchor slots), so its graphs are exactly the ones training asks for. It
saves the compile caches as one Mega-Cache blob (ARTIFACTS) that every training rank loads before its
first step. Inductor compiles into an emptied cache dir (warmup_inductor_dir) whose files are saved as
INDUCTOR_FILES next to the blob. Training compiles in that same dir, unpacking the files there on a node
that lacks them: they hold what the blob lacks (the compiled C++ kernels of CPU graphs), and a cached
kernel's autotune result is looked up beside the path the warmup saved the kernel at, so any other dir
would tune every kernel again. The caches skip Inductor code generation and autotuning, not Dynamo
tracing: a rank still traces, then hits. META holds the key the warmup compiled for; training compares
its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import sys
import tarfile
import tempfile
import time
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path

import torch
from torch._dynamo.utils import compile_times, counters
from torch._inductor import config as inductor_config
from torch._inductor.runtime.cache_dir_utils import cache_dir as _inductor_cache_dir
from torch.utils._triton import has_triton, triton_hash_with_backend

from .batches import rows_per_batch
from .config import COMPILED_TRAIN_KEYS, DrafterConfig, TrainConfig, needs_last_hidden
from .distributed import Dist, gpu_bytes, log, parallel_mode
from .errors import UserError
from .hidden import ShardMeta, manifest_path
from .io import atomic_path, background, device, write_json
from .model import DrafterSpec, meta_drafter
from .train_step import (
    anchors_for,
    build_step,
    forward_backward,
    initial_weights,
    load_spec,
    resolve,
    row_slices,
)

ARTIFACTS = "artifacts.bin"  # the Mega-Cache blob (empty when nothing was compiled)
INDUCTOR_FILES = "inductor.tar"  # the warmup's Inductor cache dir
META = "meta.json"  # the key, the counters and what was compiled


def cache_key(cfg: TrainConfig, spec: DrafterSpec, device: torch.device) -> dict:
    """What the compiled graphs depend on; the warmup writes it to META and training compares."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    fields = {k: getattr(cfg, k) for k in COMPILED_TRAIN_KEYS}
    run = resolve(cfg, device)
    return {
        "torch": torch.__version__,
        "device": name,
        "spec": asdict(spec),
        **fields,
        "buckets": sorted(cfg.buckets),
        "attention": run.attention,
        "dtype": run.dtype,
        # Inductor's CPU kernels are generated for the intra-op thread count
        "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
    }


def cache_counters() -> dict:
    """Compile-cache hits and misses so far in this process (FX graph and AOTAutograd caches), and the graphs
    AOTAutograd could not cache (traced again by every process)."""
    keys = [
        ("inductor", "fxgraph_cache_hit"),
        ("inductor", "fxgraph_cache_miss"),
        ("aot_autograd", "autograd_cache_hit"),
        ("aot_autograd", "autograd_cache_miss"),
        ("aot_autograd", "autograd_cache_bypass"),
    ]
    return {k: int(counters[group][k]) for group, k in keys}


def compile_phases(top: int = 6) -> str:
    """The slowest compile phases so far in this process, summed (Dynamo's own timers), for the log."""
    names, values = compile_times(repr="csv", aggregate=True)
    phases = sorted(((float(v), k) for k, v in zip(names, values, strict=True)), reverse=True)[:top]
    return ", ".join(f"{k} {v:.2f} s" for v, k in phases)


# ---------------------------------------------------------------------------------------------------------
# Inductor's files


def inductor_cache_dir() -> Path:
    """The Inductor cache dir this process compiles into (TORCHINDUCTOR_CACHE_DIR or torch's default)."""
    return Path(_inductor_cache_dir())


def warmup_inductor_dir(out_dir) -> Path:
    """The Inductor dir the warmup writing `out_dir` compiles in, and training after it: one per user and
    compile cache (a hash of its path), in the temp dir."""
    digest = hashlib.sha256(str(Path(out_dir).resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"flashdraft-inductor-{os.getuid()}-{digest}"


def not_ours(path: Path) -> str | None:
    """Why compiled code under `path` (a file or a dir) must not be loaded: a link, another user's, or
    writable by every user; None when it is this user's (group write, as under umask 002, is kept)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a link"
    if st.st_uid != os.getuid():
        return f"{path} belongs to user id {st.st_uid}"
    if st.st_mode & stat.S_IWOTH:
        return f"{path} is writable by every user"
    return None


def code_not_ours(*paths: Path) -> str | None:
    """The first reason (not_ours) why one of `paths` that exists, compiled code or what names where it
    is loaded from, must not be loaded; None when all are this user's."""
    return next((why for p in paths if os.path.lexists(p) and (why := not_ours(p))), None)


@contextlib.contextmanager
def fresh_inductor_dir(path: Path):
    """Inductor compiles into `path`, emptied first, for the block, so it holds exactly this warmup's
    files. Kept when the block ends well (training on this node compiles there), removed when it fails."""
    shutil.rmtree(path, ignore_errors=True)
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:  # another user's, which we cannot remove: never compile into it
        raise UserError(
            f"{path} exists and is not this user's ({not_ours(path)}); remove it, or set "
            "TMPDIR to a directory of your own"
        ) from None
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    try:
        yield path
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def pack_inductor_dir(src: Path, tar_path: Path) -> int:
    """Tar the Inductor dir's files (not Triton's cache: the FX-graph entries carry their kernels, and its
    dirs are per device index) atomically; returns the file count."""
    files = sorted(
        p
        for p in src.rglob("*")
        if p.is_file() and "triton" not in p.relative_to(src).parts and not p.name.endswith(".lock")
    )
    with atomic_path(tar_path) as tmp, tarfile.open(tmp, "w") as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(src)))
    return len(files)


def merge_inductor_files(tar_path, dest: Path) -> int:
    """Unpack the warmup's Inductor files into `dest`, keeping the files already there; returns how many
    were added. Each file is written under a temporary name and renamed, so ranks that share a cache dir
    never read another rank's half-written file. They hold what the Mega-Cache blob does not carry, such
    as the compiled C++ kernels of CPU graphs, which a fresh dir would otherwise build again."""
    added, root = 0, dest.resolve()
    with tarfile.open(tar_path) as tar:
        for member in tar:
            target = (root / member.name).resolve()
            if not member.isfile() or not target.is_relative_to(root) or target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
            with tar.extractfile(member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.chmod(tmp, member.mode & 0o777)
            os.replace(tmp, target)
            added += 1
    return added


# ---------------------------------------------------------------------------------------------------------
# training's side


def load_compile_cache(cache_dir, key: dict, d: Dist) -> bool:
    """Load the warmup's Mega-Cache blob into this process's compile caches, if there is one; True when
    it was loaded and its key matches (every graph should hit)."""
    if not cache_dir or not (Path(cache_dir) / ARTIFACTS).exists():
        log(d, f"compile cache: none at {cache_dir}; compiling from scratch")
        return False
    blob = Path(cache_dir) / ARTIFACTS
    meta = Path(cache_dir) / META
    info = json.loads(meta.read_text()) if meta.exists() else {}
    theirs = info.get("key", {})
    differ = sorted(k for k in key if theirs.get(k) != key[k])
    if differ:
        log(d, f"compile cache: warmup key differs in {differ}; expect cache misses")
    files = Path(cache_dir) / INDUCTOR_FILES
    if why := code_not_ours(blob, files, meta):  # code this process would run, and where it unpacks it
        log(d, f"compile cache: not loaded ({why}); compiling from scratch")
        return False
    if blob.stat().st_size == 0:
        why = "training shards the drafter (FSDP)" if info.get("fsdp") else "compile: false"
        log(d, f"compile cache: empty (the warmup compiled nothing: {why})")
        return False
    use_inductor_dir(info.get("inductor_dir"), d)  # before anything lands in Inductor's dir
    torch.compiler.load_cache_artifacts(blob.read_bytes())
    dest = inductor_cache_dir()
    added = merge_inductor_files(files, dest) if files.exists() else 0
    log(
        d,
        f"compile cache: loaded {blob} ({blob.stat().st_size} bytes); {added} Inductor files added to {dest}",
    )
    return not differ


def use_inductor_dir(path: str | None, d: Dist) -> None:
    """Compile in the warmup's Inductor dir (created here when this node lacks it): the cached kernels'
    autotune results are found beside the paths the warmup saved the kernels at."""
    if not path:
        return
    try:
        Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
        why = not_ours(Path(path))
    except OSError as e:
        why = f"cannot create it: {e}"
    if why:  # its files would be loaded as code
        log(
            d,
            f"compile cache: not using the warmup's Inductor dir ({why}); compiling in "
            f"{inductor_cache_dir()}, where the cached kernels are autotuned again",
        )
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


def warm_triton(device: torch.device) -> Future | None:
    """Start what Inductor computes once per process before it loads a cached graph for a GPU, in a
    thread: Triton's hash of its own files and its CUDA launcher module (built by the C compiler where
    Triton's cache lacks it), so the first step does not wait for them. Called once Dynamo is imported:
    the thread imports nothing the main thread may be importing (two threads importing the same modules
    can deadlock)."""
    if device.type != "cuda" or not has_triton():
        return None
    import torch._inductor.runtime.triton_compat  # noqa: F401  (what triton_hash_with_backend imports)

    return background(triton_hash_with_backend, name="triton")


def set_compile_workers(warm: bool, local_world: int) -> int:
    """Size Inductor's pool of compile worker processes, unless TORCHINDUCTOR_COMPILE_THREADS does.

    By default every process starts min(32, cores) workers, each importing torch, at its first compile:
    on a node of N ranks that is N pools fighting over the cores. A warm rank compiles nothing (its
    kernels load from the cache in-process), so it starts none, and its first step's tracing keeps the
    CPU; a cold rank gets its share of the cores."""
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        inductor_config.compile_threads = 1 if warm else max(1, min(32, cores // max(1, local_world)))
    return inductor_config.compile_threads


# ---------------------------------------------------------------------------------------------------------
# the warmup


def _say(msg: str) -> None:
    print(f"warmup: {msg}", file=sys.stderr, flush=True)


def feature_width(shards: list[str]) -> int | None:
    """K*H as the hidden-state manifests record it (None when no manifest exists yet)."""
    widths = set()
    for path in shards:
        m = manifest_path(path)
        if m.exists():
            widths.add(ShardMeta.from_dict(json.loads(m.read_text())).width)
    if len(widths) > 1:
        raise ValueError(f"hidden shards disagree on the feature width: {sorted(widths)}")
    return widths.pop() if widths else None


def random_batch(
    bucket: int, rows: int, width: int, vocab: int, dtype, generator, last_hidden: int = 0
) -> dict:
    """A micro-batch of the training step's shapes; `last_hidden`: H of the target's last hidden state, for
    a family whose loss reads it (0: none)."""
    batch = {
        "input_ids": torch.randint(0, vocab, (rows, bucket), generator=generator),
        "loss_mask": torch.ones(rows, bucket),
        "hidden": torch.randn(rows, bucket, width, generator=generator).to(dtype),
        "tokens": rows * bucket,
        "bucket": bucket,
    }
    if last_hidden:
        batch["last_hidden"] = torch.randn(rows, bucket, last_hidden, generator=generator).to(dtype)
    return batch


def warmup(
    cfg: TrainConfig, drafter_cfg: DrafterConfig, target_dir, shards: list[str], out_dir, world: int = 1
) -> dict:
    """Compile (or, with compile: false, only check) the step per bucket; write ARTIFACTS, INDUCTOR_FILES
    and META. `world`: the training's process count; when it shards the drafter (FSDP), nothing is
    compiled or run here (its graphs are not the unsharded step's, and one GPU may not hold that step)."""
    with fresh_inductor_dir(warmup_inductor_dir(out_dir)) as inductor:
        return _warmup(cfg, drafter_cfg, target_dir, shards, Path(out_dir), inductor, world)


def _warmup(
    cfg: TrainConfig, drafter_cfg: DrafterConfig, target_dir, shards, out: Path, inductor: Path, world: int
):
    dev = device()
    spec = load_spec(target_dir, drafter_cfg)
    initial_weights(drafter_cfg, spec)  # a drafter.init_from that does not fit stops the run here, first
    width = spec.num_features * spec.hidden_size
    stored = feature_width(shards)
    if stored is not None and stored != width:
        raise ValueError(f"hidden shards hold {stored} features per token, the drafter expects {width}")
    key = cache_key(cfg, spec, dev)
    params = sum(p.numel() for p in meta_drafter(spec).parameters())
    sharded = parallel_mode(cfg.parallel, params, world, gpu_bytes(dev)) == "fsdp"
    if sharded:
        _say(
            f"training shards the drafter over {world} processes (FSDP); its graphs are not this "
            "unsharded step's, so nothing is compiled here and every rank compiles"
        )
    step = None if sharded else build_step(cfg, spec, target_dir, dev, drafter_cfg=drafter_cfg)
    # the training's state beside the step, so that its memory is the training's: AdamW's moments (lr 0:
    # the weights stay as built) and, for DDP, the gradient buckets' copy of the gradients
    optimizer = (
        None if sharded else torch.optim.AdamW(step.model.parameters(), lr=0.0, fused=dev.type == "cuda")
    )
    buckets_copy = torch.empty(
        4 * params if world > 1 and not sharded and dev.type == "cuda" else 0, dtype=torch.uint8, device=dev
    )
    g = torch.Generator().manual_seed(cfg.seed)
    seconds, peaks = {}, {}
    for bucket in [] if sharded else sorted(set(cfg.buckets)):
        # the worst case training can meet: every row full, every anchor slot used, in its row slices
        batch = random_batch(
            bucket,
            rows_per_batch(bucket, cfg.batch_tokens),
            width,
            spec.vocab_size,
            step.amp_dtype or torch.float32,
            g,
            spec.hidden_size if needs_last_hidden(drafter_cfg) else 0,
        )
        anchors, valid = anchors_for(step, batch["loss_mask"], g)
        t0 = time.perf_counter()
        for part, a, v in row_slices(step, batch, anchors, valid):
            loss, _ = forward_backward(step, part, a, v)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            peaks[bucket] = torch.cuda.max_memory_allocated(dev)
        seconds[bucket] = round(time.perf_counter() - t0, 3)
        memory = f", peak GPU memory {peaks[bucket] / 2**30:.2f} GiB" if bucket in peaks else ""
        _say(
            f"bucket {bucket}: fwd+bwd {seconds[bucket]:.1f} s, loss {loss.item():.3f}, "
            f"caches {cache_counters()}{memory}"
        )
    del buckets_copy
    blob = b""
    if cfg.compile and not sharded:
        artifacts = torch.compiler.save_cache_artifacts()
        blob = artifacts[0] if artifacts is not None else b""
        _say(f"saved {len(blob)} bytes of compile caches")
    elif not cfg.compile:
        _say(f"compile is false; nothing to compile, writing an empty {ARTIFACTS}")
    try:
        with atomic_path(out / ARTIFACTS) as tmp:
            tmp.write_bytes(blob)
        files = pack_inductor_dir(inductor, out / INDUCTOR_FILES)  # empty when nothing was compiled
        meta = {
            "key": key,
            "compile": cfg.compile,
            "fsdp": sharded,
            "seconds": seconds,
            "peak_gpu_bytes": peaks,
            "inductor_dir": str(inductor),
            "counters": cache_counters(),
            "artifact_bytes": len(blob),
            "inductor_files": files,
            "inductor_bytes": (out / INDUCTOR_FILES).stat().st_size,
        }
        write_json(out / META, meta)
    except BaseException:  # stopped or failed between the files: none of them, rather than a mix
        for name in (ARTIFACTS, INDUCTOR_FILES, META):
            (out / name).unlink(missing_ok=True)
        raise
    return meta
