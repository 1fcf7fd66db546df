"""The DFlash loss and its objectives against DESIGN.md section 3: anchors, labels, loss weights, the
fused LM head + CE, D-PACE's weights and the simulated acceptance."""

import math

import pytest
import torch
import torch.nn.functional as F
from model_helpers import MASK, B, tiny_spec

from flashdraft.config import TrainConfig
from flashdraft.loss import (
    LinearCrossEntropy,
    block_inputs,
    block_labels,
    dflash_loss,
    num_anchor_slots,
    sample_anchors,
    simulated_tau,
    summarize,
    train_forward,
)
from flashdraft.model import DFlashDrafter
from flashdraft.objectives import OBJECTIVES, Decay, DPace, dpace_weights, objective_for


def test_anchors_only_where_loss_mask_at_p_and_p_plus_1():
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 0], [0] * 11 + [1]])
    eligible = {1, 4, 5, 9}
    seen = set()
    for seed in range(30):
        anchors, valid = sample_anchors(loss_mask, 3, B, torch.Generator().manual_seed(seed))
        assert anchors.shape[1] == num_anchor_slots(12, 3, B) and anchors.shape[1] * B % 128 == 0
        got = anchors[0][valid[0]].tolist()
        assert len(got) == 3 and set(got) <= eligible and got == sorted(got)
        assert (anchors[~valid] == -1).all() and not valid[1].any()  # row 1 has no p with mask[p] & mask[p+1]
        seen |= set(got)
    assert seen == eligible  # resampled: every eligible position is drawn at some step


def test_a_samples_anchors_depend_on_its_seed_not_on_its_batch():
    """The same sample (its seed, its loss mask) in two batches of other samples, at another row and
    padded to another length, gets the same anchors; another seed (epoch) other ones."""

    def sample(n, start):
        m = torch.zeros(n)
        m[start:] = 1
        return m

    x, y, z = sample(30, 4), sample(50, 10), sample(20, 2)

    def batch(rows, length):
        return torch.stack([F.pad(r, (0, length - len(r))) for r in rows] + [torch.zeros(length)])

    a1, v1 = sample_anchors(batch([x, y], 64), 6, B, seeds=[7, 8, None])
    a2, v2 = sample_anchors(batch([z, x], 128), 6, B, seeds=[9, 7, None])
    assert torch.equal(a1[0][v1[0]], a2[1][v2[1]]) and v1[0].sum() == 6
    assert not v1[2].any() and not v2[2].any()  # padding rows: no anchors
    a3, v3 = sample_anchors(batch([x], 64), 6, B, seeds=[70, None])
    assert not torch.equal(a1[0][v1[0]], a3[0][v3[0]])
    eligible = set(range(4, 29))
    assert set(a1[0][v1[0]].tolist()) <= eligible and set(a3[0][v3[0]].tolist()) <= eligible


def test_block_inputs_and_unshifted_labels():
    """SpecForge bug 1: block position k predicts token[anchor+k] (no shift by one)."""
    ids = torch.arange(100, 120)[None]
    anchors, valid = torch.tensor([[3, 15, -1]]), torch.tensor([[True, True, False]])
    block, pos = block_inputs(ids, anchors, 4, MASK)
    assert block.view(3, 4)[:2].tolist() == [[103, MASK, MASK, MASK], [115, MASK, MASK, MASK]]
    assert pos.view(3, 4)[:2].tolist() == [[3, 4, 5, 6], [15, 16, 17, 18]]
    loss_mask = torch.ones(1, 20)
    labels, _, label_mask = block_labels(ids, loss_mask, anchors, valid, 4, gamma=7.0)
    assert labels[0, 0].tolist() == [104, 105, 106]  # k = 1, 2, 3 -> token[anchor + k]
    assert labels[0, 1].tolist() == [116, 117, 118]
    assert label_mask[0, :2].all() and not label_mask[0, 2].any()


def test_loss_weights_formula():
    s, gamma = 12, 7.0
    ids = torch.arange(s)[None]
    loss_mask = torch.ones(1, s)
    loss_mask[0, 6] = 0
    anchors, valid = torch.tensor([[2, 8, -1]]), torch.tensor([[True, True, False]])
    _, w, _ = block_labels(ids, loss_mask, anchors, valid, B, gamma)
    expect = torch.zeros(3, B - 1)
    for j, a in enumerate([2, 8]):
        for k in range(1, B):
            if a + k < s:
                expect[j, k - 1] = loss_mask[0, a + k] * math.exp(-(k - 1) / gamma)
    torch.testing.assert_close(w[0], expect)
    assert w[0, 0, 3] == 0 and w[0, 1, 4:].eq(0).all()  # loss_mask 0 at 6; past the end of the sequence


def test_loss_is_weighted_ce_of_predict_block_logits(setup):
    """The training loss, recomputed from inference-time predictions: same positions, same labels."""
    drafter, ids, loss_mask, hidden, embed, head, anchors, valid = setup
    gamma = 4.0
    with torch.no_grad():
        loss, stats = dflash_loss(
            drafter, ids, loss_mask, hidden, anchors, valid, embed, head, Decay(gamma), chunk_blocks=2
        )
    num, den, expected = 0.0, 0.0, []
    for r in range(2):
        for a in anchors[r][valid[r]].tolist():
            logits = drafter.predict_block(hidden[r : r + 1, :a], ids[r, a].item(), embed, head)
            reached, tau = 1.0, 1.0  # expected_tau: each draft position is reached with the product of
            for k in range(1, B):  # the drafter's probabilities of the labels before it, at T=1
                if a + k < ids.shape[1]:
                    w = loss_mask[r, a + k].item() * math.exp(-(k - 1) / gamma)
                    num += w * F.cross_entropy(logits[k - 1], ids[r, a + k]).item()
                    den += w
                p = torch.softmax(logits[k - 1], -1)[ids[r, a + k]].item() if a + k < ids.shape[1] else 0.0
                reached *= p * (a + k < ids.shape[1] and loss_mask[r, a + k].item())
                tau += reached
            expected.append(tau)
    assert loss.item() == pytest.approx(num / den, rel=1e-4)
    row = summarize(stats, B)
    assert row["loss"] == pytest.approx(num / den, rel=1e-4)
    assert row["expected_tau"] == pytest.approx(sum(expected) / len(expected), rel=1e-4)
    assert 1.0 < row["expected_tau"] < B


def test_chunked_loss_equals_unchunked_in_value_and_gradient(setup):
    _, ids, loss_mask, hidden, embed, head, anchors, valid = setup
    grads, losses = [], []
    for chunk in (1, 128):
        torch.manual_seed(1)
        d = DFlashDrafter(tiny_spec())
        loss, _ = dflash_loss(
            d, ids, loss_mask, hidden, anchors, valid, embed, head, Decay(7.0), chunk_blocks=chunk
        )
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in d.parameters()]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)
    assert grads[0].abs().sum() > 0


def test_dpace_weights_are_suffix_sums_of_smoothed_prefix_products():
    """Eq. 7-8 of D-PACE by hand: q~ = (1-a) q + a, w_j = sum_{m>=j} prod_{i<=m} q~_i; an unlabeled
    position is 1 in the products, 0 in the sums and gets weight 0."""
    q = torch.tensor([[0.8, 0.5, 0.2], [0.8, 0.5, 0.2], [0.8, 0.5, 0.2]])
    mask = torch.tensor([[True, True, True], [True, False, True], [True, True, True]])
    w = dpace_weights(q, mask, 0.5)
    p1, p2, p3 = 0.9, 0.9 * 0.75, 0.9 * 0.75 * 0.6
    torch.testing.assert_close(w[0], torch.tensor([p1 + p2 + p3, p2 + p3, p3]))
    torch.testing.assert_close(w[1], torch.tensor([0.9 + 0.9 * 0.6, 0.0, 0.9 * 0.6]))
    assert dpace_weights(q, mask, 1.0)[0].tolist() == [3.0, 2.0, 1.0]  # alpha 1: positions left in the block
    assert (w[0][:-1] >= w[0][1:]).all()  # non-increasing along the block
    assert not dpace_weights(q.requires_grad_(), mask, 0.5).requires_grad  # detached


def test_dpace_loss_is_the_weighted_ce_per_block_with_detached_weights(setup):
    """D-PACE's loss, recomputed from inference-time predictions (weights from the drafter's own label
    probabilities, sum over blocks divided by the number of blocks), and its gradient equals autograd's
    through the CE alone; a given normalizer replaces the batch's own."""
    _, ids, loss_mask, hidden, embed, head, anchors, valid = setup
    torch.manual_seed(2)
    d = DFlashDrafter(tiny_spec())
    alpha, s = 0.3, ids.shape[1]
    loss, stats = dflash_loss(
        d, ids, loss_mask, hidden, anchors, valid, embed, head, DPace(alpha, B), chunk_blocks=2
    )
    loss.backward()
    got = torch.cat([p.grad.flatten() for p in d.parameters()])
    d.zero_grad()
    out = train_forward(d, ids, hidden, anchors, valid, embed, "sdpa")
    num, blocks = 0.0, 0
    for r in range(2):
        for j in valid[r].nonzero().flatten().tolist():
            a = anchors[r, j].item()
            k = torch.arange(1, B)
            inside = (a + k) < s
            lab = ids[r, (a + k).clamp(max=s - 1)]
            ce = F.cross_entropy(out[r, j, 1:] @ head.T, lab, reduction="none")
            m = inside & (loss_mask[r, (a + k).clamp(max=s - 1)] > 0)
            w = dpace_weights(torch.exp(-ce)[None], m[None], alpha)[0]
            num = num + (w * ce).sum()
            blocks += 1
    want_loss = num / blocks
    want_loss.backward()
    want = torch.cat([p.grad.flatten() for p in d.parameters()])
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    assert summarize(stats, B)["loss"] == pytest.approx(want_loss.item(), rel=1e-5)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    assert got.abs().sum() > 0
    with torch.no_grad():
        given, _ = dflash_loss(
            d,
            ids,
            loss_mask,
            hidden,
            anchors,
            valid,
            embed,
            head,
            DPace(alpha, B),
            normalizer=torch.tensor(10.0),
        )
    assert given.item() == pytest.approx(num.item() / 10, rel=1e-5)
    decay, _ = dflash_loss(d, ids, loss_mask, hidden, anchors, valid, embed, head, Decay(4.0))
    assert decay.item() != pytest.approx(loss.item(), rel=1e-3)  # the objective is not ignored
    with pytest.raises(ValueError, match="train.loss"):
        objective_for(TrainConfig(loss="mean"), B)


def test_train_loss_names_its_objective_with_the_config_keys():
    """objective_for: the registered class of train.loss, built from train.gamma / train.dpace_alpha and
    the block size; D-PACE's fixed weights are the label mask (block_labels without a decay)."""
    assert {name: type(objective_for(TrainConfig(loss=name), B)) for name in OBJECTIVES} == OBJECTIVES
    assert objective_for(TrainConfig(loss="decay"), 16) == Decay(7.0)  # train.gamma null: by block size
    assert objective_for(TrainConfig(loss="decay", gamma=3.0), B).decay() == 3.0
    dpace = objective_for(TrainConfig(loss="dpace", dpace_alpha=0.3), B)
    assert dpace == DPace(0.3, B) and dpace.decay() is None
    ids, loss_mask = torch.arange(12)[None], torch.ones(1, 12)
    loss_mask[0, 6] = 0
    anchors, valid = torch.tensor([[2, 8, -1]]), torch.tensor([[True, True, False]])
    _, w, label_mask = block_labels(ids, loss_mask, anchors, valid, B, None)
    assert torch.equal(w, label_mask.float())
    assert dpace.normalizer(w, valid).item() == 2.0  # the blocks, not the weights' sum


@pytest.mark.parametrize("head_dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_equals_autograd_in_value_gradient_and_argmax(head_dtype):
    """The fused LM head + CE (gradient made in the forward, chunk by chunk) against plain autograd over
    the full logits: the same weighted CE sum, the same gradient for h, the same argmax hits."""
    g = torch.Generator().manual_seed(0)
    n, hdim, vocab = 37, 16, 50
    h = torch.randn(n, hdim, generator=g, requires_grad=True)
    head = torch.randn(vocab, hdim, generator=g).to(head_dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    weights = torch.rand(n, generator=g) * (torch.rand(n, generator=g) > 0.3)  # some rows weigh nothing
    logits = (h.to(head_dtype) @ head.T).float()
    want = (F.cross_entropy(logits, labels, reduction="none") * weights).sum()
    (want_grad,) = torch.autograd.grad(want * 2.0, h)  # a power of 2: scaling commutes with rounding
    tol = dict(rtol=1e-5, atol=1e-5) if head_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    for chunk in (1, 8, 64):
        x = h.detach().clone().requires_grad_(True)
        total, correct, ce = LinearCrossEntropy.apply(x, head, labels, weights, chunk)
        (total * 2.0).backward()
        torch.testing.assert_close(total, want.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, want_grad, **tol)
        assert torch.equal(correct, logits.argmax(-1) == labels) and not correct.requires_grad
        # each row's CE, weighted or not: the drafter's probability of its label is exp(-CE)
        torch.testing.assert_close(
            ce, F.cross_entropy(logits, labels, reduction="none").detach(), rtol=1e-5, atol=1e-5
        )
        assert not ce.requires_grad
    assert head.grad is None


@pytest.mark.parametrize("dpace", [None, DPace(0.5, 6)])
def test_compiled_cross_entropy_chunks_equal_eager_ones(dpace):
    """train.compile_loss: the full chunks compiled (the last, shorter chunk eager) give the eager value,
    gradient and argmax hits, with fixed weights and with D-PACE's (blocks of 5 positions)."""
    g = torch.Generator().manual_seed(1)
    n, hdim, vocab, chunk = 2 * 10 + 5, 16, 50, 10
    h = torch.randn(n, hdim, generator=g)
    head = torch.randn(vocab, hdim, generator=g)
    labels = torch.randint(0, vocab, (n,), generator=g)
    weights = (torch.rand(n, generator=g) > 0.3).float()
    out = {}
    for compiled in (False, True):
        x = h.clone().requires_grad_(True)
        total, correct, _ = LinearCrossEntropy.apply(x, head, labels, weights, chunk, dpace, compiled)
        total.backward()
        out[compiled] = total.detach(), correct, x.grad
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[True][1], out[False][1])
    torch.testing.assert_close(out[True][2], out[False][2], rtol=1e-5, atol=1e-6)


def test_compiled_cross_entropy_compiles_at_its_first_full_chunk_under_fail_on_recompile():
    """The first full chunk may come in any step (training's stance is then fail_on_recompile): it compiles
    there once, and a later call that would compile again still fails."""
    import flashdraft.loss as loss_module

    g = torch.Generator().manual_seed(2)
    h, head = torch.randn(20, 16, generator=g), torch.randn(50, 16, generator=g)
    labels, weights = torch.randint(0, 50, (20,), generator=g), torch.ones(20)
    loss_module._compiled_chunks.clear()
    with torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(2):
            total, *_ = LinearCrossEntropy.apply(h, head, labels, weights, 10, None, True)
        assert loss_module.compiled_ce_chunk().ran
        with pytest.raises(RuntimeError, match="fail_on_recompile"):  # another chunk size: a recompile
            LinearCrossEntropy.apply(h, head, labels, weights, 5, None, True)
    want, *_ = LinearCrossEntropy.apply(h, head, labels, weights, 10, None, False)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


def test_expected_tau_is_the_mean_acceptance_length_of_rejection_sampling():
    """expected_tau's acceptance probability of a position, 1 - TV(q, p), is speculative.verify's at T=1:
    over many verify steps with context-free distributions (the drafter's q_k, the target's p_k), the mean
    tokens a step emits (accepted drafts + the bonus) is expected_tau; against a one-hot target (a DFlash
    store's token y) the probability is q(y), what dflash_loss counts."""
    from flashdraft.loss import expected_tau
    from flashdraft.speculative import verify

    g = torch.Generator().manual_seed(0)
    n, vocab, trials = 3, 6, 4000
    q = torch.softmax(torch.randn(n, vocab, generator=g) * 1.5, -1)
    y = torch.tensor([2, 0, 4])
    one_hot = torch.full((n + 1, vocab), -math.inf)
    one_hot[torch.arange(n), y], one_hot[n, 0] = 0.0, 0.0
    spread = torch.randn(n + 1, vocab, generator=g) * 1.5
    for logits, accept in [(spread, None), (one_hot, q[torch.arange(n), y])]:
        p = torch.softmax(logits, -1)[:n]
        if accept is None:
            accept = 1 - (q - p).abs().sum(-1) / 2
        want = float(expected_tau(accept[None])[0])
        emitted = 0
        for _ in range(trials):
            draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(n)]
            emitted += verify(draft, logits, q, 1.0, g)[0] + 1
        # a step emits 1..n+1 tokens: sd <= (n+1)/2, so 4 sd of the mean
        assert abs(emitted / trials - want) < 4 * (n + 1) / 2 / trials**0.5, (emitted / trials, want)
        # and the check can tell: 1 - L1 (no half) for the acceptance probability is far off
        wrong = float(expected_tau((1 - (q - p).abs().sum(-1)).clamp(0)[None])[0])
        assert abs(emitted / trials - wrong) > 0.2


def test_simulated_tau_and_per_position_metrics():
    hit = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert simulated_tau(hit).tolist() == [3.0, 1.0, 5.0]  # accepted prefix + the bonus token
    stats = torch.tensor([6.0, 3.0, 9.0, 3.0, 2, 3, 2, 3, 3, 3, 3, 3, 7.5])  # B = 5: 4 positions
    row = summarize(stats, 5)
    assert row["loss"] == 2.0 and row["sim_tau"] == 3.0 and row["acc"] == 10 / 12
    assert row["expected_tau"] == 2.5
    assert [row[f"acc_pos_{k}"] for k in range(1, 5)] == [2 / 3, 1.0, 2 / 3, 1.0]
