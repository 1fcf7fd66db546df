"""What speculative decoding asks of a drafter (proposer.py's Proposer), and the proposers that give it:
at most max_draft drafts, distributions at T > 0, a new sequence on reset."""

import pytest
import torch
from model_helpers import MASK, B, V

from flashdraft import speculative
from flashdraft.dflash import FAMILY
from flashdraft.proposer import Proposer
from flashdraft.speculative import DFlashProposer, NgramProposer

CONTEXT = 12  # verified tokens; the drafter's context is all but the last


@pytest.fixture(scope="module")
def sequence(setup):
    """Verified tokens and the target's features of them (random, the tiny drafter's width)."""
    drafter = setup[0]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, MASK, (CONTEXT,), generator=g).tolist()
    width = len(drafter.spec.target_layer_ids) * drafter.spec.hidden_size
    return tokens, torch.randn(1, CONTEXT, width, generator=g)


def dflash(setup, cached: bool = True) -> DFlashProposer:
    drafter, _, _, _, embed, head, _, _ = setup
    return FAMILY.proposer(drafter, embed, head, cached)


def test_the_base_class_is_a_stateless_proposer_that_must_propose():
    p = Proposer()
    assert not p.uses_features and p.reset() is None and p.static(64) is p
    with pytest.raises(NotImplementedError):
        p.propose([1, 2], None, 3, 0.0, None)

    class Repeat(Proposer):
        def propose(self, tokens, new_features, max_draft, temperature, generator):
            return tokens[-1:] * max_draft, None

    r = Repeat()
    assert r.static(8) is r and r.propose([4, 5], None, 3, 0.0, None) == ([5, 5, 5], None)
    assert speculative.Proposer is Proposer  # the engines' users find the one base class there
    assert issubclass(DFlashProposer, Proposer) and issubclass(NgramProposer, Proposer)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("max_draft", [0, 1, 3, B - 1, B + 4])
def test_dflash_proposes_at_most_max_draft_and_its_distributions(setup, sequence, max_draft, temperature):
    tokens, features = sequence
    p = dflash(setup)
    assert p.uses_features and p.block_size == B
    drafts, q = p.propose(tokens, features[:, :-1], max_draft, temperature, torch.Generator().manual_seed(0))
    n = min(max_draft, B - 1)  # a block of B holds the anchor and B - 1 drafts
    assert len(drafts) == n and all(0 <= d < V for d in drafts)
    if temperature == 0:
        assert q is None
    else:
        assert q.shape == (n, V) and torch.allclose(q.sum(-1), torch.ones(n))
        assert all(q[i, d] > 0 for i, d in enumerate(drafts))


def test_dflash_greedy_drafts_are_the_argmax_of_its_distributions(setup, sequence):
    tokens, features = sequence
    greedy, _ = dflash(setup).propose(tokens, features[:, :-1], B - 1, 0.0, None)
    _, q = dflash(setup).propose(tokens, features[:, :-1], B - 1, 1.0, torch.Generator().manual_seed(0))
    assert greedy == q.argmax(-1).tolist()


@pytest.mark.parametrize("cached", [True, False])
def test_reset_starts_a_new_sequence(setup, sequence, cached):
    """A proposer's context grows by the features of each call; reset forgets it."""
    tokens, features = sequence
    gen = torch.Generator().manual_seed(0)
    p = dflash(setup, cached)
    _, first = p.propose(tokens[:6], features[:, :5], B - 1, 1.0, gen)
    _, longer = p.propose(tokens, features[:, 5:-1], B - 1, 1.0, gen)
    p.reset()
    _, again = p.propose(tokens[:6], features[:, :5], B - 1, 1.0, gen)
    assert torch.allclose(again, first, atol=1e-6)
    assert not torch.allclose(longer, first, atol=1e-3)
    _, whole = dflash(setup, cached).propose(tokens, features[:, :-1], B - 1, 1.0, gen)
    assert torch.allclose(longer, whole, atol=1e-5)  # fed in two calls or one: the same context


def test_ngram_proposes_the_latest_continuation_within_max_draft():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    p = NgramProposer(num_draft=4)
    assert p.propose(tokens, None, 8, 0.0, None) == ([7, 8, 5, 1], None)
    assert p.propose(tokens, None, 2, 0.0, None) == ([7, 8], None)
    assert p.propose(tokens, None, 0, 0.0, None) == ([], None)
    assert p.propose([4, 5, 6], None, 3, 0.0, None) == ([], None)  # nothing to look up
