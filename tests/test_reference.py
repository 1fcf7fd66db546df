"""Our export and evaluator against the official DFlash reference implementation (PyPI `dflash`, pinned in
envs/requirements-nodeps.txt): it loads our export, drafts what we draft, decodes losslessly with it, and
counts acceptance per verify step as we do."""

import dataclasses

import pytest
import torch

from flashdraft.config import DrafterConfig, ToyConfig, target_layer_ids
from flashdraft.drafter_io import export_drafter
from flashdraft.evaluate import prompt_ids
from flashdraft.loss import dflash_loss, sample_anchors
from flashdraft.model import DFlashDrafter, DraftCache, DrafterSpec
from flashdraft.objectives import Decay
from flashdraft.speculative import DFlashProposer, make_session, speculative_decode, target_decode
from flashdraft.target import eos_ids, load_target, select_features
from flashdraft.toy import build_toy_target, task_conversations

reference = pytest.importorskip("dflash.model", reason="the pinned reference; `make install` installs it")

pytestmark = pytest.mark.usefixtures("one_thread")

B = 8
MAX_NEW = 40


def test_default_layer_ids_are_the_references():
    pairs = [(n, k) for n in range(4, 130) for k in range(1, 9)]
    for n, k in pairs:
        assert target_layer_ids(n, k) == reference.build_target_layer_ids(n, k), (n, k)
    # the table holds ties (1 + i*(N-4)/(K-1) = x.5) that rounding half up takes to other ids
    half_up = {(n, k): [int(1 + i * (n - 4) / (k - 1) + 0.5) for i in range(k)] for n, k in pairs if k > 1}
    differ = [nk for nk, ids in half_up.items() if ids != target_layer_ids(*nk)]
    assert (94, 5) in differ and len(differ) > 50


def train_briefly(model, spec, sequences, prompt_lens, steps=60):
    """A drafter fitted for a few steps to the target's own continuations of the eval prompts: enough for
    acceptance lengths from 1 to a whole block, which is what the comparison needs."""
    s = max(map(len, sequences))
    ids, loss_mask = torch.zeros(len(sequences), s, dtype=torch.long), torch.zeros(len(sequences), s)
    hidden = torch.zeros(len(sequences), s, spec.num_features * spec.hidden_size)
    with torch.no_grad():
        for j, (seq, n) in enumerate(zip(sequences, prompt_lens, strict=True)):
            hs = model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
            hidden[j, : len(seq)] = select_features(hs, spec.target_layer_ids)[0]
            ids[j, : len(seq)], loss_mask[j, n : len(seq)] = torch.tensor(seq), 1
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        anchors, valid = sample_anchors(loss_mask, 16, B, gen)
        loss, _ = dflash_loss(drafter, ids, loss_mask, hidden, anchors, valid, embed, head, Decay(4.0))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    build_toy_target(ToyConfig(steps=0, num_docs=200), str(root / "target"))
    model, tokenizer = load_target(str(root / "target"), "float32")
    model.requires_grad_(False)
    spec = DrafterSpec.from_target(model.config, tokenizer, DrafterConfig(num_layers=2, block_size=B))
    prompts = [prompt_ids(tokenizer, c) for c in task_conversations(4, seed=11)]
    session = make_session(model, "auto", 256)
    sequences = [p + target_decode(session, p, MAX_NEW, eos=set()).tokens for p in prompts]
    drafter = train_briefly(model, spec, sequences, [len(p) for p in prompts])
    export_drafter(drafter, spec, root / "drafter")
    ref, info = reference.DFlashDraftModel.from_pretrained(
        root / "drafter", dtype=torch.float32, output_loading_info=True
    )
    return model, tokenizer, spec, drafter, ref.eval(), info, prompts, sequences


def test_reference_loads_our_export_strictly(setup):
    _, _, spec, drafter, ref, info, _, _ = setup
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys, no errors
    assert ref.target_layer_ids == spec.target_layer_ids and ref.block_size == B
    assert ref.mask_token_id == spec.mask_token_id
    ours = drafter.state_dict()
    assert all(torch.equal(v, ours[k]) for k, v in ref.state_dict().items())


def reference_block(ref, model, context, anchor: int, size: int, mask_id: int):
    """The reference drafter's logits for the block [anchor, MASK x (size-1)] after `context` features."""
    block = torch.full((1, size), mask_id)
    block[0, 0] = anchor
    positions = torch.arange(context.shape[1] + size)[None]
    with torch.no_grad():
        out = ref(
            target_hidden=context,
            noise_embedding=model.get_input_embeddings().weight[block],
            position_ids=positions,
        )
        return ref.compute_logits(out[:, 1:], model.get_output_embeddings())[0]


def test_reference_drafts_our_logits(setup):
    model, _, spec, drafter, ref, _, _, sequences = setup
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    seq = sequences[1]
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
    features = select_features(hs, spec.target_layer_ids)
    for s in (5, len(seq) - B):  # the anchor seq[s] after a context of s verified tokens
        for size in (B, 3):  # a full block, and a last one shortened by the cap
            theirs = reference_block(ref, model, features[:, :s], seq[s], size, spec.mask_token_id)
            # the evaluator's path: context and block projected apart, as the reference projects them
            # (one matmul over both can round differently in the last bit)
            ours = drafter.predict_block_cached(features[:, :s], seq[s], embed, head, DraftCache(), s, size)
            assert torch.equal(ours, theirs)


def test_reference_loads_a_windowed_export_and_drafts_our_logits(setup, tmp_path):
    """drafter.sliding_window: the reference reads the export's layer_types, sliding_window and is_causal
    as a non-causal window of W on every layer, and drafts what our windowed drafter drafts."""
    model, _, spec, _, _, _, _, sequences = setup
    w = B
    windowed = dataclasses.replace(spec, sliding_window=w)
    torch.manual_seed(5)
    drafter = DFlashDrafter(windowed).eval()
    export_drafter(drafter, windowed, tmp_path / "drafter")
    ref, info = reference.DFlashDraftModel.from_pretrained(
        tmp_path / "drafter", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    assert all(layer.self_attn.sliding_window == w and not layer.self_attn.is_causal for layer in ref.layers)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    seq = sequences[1]
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
    features = select_features(hs, spec.target_layer_ids)
    s = len(seq) - B  # a context well past the window
    theirs = reference_block(ref, model, features[:, :s], seq[s], B, spec.mask_token_id)
    with torch.no_grad():
        full = drafter.predict_block(features[:, :s], seq[s], embed, head)
    cached = drafter.predict_block_cached(features[:, :s], seq[s], embed, head, DraftCache(), s)
    torch.testing.assert_close(cached, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full, theirs, atol=1e-5, rtol=1e-5)
    unwindowed = DFlashDrafter(spec).eval()
    unwindowed.load_state_dict(drafter.state_dict())
    unwindowed_logits = unwindowed.predict_block(features[:, :s], seq[s], embed, head)
    assert not torch.allclose(unwindowed_logits, theirs, atol=1e-3)


@pytest.fixture
def cpu_timer(monkeypatch):
    """The reference times with `torch.cuda.synchronize()` around `perf_counter()`. On the CPU no work is
    queued on a device, so dropping that call (and only that call) leaves what it measures unchanged."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)


def test_reference_decodes_losslessly_and_counts_acceptance_as_we_do(setup, cpu_timer):
    model, tokenizer, spec, drafter, ref, _, prompts, sequences = setup
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    proposer = DFlashProposer(drafter, embed, head)
    # the real stop tokens, then a token the answer repeats, so the stop lands inside accepted runs
    stops = [eos_ids(model, tokenizer), [max(set(sequences[3]), key=sequences[3].count)]]
    steps, stopped_on_a_draft = [], False
    plain = make_session(model, "auto", 256, (), B)
    featured = make_session(model, "auto", 256, spec.target_layer_ids, B)
    for stop in stops:
        for p in prompts:
            for max_new in (MAX_NEW, MAX_NEW - 3):
                want = target_decode(plain, p, max_new, set(stop)).tokens
                theirs = reference.dflash_generate(
                    ref, model, torch.tensor([p]), max_new, stop, return_stats=True
                )
                ours = speculative_decode(featured, proposer, p, max_new, set(stop))
                assert theirs.output_ids[0, len(p) :].tolist() == want == ours.tokens
                assert theirs.acceptance_lengths == ours.emitted
                steps += zip(ours.emitted, ours.accepted, strict=True)
                stopped_on_a_draft |= ours.tokens[-1] in stop and ours.emitted[-1] == ours.accepted[-1]
    # the comparison covered whole blocks, rejections, and steps that ended on a draft: cut by the cap
    # or by a stop token among the accepted drafts
    assert any(e == B for e, _ in steps) and any(e == a + 1 < B for e, a in steps)
    assert any(e == a for e, a in steps) and stopped_on_a_draft
