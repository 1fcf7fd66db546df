"""The DFlash family (dflash.py): what the trainer, the validation and the evaluation ask of a family, against
loss.py's dflash_loss on the tiny drafter."""

from types import SimpleNamespace

import pytest
import torch
from model_helpers import B, tiny_spec

from flashdraft import dflash, loss
from flashdraft.drafter_io import init_weights
from flashdraft.families import FAMILIES, family, family_of_export
from flashdraft.model import DFlashDrafter, DrafterSpec
from flashdraft.objectives import Decay, DPace
from flashdraft.speculative import DFlashProposer

FAMILY = dflash.FAMILY
OBJECTIVES = [Decay(7.0), DPace(0.5, B)]


def step(setup, objective):
    """What the family's loss reads of a training step (train_step.Step)."""
    drafter, _, _, _, embed, head, _, _ = setup
    return SimpleNamespace(
        model=drafter,
        spec=drafter.spec,
        embed=embed,
        head=head,
        objective=objective,
        attention="sdpa",
        compile_loss=False,
    )


def batch(setup, rows=slice(None)):
    """The setup batch's tensors, anchors and valid anchors (its rows `rows`)."""
    _, ids, loss_mask, hidden, _, _, anchors, valid = setup
    tensors = {"input_ids": ids[rows], "loss_mask": loss_mask[rows], "hidden": hidden[rows]}
    return tensors, anchors[rows], valid[rows]


def test_the_registry_names_this_module_s_family():
    assert FAMILIES["dflash"].module == dflash.__name__ and family("dflash") is FAMILY
    assert FAMILY.name == "dflash" and FAMILY.spec is DrafterSpec and FAMILY.drafter is DFlashDrafter
    assert FAMILY.init_weights is init_weights and FAMILY.summarize is loss.summarize
    assert family_of_export(tiny_spec().to_config_dict()) is FAMILY


@pytest.mark.parametrize("objective", OBJECTIVES, ids=["decay", "dpace"])
def test_the_loss_is_dflash_loss_of_the_step_s_objective(setup, objective):
    drafter, ids, loss_mask, hidden, embed, head, anchors, valid = setup
    t, a, v = batch(setup)
    another = OBJECTIVES[1] if objective is OBJECTIVES[0] else OBJECTIVES[0]
    with torch.no_grad():
        got, stats = FAMILY.loss(step(setup, objective), t, a, v)
        want, want_stats = loss.dflash_loss(
            drafter, ids, loss_mask, hidden, anchors, valid, embed, head, objective, "sdpa"
        )
        other, _ = loss.dflash_loss(
            drafter, ids, loss_mask, hidden, anchors, valid, embed, head, another, "sdpa"
        )
    assert torch.allclose(got, want) and torch.allclose(stats, want_stats)
    assert not torch.allclose(got, other)  # the objective the step names, not another
    assert got.isfinite() and got > 0


@pytest.mark.parametrize("objective", OBJECTIVES, ids=["decay", "dpace"])
def test_the_normalizer_is_the_loss_s_and_adds_up_over_rows(setup, objective):
    """A global batch's normalizer is the sum of its micro-batches' (train.py divides by it once)."""
    s = step(setup, objective)
    t, a, v = batch(setup)
    n = FAMILY.normalizer(s, t, a, v)
    with torch.no_grad():
        own, stats = FAMILY.loss(s, t, a, v)
        given, _ = FAMILY.loss(s, t, a, v, normalizer=2 * n)
    assert torch.isclose(stats[1], n.float())  # the stats' normalizer sum
    assert torch.allclose(given * 2, own)
    if isinstance(objective, DPace):  # the real blocks
        assert n == v.sum() == 5
    else:  # the decayed weights' sum
        _, weights, _ = loss.block_labels(t["input_ids"], t["loss_mask"], a, v, B, objective.gamma)
        assert torch.isclose(n, weights.sum()) and n < v.sum() * (B - 1)
    parts = [FAMILY.normalizer(s, *batch(setup, slice(r, r + 1))) for r in (0, 1)]
    assert torch.isclose(parts[0] + parts[1], n) and (parts[0] > 0) and (parts[1] > 0)


def test_metric_names_are_the_summary_s_columns(setup):
    t, a, v = batch(setup)
    with torch.no_grad():
        _, stats = FAMILY.loss(step(setup, OBJECTIVES[0]), t, a, v)
    names = FAMILY.metric_names(B)
    assert list(FAMILY.summarize(stats, B)) == names and len(stats) == FAMILY.stats_size(B)
    assert names[:2] == ["loss", "acc"] and names[-2:] == ["sim_tau", "expected_tau"]
    assert [n for n in names if n.startswith("acc_pos_")] == [f"acc_pos_{k}" for k in range(1, B)]
    assert len(FAMILY.metric_names(4)) == len(names) - (B - 4)


@pytest.mark.parametrize("cached", [True, False])
def test_the_proposer_is_speculative_s_dflash_proposer(setup, cached):
    drafter, _, _, _, embed, head, _, _ = setup
    p = FAMILY.proposer(drafter, embed, head, cached=cached)
    assert type(p) is DFlashProposer and p.cached is cached and p.uses_features
    assert p.drafter is drafter and p.embed is embed and p.head is head and p.block_size == B
