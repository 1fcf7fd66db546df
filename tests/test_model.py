"""The DFlash drafter against DESIGN.md section 3: masks, anchors, labels, loss weights, export format."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import run_python
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3ForCausalLM

from flashdraft.config import DrafterConfig, TrainConfig
from flashdraft.drafter_io import export_drafter, load_drafter
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
from flashdraft.model import DFlashDrafter, DraftCache, DrafterSpec, dense_mask, dflash_mask_mod
from flashdraft.objectives import OBJECTIVES, Decay, DPace, dpace_weights, objective_for
from flashdraft.target import load_target_head

B = 8  # block size of the tiny drafter
V = 100
MASK = 99


def tiny_spec(**kw) -> DrafterSpec:
    base = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                num_layers=2, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V,
                max_position_embeddings=512, block_size=B, mask_token_id=MASK, target_layer_ids=[1, 3],
                num_target_layers=6)
    return DrafterSpec(**{**base, **kw})


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    spec = tiny_spec()
    drafter = DFlashDrafter(spec).eval()
    s = 40
    ids = torch.randint(0, MASK, (2, s))
    loss_mask = torch.zeros(2, s)
    loss_mask[0, 10:] = 1
    loss_mask[1, 5:30] = 1
    hidden = torch.randn(2, s, 2 * 64)
    embed, head = torch.randn(V, 64), torch.randn(V, 64) * 0.1
    anchors = torch.full((2, 16), -1)
    anchors[0, :3] = torch.tensor([12, 20, 30])
    anchors[1, :2] = torch.tensor([6, 25])
    return drafter, ids, loss_mask, hidden, embed, head, anchors, anchors >= 0


def block_out(setup, hidden=None, ids=None, attention="sdpa"):
    drafter, ids0, _, hidden0, embed, _, anchors, valid = setup
    with torch.no_grad():
        return train_forward(drafter, ids0 if ids is None else ids, hidden0 if hidden is None else hidden,
                             anchors, valid, embed, attention)


def test_feature_layers_and_mask_id_for_qwen3_8b_shape():
    config = Qwen3Config(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                         rope_theta=1e6)
    spec = DrafterSpec.from_target(config, 151669, DrafterConfig())
    assert spec.target_layer_ids == [1, 9, 17, 25, 33]
    assert (spec.num_layers, spec.block_size, spec.mask_token_id) == (5, 16, 151669)
    assert (spec.num_kv_heads, spec.head_dim, spec.rope_theta, spec.num_target_layers) == (8, 128, 1e6, 36)
    assert DFlashDrafter(tiny_spec()).fc.weight.shape == (64, 2 * 64)  # fc: K*H -> H, no bias
    assert DFlashDrafter(tiny_spec()).fc.bias is None


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


def test_mask_context_strictly_before_anchor_own_block_only_padded_sees_nothing():
    anchors, valid = torch.tensor([[5, 9, -1]]), torch.tensor([[True, True, False]])
    s, bs = 12, 4
    mod = dflash_mask_mod(anchors, valid, s, bs)
    q, kv = torch.arange(3 * bs)[:, None], torch.arange(s + 3 * bs)[None, :]
    m = mod(torch.tensor(0), 0, q, kv)
    assert m[0, :5].all() and not m[0, 5:s].any()  # block 0 (anchor 5): context 0..4, not 5 (strict)
    assert m[bs, :9].all() and not m[bs, 9:s].any()  # block 1 (anchor 9): context 0..8
    assert m[:bs, s : s + bs].all() and not m[:bs, s + bs :].any()  # own block, bidirectional; not block 1
    assert m[bs : 2 * bs, s + bs : s + 2 * bs].all() and not m[bs : 2 * bs, s : s + bs].any()
    assert not m[2 * bs :].any()  # the padded block sees nothing
    dense, keep = dense_mask(anchors, valid, s, bs)
    assert torch.equal(dense[0, 0, : 2 * bs], m[: 2 * bs])
    # SDPA path: the padded block attends only to itself (no NaN rows) and its output is zeroed
    assert dense[0, 0, 2 * bs :, s + 2 * bs :].all() and dense[0, 0, 2 * bs :].sum() == bs * bs
    assert keep[0, 0, :, 0].tolist() == [True] * 2 * bs + [False] * bs


def test_context_is_visible_strictly_before_the_anchor(setup):
    """SpecForge bug 2: context up to and including the anchor (`<=`) leaks the next token."""
    hidden = setup[3]
    ref = block_out(setup)
    at = hidden.clone()
    at[0, 20] += 5.0  # features AT anchor 20 (block 1 of row 0)
    out = block_out(setup, hidden=at)
    assert torch.equal(out[0, 1], ref[0, 1])  # the anchor's block does not see them
    assert not torch.allclose(out[0, 2], ref[0, 2])  # block at 30 does
    before = hidden.clone()
    before[0, 19] += 5.0
    assert not torch.allclose(block_out(setup, hidden=before)[0, 1], ref[0, 1])


def test_blocks_do_not_see_each_other_and_padded_blocks_see_nothing(setup):
    ids = setup[1].clone()
    ids[0, 20] = (ids[0, 20] + 1) % MASK  # the anchor token of block 1 (and a context position of none)
    ref, out = block_out(setup), block_out(setup, ids=ids)
    assert not torch.allclose(out[0, 1], ref[0, 1])
    assert torch.equal(out[0, 0], ref[0, 0]) and torch.equal(out[0, 2], ref[0, 2])
    assert torch.equal(out[1], ref[1])
    noise = setup[3] + torch.randn_like(setup[3])
    padded = block_out(setup, hidden=noise)[0, 3:]
    assert torch.equal(padded, ref[0, 3:])  # padded blocks: independent of everything real


def test_attention_is_bidirectional_inside_a_block(setup):
    drafter, _, _, hidden, embed, _, _, _ = setup
    embeds = torch.randn(1, B, 64)
    positions = torch.arange(10 + B)[None]
    with torch.no_grad():
        ref = drafter(hidden[:1, :10], embeds, positions)
        changed = embeds.clone()
        changed[0, -1] += 1.0  # the last block token
        out = drafter(hidden[:1, :10], changed, positions)
    assert not torch.allclose(out[0, 0], ref[0, 0])  # ...reaches the first one


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_forward_agrees_with_sdpa_on_cpu(setup):
    """flex_attention runs its forward on CPU (eager), not its backward: the training path there is SDPA."""
    sdpa, flex = block_out(setup, attention="sdpa"), block_out(setup, attention="flex")
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-4)


def test_sliding_window_mask_keeps_the_w_context_positions_up_to_each_query():
    """W = 6, B = 4, anchor 9: the query at block position k (position 9 + k) sees context 4+k..8, its
    whole block, nothing else; the dense SDPA mask is built from the same function."""
    anchors, valid = torch.tensor([[9, 2, -1]]), torch.tensor([[True, True, False]])
    s, bs, w = 12, 4, 6
    m = dflash_mask_mod(anchors, valid, s, bs, w)(torch.tensor(0), 0, torch.arange(3 * bs)[:, None],
                                                      torch.arange(s + 3 * bs)[None, :])
    for k in range(bs):
        assert m[k, :s].nonzero().flatten().tolist() == list(range(9 + k - w + 1, 9)), k
        assert m[k, s : s + bs].all() and not m[k, s + bs :].any()  # its whole block, bidirectional
    assert m[bs, :s].nonzero().flatten().tolist() == [0, 1]  # anchor 2: the window holds all its context
    assert not m[2 * bs :].any()
    full = dflash_mask_mod(anchors, valid, s, bs)(torch.tensor(0), 0, torch.arange(3 * bs)[:, None],
                                                  torch.arange(s + 3 * bs)[None, :])
    assert torch.equal(m[bs : 2 * bs], full[bs : 2 * bs]) and m[:bs, :s].sum() < full[:bs, :s].sum()
    dense, _ = dense_mask(anchors, valid, s, bs, w)
    assert torch.equal(dense[0, 0, : 2 * bs], m[: 2 * bs])


@pytest.fixture(scope="module")
def windowed(setup):
    torch.manual_seed(3)
    return DFlashDrafter(tiny_spec(sliding_window=12)).eval()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_windowed_training_forward_drafting_and_cache_agree(setup, windowed):
    """With a window, the training forward (SDPA and flex), predict_block and cached drafting give the
    same logits; features beyond the window change nothing, those inside do."""
    _, ids, _, hidden, embed, head, anchors, valid = setup
    with torch.no_grad():
        train = train_forward(windowed, ids, hidden, anchors, valid, embed, "sdpa")
        flex = train_forward(windowed, ids, hidden, anchors, valid, embed, "flex")
    torch.testing.assert_close(flex, train, atol=1e-5, rtol=1e-4)
    a = anchors[0, 2].item()  # 30: a query at 30 + k sees context > 30 + k - 12, i.e. from 19 + k
    logits = windowed.predict_block(hidden[:1, :a], ids[0, a].item(), embed, head)
    torch.testing.assert_close(logits, train[0, 2, 1:] @ head.T, atol=1e-4, rtol=1e-4)
    far, near = hidden.clone(), hidden.clone()
    far[0, :19] += 5.0
    near[0, 19] += 5.0
    assert torch.equal(windowed.predict_block(far[:1, :a], ids[0, a].item(), embed, head), logits)
    assert not torch.allclose(windowed.predict_block(near[:1, :a], ids[0, a].item(), embed, head), logits)
    cache, s = DraftCache(), 0
    for new in [9, 1, 14, B, 2]:
        got = windowed.predict_block_cached(hidden[:1, s : s + new], ids[0, s + new].item(), embed, head,
                                            cache, s + new)
        s += new
        want = windowed.predict_block(hidden[:1, :s], ids[0, s].item(), embed, head)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        short = windowed.predict_block_cached(hidden[:1, :0], ids[0, s].item(), embed, head, cache, s, 3)
        torch.testing.assert_close(short, windowed.predict_block(hidden[:1, :s], ids[0, s].item(), embed,
                                                                 head, 3), atol=1e-5, rtol=1e-5)


def test_windowed_export_writes_the_engines_keys_and_round_trips(setup, windowed, tmp_path):
    _, ids, _, hidden, embed, head, _, _ = setup
    export_drafter(windowed, windowed.spec, tmp_path / "drafter")
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 3], "use_swa": True,
                                       "swa_window_size": 12, "causal": False}
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["sliding_window"] == 12
    assert config["use_sliding_window"] is True and config["is_causal"] is False
    loaded, spec = load_drafter(tmp_path / "drafter")
    assert spec == windowed.spec and spec.sliding_window == 12
    a = 30
    torch.testing.assert_close(loaded.predict_block(hidden[:1, :a], ids[0, a].item(), embed, head),
                               windowed.predict_block(hidden[:1, :a], ids[0, a].item(), embed, head))
    plain = tiny_spec().to_config_dict()
    assert "use_swa" not in plain["dflash_config"] and "is_causal" not in plain
    assert DrafterSpec.from_config_dict(plain).sliding_window is None
    # an export of another engine that windows by use_swa alone, over all-full layer_types
    other = {**plain, "dflash_config": {**plain["dflash_config"], "use_swa": True, "swa_window_size": 64}}
    assert DrafterSpec.from_config_dict(other).sliding_window == 64


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
        loss, stats = dflash_loss(drafter, ids, loss_mask, hidden, anchors, valid, embed, head, Decay(gamma),
                                  chunk_blocks=2)
    num, den = 0.0, 0.0
    for r in range(2):
        for a in anchors[r][valid[r]].tolist():
            logits = drafter.predict_block(hidden[r : r + 1, :a], ids[r, a].item(), embed, head)
            for k in range(1, B):
                if a + k < ids.shape[1]:
                    w = loss_mask[r, a + k].item() * math.exp(-(k - 1) / gamma)
                    num += w * F.cross_entropy(logits[k - 1], ids[r, a + k]).item()
                    den += w
    assert loss.item() == pytest.approx(num / den, rel=1e-4)
    assert summarize(stats, B)["loss"] == pytest.approx(num / den, rel=1e-4)


def test_predict_block_equals_training_forward(setup):
    drafter, ids, _, hidden, embed, head, anchors, _ = setup
    train = block_out(setup)
    for r, j in [(0, 0), (0, 2), (1, 1)]:
        a = anchors[r, j].item()
        logits = drafter.predict_block(hidden[r : r + 1, :a], ids[r, a].item(), embed, head)
        torch.testing.assert_close(logits, train[r, j, 1:] @ head.T, atol=1e-4, rtol=1e-4)


def test_cached_drafting_equals_predict_block_over_the_full_context(setup):
    """Speculative decoding's drafter: the context's keys/values are cached and grow by the positions
    each verify step accepts (the prompt first, then accepted drafts + 1); the block is recomputed."""
    drafter, ids, _, hidden, embed, head, _, _ = setup
    cache, s = DraftCache(), 0
    for new in [9, 1, 4, B, 2, 1, 7]:
        got = drafter.predict_block_cached(hidden[:1, s : s + new], ids[0, s + new].item(), embed, head,
                                           cache, s + new)
        s += new
        want = drafter.predict_block(hidden[:1, :s], ids[0, s].item(), embed, head)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert cache.length == s and all(k.shape[2] == s for k in cache.k + cache.v)
    assert len(cache.k) == drafter.spec.num_layers
    # the caller's count of verified tokens must match: a rejected draft that entered the cache is caught
    with pytest.raises(AssertionError, match="holds 33 positions, not 32"):
        drafter.predict_block_cached(hidden[:1, s : s + 1], ids[0, s + 1].item(), embed, head, cache, s)


def test_chunked_loss_equals_unchunked_in_value_and_gradient(setup):
    _, ids, loss_mask, hidden, embed, head, anchors, valid = setup
    grads, losses = [], []
    for chunk in (1, 128):
        torch.manual_seed(1)
        d = DFlashDrafter(tiny_spec())
        loss, _ = dflash_loss(d, ids, loss_mask, hidden, anchors, valid, embed, head, Decay(7.0),
                              chunk_blocks=chunk)
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
    loss, stats = dflash_loss(d, ids, loss_mask, hidden, anchors, valid, embed, head, DPace(alpha, B),
                              chunk_blocks=2)
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
        given, _ = dflash_loss(d, ids, loss_mask, hidden, anchors, valid, embed, head, DPace(alpha, B),
                               normalizer=torch.tensor(10.0))
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
        total, correct = LinearCrossEntropy.apply(x, head, labels, weights, chunk)
        (total * 2.0).backward()
        torch.testing.assert_close(total, want.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, want_grad, **tol)
        assert torch.equal(correct, logits.argmax(-1) == labels) and not correct.requires_grad
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
        total, correct = LinearCrossEntropy.apply(x, head, labels, weights, chunk, dpace, compiled)
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
    loss_module._compiled_ce_chunk = None
    with torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(2):
            total, _ = LinearCrossEntropy.apply(h, head, labels, weights, 10, None, True)
        assert loss_module.compiled_ce_chunk().ran
        with pytest.raises(RuntimeError, match="fail_on_recompile"):  # another chunk size: a recompile
            LinearCrossEntropy.apply(h, head, labels, weights, 5, None, True)
    want, _ = LinearCrossEntropy.apply(h, head, labels, weights, 10, None, False)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


def test_layer_scope_compiles_one_layer_graph_at_any_depth_and_matches_eager(setup):
    """train.compile_scope: layer: a 4-layer drafter compiles the context's graph and a layer's graph
    (twice: the first layer's input needs no gradient), not one graph per layer, and the forward and the
    parameters' gradients are the eager drafter's."""
    from torch._dynamo.utils import counters

    from flashdraft.train_step import compile_drafter

    _, ids, _, hidden, embed, _, anchors, valid = setup
    torch.manual_seed(0)
    eager, layered = DFlashDrafter(tiny_spec(num_layers=4)), DFlashDrafter(tiny_spec(num_layers=4))
    layered.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compile_drafter(layered, "layer")
    outs = []
    for drafter in (eager, layered):
        out = train_forward(drafter, ids, hidden, anchors, valid, embed, "sdpa")
        (out.square().mean()).backward()
        outs.append((out.detach(), {n: p.grad for n, p in drafter.named_parameters()}))
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    assert list(layered.state_dict()) == list(eager.state_dict())  # checkpoints keep their keys
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-5)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], grad, rtol=1e-3, atol=1e-6, msg=name)


def test_simulated_tau_and_per_position_metrics():
    hit = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert simulated_tau(hit).tolist() == [3.0, 1.0, 5.0]  # accepted prefix + the bonus token
    stats = torch.tensor([6.0, 3.0, 9.0, 3.0, 2, 3, 2, 3, 3, 3, 3, 3])  # B = 5: 4 positions
    row = summarize(stats, 5)
    assert row["loss"] == 2.0 and row["sim_tau"] == 3.0 and row["acc"] == 10 / 12
    assert [row[f"acc_pos_{k}"] for k in range(1, 5)] == [2 / 3, 1.0, 2 / 3, 1.0]


def test_export_keys_config_and_reload_reproduce_logits(setup, tmp_path):
    drafter, ids, _, hidden, embed, head, _, _ = setup
    spec = drafter.spec
    export_drafter(drafter, spec, tmp_path / "drafter")
    with safe_open(tmp_path / "drafter" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(spec.num_layers):
        want |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        want |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        want |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        want |= {f"layers.{i}.{p}_layernorm.weight" for p in ("input", "post_attention")}
    assert keys == want  # no embed_tokens, no lm_head
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 3]}
    assert (config["block_size"], config["num_target_layers"], config["num_hidden_layers"]) == (B, 6, 2)
    qwen3 = Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    assert (qwen3.hidden_size, qwen3.num_key_value_heads, qwen3.head_dim) == (64, 2, 16)
    assert DrafterSpec.from_config_dict(config) == spec
    loaded, spec2 = load_drafter(tmp_path / "drafter")
    assert spec2 == spec
    a = 25
    before = drafter.predict_block(hidden[:1, :a], ids[0, a].item(), embed, head)
    after = loaded.predict_block(hidden[:1, :a], ids[0, a].item(), embed, head)
    assert torch.equal(before, after)


@pytest.mark.parametrize("tied", [False, True])
def test_load_target_head_reads_sharded_and_tied_checkpoints(tmp_path, tied):
    config = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="20KB")  # several shards + model.safetensors.index.json
    assert (tmp_path / "model.safetensors.index.json").exists()
    embed, head = load_target_head(tmp_path)
    assert torch.equal(embed, model.get_input_embeddings().weight.detach())
    assert torch.equal(head, model.get_output_embeddings().weight.detach())
    assert torch.equal(embed, head) == tied
    if torch.cuda.is_available():  # read straight onto the GPU, as training does: the same tensors
        on_gpu = load_target_head(tmp_path, torch.device("cuda", 0))
        assert all(t.is_cuda for t in on_gpu)
        assert torch.equal(on_gpu[0].cpu(), embed) and torch.equal(on_gpu[1].cpu(), head)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flex_and_sdpa_agree_on_gpu_in_loss_and_gradients():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    s = 128
    ids = torch.randint(0, MASK, (2, s), device=dev)
    loss_mask = (torch.rand(2, s, device=dev) < 0.8).float()
    hidden = torch.randn(2, s, 2 * 64, device=dev)
    embed, head = torch.randn(V, 64, device=dev), torch.randn(V, 64, device=dev) * 0.1
    anchors, valid = sample_anchors(loss_mask, 12, B, torch.Generator().manual_seed(0))
    anchors, valid = anchors.to(dev), valid.to(dev)
    results = []
    for attention in ("sdpa", "flex"):
        torch.manual_seed(1)
        d = DFlashDrafter(tiny_spec()).to(dev)
        loss, _ = dflash_loss(d, ids, loss_mask, hidden, anchors, valid, embed, head, Decay(4.0), attention)
        loss.backward()
        results.append((loss.item(), torch.cat([p.grad.flatten() for p in d.parameters()])))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-4)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-4, rtol=1e-3)


# the spec-relevant keys of real config.json files (transformers 4's format)
QWEN3_8B_JSON = dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-06,
                     rope_scaling=None, rope_theta=1000000, max_position_embeddings=40960, vocab_size=151936,
                     tie_word_embeddings=False, sliding_window=None)
LLAMA31_8B_JSON = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-05,
                       rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                       rope_theta=500000.0, max_position_embeddings=131072, vocab_size=128256)
QWEN25_7B_JSON = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-06, rope_theta=1000000.0,
                      max_position_embeddings=32768, vocab_size=152064, sliding_window=131072,
                      use_sliding_window=False)
MISTRAL_JSON = dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-05,
                    rope_theta=1000000.0, max_position_embeddings=32768, vocab_size=32768)
NO_HEAD_DIM = {k: v for k, v in QWEN3_8B_JSON.items() if k != "head_dim"} | {"hidden_size": 2048}


@pytest.mark.parametrize("raw", [QWEN3_8B_JSON, LLAMA31_8B_JSON, MISTRAL_JSON, "transformers 5",
                                 QWEN25_7B_JSON, NO_HEAD_DIM, {**QWEN3_8B_JSON, "model_type": "gemma3_text"}],
                         ids=["qwen3", "llama", "mistral", "transformers 5", "qwen2 no head_dim",
                              "qwen3 no head_dim", "other type"])
def test_config_json_gives_the_spec_autoconfig_gives_or_none(raw, tmp_path):
    """load_spec reads config.json without transformers where plain_target_config says that is exact; a
    missing key takes its config class's default (Qwen3's head_dim 128, not hidden_size / heads)."""
    from transformers import AutoConfig

    from flashdraft.hf_config import plain_target_config

    if raw == "transformers 5":  # rope_parameters, written by this transformers
        Qwen3Config(**{k: v for k, v in QWEN3_8B_JSON.items() if k != "model_type"}).save_pretrained(tmp_path)
    else:
        (tmp_path / "config.json").write_text(json.dumps(raw))
    raw = json.loads((tmp_path / "config.json").read_text())
    plain, cfg = plain_target_config(raw), DrafterConfig()
    spec = DrafterSpec.from_target(AutoConfig.from_pretrained(tmp_path), 1000, cfg)
    if "head_dim" in raw and raw["model_type"] != "gemma3_text":
        assert plain is not None and DrafterSpec.from_target(plain, 1000, cfg) == spec
    else:
        assert plain is None
    if raw.get("hidden_size") == 2048:
        assert spec.head_dim == 128 != 2048 // 32


def test_the_parameter_count_takes_no_dynamo_import():
    """A trainer counts the drafter's parameters (for the parallel mode) before its slow reads start:
    the meta drafter must not import Dynamo (seconds), as the meta device's random init does."""
    code = (
        "import sys\n"
        "from flashdraft.model import DrafterSpec, meta_drafter\n"
        "spec = DrafterSpec(64, 128, 4, 2, 16, 2, 1e-6, 1e4, 256, 512, 4, 255, [1, 2], 3)\n"
        "n = sum(p.numel() for p in meta_drafter(spec).parameters())\n"
        "print(n, 'torch._dynamo' in sys.modules)\n"
    )
    p = run_python(code)
    assert p.returncode == 0, p.stderr
    count, dynamo = p.stdout.split()
    assert int(count) > 0 and dynamo == "False"
