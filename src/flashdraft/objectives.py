"""The training objectives (`train.loss`): how the block CE's positions are weighted and what the summed
weighted CE is divided by. One small frozen class per loss, in `OBJECTIVES` by its `train.loss` name;
`objective_for` makes the run's one from the train config. loss.py runs them (`dflash_loss`, and
`ce_chunk` inside the chunked LM-head CE, compiled with `train.compile_loss`: an objective holds plain
ints and floats, so the compiled chunk sees constants).

torch is imported only where a tensor is made, so config_check.py (and the workflow, which never imports
torch) reads the names in `OBJECTIVES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import TrainConfig


@dataclass(frozen=True)
class Objective:
    """A training objective. `block_labels` gives each block position k=1..B-1 a fixed weight:
    loss_mask * exp(-(k-1)/gamma) with the gamma of `decay`, or without one the label mask itself (1
    where there is a label). Per chunk of LM-head rows (whole blocks), `chunk_weights` turns those into
    the weights of the rows' CE; the summed weighted CE is divided by `normalizer`, known before the
    forward."""

    @classmethod
    def from_config(cls, cfg: TrainConfig, block_size: int) -> Objective:
        raise NotImplementedError

    def decay(self) -> float | None:
        """block_labels' gamma, the decay length of the fixed weights; None: the label mask."""
        return None

    def normalizer(self, weights, valid):
        """What the summed weighted CE of a batch is divided by, from block_labels' weights `[b, A, B-1]`
        and the real anchors `valid` `[b, A]`; it must add up over micro-batches and ranks, so a global
        batch is normalized once (see train.py)."""
        raise NotImplementedError

    def chunk_weights(self, ce, w):
        """The weights of one chunk's rows (the flattened positions of whole blocks) from their CE `[N]`
        and fixed weights `w` `[N]`; runs inside the compiled chunk. Default: the fixed weights."""
        return w


@dataclass(frozen=True)
class Decay(Objective):
    """`train.loss: decay`, the DFlash recipe: w = loss_mask * exp(-(k-1)/gamma), normalized by the
    weights' sum."""

    gamma: float

    @classmethod
    def from_config(cls, cfg: TrainConfig, block_size: int) -> Decay:
        return cls(cfg.loss_gamma(block_size))

    def decay(self) -> float:
        return self.gamma

    def normalizer(self, weights, valid):
        return weights.sum()


@dataclass(frozen=True)
class DPace(Objective):
    """`train.loss: dpace`: each block's weights are `dpace_weights` of its own label probabilities
    (detached), computed from the chunk's logits; the fixed weights are the label mask. Normalized by the
    number of real blocks (anchors), not the weights' sum, which would cancel the expected-length credit
    the weights carry (the D-PACE author, sgl-project/SpecForge#828; SpecForge #848 normalizes by anchors
    too)."""

    alpha: float  # train.dpace_alpha
    block_size: int  # B: a block's rows are its B-1 labelled positions

    @classmethod
    def from_config(cls, cfg: TrainConfig, block_size: int) -> DPace:
        return cls(cfg.dpace_alpha, block_size)

    def normalizer(self, weights, valid):
        return valid.sum().to(weights.dtype)

    def chunk_weights(self, ce, w):
        import torch

        width = self.block_size - 1
        mask = w.view(-1, width) > 0
        return dpace_weights(torch.exp(-ce).view(-1, width), mask, self.alpha).flatten()


OBJECTIVES: dict[str, type[Objective]] = {"decay": Decay, "dpace": DPace}


def objective_for(cfg: TrainConfig, block_size: int) -> Objective:
    """The objective `train.loss` names, with its keys from `cfg` and the drafter's block size."""
    kind = OBJECTIVES.get(cfg.loss)
    if kind is None:
        raise ValueError(f"train.loss must be one of {tuple(OBJECTIVES)}, not {cfg.loss!r}")
    return kind.from_config(cfg, block_size)


def dpace_weights(q, label_mask, alpha: float):
    """D-PACE position weights `[N, B-1]` from the drafter's probabilities q of the labels at block
    positions 1..B-1 (D-PACE: Dynamic Position-Aware Cross-Entropy for Parallel Speculative Drafting,
    Wu et al., arXiv 2605.18810, Eq. 7-8; the authors' code github.com/Lucas-TY/D-PACE,
    specforge/core/dflash.py `_dpace_weight`):

        q~_i = (1 - alpha) q_i + alpha                 (smoothing, Eq. 7)
        w_j  = sum_{m >= j} prod_{i <= m} q~_i         (Eq. 8: d E[accepted length] / d log q_j)

    A position without a label (loss mask 0, past the sequence end) is 1 in the products and adds
    nothing to the sums, and gets weight 0, as in the authors' code. The weights are detached: they set
    how much each position's CE counts, the gradient flows only through the CE (Eq. 9)."""
    import torch

    q = q.detach().float()
    smooth = torch.where(label_mask, (1.0 - alpha) * q + alpha, torch.ones_like(q))
    prefix = smooth.cumprod(-1) * label_mask
    return prefix.flip(-1).cumsum(-1).flip(-1) * label_mask
