"""The static-cache session (flashdraft.session) against the model's own forward over a DynamicCache."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from flashdraft.session import HFSession, StaticSession
from flashdraft.step import KV_BLOCK

B = 6
# (device, compiled): eager and compiled on the CPU; on a GPU compiled and captured as CUDA graphs (fp32)
ENGINES = [
    ("cpu", False),
    ("cpu", True),
    pytest.param(
        "cuda",
        True,
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]
LAYERS = [0, 2]  # the last layer (2): its feature is the final-normed state, as in HF's hidden_states


@pytest.fixture(scope="module")
def model():
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    for name, p in m.named_parameters():
        if "norm" not in name:
            torch.nn.init.normal_(p, std=0.1)
    return m


@pytest.mark.parametrize(("device", "compiled"), ENGINES)
def test_steps_verifies_and_crops_match_the_models_forward(model, device, compiled):
    """A prompt ending just before a KV block boundary, then one-token steps, full and short verify
    blocks (padded to B) across the boundary, crops of rejected drafts, and a second sequence in the
    same session: logits and features as the model's own forward computes them."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    model = model.to(device)
    ours = StaticSession(model, 2 * KV_BLOCK, LAYERS, B, compiled=compiled, graphs=device == "cuda")
    ref = HFSession(model, LAYERS)
    for prompt_len in (KV_BLOCK - 3, 5):
        prompt = torch.randint(0, 96, (prompt_len,), generator=g).tolist()
        (a, fa), (b, fb) = ours.prefill(prompt), ref.prefill(prompt)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fa, fb, atol=1e-4, rtol=1e-4)
        for size, crop in ((1, 0), (B, 2), (3, 1), (1, 0), (B, 0), (2, 2), (B, B - 1)):
            tokens = torch.randint(0, 96, (size,), generator=g).tolist()
            (a, fa), (b, fb) = ours.forward(tokens), ref.forward(tokens)
            assert a.shape == (size, 96) and fa.shape == (1, size, 2 * 64)
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(fa, fb, atol=1e-4, rtol=1e-4)
            ours.crop(crop)
            ref.crop(crop)
        assert ours.pos == ref.cache.get_seq_length()


def test_a_block_past_the_cache_or_the_block_size_is_refused(model):
    s = StaticSession(model, 8, (), B)
    s.prefill([1, 2, 3])
    with pytest.raises(ValueError, match="blocks of 1..6 tokens"):
        s.forward([1] * (B + 1))
    s.pos = s.max_len - 2
    with pytest.raises(ValueError, match=f"within {s.max_len} positions"):
        s.forward([1, 2])


@pytest.mark.parametrize("window", [None, 2 * B])
@pytest.mark.parametrize(("device", "compiled"), ENGINES)
def test_draft_session_drafts_as_the_drafter_over_its_context_cache(model, device, compiled, window):
    """Blocks of every size (short ones padded), context extends longer than a block (in pieces) and
    shorter (padded), past a KV block boundary, with and without a sliding window: the logits
    `predict_block_cached` gives, and with `hidden_states` the block's hidden states
    (`block_hidden_cached`)."""
    from flashdraft.config import DrafterConfig
    from flashdraft.model import DFlashDrafter, DraftCache, DrafterSpec
    from flashdraft.session import DraftSession

    torch._dynamo.reset()
    spec = DrafterSpec.from_target(
        model.config, 90, DrafterConfig(num_layers=2, block_size=B, sliding_window=window)
    )
    torch.manual_seed(1)
    drafter = DFlashDrafter(spec).eval().to(device)
    model = model.to(device)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    ours = DraftSession(drafter, embed, head, 2 * KV_BLOCK, compiled=compiled, graphs=device == "cuda")
    # the block's hidden states at every position, as a family that picks its own drafts reads them
    states = DraftSession(
        drafter, embed, head, 2 * KV_BLOCK, compiled=compiled, graphs=device == "cuda", hidden_states=True
    )
    g = torch.Generator().manual_seed(2)
    width = spec.num_features * spec.hidden_size
    for context in (KV_BLOCK - 4, 3):  # two sequences in one session
        ours.reset()
        states.reset()
        cache, n_new = DraftCache(), context
        for size in (B, 1, 3, B, 2, B):
            feats = torch.randn(1, n_new, width, generator=g).to(device)
            last = int(torch.randint(0, 90, (), generator=g))
            with torch.no_grad():
                hidden = drafter.block_hidden_cached(feats, last, embed, cache, cache.length + n_new, size)
            ours.extend(feats)
            states.extend(feats)
            assert ours.length == states.length == cache.length
            torch.testing.assert_close(ours.draft(last, size), hidden[1:] @ head.T, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(states.draft(last, size), hidden, atol=1e-4, rtol=1e-4)
            n_new = size  # the next step's context grows by what a verify may accept: up to the block
