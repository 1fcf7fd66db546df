"""The training step, shared by the loop (train.py) and the compile warmup (compile_cache.py) so both
compile the same graphs: the drafter, the target's frozen head, and one forward+backward."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from .config import DrafterConfig, TrainConfig, slice_size
from .families import Family, family
from .float8 import float8_linears
from .hf_config import plain_target_config, read_target_config
from .io import torch_dtype
from .loss import resolve_attention, sample_anchors
from .model import DrafterSpec
from .objectives import Objective, objective_for
from .target import load_target_head


@dataclass
class Step:
    """Everything one forward+backward needs besides the batch."""

    model: torch.nn.Module  # the drafter, compiled in place, maybe wrapped in DDP
    spec: DrafterSpec
    family: Family  # the drafter's family: its loss
    embed: torch.Tensor  # frozen target embedding [V, H]
    head: torch.Tensor  # frozen target LM head [V, H]
    objective: Objective  # train.loss with its keys (objectives.objective_for)
    attention: str  # flex | sdpa
    max_anchors: int
    compile_loss: bool  # train.compile_loss: the LM head's chunked CE compiled
    device: torch.device
    amp_dtype: torch.dtype | None  # autocast dtype (GPU), None: plain float32 (CPU)
    options: Any = None  # what the family's loss reads besides the objective (Family.loss_options)
    batch_anchors: int = 0  # train.batch_anchors: anchor slots of one forward+backward (0: no bound)


def load_spec(target_dir, drafter_cfg: DrafterConfig, tokenizer_length: int | None = None) -> DrafterSpec:
    """The drafter's spec from the target's config and tokenizer (`tokenizer_length`: its length, where an
    earlier stage has read it). transformers is imported only for what config.json alone cannot give
    exactly: it costs seconds of every training process's start, and its AutoTokenizer pulls in
    generation (and scikit-learn)."""
    raw = read_target_config(target_dir)  # refuses remote code before transformers sees the directory
    config = plain_target_config(raw)
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(target_dir)
    tokens = tokenizer_length  # a set drafter.mask_token_id needs no tokenizer; else MASK at len(tokenizer)
    if drafter_cfg.mask_token_id is None and tokens is None:
        from transformers import AutoTokenizer

        tokens = len(AutoTokenizer.from_pretrained(target_dir))
    return family(drafter_cfg.family).spec.from_target(config, tokens, drafter_cfg)


@dataclass(frozen=True)
class Resolved:
    """train.dtype and train.attention as they apply on one device, decided once: the step, the batches'
    dtype and the compile cache's key all read them here."""

    amp_dtype: torch.dtype | None  # autocast dtype on a GPU; None: plain float32 (the CPU, or float32)
    attention: str  # flex | sdpa

    @property
    def dtype(self) -> str:
        """The name of the dtype the step computes in."""
        return "float32" if self.amp_dtype is None else str(self.amp_dtype).removeprefix("torch.")


def resolve(cfg: TrainConfig, device: torch.device) -> Resolved:
    """auto attention is flex on a GPU and SDPA on the CPU (loss.resolve_attention); train.dtype applies
    on a GPU only: the CPU trains in float32."""
    amp = torch_dtype(cfg.dtype) if device.type == "cuda" and cfg.dtype != "float32" else None
    return Resolved(amp, resolve_attention(cfg.attention, device))


def frozen_head(target_dir, device: torch.device, dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
    """The target's (embedding, LM head) on `device`, in the step's dtype (float32 without autocast)."""
    return tuple(t.to(device, dtype or torch.float32) for t in load_target_head(target_dir, device))


def build_step(
    cfg: TrainConfig,
    spec: DrafterSpec,
    target_dir,
    device: torch.device,
    init: dict | None = None,
    head: Future | None = None,
    drafter_cfg: DrafterConfig | None = None,
) -> Step:
    """A seeded fp32 drafter on `device` (compiled in place when cfg.compile) and the target's frozen head;
    `init`: weights to start from (drafter_io.init_weights of drafter.init_from); `head`: frozen_head's, read
    in the background while the drafter is built (None: read here)."""
    torch.manual_seed(cfg.seed)
    kind = family(spec.family)
    with torch.device(device):  # initialized where it runs, not on one CPU core and then moved
        drafter = kind.drafter(spec)
    if init is not None:
        drafter.load_state_dict(init, strict=True)
    if cfg.fp8:
        float8_linears(drafter, cfg.fp8, device)
    if cfg.compile:
        compile_drafter(drafter, cfg.compile_scope)
    run = resolve(cfg, device)
    embed, head = head.result() if head is not None else frozen_head(target_dir, device, run.amp_dtype)
    options = kind.loss_options(cfg, drafter_cfg or DrafterConfig(family=spec.family), spec)
    return Step(
        drafter,
        spec,
        kind,
        embed,
        head,
        objective_for(cfg, spec.block_size),
        run.attention,
        cfg.max_anchors,
        cfg.compile_loss,
        device,
        run.amp_dtype,
        options,
        cfg.batch_anchors,
    )


def compile_drafter(drafter: torch.nn.Module, scope: str) -> None:
    """torch.compile the drafter in place, one graph per length bucket (dynamic=False keeps shapes static,
    the buckets bound the recompiles). scope "layer": the decoder layers share one compiled graph (one
    code object, the parameters are its inputs), so Dynamo traces one layer instead of all of them."""
    if scope == "model":
        drafter.compile(dynamic=False)
        return
    for layer in drafter.layers:
        layer.compile(dynamic=False)
    drafter.context = torch.compile(drafter.context, dynamic=False)


def initial_weights(drafter_cfg: DrafterConfig, spec: DrafterSpec) -> dict | None:
    """drafter.init_from's weights, checked against `spec` (None: a fresh drafter)."""
    return family(spec.family).init_weights(drafter_cfg.init_from, spec) if drafter_cfg.init_from else None


def anchors_for(step: Step, loss_mask, generator=None, seeds=None):
    anchors, valid = sample_anchors(loss_mask, step.max_anchors, step.spec.block_size, generator, seeds)
    return anchors.to(step.device), valid.to(step.device)


def batch_tensors(step: Step, batch: dict) -> dict:
    """The batch's tensors the loss reads, on the step's device."""
    return {k: batch[k].to(step.device, non_blocking=True) for k in LOSS_INPUTS if k in batch}


LOSS_INPUTS = ("input_ids", "loss_mask", "hidden", "last_hidden")


def batch_normalizer(step: Step, batch: dict, anchors, valid) -> torch.Tensor:
    """This micro-batch's share of the loss normalizer (the family's), known before its forward."""
    t = {k: batch[k].to(step.device, non_blocking=True) for k in ("input_ids", "loss_mask")}
    return step.family.normalizer(step, t, anchors, valid).double()


def row_slices(step: Step, batch: dict, anchors, valid) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
    """The forward+backward passes a micro-batch runs as: itself, or under train.batch_anchors equal row
    slices (config.slice_size; the last padded with empty rows, which hold no anchor), each a (batch,
    anchors, valid). Their gradients, each scaled by the step's normalizer, add up to the micro-batch's;
    the batch's token count goes with the first slice."""
    rows, slots = anchors.shape
    per = slice_size(rows, slots, step.batch_anchors)
    if per >= rows:
        return [(batch, anchors, valid)]
    out = []
    for start in range(0, rows, per):
        part = {
            k: pad_rows(v[start : start + per], per, 0) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()
        }
        part["tokens"] = batch["tokens"] if start == 0 else 0
        out.append(
            (
                part,
                pad_rows(anchors[start : start + per], per, -1),
                pad_rows(valid[start : start + per], per, False),
            )
        )
    return out


def pad_rows(t: torch.Tensor, rows: int, value) -> torch.Tensor:
    """`t` with rows of `value` appended up to `rows` rows."""
    if len(t) == rows:
        return t
    return torch.cat([t, t.new_full((rows - len(t), *t.shape[1:]), value)])


def forward_backward(step: Step, batch: dict, anchors, valid, normalizer=None):
    """Loss, backward; returns (detached loss, stats). The optimizer step is the caller's. normalizer:
    what the summed loss is divided by (None: this batch's own, the family's `normalizer`)."""
    dev = step.device
    t = batch_tensors(step, batch)
    with torch.autocast(dev.type, dtype=step.amp_dtype or torch.bfloat16, enabled=step.amp_dtype is not None):
        loss, stats = step.family.loss(step, t, anchors, valid, normalizer)
    loss.backward()
    return loss.detach(), stats
