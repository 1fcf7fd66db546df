"""The DFlash family: the drafter of model.py, the block CE of loss.py (its position weights the
objectives.py objective of train.loss) and speculative.py's DFlashProposer."""

from __future__ import annotations

from .drafter_io import init_weights
from .families import Family
from .loss import block_labels, dflash_loss, stats_size, summarize
from .model import DFlashDrafter, DrafterSpec


def loss(step, t: dict, anchors, valid, normalizer=None):
    """dflash_loss of one micro-batch."""
    return dflash_loss(
        step.model,
        t["input_ids"],
        t["loss_mask"],
        t["hidden"],
        anchors,
        valid,
        step.embed,
        step.head,
        step.objective,
        step.attention,
        normalizer=normalizer,
        compile_loss=step.compile_loss,
    )


def normalizer(step, t: dict, anchors, valid):
    _, weights, _ = block_labels(
        t["input_ids"], t["loss_mask"], anchors, valid, step.spec.block_size, step.objective.decay()
    )
    return step.objective.normalizer(weights, valid)


def proposer(drafter, embed_weight, lm_head_weight, cached: bool = True):
    """The evaluation's DFlashProposer (speculative.py, imported here only: it brings the engines)."""
    from .speculative import DFlashProposer

    return DFlashProposer(drafter, embed_weight, lm_head_weight, cached)


def metric_names(block_size: int) -> list[str]:
    return ["loss", "acc", *(f"acc_pos_{k}" for k in range(1, block_size)), "sim_tau", "expected_tau"]


FAMILY = Family(
    name="dflash",
    spec=DrafterSpec,
    drafter=DFlashDrafter,
    loss=loss,
    normalizer=normalizer,
    summarize=summarize,
    metric_names=metric_names,
    stats_size=stats_size,
    proposer=proposer,
    init_weights=init_weights,
)
