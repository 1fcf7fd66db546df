"""The DSpark drafter family (flashdraft.dspark) against DeepSpec's definitions (docs/dspark.md): the slot
convention, the chunked loss against a dense one, vllm-project/speculators' loss, the Markov-corrected
proposer and lossless decoding, and the export in DeepSpec's layout."""

import dataclasses
import importlib
import importlib.util
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from flashdraft.chat import prompt_ids
from flashdraft.config import DrafterConfig, DSparkConfig, ToyConfig
from flashdraft.drafter_io import export_drafter, load_drafter
from flashdraft.dspark import (
    FAMILY,
    DSparkDrafter,
    DSparkSpec,
    dspark_chunk,
    dspark_labels,
    dspark_loss,
    dspark_normalizer,
    dspark_stats_size,
    dspark_summarize,
    init_weights,
)
from flashdraft.dspark_decode import DSparkProposer, GraphPicks
from flashdraft.errors import UserError
from flashdraft.families import family, family_of_export
from flashdraft.loss import compiled_chunk, sample_anchors, train_forward
from flashdraft.model import DFlashDrafter, DrafterSpec
from flashdraft.speculative import make_session, speculative_decode, target_decode
from flashdraft.target import eos_ids, load_target, select_features
from flashdraft.toy import build_toy_target, task_conversations

pytestmark = pytest.mark.usefixtures("one_thread")

B = 4
V = 100
MASK = 99
H = 64
KW = dict(gamma=3.0, ce_weight=0.1, l1_weight=0.9, confidence_weight=1.0)


def tiny_spec(**kw) -> DSparkSpec:
    base = dict(
        hidden_size=H,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_layers=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=V,
        max_position_embeddings=512,
        block_size=B,
        mask_token_id=MASK,
        target_layer_ids=[1, 3],
        num_target_layers=6,
        markov_rank=8,
    )
    return DSparkSpec(**{**base, **kw})


HEADS_OFF = dict(markov_rank=0, confidence_head=False)  # the DSpark paper's DFlash baseline
CE_ONLY = dict(gamma=3.0, ce_weight=1.0, l1_weight=0.0, confidence_weight=0.0)


def drafter(seed=0, **kw) -> DSparkDrafter:
    torch.manual_seed(seed)
    d = DSparkDrafter(tiny_spec(**kw))
    if d.markov_head is not None:
        with torch.no_grad():  # a Markov bias as large as the base logits, so that it changes what is picked
            d.markov_head.markov_w1.weight.mul_(40)
            d.markov_head.markov_w2.weight.mul_(40)
    return d


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    s = 30
    ids = torch.randint(0, MASK, (2, s), generator=g)
    loss_mask = torch.zeros(2, s)
    loss_mask[0, 6:] = 1
    loss_mask[0, 17] = 0  # a hole: the slots after it are cut (contiguous prefix)
    loss_mask[1, 3:22] = 1
    hidden = torch.randn(2, s, 2 * H, generator=g)
    last = torch.randn(2, s, H, generator=g)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    anchors = torch.full((2, 8), -1)
    anchors[0, :4] = torch.tensor([7, 12, 15, 27])  # 27: the block runs past the end (S=30)
    anchors[1, :3] = torch.tensor([3, 10, 19])
    return ids, loss_mask, hidden, last, embed, head, anchors, anchors >= 0


def loss_of(d, data, **kw):
    ids, loss_mask, hidden, last, embed, head, anchors, valid = data
    return dspark_loss(d, ids, loss_mask, hidden, last, anchors, valid, embed, head, **{**KW, **kw})


# ---------------------------------------------------------------------------------------------------------
# (a) the slot convention and the mask


def test_slot_k_predicts_anchor_plus_k_plus_1_from_the_previous_true_token():
    ids = torch.arange(10, 20)[None]  # token at position p is 10 + p
    loss_mask = torch.ones(1, 10)
    loss_mask[0, 7] = 0
    anchors = torch.tensor([[2, 5, 8, -1]])
    labels, prev, pos, weights, mask = dspark_labels(ids, loss_mask, anchors, anchors >= 0, 3, 2.0)
    assert labels[0, 0].tolist() == [13, 14, 15] and prev[0, 0].tolist() == [12, 13, 14]
    assert pos[0, 0].tolist() == [2, 3, 4]  # the teacher reads the target's last hidden state at anchor+k
    # anchor 5: labels at 6, 7, 8; loss_mask[7] = 0 cuts slot 1 and every later slot (slot 2's label is in)
    assert labels[0, 1].tolist() == [16, 17, 18] and mask[0, 1].tolist() == [True, False, False]
    assert mask[0, 2].tolist() == [True, False, False]  # anchor 8: label 9, then past the end (S=10)
    assert not mask[0, 3].any()  # a padded block
    torch.testing.assert_close(weights[0, 0], torch.exp(-torch.arange(3.0) / 2.0))  # slot 0: weight 1
    assert weights[0, 1].tolist() == [1.0, 0.0, 0.0]


def test_training_slots_are_the_drafting_slots(data):
    """The CE of each training slot equals the CE of the inference block's slot against the next token: the
    block at anchor a over the context before a, slot k's logits plus the Markov bias of token[a+k], against
    token[a+k+1]. DFlash's convention (slot k against token[a+k]) or an off-by-one fails here."""
    ids, loss_mask, hidden, last, embed, head, _, _ = data
    d = drafter().eval()
    a = 8
    anchors = torch.tensor([[a]])
    loss, _ = dspark_loss(
        d,
        ids[:1],
        torch.ones(1, 30),
        hidden[:1],
        last[:1],
        anchors,
        anchors >= 0,
        embed,
        head,
        gamma=1e9,
        ce_weight=1.0,
        l1_weight=0.0,
        confidence_weight=0.0,
    )
    with torch.no_grad():
        h = d.block_hidden(hidden[:1, :a], ids[0, a].item(), embed)
        logits = h @ head.T + d.markov_bias(ids[0, a : a + B])
        want = F.cross_entropy(logits, ids[0, a + 1 : a + B + 1])
        shifted = F.cross_entropy(logits, ids[0, a : a + B])
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert abs(shifted.item() - want.item()) > 1e-2


def test_the_teacher_is_the_target_distribution_at_anchor_plus_k(data):
    """Slot k's L1 compares with the target's own prediction of token[a+k+1]: its LM head over its last
    hidden state at a+k. Only positions a..a+B-1 of last_hidden matter."""
    ids, _, hidden, last, embed, head, _, _ = data
    d = drafter().eval()
    a, anchors = 8, torch.tensor([[8]])

    def l1(last_hidden):
        loss, _ = dspark_loss(
            d,
            ids[:1],
            torch.ones(1, 30),
            hidden[:1],
            last_hidden,
            anchors,
            anchors >= 0,
            embed,
            head,
            gamma=3.0,
            ce_weight=0.0,
            l1_weight=1.0,
            confidence_weight=0.0,
        )
        return loss.item()

    ref = l1(last[:1])
    for p, used in [(a - 1, False), (a, True), (a + B - 1, True), (a + B, False)]:
        changed = last[:1].clone()
        changed[0, p] += 3.0
        assert (l1(changed) != ref) == used, p


def test_context_is_visible_strictly_before_the_anchor(data):
    ids, _, hidden, _, embed, _, anchors, valid = data
    d = drafter().eval()

    def out(h):
        with torch.no_grad():
            return train_forward(d, ids, h, anchors, valid, embed, "sdpa")

    ref = out(hidden)
    at, before = hidden.clone(), hidden.clone()
    at[0, 12] += 5.0  # features AT anchor 12 (block 1 of row 0)
    before[0, 11] += 5.0
    assert torch.equal(out(at)[0, 1], ref[0, 1]) and not torch.allclose(out(at)[0, 2], ref[0, 2])
    assert not torch.allclose(out(before)[0, 1], ref[0, 1])


# ---------------------------------------------------------------------------------------------------------
# (b) the chunked loss against a dense implementation of DeepSpec's formulas (loss.py)


def dense_loss(d, data, gamma, ce_weight, l1_weight, confidence_weight):
    """Slot by slot, as DeepSpec's loss.py reads: w = exp(-k/gamma) over the contiguous prefix of slots whose
    label is in the sequence and the loss mask; CE(logits + Markov bias, token[a+k+1]); L1 between the
    softmaxes of the draft and of the target's head over last_hidden[a+k]; BCE(confidence, 1 - L1/2
    detached); the sum over sum(w)."""
    ids, loss_mask, hidden, last, embed, head, anchors, valid = data
    out = train_forward(d, ids, hidden, anchors, valid, embed, "sdpa")
    markov = d.markov_head is not None
    w1 = d.markov_head.markov_w1.weight if markov else None
    w2 = d.markov_head.markov_w2.weight if markov else None
    num, den = 0.0, 0.0
    for r in range(ids.shape[0]):
        for j in range(anchors.shape[1]):
            if not valid[r, j]:
                continue
            a = int(anchors[r, j])
            for k in range(B):
                label = a + k + 1
                if label >= ids.shape[1] or loss_mask[r, label] == 0:
                    break
                w, h = math.exp(-k / gamma), out[r, j, k]
                e = w1[ids[r, a + k]] if markov else None
                logits = h @ head.T + (w2 @ e if markov else 0.0)
                ce = F.cross_entropy(logits, ids[r, label])
                l1 = (logits.softmax(-1) - (last[r, a + k] @ head.T).softmax(-1)).abs().sum()
                term = ce_weight * ce + l1_weight * l1
                if d.confidence_head is not None:
                    x = torch.cat([h, e]) if d.spec.confidence_with_markov else h
                    conf = d.confidence_head.proj(x)[0]
                    term = term + confidence_weight * F.binary_cross_entropy_with_logits(
                        conf, (1 - l1.detach() / 2).clamp(0, 1)
                    )
                num, den = num + w * term, den + w
    return num / den


@pytest.mark.parametrize(
    "heads",
    [
        dict(),
        dict(confidence_with_markov=False),
        dict(confidence_head=False),
        dict(markov_rank=0, confidence_with_markov=False),
        HEADS_OFF,
    ],
)
def test_chunked_loss_and_gradients_equal_the_dense_formulas(data, heads):
    d = drafter(**heads)
    want = dense_loss(d, data, **KW)
    want.backward()
    ref = {n: p.grad.clone() for n, p in d.named_parameters()}
    assert all(g.abs().sum() > 0 for n, g in ref.items() if p_numel(d, n)), "every parameter learns"
    for chunk in (1, 3, 128):
        d.zero_grad()
        loss, _ = loss_of(d, data, chunk_blocks=chunk)
        loss.backward()
        assert loss.item() == pytest.approx(want.item(), rel=1e-5)
        for n, p in d.named_parameters():
            torch.testing.assert_close(p.grad, ref[n], atol=1e-6, rtol=1e-4, msg=n)


@pytest.mark.parametrize("heads", [dict(), HEADS_OFF])
def test_compiled_loss_chunks_equal_eager_ones(data, heads):
    """train.compile_loss: the full chunks of dspark_chunk compiled (the last, shorter one eager) give the
    eager loss, stats and gradients, with both heads and with none."""
    d = drafter(**heads)
    out = {}
    for compiled in (False, True):
        d.zero_grad()
        loss, stats = loss_of(d, data, chunk_blocks=2, compile_loss=compiled)
        loss.backward()
        out[compiled] = loss.detach(), stats, {n: p.grad.clone() for n, p in d.named_parameters()}
    assert compiled_chunk(dspark_chunk).ran  # a full chunk went through the compiled function
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=1e-5, atol=1e-5, equal_nan=True)
    for n, g in out[False][2].items():
        torch.testing.assert_close(out[True][2][n], g, atol=1e-6, rtol=1e-4, msg=n)


def p_numel(d, name):
    return dict(d.named_parameters())[name].numel()


def test_a_given_normalizer_divides_the_sum_and_the_stats_add_up(data):
    d = drafter()
    ids, loss_mask, hidden, last, embed, head, anchors, valid = data
    own = dspark_normalizer(ids, loss_mask, anchors, valid, B, KW["gamma"])
    loss, stats = loss_of(d, data)
    half, _ = loss_of(d, data, normalizer=own * 2)
    assert half.item() == pytest.approx(loss.item() / 2, rel=1e-6)
    assert stats.shape == (dspark_stats_size(B),) and not stats.requires_grad
    row = dspark_summarize(stats, B)
    assert row["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert row["loss"] == pytest.approx(0.1 * row["ce"] + 0.9 * row["l1"] + row["confidence"], rel=1e-5)
    assert set(row) >= {"acc", "sim_tau", "expected_tau", *(f"acc_pos_{k}" for k in range(1, B + 1))}
    assert 1.0 <= row["sim_tau"] <= B + 1 and 1.0 <= row["expected_tau"] <= B + 1
    assert row["acc_pos_1"] == row["acc_pos_1"]  # every real block has its first slot
    assert dspark_summarize(stats + stats, B) == pytest.approx(row)  # sums: steps and ranks add up


def test_a_batch_without_anchors_gives_zero_loss_and_zero_gradients(data):
    ids, loss_mask, hidden, last, embed, head, anchors, _ = data
    d = drafter()
    none = torch.zeros_like(anchors, dtype=torch.bool)
    loss, stats = dspark_loss(
        d, ids, loss_mask, hidden, last, torch.full_like(anchors, -1), none, embed, head, **KW
    )
    loss.backward()
    assert loss.item() == 0.0 and stats[7] == 0
    assert all(p.grad is None or not p.grad.any() for p in d.parameters())


def test_the_heads_off_loss_is_the_ce_alone_without_the_teacher(data):
    """The DSpark paper's DFlash baseline trains with the cross-entropy alone (DeepSpec's
    config/dflash/dflash_qwen3_8b.py: ce_loss_alpha 1, l1_loss_alpha 0, no heads): without the target's last
    hidden state the loss and its gradients are the dense CE's, every parameter (the backbone's, there are
    no others) learns, a given teacher changes nothing, and the teacher's stats are NaN."""
    ids, loss_mask, hidden, last, embed, head, anchors, valid = data
    d = drafter(**HEADS_OFF)
    want = dense_loss(d, data, **CE_ONLY)
    want.backward()
    ref = {n: p.grad.clone() for n, p in d.named_parameters()}
    assert all(g.abs().sum() > 0 for g in ref.values())
    for teacher in (None, last):
        d.zero_grad()
        loss, stats = dspark_loss(d, ids, loss_mask, hidden, teacher, anchors, valid, embed, head, **CE_ONLY)
        loss.backward()
        assert loss.item() == pytest.approx(want.item(), rel=1e-5)
        for n, p in d.named_parameters():
            torch.testing.assert_close(p.grad, ref[n], atol=1e-6, rtol=1e-4, msg=n)
        row = dspark_summarize(stats, B)
        assert row["loss"] == pytest.approx(row["ce"], rel=1e-6) and 1.0 <= row["sim_tau"] <= B + 1
        assert math.isnan(row["l1"]) == math.isnan(row["expected_tau"]) == (teacher is None)
    confident = dict(markov_rank=0, confidence_with_markov=False)  # a confidence head: it reads the teacher
    for heads, kw in ((HEADS_OFF, {"l1_weight": 0.1}), (confident, {})):
        with pytest.raises(ValueError, match="dspark_loss needs last_hidden"):
            dspark_loss(
                drafter(**heads),
                ids,
                loss_mask,
                hidden,
                None,
                anchors,
                valid,
                embed,
                head,
                **{**CE_ONLY, **kw},
            )


def test_the_family_reads_the_last_hidden_state_only_where_a_term_does():
    """config.needs_last_hidden: a dspark drafter's shards hold the target's last hidden state where its L1
    or confidence term has a weight; the CE-only baseline's do not, and its loss leaves a store's column
    unread (the same loss with and without it)."""
    from flashdraft.config import TrainConfig, needs_last_hidden
    from flashdraft.dspark import loss, loss_options

    paper = DrafterConfig(
        family="dspark",
        block_size=B,
        dspark=DSparkConfig(
            markov_rank=0, ce_weight=1.0, l1_weight=0.0, confidence_weight=0.0, confidence_with_markov=False
        ),
    )
    assert not needs_last_hidden(paper) and not needs_last_hidden(DrafterConfig())
    assert needs_last_hidden(DrafterConfig(family="dspark"))

    def changed(**kw):
        return dataclasses.replace(paper, dspark=dataclasses.replace(paper.dspark, **kw))

    for change in (dict(l1_weight=0.1), dict(confidence_weight=0.5), dict(markov_rank=8, l1_weight=0.1)):
        assert needs_last_hidden(changed(**change))
    assert not needs_last_hidden(changed(markov_rank=8))  # a Markov head alone reads no teacher
    g = torch.Generator().manual_seed(5)
    s = 24
    t = {
        "input_ids": torch.randint(0, MASK, (1, s), generator=g),
        "loss_mask": torch.ones(1, s),
        "hidden": torch.randn(1, s, 2 * H, generator=g),
        "last_hidden": torch.randn(1, s, H, generator=g),
    }
    anchors = torch.tensor([[2, 9, 15]])
    d = drafter(**HEADS_OFF)
    step = types.SimpleNamespace(
        model=d,
        spec=d.spec,
        embed=torch.randn(V, H, generator=g),
        head=torch.randn(V, H, generator=g),
        attention="sdpa",
        compile_loss=False,
        options=loss_options(TrainConfig(gamma=3.0), paper, d.spec),
    )
    assert step.options.teacher is False
    full, stats = loss(step, t, anchors, anchors >= 0)
    bare, _ = loss(step, {k: v for k, v in t.items() if k != "last_hidden"}, anchors, anchors >= 0)
    assert full.item() == bare.item() and math.isnan(dspark_summarize(stats, B)["l1"])
    step.options = loss_options(TrainConfig(gamma=3.0), DrafterConfig(family="dspark"), d.spec)
    with pytest.raises(ValueError, match="holding the target's last hidden state"):
        loss(step, {k: v for k, v in t.items() if k != "last_hidden"}, anchors, anchors >= 0)


def test_under_ddp_the_loss_is_the_same_and_a_batch_without_anchors_reaches_every_parameter(data, tmp_path):
    """DDP's all-reduce waits for a gradient of every parameter: an empty batch must still give them one
    (else the next step's forward fails), and the wrapper must not change the loss."""
    import torch.distributed as dist

    ids, loss_mask, hidden, last, embed, head, anchors, valid = data
    plain = drafter()
    want, _ = loss_of(plain, data)
    want.backward()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(drafter())
        none = torch.zeros_like(valid)
        for a, v in [(torch.full_like(anchors, -1), none), (anchors, valid)]:
            ddp.zero_grad()
            loss, _ = dspark_loss(ddp, ids, loss_mask, hidden, last, a, v, embed, head, **KW)
            loss.backward()
            assert all(p.grad is not None for p in ddp.parameters())
        assert loss.item() == pytest.approx(want.item(), rel=1e-6)
        for (n, p), q in zip(ddp.module.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=n)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# (c) the reference: vllm-project/speculators 0.9.0's DSpark loss


@pytest.fixture
def speculators(monkeypatch):
    """speculators' DSpark loss modules, imported without the package's __init__: it imports its whole
    trainer (openai, datasets, ...), while these modules need torch only. Stand-in parent packages point
    at the installed files; everything imported is removed afterwards."""
    spec = importlib.util.find_spec("speculators")
    if spec is None:
        pytest.skip("speculators==0.9.0 (envs/requirements-nodeps.txt) is not installed")
    root, before = Path(next(iter(spec.submodule_search_locations))), set(sys.modules)
    packages = ("speculators", "speculators.models", "speculators.models.dflash", "speculators.models.dspark")
    for name in packages:
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        monkeypatch.setitem(sys.modules, name, package)
    yield types.SimpleNamespace(
        **{
            n.rsplit(".", 1)[1]: importlib.import_module(n)
            for n in (
                "speculators.losses.eager",
                "speculators.models.dspark.metrics",
                "speculators.models.dspark.model_definitions",
                "speculators.models.dflash.utils",
            )
        }
    )
    for name in set(sys.modules) - before:
        if name.startswith("speculators."):
            del sys.modules[name]


def test_loss_equals_speculators_dspark_loss(speculators):
    """Their loss on our slots. Their DSpark (sample_from_anchor) slot k is ours: it predicts anchor+k+1
    from the target's logits at anchor+k, with the Markov bias of token[anchor+k]. Three differences are
    mapped explicitly: they mask slot k by loss_mask[anchor+k] without cutting at the first masked slot
    (we hand them DeepSpec's eval mask), divide each term by the number of masked slots instead of the sum
    of weights, and take their CE against the target's argmax (the data here is the target's own greedy
    continuation, so both labels agree); their TV is L1/2, so 0.9 * L1 is 1.8 * TV."""
    torch.manual_seed(3)
    s, vocab, dflash_utils, defs = 40, V, speculators.utils, speculators.model_definitions
    head, last = torch.randn(vocab, H) * 0.3, torch.randn(1, s, H)
    ids = torch.zeros(1, s, dtype=torch.long)
    ids[0, 0] = 5
    ids[0, 1:] = (last[0, :-1] @ head.T).argmax(-1)  # token[p+1] is the target's pick at p
    loss_mask = torch.ones(1, s)
    loss_mask[0, :4], loss_mask[0, 20], loss_mask[0, 34:] = 0, 0, 0  # anchors <= 32: slots stay inside
    hidden, embed = torch.randn(1, s, 2 * H), torch.randn(vocab, H)
    anchors, valid = sample_anchors(loss_mask, 8, B, torch.Generator().manual_seed(1))
    data = (ids, loss_mask, hidden, last, embed, head, anchors, valid)
    d = drafter()
    ours, stats = loss_of(d, data)
    row = dspark_summarize(stats, B)
    _, _, _, weights, eval_mask = dspark_labels(ids, loss_mask, anchors, valid, B, KW["gamma"])

    # their side, from their own modules with our weights
    markov = defs.MarkovHead(verifier_vocab_size=vocab, draft_vocab_size=vocab, markov_rank=8, hidden_size=H)
    markov.load_state_dict(d.markov_head.state_dict())
    confidence = defs.ConfidenceHead(H + 8)
    confidence.load_state_dict(d.confidence_head.state_dict())
    real = anchors[valid]
    index = dflash_utils.get_base_indices_for_anchored_blocks(real, B)  # slot k of anchor p: p + k
    with torch.no_grad():
        h = train_forward(d, ids, hidden, anchors, valid, embed, "sdpa")[valid]  # [n, B, H]
        prev = ids[0, index].view(-1, B)  # sample_from_anchor: the block's own tokens
        emb = markov.prev_embeddings(prev)
        logits = h @ head.T + markov.block_bias(prev_token_ids=prev, hidden_states=h, prev_emb=emb)
        conf = confidence(torch.cat([h, emb], -1)).reshape(1, -1)
        targets = (last[0, index] @ head.T)[None]
        mask = eval_mask[valid].reshape(1, -1).float()
        theirs, metrics = speculators.metrics.compute_metrics(
            logits.reshape(1, -1, vocab),
            targets,
            conf,
            mask,
            B,
            loss_config={"ce": (speculators.eager.ce_loss, 0.1), "tv": (speculators.eager.tv_loss, 1.8)},
            tv_loss_fn=speculators.eager.tv_loss,
            gamma=KW["gamma"],
            confidence_head_alpha=1.0,
            sample_from_anchor=True,
        )
    assert (ids[0, index + 1].view(-1, B) == targets[0].argmax(-1).view(-1, B))[eval_mask[valid]].all()
    assert ours.item() * weights.sum().item() / mask.sum().item() == pytest.approx(theirs.item(), rel=1e-4)
    expected = metrics["accept_len_sum"] / metrics["accept_len_total"]
    assert row["expected_tau"] == pytest.approx(expected.item(), rel=1e-5)
    assert row["sim_tau"] == pytest.approx((metrics["eal_sum"] / metrics["eal_total"]).item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------------------
# (d) drafting


def test_markov_corrected_greedy_pick_is_the_step_by_step_reference(data):
    _, _, hidden, _, embed, head, _, _ = data
    d = drafter().eval()
    with torch.no_grad():
        d.markov_head.markov_w2.weight.mul_(5)  # a bias that outweighs the base logits' gaps
        h = d.block_hidden(hidden[:1, :10], 7, embed)
        drafts, q, logits = d.pick_block(h, 7, head)
        w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
        prev, want = 7, []
        for k in range(B):
            want.append(int((h[k] @ head.T + w2 @ w1[prev]).argmax()))
            prev = want[-1]
    assert q is None and drafts.tolist() == want
    assert want != (h @ head.T).argmax(-1).tolist()  # the bias changed the picks: the test can fail
    # T > 0: the distributions are those of the logits each sample was drawn from
    g = torch.Generator().manual_seed(0)
    drafts, q, logits = d.pick_block(h, 7, head, 0.7, g)
    torch.testing.assert_close(q, torch.softmax(logits / 0.7, -1))
    for k in range(1, B):
        base = (h[k] @ head.T).float()
        torch.testing.assert_close(logits[k], base + (w2 @ w1[drafts[k - 1]]).detach(), atol=1e-5, rtol=1e-5)


def test_a_heads_off_drafter_is_the_backbone_and_drafts_the_argmax_of_its_base_logits(data):
    """markov_rank 0 and no confidence head (DeepSpec builds neither: `build_markov_head` returns None at
    rank 0): the drafter's tensors are the DFlash backbone's, and every slot is picked from its base logits
    alone: the argmax at T=0, at T>0 a sample of softmax(logits/T), carried with that distribution."""
    _, _, hidden, _, embed, head, _, _ = data
    d = drafter(**HEADS_OFF).eval()
    assert d.markov_head is None and d.confidence_head is None
    assert d.state_dict().keys() == DFlashDrafter(backbone_spec(d.spec)).state_dict().keys()
    with torch.no_grad():
        h = d.block_hidden(hidden[:1, :10], 7, embed)
        base = (h @ head.T).float()
        drafts, q, logits = d.pick_block(h, 7, head)
    assert q is None and drafts.tolist() == base.argmax(-1).tolist()
    torch.testing.assert_close(logits, base, atol=0, rtol=0)
    drafts, q, logits = d.pick_block(h, 7, head, 0.7, torch.Generator().manual_seed(0))
    torch.testing.assert_close(q, torch.softmax(base / 0.7, -1))
    assert drafts.shape == (B,) and all(q[k, t] > 0 for k, t in enumerate(drafts.tolist()))


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    """A tiny random target, its greedy continuations of four prompts, and their training tensors."""
    root = tmp_path_factory.mktemp("dspark")
    build_toy_target(ToyConfig(steps=0, num_docs=200), str(root / "target"))
    model, tokenizer = load_target(str(root / "target"), "float32", torch.device("cpu"))  # fitted on the CPU
    spec = DSparkSpec.from_target(
        model.config,
        tokenizer,
        DrafterConfig(num_layers=2, block_size=B, dspark=DSparkConfig(markov_rank=16)),
    )
    prompts = [prompt_ids(tokenizer, c) for c in task_conversations(4, seed=11)]
    session = make_session(model, "auto", 256)
    seqs = [p + target_decode(session, p, 40, eos=set()).tokens for p in prompts]
    s = max(map(len, seqs))
    ids, loss_mask = torch.zeros(len(seqs), s, dtype=torch.long), torch.zeros(len(seqs), s)
    hidden = torch.zeros(len(seqs), s, 2 * spec.hidden_size)
    last = torch.zeros(len(seqs), s, spec.hidden_size)
    with torch.no_grad():
        for j, (seq, p) in enumerate(zip(seqs, prompts, strict=True)):
            out = model.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
            hidden[j, : len(seq)] = select_features(out.hidden_states, spec.target_layer_ids)[0]
            last[j, : len(seq)] = out.last_hidden_state[0]
            ids[j, : len(seq)], loss_mask[j, len(p) : len(seq)] = torch.tensor(seq), 1
    return model, tokenizer, spec, prompts, (ids, loss_mask, hidden, last)


def fit(toy_data, spec, teacher=True, **kw):
    """A drafter of `spec` fitted to the toy's continuations for 60 steps; `teacher` False: trained without
    the target's last hidden state. Returns what the toy fixtures give."""
    model, tokenizer, _, prompts, (ids, loss_mask, hidden, last) = toy_data
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    torch.manual_seed(0)
    d = DSparkDrafter(spec)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2, weight_decay=0.0)
    gen, rows = torch.Generator().manual_seed(0), []
    for _ in range(60):
        anchors, valid = sample_anchors(loss_mask, 16, B, gen)
        loss, stats = dspark_loss(
            d, ids, loss_mask, hidden, last if teacher else None, anchors, valid, embed, head, **{**KW, **kw}
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        rows.append(dspark_summarize(stats, B))
    return model, tokenizer, spec, d.eval(), prompts, rows


@pytest.fixture(scope="module")
def toy(toy_data):
    """A DSpark drafter fitted to the toy's continuations for a few steps (enough for acceptance from none
    to a whole block)."""
    return fit(toy_data, toy_data[2])


@pytest.fixture(scope="module")
def toy_heads_off(toy_data):
    """The DSpark paper's DFlash baseline fitted as `toy`: no Markov or confidence head, CE alone, no
    teacher."""
    return fit(toy_data, dataclasses.replace(toy_data[2], **HEADS_OFF), teacher=False, **CE_ONLY)


@pytest.mark.parametrize("fitted", ["toy", "toy_heads_off"])
def test_training_raises_acceptance(fitted, request):
    rows = request.getfixturevalue(fitted)[-1]
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["sim_tau"] > rows[0]["sim_tau"] + 1


@pytest.mark.parametrize("fitted", ["toy", "toy_heads_off"])
def test_speculative_decoding_is_lossless_and_cached_equals_uncached_and_static(fitted, request):
    model, tokenizer, spec, d, prompts, _ = request.getfixturevalue(fitted)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    eos = set(eos_ids(model, tokenizer))
    plain = make_session(model, "auto", 256, (), B + 1)
    featured = make_session(model, "auto", 256, spec.target_layer_ids, B + 1)
    fixed = DSparkProposer(d, embed, head).static(256)  # the drafter's context in a session.DraftSession
    assert fixed.session is not None and fixed.session.hidden_states
    steps = []
    for p in prompts:
        for max_new in (40, 37):
            want = target_decode(plain, p, max_new, eos).tokens
            cached = speculative_decode(featured, DSparkProposer(d, embed, head), p, max_new, eos)
            full = speculative_decode(featured, DSparkProposer(d, embed, head, cached=False), p, max_new, eos)
            static = speculative_decode(featured, fixed, p, max_new, eos)  # one static cache, reset each
            assert cached.tokens == full.tokens == static.tokens == want
            assert cached.emitted == full.emitted == static.emitted
            steps += zip(cached.emitted, cached.accepted, strict=True)
    # B drafts per step: whole blocks (B drafts + the bonus), rejections and partial runs all happened
    assert any(e == B + 1 for e, _ in steps) and any(a == 0 for _, a in steps)
    assert any(0 < a < B for _, a in steps)
    if d.confidence_head is None:
        return
    # a confidence threshold above every confidence drafts nothing: plain decoding, still lossless
    silent = DSparkProposer(d, embed, head, confidence_threshold=1.0)
    out = speculative_decode(featured, silent, prompts[0], 20, eos)
    assert out.tokens == target_decode(plain, prompts[0], 20, eos).tokens and set(out.emitted) == {1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fitted", ["toy", "toy_heads_off"])
def test_cuda_graph_drafting_is_lossless_and_drafts_as_the_cached_drafter(fitted, request):
    """On CUDA, the static engine: the target's session and the drafter's block step compiled and captured
    as CUDA graphs (float32) decode what target-only decoding does, with the cached drafter's drafts."""
    import copy

    model, tokenizer, spec, d, prompts, _ = request.getfixturevalue(fitted)
    model, d = copy.deepcopy(model).cuda(), copy.deepcopy(d).cuda()
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    eos = set(eos_ids(model, tokenizer))
    plain = make_session(model, "static", 256, (), B + 1)
    featured = make_session(model, "static", 256, spec.target_layer_ids, B + 1)
    fixed = DSparkProposer(d, embed, head).static(256)
    assert fixed.session.graphs.on
    for p in prompts:
        want = target_decode(plain, p, 40, eos).tokens
        static = speculative_decode(featured, fixed, p, 40, eos)
        cached = speculative_decode(featured, DSparkProposer(d, embed, head), p, 40, eos)
        assert static.tokens == cached.tokens == want
        assert static.emitted == cached.emitted


def test_heads_off_proposals_are_the_argmax_of_the_base_logits(toy_heads_off):
    """The trained baseline's proposal at T=0: the block over the verified context, each slot's argmax."""
    model, _, spec, d, prompts, _ = toy_heads_off
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    featured = make_session(model, "auto", 256, spec.target_layer_ids, B + 1)
    _, feats = featured.prefill(prompts[0])
    drafts, q = DSparkProposer(d, embed, head).propose(prompts[0] + [7], feats, B, 0.0, None)
    with torch.no_grad():
        want = (d.block_hidden(feats, 7, embed) @ head.T).argmax(-1).tolist()
    assert q is None and drafts == want and len(set(want)) > 1


def test_graph_picks_are_pick_block_s_greedy_and_sample_by_the_inverse_cdf(data):
    """GraphPicks (the picks replayed as CUDA graphs; run eagerly here): at T=0 pick_block's drafts; at T>0
    each slot's distribution is softmax((base + Markov bias of the pick before) / T), as pick_block makes
    it, and its pick is the inverse CDF at the slot's uniform; a block shorter than the graph's gives the
    first slots of the full one, and the picks follow the distribution over many draws."""
    _, _, hidden, _, embed, head, _, _ = data
    d = drafter().eval()
    with torch.no_grad():
        d.markov_head.markov_w2.weight.mul_(5)
        h = d.block_hidden(hidden[:1, :10], 7, embed)
        picks = GraphPicks(d, head, B)
        assert picks(h, 7, 0.0)[0].tolist() == d.pick_block(h, 7, head)[0].tolist()
        assert picks(h[:3], 7, 0.0)[0].tolist() == d.pick_block(h, 7, head)[0][:3].tolist()
        g = torch.Generator().manual_seed(0)
        drafts, q = picks(h, 7, 0.9, g)
        u = torch.rand(B, generator=torch.Generator().manual_seed(0))
        w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
        prev = 7
        for k in range(B):
            want = torch.softmax((h[k] @ head.T + w2 @ w1[prev]) / 0.9, -1)
            torch.testing.assert_close(q[k], want, rtol=1e-5, atol=1e-7)
            cdf = q[k].cumsum(-1)
            t = int(drafts[k])
            assert (t == 0 or cdf[t - 1] < u[k] * cdf[-1]) and u[k] * cdf[-1] <= cdf[t]
            prev = t
        first = torch.stack([picks(h[:1], 7, 0.9, g)[0][0] for _ in range(3000)])
    p0 = torch.softmax((h[0] @ head.T + w2 @ w1[7]) / 0.9, -1)
    seen = torch.bincount(first, minlength=p0.numel()).float() / len(first)
    assert (seen - p0).abs().sum() / 2 < 0.1  # total variation of 3000 draws from p0


def test_sampling_proposals_carry_their_distributions(toy):
    model, _, spec, d, prompts, _ = toy
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    proposer = DSparkProposer(d, embed, head)
    featured = make_session(model, "auto", 256, spec.target_layer_ids, B + 1)
    _, feats = featured.prefill(prompts[0])
    drafts, q = proposer.propose(prompts[0] + [7], feats, 3, 0.8, torch.Generator().manual_seed(0))
    assert len(drafts) == 3 and q.shape == (3, spec.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    assert all(q[k, t] > 0 for k, t in enumerate(drafts))


# ---------------------------------------------------------------------------------------------------------
# (e) export, load, init_from


def backbone_spec(spec: DSparkSpec) -> DrafterSpec:
    """The DFlash spec of a DSpark spec's backbone."""
    return DrafterSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(DrafterSpec)})


def test_export_is_deepspec_layout_and_loads_back_bit_exactly(data, tmp_path):
    _, _, hidden, _, embed, head, _, _ = data
    d = drafter()
    export_drafter(d, d.spec, tmp_path / "drafter")
    with safe_open(tmp_path / "drafter" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {k for k in keys if not k.startswith("layers.")} == {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    }
    backbone = DFlashDrafter(backbone_spec(d.spec))
    assert keys - set(backbone.state_dict()) == {k for k in keys if "_head." in k}  # DFlash's + the heads
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert "dflash_config" not in config
    assert {
        k: config[k]
        for k in (
            "block_size",
            "mask_token_id",
            "target_layer_ids",
            "num_target_layers",
            "markov_rank",
            "markov_head_type",
            "enable_confidence_head",
            "confidence_head_with_markov",
            "num_hidden_layers",
        )
    } == {
        "block_size": B,
        "mask_token_id": MASK,
        "target_layer_ids": [1, 3],
        "num_target_layers": 6,
        "markov_rank": 8,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "num_hidden_layers": 2,
    }
    loaded, spec = load_drafter(tmp_path / "drafter")
    assert spec == d.spec and type(loaded) is DSparkDrafter
    mine, theirs = d.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    with torch.no_grad():
        h1, h2 = d.block_hidden(hidden[:1, :9], 3, embed), loaded.block_hidden(hidden[:1, :9], 3, embed)
        assert torch.equal(d.pick_block(h1, 3, head)[2], loaded.pick_block(h2, 3, head)[2])


def test_config_refuses_other_markov_heads():
    config = tiny_spec().to_config_dict()
    assert DSparkSpec.from_config_dict(config) == tiny_spec()
    for change in ({"markov_head_type": "gated"}, {"markov_rank": -1}, {"markov_head_type": None}):
        with pytest.raises(ValueError, match="only DSpark's vanilla Markov head"):
            DSparkSpec.from_config_dict({**config, **change})
    # markov_rank 0: no Markov head, whatever type is named (DeepSpec's build_markov_head reads none)
    none = {**config, "markov_rank": 0, "confidence_head_with_markov": False}
    assert DSparkSpec.from_config_dict(none) == tiny_spec(markov_rank=0, confidence_with_markov=False)
    no_head = tiny_spec(confidence_head=False)
    assert DSparkSpec.from_config_dict(no_head.to_config_dict()) == no_head
    deepspec = {k: v for k, v in no_head.to_config_dict().items() if k != "confidence_head_with_markov"}
    assert DSparkSpec.from_config_dict(deepspec) == no_head  # DeepSpec writes the key only with a head


def test_a_heads_off_export_is_deepspec_s_layout_and_loads_back_bit_exactly(data, tmp_path):
    """No markov_head.* or confidence_head.* tensors, markov_rank 0 and no markov_head_type in config.json
    (DeepSpec's build_draft_config writes the type only with a head); it loads back bit-exactly, and
    DeepSpec's own checkpoint of it (the target's tensors inside, no confidence_head_with_markov) starts a
    run of the same heads, and no other."""
    _, _, hidden, _, embed, head, _, _ = data
    d = drafter(**HEADS_OFF)
    export_drafter(d, d.spec, tmp_path / "drafter")
    with safe_open(tmp_path / "drafter" / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(DFlashDrafter(backbone_spec(d.spec)).state_dict())
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and "markov_head_type" not in config
    heads = ("markov_rank", "enable_confidence_head", "confidence_head_with_markov")
    assert [config[k] for k in heads] == [0, False, False]
    loaded, spec = load_drafter(tmp_path / "drafter")
    assert spec == d.spec and loaded.markov_head is None and loaded.confidence_head is None
    mine, theirs = d.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    with torch.no_grad():
        h1, h2 = d.block_hidden(hidden[:1, :9], 3, embed), loaded.block_hidden(hidden[:1, :9], 3, embed)
        assert torch.equal(d.pick_block(h1, 3, head)[2], loaded.pick_block(h2, 3, head)[2])
    path = tmp_path / "deepspec"
    deepspec_checkpoint(path, d)
    written = json.loads((path / "config.json").read_text())
    del written["confidence_head_with_markov"]
    (path / "config.json").write_text(json.dumps(written))
    state = init_weights(path, d.spec)
    assert state.keys() == mine.keys() and all(torch.equal(state[k], mine[k]) for k in mine)
    with pytest.raises(UserError, match=r"markov_rank 0, this drafter 8; set drafter.dspark.markov_rank: 0"):
        init_weights(path, tiny_spec())
    with pytest.raises(ValueError, match="only with a Markov head"):
        tiny_spec(markov_rank=0)  # a confidence head reading the Markov features of none


def deepspec_checkpoint(path, d, extra=None, **config):
    """A checkpoint as DeepSpec's trainer saves one: the target's embedding and head inside."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**d.spec.to_config_dict(), **config}))
    state = {
        **d.state_dict(),
        "embed_tokens.weight": torch.randn(V, H),
        "lm_head.weight": torch.randn(V, H),
        **(extra or {}),
    }
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")


def test_init_from_a_deepspec_checkpoint(tmp_path):
    d, spec = drafter(seed=1), tiny_spec()
    deepspec_checkpoint(tmp_path / "ok", d)
    state = init_weights(tmp_path / "ok", spec)
    assert state.keys() == d.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in d.state_dict().items())
    assert load_drafter(tmp_path / "ok")[1] == spec  # and loads for evaluation
    deepspec_checkpoint(tmp_path / "extra", d, {"markov_head.gate_proj.weight": torch.zeros(8, 72)})
    with pytest.raises(UserError, match=r"has tensors this drafter has not: markov_head.gate_proj.weight$"):
        init_weights(tmp_path / "extra", spec)
    with pytest.raises(UserError, match=r"markov_rank 8, this drafter 16; set drafter.dspark.markov_rank: 8"):
        init_weights(tmp_path / "ok", tiny_spec(markov_rank=16))
    with pytest.raises(UserError, match="has not: confidence_head.proj.bias, confidence_head.proj.weight$"):
        init_weights(tmp_path / "ok", tiny_spec(confidence_head=False))
    with pytest.raises(UserError, match="set drafter.dspark.confidence_with_markov: True"):
        init_weights(tmp_path / "ok", tiny_spec(confidence_with_markov=False))
    dflash = DFlashDrafter(backbone_spec(spec))
    export_drafter(dflash, dflash.spec, tmp_path / "dflash")
    with pytest.raises(UserError, match=r"is not a DSpark drafter's config \(KeyError: 'markov_rank'\)"):
        init_weights(tmp_path / "dflash", spec)


def test_the_family_seam():
    """The family's parts, and training's import of its module brings no decoding engine (dspark_decode,
    with the proposer, is imported by the family's proposer only)."""
    engines = "{'flashdraft.speculative', 'transformers'}"
    code = f"import sys, flashdraft.dspark; print(sorted({engines} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    assert family("dspark") is FAMILY
    assert (FAMILY.spec, FAMILY.drafter) == (DSparkSpec, DSparkDrafter)
    assert FAMILY.init_weights is init_weights and FAMILY.name == "dspark"
    cfg = DrafterConfig(dspark=DSparkConfig(confidence_weight=0.0))
    target = types.SimpleNamespace(
        num_hidden_layers=6,
        hidden_size=H,
        intermediate_size=128,
        vocab_size=V,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=1e4,
    )
    spec = DSparkSpec.from_target(target, 90, cfg)
    assert family_of_export(spec.to_config_dict()) is FAMILY and spec.family == "dspark"
    assert spec.verify_width == spec.block_size + 1  # B drafts and the anchor
    assert spec.confidence_head is False and spec.markov_rank == 256 and spec.mask_token_id == 90


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_flex_and_sdpa_agree_and_bf16_tracks_float32(data):
    """On CUDA: flex_attention (training's GPU kernel) and SDPA give one loss and one gradient in float32,
    and a bf16-autocast step (training's dtype) stays within bf16's error of it, its gradients finite."""
    dev = torch.device("cuda")
    ids, loss_mask, hidden, last, embed, head, anchors, _ = (t.to(dev) for t in data)
    # flex_attention's kernels take block queries in multiples of 128 (loss.num_anchor_slots pads so)
    anchors = torch.cat([anchors, anchors.new_full((2, 128 // B - anchors.shape[1]), -1)], 1)
    valid = anchors >= 0
    results = {}
    for name, attention, amp in (("sdpa", "sdpa", False), ("flex", "flex", False), ("bf16", "flex", True)):
        d = drafter().to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss, stats = dspark_loss(
                d, ids, loss_mask, hidden, last, anchors, valid, embed, head, **{**KW, "attention": attention}
            )
        loss.backward()
        results[name] = (loss.item(), torch.cat([p.grad.flatten() for p in d.parameters()]), stats.cpu())
    assert results["sdpa"][0] == pytest.approx(results["flex"][0], rel=1e-4)
    torch.testing.assert_close(results["sdpa"][1], results["flex"][1], atol=1e-4, rtol=1e-3)
    assert results["bf16"][0] == pytest.approx(results["sdpa"][0], rel=0.05)
    assert results["bf16"][1].isfinite().all() and results["bf16"][1].abs().sum() > 0


# ---------------------------------------------------------------------------------------------------------
# (f) config/dflash_paper.yaml: the DSpark paper's DFlash baseline


def overlay(*names):
    """The Config of the embedded default with `names` (files of config/) over it, as Snakemake merges
    them, read as the workflow reads it."""
    from flashdraft.config_load import load

    repo = Path(__file__).resolve().parents[1]
    return load([repo / "config" / name for name in ("config.yaml", *names)])


def test_the_paper_baseline_config_is_heads_off_on_dflash_shards_at_dflash_rates():
    """config/dflash_paper.yaml over the embedded default: a dspark drafter of block 7 without either head,
    trained with CE alone (DeepSpec's config/dflash/dflash_qwen3_8b.py), that passes the checks; its hidden
    shards are a dflash run's (no last hidden state: a token's bytes are DFlash's), and the planner gives it
    DFlash's training and decoding rates, where config/dspark.yaml pays both measured factors."""
    from flashdraft.config import needs_last_hidden
    from flashdraft.config_check import check
    from flashdraft.estimate import Run, Split, token_bytes
    from flashdraft.shapes import QWEN3_8B

    paper, dspark, dflash = overlay("dflash_paper.yaml"), overlay("dspark.yaml"), overlay()
    d = paper.drafter
    assert (d.family, d.block_size, paper.train.loss_gamma(d.block_size)) == ("dspark", 7, 4.0)
    assert (d.dspark.markov_rank, d.dspark.ce_weight, d.dspark.l1_weight, d.dspark.confidence_weight) == (
        0,
        1.0,
        0.0,
        0.0,
    )
    check(paper)
    target = types.SimpleNamespace(
        num_hidden_layers=6,
        hidden_size=H,
        intermediate_size=128,
        vocab_size=V,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=1e4,
    )
    spec = DSparkSpec.from_target(target, 90, d)
    assert (spec.markov_rank, spec.confidence_head, spec.verify_width) == (0, False, 8)
    assert not needs_last_hidden(d) and needs_last_hidden(dspark.drafter)
    assert token_bytes(paper, QWEN3_8B) == token_bytes(dflash, QWEN3_8B) < token_bytes(dspark, QWEN3_8B)
    split = Split(target=1, drafter=1)

    def keys(cfg):
        run = Run(cfg, None, QWEN3_8B, 1.0, 1)
        return run.train_keys(split) + run.eval_keys()

    assert keys(paper) == keys(dflash)
    assert {"train_dspark_factor", "eval_dspark_factor"} <= set(keys(dspark))


def test_a_confidence_head_on_the_markov_features_of_no_markov_head_is_refused():
    from flashdraft.config_check import check

    cfg = overlay("dflash_paper.yaml")
    cfg.drafter.dspark.confidence_weight = 1.0
    check(cfg)  # a confidence head over the slot's hidden state alone
    cfg.drafter.dspark.confidence_with_markov = True
    with pytest.raises(
        UserError,
        match=r"confidence_with_markov: true reads the Markov head's features, and "
        r"drafter\.dspark\.markov_rank 0 builds none",
    ):
        check(cfg)


@pytest.mark.slow
def test_the_paper_baseline_trains_from_shards_without_the_last_hidden_state(tmp_path):
    """scripts/train.py with config/dflash_paper.yaml's drafter on shards a dflash run makes (no
    last_hidden column): the loss falls, metrics.csv's teacher columns are empty, and the export is a
    DSpark drafter with neither head."""
    from conftest import toy_hidden_shards
    from train_helpers import TRAIN, losses, read_rows, run, train_cmd

    paper = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "dflash_paper.yaml").read_text())
    backbone = {"num_layers": 2, "block_size": paper["drafter"]["block_size"]}
    shards = toy_hidden_shards(tmp_path, backbone)
    drafter = {**backbone, "family": "dspark", "dspark": paper["drafter"]["dspark"]}
    run(
        train_cmd(
            tmp_path,
            shards,
            tmp_path / "out",
            {**TRAIN, **paper["train"], "max_steps": 8},
            nproc=1,
            drafter=drafter,
        )
    )
    rows = read_rows(tmp_path / "out" / "metrics.csv")
    assert losses(rows)[-1] < losses(rows)[0]
    assert all(math.isnan(float(r["l1"])) and math.isnan(float(r["expected_tau"])) for r in rows)
    assert all(float(r["loss"]) == pytest.approx(float(r["ce"]), rel=1e-6) for r in rows)
    d, spec = load_drafter(tmp_path / "out" / "drafter")
    assert (spec.family, spec.markov_rank, spec.confidence_head) == ("dspark", 0, False)
    assert d.markov_head is None and d.confidence_head is None
