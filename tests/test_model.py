"""The DFlash drafter against DESIGN.md section 3: masks, the training forward against drafting, the
cache, the export format (the loss and its objectives: test_loss.py)."""

import json

import pytest
import torch
from conftest import run_python
from model_helpers import MASK, B, V, block_out, tiny_spec
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3ForCausalLM

from flashdraft.config import DrafterConfig
from flashdraft.drafter_io import export_drafter, load_drafter
from flashdraft.loss import dflash_loss, sample_anchors, train_forward
from flashdraft.model import DFlashDrafter, DraftCache, DrafterSpec, dense_mask, dflash_mask_mod
from flashdraft.objectives import Decay
from flashdraft.target import load_target_head


def test_feature_layers_and_mask_id_for_qwen3_8b_shape():
    config = Qwen3Config(
        num_hidden_layers=36,
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1e6,
    )
    spec = DrafterSpec.from_target(config, 151669, DrafterConfig())
    assert spec.target_layer_ids == [1, 9, 17, 25, 33]
    assert (spec.num_layers, spec.block_size, spec.mask_token_id) == (5, 16, 151669)
    assert (spec.num_kv_heads, spec.head_dim, spec.rope_theta, spec.num_target_layers) == (8, 128, 1e6, 36)
    assert DFlashDrafter(tiny_spec()).fc.weight.shape == (64, 2 * 64)  # fc: K*H -> H, no bias
    assert DFlashDrafter(tiny_spec()).fc.bias is None


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
    m = dflash_mask_mod(anchors, valid, s, bs, w)(
        torch.tensor(0), 0, torch.arange(3 * bs)[:, None], torch.arange(s + 3 * bs)[None, :]
    )
    for k in range(bs):
        assert m[k, :s].nonzero().flatten().tolist() == list(range(9 + k - w + 1, 9)), k
        assert m[k, s : s + bs].all() and not m[k, s + bs :].any()  # its whole block, bidirectional
    assert m[bs, :s].nonzero().flatten().tolist() == [0, 1]  # anchor 2: the window holds all its context
    assert not m[2 * bs :].any()
    full = dflash_mask_mod(anchors, valid, s, bs)(
        torch.tensor(0), 0, torch.arange(3 * bs)[:, None], torch.arange(s + 3 * bs)[None, :]
    )
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
        got = windowed.predict_block_cached(
            hidden[:1, s : s + new], ids[0, s + new].item(), embed, head, cache, s + new
        )
        s += new
        want = windowed.predict_block(hidden[:1, :s], ids[0, s].item(), embed, head)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        short = windowed.predict_block_cached(hidden[:1, :0], ids[0, s].item(), embed, head, cache, s, 3)
        torch.testing.assert_close(
            short,
            windowed.predict_block(hidden[:1, :s], ids[0, s].item(), embed, head, 3),
            atol=1e-5,
            rtol=1e-5,
        )


def test_windowed_export_writes_the_engines_keys_and_round_trips(setup, windowed, tmp_path):
    _, ids, _, hidden, embed, head, _, _ = setup
    export_drafter(windowed, windowed.spec, tmp_path / "drafter")
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["dflash_config"] == {
        "mask_token_id": MASK,
        "target_layer_ids": [1, 3],
        "use_swa": True,
        "swa_window_size": 12,
        "causal": False,
    }
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["sliding_window"] == 12
    assert config["use_sliding_window"] is True and config["is_causal"] is False
    loaded, spec = load_drafter(tmp_path / "drafter")
    assert spec == windowed.spec and spec.sliding_window == 12
    a = 30
    torch.testing.assert_close(
        loaded.predict_block(hidden[:1, :a], ids[0, a].item(), embed, head),
        windowed.predict_block(hidden[:1, :a], ids[0, a].item(), embed, head),
    )
    plain = tiny_spec().to_config_dict()
    assert "use_swa" not in plain["dflash_config"] and "is_causal" not in plain
    assert DrafterSpec.from_config_dict(plain).sliding_window is None
    # an export of another engine that windows by use_swa alone, over all-full layer_types
    other = {**plain, "dflash_config": {**plain["dflash_config"], "use_swa": True, "swa_window_size": 64}}
    assert DrafterSpec.from_config_dict(other).sliding_window == 64


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
        got = drafter.predict_block_cached(
            hidden[:1, s : s + new], ids[0, s + new].item(), embed, head, cache, s + new
        )
        s += new
        want = drafter.predict_block(hidden[:1, :s], ids[0, s].item(), embed, head)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert cache.length == s and all(k.shape[2] == s for k in cache.k + cache.v)
    assert len(cache.k) == drafter.spec.num_layers
    # the caller's count of verified tokens must match: a rejected draft that entered the cache is caught
    with pytest.raises(AssertionError, match="holds 33 positions, not 32"):
        drafter.predict_block_cached(hidden[:1, s : s + 1], ids[0, s + 1].item(), embed, head, cache, s)


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
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=tied,
    )
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
QWEN3_8B_JSON = dict(
    model_type="qwen3",
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-06,
    rope_scaling=None,
    rope_theta=1000000,
    max_position_embeddings=40960,
    vocab_size=151936,
    tie_word_embeddings=False,
    sliding_window=None,
)
LLAMA31_8B_JSON = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-05,
    rope_scaling={
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    rope_theta=500000.0,
    max_position_embeddings=131072,
    vocab_size=128256,
)
QWEN25_7B_JSON = dict(
    model_type="qwen2",
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    rms_norm_eps=1e-06,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    vocab_size=152064,
    sliding_window=131072,
    use_sliding_window=False,
)
MISTRAL_JSON = dict(
    model_type="mistral",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-05,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    vocab_size=32768,
)
NO_HEAD_DIM = {k: v for k, v in QWEN3_8B_JSON.items() if k != "head_dim"} | {"hidden_size": 2048}


@pytest.mark.parametrize(
    "raw",
    [
        QWEN3_8B_JSON,
        LLAMA31_8B_JSON,
        MISTRAL_JSON,
        "transformers 5",
        QWEN25_7B_JSON,
        NO_HEAD_DIM,
        {**QWEN3_8B_JSON, "model_type": "gemma3_text"},
    ],
    ids=[
        "qwen3",
        "llama",
        "mistral",
        "transformers 5",
        "qwen2 no head_dim",
        "qwen3 no head_dim",
        "other type",
    ],
)
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
