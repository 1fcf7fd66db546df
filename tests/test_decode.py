"""The static-cache decoder (flashdraft.decode) against HF generate, on the toy target."""

import pyarrow.parquet as pq
import pytest
import torch
from conftest import toy_prompt_set
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM

from flashdraft.chat import prompt_messages, render
from flashdraft.decode import SlotDecoder
from flashdraft.step import KV_BLOCK, RECIPES, pick, unsupported
from flashdraft.target import load_for_generate

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 12


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return toy_prompt_set(tmp_path_factory.mktemp("decode"), num_docs=300)


def _prompts(data, tok):
    rows = pq.read_table(data / "prompts/train.parquet").to_pylist()
    prompts = [prompt_messages(r["messages"]) for r in rows]
    return prompts, [tok(render(tok, p, True, False), add_special_tokens=False)["input_ids"] for p in prompts]


def _hf(model, tok, prompts, eos):
    """HF generate, one prompt at a time (no padding): (new tokens without the stop token, finish)."""
    out = []
    for p in prompts:
        ids = tok(render(tok, p, True, False), add_special_tokens=False, return_tensors="pt").to(model.device)
        new = model.generate(
            **ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id
        )[0, ids["input_ids"].shape[1] :].tolist()
        stop = next((i for i, t in enumerate(new) if t in eos), None)
        out.append((new, "length") if stop is None else (new[:stop], "stop"))
    return out


def _decoded(model, tok, ids, eos, slots, **kw):
    dec = SlotDecoder(model, slots, max(map(len, ids)) + NEW, eos, tok.pad_token_id, **kw)
    out = list(dec.run(ids, NEW))
    assert sorted(i for i, _, _ in out) == list(range(len(ids)))  # every prompt once
    return {i: (tokens, finish) for i, tokens, finish in out}


@pytest.mark.parametrize("slots", [1, 7, 64])
def test_greedy_equals_hf_generate_with_slots_refilled(data, slots):
    """Fewer slots than prompts: finished rows hand their slot to waiting prompts mid-run. A second run
    adds the most common generated token to the stop tokens, so many rows stop early (and free slots at
    different steps) and the cut is checked too."""
    model, tok, eos = load_for_generate(str(data / "target"), "float32")
    prompts, ids = _prompts(data, tok)
    ref = dict(enumerate(_hf(model, tok, prompts, eos)))
    assert _decoded(model, tok, ids, eos, slots) == ref
    tokens = [t for toks, _ in ref.values() for t in toks]
    stop = sorted({*eos, max(set(tokens), key=tokens.count)})  # the most common new token stops rows
    ref = dict(enumerate(_hf(model, tok, prompts, stop)))
    assert _decoded(model, tok, ids, stop, slots) == ref
    assert sum(f == "stop" for _, f in ref.values()) >= 10


def test_unsupported_layouts_are_named(data):
    model, _, _ = load_for_generate(str(data / "target"), "float32")
    assert unsupported(model) is None
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    assert "sliding" in unsupported(model)
    with pytest.raises(ValueError, match="cannot run this model: sliding"):
        SlotDecoder(model, 2, 64, [0], 0)


def test_sampling_is_seeded_and_rows_are_independent_of_slots(data):
    """T > 0: the same seed gives the same answers; rows still end at stop tokens or the length."""
    model, tok, eos = load_for_generate(str(data / "target"), "float32")
    _, ids = _prompts(data, tok)
    a = _decoded(model, tok, ids, eos, 8, temperature=1.0, seed=3)
    b = _decoded(model, tok, ids, eos, 8, temperature=1.0, seed=3)
    assert a == b
    assert all(len(t) == NEW if f == "length" else len(t) < NEW for t, f in a.values())
    assert a != _decoded(model, tok, ids, eos, 8)  # not greedy


def test_top_k_1_is_greedy_and_top_p_top_k_sample_only_their_tokens(data):
    """Sampled with top_k 1 (or a top_p below the likeliest token's probability), the one token left is the
    greedy one, at any temperature and seed; wider, the answers are sampled again."""
    model, tok, eos = load_for_generate(str(data / "target"), "float32")
    _, ids = _prompts(data, tok)
    greedy = _decoded(model, tok, ids, eos, 8)
    assert _decoded(model, tok, ids, eos, 8, temperature=1.5, seed=3, top_k=1) == greedy
    assert _decoded(model, tok, ids, eos, 8, temperature=1.0, seed=4, top_p=1e-6) == greedy
    assert _decoded(model, tok, ids, eos, 8, temperature=1.0, seed=3, top_k=50, top_p=0.9) != greedy


def test_pick_samples_within_top_k_then_top_p_in_their_proportions():
    """step.pick: top_k keeps the k likeliest tokens, top_p then the fewest likeliest whose probabilities
    (renormalized over those k) reach p; the kept ones are drawn in proportion to their probabilities."""
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, 0.2])
    n, g = 20000, torch.Generator().manual_seed(0)

    def freq(**kw):
        draws = pick(logits.expand(n, -1), 1.0, g, **kw)
        assert draws.shape == (n,)
        return torch.bincount(draws, minlength=len(logits)).double() / n

    def law(keep):
        p = torch.zeros(len(logits), dtype=torch.float64)
        p[keep] = torch.softmax(logits[keep].double(), -1)
        return p

    probs = torch.softmax(logits.double(), -1)  # 0.43, 0.26, 0.16, 0.06, ...; of the top 3: 0.51, 0.31, 0.19
    for kw, keep in [
        ({}, list(range(8))),
        ({"top_k": 3}, [0, 1, 2]),
        ({"top_p": 0.6}, [0, 1]),
        ({"top_p": 0.9}, [0, 1, 2, 3]),
        ({"top_k": 3, "top_p": 0.7}, [0, 1]),
        ({"top_k": 1}, [0]),
    ]:
        f, want = freq(**kw), law(keep)
        assert (f[want == 0] == 0).all(), kw  # nothing outside the kept tokens
        assert torch.allclose(f, want, atol=0.015), (kw, f, want)  # > 4 sd at n draws
    assert probs[0] < 0.6 < probs[:2].sum() and probs[:3].sum() < 0.9 < probs[:4].sum()  # where p cuts
    assert torch.softmax(logits[:3].double(), -1)[0] < 0.7 < torch.softmax(logits[:3].double(), -1)[:2].sum()
    assert int(pick(logits, 0.0, g, top_k=3, top_p=0.5)) == 0  # greedy ignores them
    assert pick(logits, 1.0, g, top_k=2).shape == ()  # one row in, one token out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cuda_graph_steps_equal_hf_generate(data):
    """On the GPU the steps replay CUDA graphs over attention-length buckets; fp32 keeps the comparison
    exact."""
    model, tok, eos = load_for_generate(str(data / "target"), "float32")
    model.to("cuda")
    prompts, ids = _prompts(data, tok)
    ref = dict(enumerate(_hf(model, tok, prompts, eos)))
    dec = SlotDecoder(model, 7, max(map(len, ids)) + NEW, eos, tok.pad_token_id)
    assert dec.graphs.on
    got = {i: (t, f) for i, t, f in dec.run(ids, NEW)}
    assert got == ref and len(dec.graphs.captured) >= 1


def _random_model(arch, **extra):
    """A tiny random `arch` model whose biases (zero at init) and weights make a difference, with heads
    x head_dim != hidden_size."""
    cfg = AutoConfig.for_model(
        arch,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=1024,
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    for name, p in model.named_parameters():  # norms stay 1
        if "norm" not in name:
            torch.nn.init.normal_(p, std=0.3 if "bias" in name else 0.1)
    return model


def _hf_ids(model, ids, new):
    """HF generate's greedy continuation of each token-id prompt (explicit mask: ids may hold pad)."""
    return [
        model.generate(
            torch.tensor([p], device=model.device),
            attention_mask=torch.ones(1, len(p), dtype=torch.long, device=model.device),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in ids
    ]


@pytest.mark.parametrize("arch", sorted(set(RECIPES) - {"qwen3"}))  # qwen3: the tests above
def test_other_layouts_equal_hf_generate(arch):
    """The decode step writes the layer math out: biases (llama's attention and MLP biases, qwen2's
    q/k/v biases) and layouts without QK-norm must match the model's own layers. Every architecture
    of step.RECIPES is a parameter here (its config's extras below, where it needs any)."""
    extra = {"llama": {"attention_bias": True, "mlp_bias": True}, "mistral": {"sliding_window": None}}
    model = _random_model(arch, **extra.get(arch, {}))
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 9, 17, 3)]
    ref = {i: (t, "length") for i, t in enumerate(_hf_ids(model, ids, NEW))}
    dec = SlotDecoder(model, 2, max(map(len, ids)) + NEW, [], 0)
    assert {i: (t, f) for i, t, f in dec.run(ids, NEW)} == ref


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_compiled_step_with_per_row_kv_blocks_equals_hf_generate(device):
    """The CUDA path: compiled layer halves and FlexAttention over each row's own KV blocks (on the CPU,
    Inductor's CPU kernels; on the GPU, in CUDA graphs), prompts on both sides of block boundaries,
    slots refilled mid-run."""
    model, g, new = _random_model("qwen3").to(device), torch.Generator().manual_seed(1), 40
    lengths = (5, KV_BLOCK - 1, KV_BLOCK, KV_BLOCK + 1, 2 * KV_BLOCK - 6, 3, 3 * KV_BLOCK + 7)
    ids = [torch.randint(1, 96, (n,), generator=g).tolist() for n in lengths]
    ref = dict(enumerate(_hf_ids(model, ids, new)))
    torch._dynamo.reset()
    counters.clear()
    dec = SlotDecoder(model, 3, max(lengths) + new, [], 0, compiled=True, graphs=device == "cuda")
    assert {i: t for i, t, _ in dec.run(ids, new)} == ref
    assert counters["stats"]["unique_graphs"] == 3  # one graph per function, whatever the layer
