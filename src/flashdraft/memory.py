"""GPU memory of every GPU stage, predicted from the config and the target's shapes: the one model the
planner prints and the checks before the first job read (torch-free).

Training, per process (`train_peak`): the drafter's fp32 weights and gradients and AdamW's two fp32
moments (16 bytes a parameter; DDP adds its gradient buckets, a fourth fp32 copy; FSDP divides the state by
the process count and gathers one layer at a time), the target's frozen embedding and LM head in the step's
dtype, one forward's batch on the device (its features, and the target's last hidden state for a family
that reads it), and the activations of one forward+backward: the draft positions (rows x anchor slots x B)
through the decoder layers, the context positions (rows x bucket) through every layer's K/V projection, and
a constant (the LM head's chunk, the kernels' workspace). A micro-batch runs in row slices under
train.batch_anchors (config.slice_size), so its activations are one slice's. The activation coefficients
are measured: benchmarks/memory.py fits them on one GPU (`fit`) and writes them, with each shape's
leave-one-out error, to COEFFICIENTS_FILE; the planner and the checks read them there.

Precompute (`precompute_peak`): the target's weights, every hidden state up to its deepest tapped layer of
one batch of hidden.batch_tokens tokens, one layer's transient activations and the packed features.
Regeneration and evaluation decode with the target (and evaluation with the drafter beside it): weights, KV
cache of their slots and the logits; regeneration's static engine with regenerate.batch_size 0 sizes its
slots from the free memory (decode.auto_slots), so it fits by construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .config import (
    Config,
    feature_layers,
    needs_last_hidden,
    num_anchor_slots,
    rows_per_batch,
    slice_size,
    train_world,
)
from .parallel import parallel_mode

GIB = 2**30
COEFFICIENTS_FILE = "memory_h100.json"  # under benchmarks/results/: the fit the model reads
# The share of the card a stage's predicted peak may take: the allocator's fragmentation and the CUDA
# context live beside what PyTorch counts as allocated.
FIT_FRACTION = 0.92
CUDA_CONTEXT = 600 * 2**20  # the CUDA context and the libraries' handles, beside the allocator
# Before benchmarks/memory.py has fitted the coefficients (or where its file is missing): bytes per unit
# of each activation feature, set high on purpose.
PRIOR = {"draft": {"fp8": 3.0, "bf16": 3.5, "eager": 6.0}, "context": 8.0, "constant": 4 * GIB}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3": 1}


@dataclass(frozen=True)
class Peak:
    """A stage's predicted peak on one GPU: the bytes by part, and the config keys that move it."""

    stage: str
    parts: dict[str, int]
    keys: tuple[str, ...]
    note: str = ""  # what the prediction assumes (or why the stage fits by construction)
    by_construction: bool = False  # sized from the free memory at run time (fits any card)

    @property
    def bytes(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class Sample:
    """A measured point for the fit: the config and shapes it ran, and its steady peak in bytes."""

    cfg: Config
    shapes: dict
    measured: int


@dataclass
class Features:
    """What a training pass's activations scale with (elements), and its variant's name."""

    variant: str
    draft: float  # layers x draft positions x (H + I)
    context: float  # layers x context positions x H
    extra: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------
# shapes


def layer_parameters(c: dict) -> int:
    from .estimate import layer_parameters as per_layer

    return per_layer(c)


def family_parameters(cfg: Config, shapes: dict) -> int:
    """The trained parameters of drafter.family's heads beside the DFlash backbone
    (families.FamilyInfo.head_parameters: DSpark's Markov and confidence heads)."""
    from .families import family_info

    return family_info(cfg.drafter.family).head_parameters(cfg.drafter, shapes)


def drafter_parameters(cfg: Config, shapes: dict) -> int:
    from .estimate import drafter_parameters as backbone

    return backbone(cfg, shapes) + family_parameters(cfg, shapes)


def target_parameters(shapes: dict) -> int:
    from .estimate import num_parameters

    return num_parameters(shapes)


def kv_bytes_per_token(shapes: dict, layers: int, dtype_bytes: int) -> int:
    from .hf_config import attention_shape

    _, kv, d = attention_shape(shapes)
    return 2 * layers * kv * d * dtype_bytes


def amp_bytes(cfg: Config) -> int:
    return DTYPE_BYTES.get(cfg.train.dtype, 2)


def target_bytes(cfg: Config) -> int:
    return DTYPE_BYTES.get(cfg.target.dtype, 2)


# ---------------------------------------------------------------------------------------------------------
# training


def variant(cfg: Config) -> str:
    """The activation coefficients' key: how the step runs (float8 and compiled, bf16 compiled, eager),
    prefixed by a family other than dflash."""
    t = cfg.train
    base = "eager" if not t.compile else "fp8" if t.fp8 else "bf16"
    return base if cfg.drafter.family == "dflash" else f"{cfg.drafter.family}-{base}"


def pass_features(cfg: Config, shapes: dict, bucket: int) -> tuple[Features, int]:
    """The activation features of one forward+backward in `bucket`, and its rows (a slice's)."""
    t, b = cfg.train, cfg.drafter.block_size
    slots = num_anchor_slots(bucket, t.max_anchors, b)
    rows = slice_size(rows_per_batch(bucket, t.batch_tokens), slots, t.batch_anchors)
    h, i, layers = shapes["hidden_size"], shapes["intermediate_size"], cfg.drafter.num_layers
    draft = rows * slots * b
    return Features(variant(cfg), layers * draft * (h + i), layers * rows * bucket * h), rows


def coefficients() -> dict:
    """The fitted activation coefficients (COEFFICIENTS_FILE's), else PRIOR."""
    from .errors import UserError
    from .results import figure

    try:
        return figure(COEFFICIENTS_FILE, "coefficients")
    except UserError:
        return PRIOR


def coefficients_source() -> str:
    """Where `coefficients` comes from, as the planner says it."""
    if coefficients() is PRIOR:
        return f"the prior (no benchmarks/results/{COEFFICIENTS_FILE} yet), set high"
    return f"fitted on one GPU (benchmarks/results/{COEFFICIENTS_FILE})"


def draft_coefficient(coef: dict, name: str) -> float:
    """The bytes per draft feature of variant `name`; a variant the fit lacks takes the largest one of its
    family (else of all): a prediction on the safe side."""
    draft = coef["draft"]
    if name in draft:
        return draft[name]
    family = name.split("-")[0] if "-" in name else None
    same = [v for k, v in draft.items() if family and k.startswith(family + "-")]
    return max(same or draft.values())


def train_state(cfg: Config, shapes: dict, world: int, mode: str) -> dict[str, int]:
    """The bytes that stay through training on one process: weights, gradients, moments (DDP buckets;
    FSDP's shards and one gathered layer), the frozen head."""
    p = drafter_parameters(cfg, shapes)
    v, h = shapes["vocab_size"], shapes["hidden_size"]
    head = 2 * v * h * amp_bytes(cfg)
    if mode == "fsdp":
        layer = layer_parameters(shapes)
        return {
            "weights, gradients and AdamW moments (sharded)": 16 * p // world,
            "one layer gathered (weights and gradients)": 8 * layer,
            "frozen embedding and LM head": head,
        }
    parts = {
        "weights and gradients (fp32)": 8 * p,
        "AdamW moments (fp32)": 8 * p,
        "frozen embedding and LM head": head,
    }
    if mode == "ddp":
        parts["DDP gradient buckets (fp32)"] = 4 * p
    return parts


def config_parallel_mode(cfg: Config, shapes: dict, world: int, gpu_bytes: int | None) -> str:
    return parallel_mode(cfg.train.parallel, drafter_parameters(cfg, shapes), world, gpu_bytes)


def train_peak(
    cfg: Config, shapes: dict, world: int = 1, gpu_bytes: int | None = None, coefficients: dict | None = None
) -> Peak:
    """The training step's peak on one process (the warmup's is the same by construction: it holds the
    same state and runs every bucket's largest forward), over the buckets."""
    coef = coefficients or globals()["coefficients"]()
    mode = config_parallel_mode(cfg, shapes, world, gpu_bytes)
    state = train_state(cfg, shapes, world, mode)
    k = len(feature_layers(shapes["num_hidden_layers"], cfg.drafter))
    h = shapes["hidden_size"]
    width = k * h + (h if needs_last_hidden(cfg.drafter) else 0)
    best = None
    for bucket in sorted(set(cfg.train.buckets)):
        f, rows = pass_features(cfg, shapes, bucket)
        act = {
            "batch on the device": rows * bucket * width * amp_bytes(cfg),
            "activations of one forward+backward": int(
                draft_coefficient(coef, f.variant) * f.draft + coef["context"] * f.context + coef["constant"]
            ),
        }
        if best is None or sum(act.values()) > sum(best[1].values()):
            best = (bucket, act, rows)
    bucket, act, rows = best
    return Peak("train", {**state, **act}, TRAIN_KEYS, note=f"bucket {bucket}, {rows} rows a forward, {mode}")


TRAIN_KEYS = ("train.batch_anchors", "train.batch_tokens", "train.max_anchors")


def largest_batch_anchors(cfg: Config, shapes: dict, world: int, gpu_bytes: int) -> int | None:
    """The largest train.batch_anchors (a multiple of the anchor slots of a row) whose training peak fits
    FIT_FRACTION of `gpu_bytes`; None when not even one row does."""
    t, b = cfg.train, cfg.drafter.block_size
    slots = max(num_anchor_slots(s, t.max_anchors, b) for s in t.buckets)
    most = max(rows_per_batch(s, t.batch_tokens) * num_anchor_slots(s, t.max_anchors, b) for s in t.buckets)
    fits = None
    for n in range(1, -(-most // slots) + 1):
        trial = replace(cfg, train=replace(t, batch_anchors=n * slots))
        if train_peak(trial, shapes, world, gpu_bytes).bytes <= budget(gpu_bytes):
            fits = n * slots
        else:
            break
    return fits


# ---------------------------------------------------------------------------------------------------------
# the target's stages


def precompute_peak(cfg: Config, shapes: dict) -> Peak:
    """One shard job: the target's weights, the hidden states HF keeps of one batch (every layer's up to the
    deepest one read), one layer's MLP activations, and the packed features."""
    t = cfg.hidden.batch_tokens
    h, i = shapes["hidden_size"], shapes["intermediate_size"]
    n = shapes["num_hidden_layers"]
    tapped = feature_layers(n, cfg.drafter)
    deepest = n if needs_last_hidden(cfg.drafter) else max(tapped) + 1
    b = target_bytes(cfg)
    parts = {
        "target weights": target_parameters(shapes) * b,
        "hidden states of one batch": (deepest + 1) * t * h * b,
        "one layer's activations": t * (3 * i + 4 * h) * b,
        "packed features": t * len(tapped) * h * (b + DTYPE_BYTES.get(cfg.hidden.dtype, 2)),
    }
    return Peak("precompute", parts, ("hidden.batch_tokens",))


def regenerate_peak(cfg: Config, shapes: dict, prompt_tokens: int = 1024) -> Peak:
    """One regeneration job (backend hf): the target's weights and its slots' KV cache and logits."""
    r = cfg.regenerate
    b = target_bytes(cfg)
    weights = target_parameters(shapes) * b
    if r.backend != "hf":
        return Peak("regenerate", {}, (), note=f"backend {r.backend}: the server's own", by_construction=True)
    if not r.batch_size:
        return Peak(
            "regenerate",
            {"target weights": weights},
            ("regenerate.batch_size",),
            note="slots sized from the free memory",
            by_construction=True,
        )
    per = (prompt_tokens + r.max_new_tokens) * kv_bytes_per_token(shapes, shapes["num_hidden_layers"], b)
    return Peak(
        "regenerate",
        {
            "target weights": weights,
            "KV cache": r.batch_size * per,
            "logits": r.batch_size * shapes["vocab_size"] * 4,
            "prefill": 2 * GIB,
        },
        ("regenerate.batch_size", "regenerate.max_new_tokens"),
    )


def evaluate_peak(cfg: Config, shapes: dict, prompt_tokens: int = 1024) -> Peak:
    """One evaluation job: the target and the drafter in bf16, both KV caches for one prompt of the longest
    evaluated length, the verify's logits."""
    b = target_bytes(cfg)
    length = prompt_tokens + cfg.eval.max_new_tokens + cfg.drafter.block_size
    parts = {
        "target weights": target_parameters(shapes) * b,
        "drafter weights": drafter_parameters(cfg, shapes) * b,
        "KV caches": length
        * (
            kv_bytes_per_token(shapes, shapes["num_hidden_layers"], b)
            + kv_bytes_per_token(shapes, cfg.drafter.num_layers, b)
        ),
        "logits and activations": cfg.drafter.block_size * shapes["vocab_size"] * 4 + GIB,
    }
    return Peak("evaluate", parts, ("eval.max_new_tokens",))


# ---------------------------------------------------------------------------------------------------------
# the plan and the check


def budget(gpu_bytes: int) -> int:
    """What a stage may take of a card: FIT_FRACTION of it, less the CUDA context."""
    return int(gpu_bytes * FIT_FRACTION) - CUDA_CONTEXT


def stage_peaks(cfg: Config, shapes: dict, world: int, gpu_bytes: int | None) -> list[Peak]:
    """Every GPU stage's predicted peak, in the DAG's order (regeneration only where it runs)."""
    peaks = [
        precompute_peak(cfg, shapes),
        train_peak(cfg, shapes, world, gpu_bytes),
        evaluate_peak(cfg, shapes),
    ]
    if cfg.regenerate.enabled:
        peaks.insert(0, regenerate_peak(cfg, shapes))
    return peaks


def on_gpu(cfg: Config, stage: str) -> bool:
    """Whether `stage` runs on a GPU as configured (gpus.drafter for training, gpus.target for the rest)."""
    return cfg.gpus.drafter > 0 if stage == "train" else cfg.gpus.target > 0


def card(cfg: Config, visible: Callable[[], int | None]) -> tuple[int | None, str]:
    """The GPU memory the jobs get, in bytes, and where that figure comes from: gpus.memory_gib, else the
    visible GPU's (`visible()`: bytes, None when none is) where the jobs run here (gpus.check_visible)."""
    if cfg.gpus.memory_gib:
        return int(cfg.gpus.memory_gib * GIB), "gpus.memory_gib"
    if cfg.gpus.check_visible and (size := visible()):
        return size, "the visible GPU"
    return None, "no GPU visible, gpus.memory_gib unset"


def check(cfg: Config, visible: Callable[[], int | None], target: dict | None = None) -> list[str]:
    """Before the first job: one line per GPU stage whose predicted peak exceeds the card (`card`); none
    when no stage runs on a GPU, the card is unknown or the target's shapes are not on disk yet (`target`:
    its config.json)."""
    from .errors import UserError
    from .estimate_inputs import target_shapes

    if not (cfg.gpus.target or cfg.gpus.drafter):
        return []
    gpu_bytes, where = card(cfg, visible)
    if not gpu_bytes:
        return []
    try:
        shapes = target_shapes(cfg, target)
        return problems(cfg, shapes, train_world(cfg.gpus), gpu_bytes, where)
    except (UserError, KeyError):  # no config.json yet, or not a decoder's: the target's own check names it
        return []


def problems(cfg: Config, shapes: dict, world: int, gpu_bytes: int, where: str) -> list[str]:
    """One line per GPU stage whose predicted peak exceeds `budget(gpu_bytes)`, naming its keys and the
    largest values that fit; `where`: what the card's size is (the visible GPU, gpus.memory_gib)."""
    out = []
    for peak in stage_peaks(cfg, shapes, world, gpu_bytes):
        if not on_gpu(cfg, peak.stage) or peak.by_construction or peak.bytes <= budget(gpu_bytes):
            continue
        head = (
            f"stage {peak.stage}: predicted peak {peak.bytes / GIB:.1f} GiB of GPU memory, more than "
            f"the {budget(gpu_bytes) / GIB:.1f} GiB a {gpu_bytes / GIB:.0f} GiB card ({where}) gives it"
        )
        out.append(f"{head}; {remedy(cfg, shapes, world, gpu_bytes, peak)}")
    return out


def remedy(cfg: Config, shapes: dict, world: int, gpu_bytes: int, peak: Peak) -> str:
    """What to set so that `peak`'s stage fits."""
    if peak.stage == "train":
        n = largest_batch_anchors(cfg, shapes, world, gpu_bytes)
        if n:
            return f"set train.batch_anchors to {n} or less (now {cfg.train.batch_anchors or 'unbounded'})"
        return (
            "not even one row of the largest bucket fits: lower train.max_anchors or the largest of "
            "train.buckets, or train on GPUs with more memory (or more of them: train.parallel fsdp)"
        )
    if peak.stage == "precompute":
        fixed = peak.parts["target weights"]
        per_token = (peak.bytes - fixed) / cfg.hidden.batch_tokens
        tokens = int((budget(gpu_bytes) - fixed) // per_token) if budget(gpu_bytes) > fixed else 0
        if tokens >= cfg.hidden.max_length:
            return (
                f"set hidden.batch_tokens to {tokens // 1024 * 1024} or less (now {cfg.hidden.batch_tokens})"
            )
    if peak.stage == "regenerate":
        return "set regenerate.batch_size to 0 (slots sized from the free memory) or fewer"
    weights = peak.parts.get("target weights", 0) / GIB
    return (
        f"the target's weights alone take {weights:.1f} GiB: serve it on larger GPUs (regenerate.backend "
        "server with tensor parallelism) or a smaller target"
    )


def oom_message(stage: str, peak: Peak | None, gpu_bytes: int | None, allocated: int | None = None) -> str:
    """The one line an out-of-memory error ends a stage with."""
    have = f"{gpu_bytes / GIB:.1f} GiB on this GPU" if gpu_bytes else "the GPU's memory"
    if allocated:
        have += f" ({allocated / GIB:.1f} GiB allocated at the most)"
    predicted = (
        f"predicted peak {peak.bytes / GIB:.1f} GiB ({peak.note or 'the config'})"
        if peak
        else "no prediction"
    )
    keys = ", ".join(peak.keys) if peak and peak.keys else "the stage's batch keys"
    return (
        f"stage {stage} ran out of GPU memory: {predicted}, {have}; lower {keys} (python -m "
        f"flashdraft.plan prints each stage's peak and the values that fit; another process on the "
        f"GPU takes from it too)"
    )


def on_oom(stage: str, cfg: Config, world: int = 1, peak_of: str | None = None) -> None:
    """Make an out-of-memory error end this process with oom_message's line (errors.cli prints it):
    `stage` as the user knows it, its prediction that of `peak_of` (default `stage`) for `cfg` (the
    sections the stage read; the target's shapes from target.path)."""
    from . import errors

    def line() -> str:
        import torch

        from .estimate_inputs import target_shapes

        cuda = torch.cuda.is_available()
        gpu = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if cuda else None
        peaks = {p.stage: p for p in stage_peaks(cfg, target_shapes(cfg), world, gpu)}
        return oom_message(
            stage, peaks.get(peak_of or stage), gpu, torch.cuda.max_memory_allocated() if cuda else None
        )

    errors.oom_line = line


# ---------------------------------------------------------------------------------------------------------
# the fit


def fit(samples: list[Sample]) -> dict:
    """The activation coefficients from measured steady peaks, by least squares on what the state and the
    batch leave: one bytes-per-draft-feature coefficient per variant, one per context feature and one
    constant, all shared. A variant with no sample keeps none (draft_coefficient falls back)."""
    import numpy as np

    if any(len(set(s.cfg.train.buckets)) != 1 for s in samples):
        raise ValueError("fit: each sample runs one bucket (its features are that bucket's)")
    names = sorted({variant(s.cfg) for s in samples})
    rows, ys = [], []
    for s in samples:
        base = train_peak(
            s.cfg, s.shapes, coefficients={"draft": dict.fromkeys(names, 0.0), "context": 0.0, "constant": 0}
        )
        f, _ = pass_features(s.cfg, s.shapes, max(s.cfg.train.buckets))
        rows.append([f.draft if n == f.variant else 0.0 for n in names] + [f.context, 1.0])
        ys.append(s.measured - base.bytes)
    a, y = np.array(rows), np.array(ys, dtype=float)
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1
    x = np.linalg.lstsq(a / scale, y, rcond=None)[0] / scale
    return {
        "draft": {n: round(float(v), 4) for n, v in zip(names, x[:-2], strict=True)},
        "context": round(float(x[-2]), 4),
        "constant": int(x[-1]),
    }


def human(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def headroom(peak: Peak, gpu_bytes: int) -> float:
    return peak.bytes / gpu_bytes if gpu_bytes else math.nan
