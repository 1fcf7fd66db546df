"""The static-cache decoder (flashdraft.decode) against HF generate, on the toy target."""

import pyarrow.parquet as pq
import pytest
import torch
from conftest import toy_prompt_set

from flashdraft.chat import prompt_messages, render
from flashdraft.decode import SlotDecoder, unsupported
from flashdraft.regenerate import load_for_generate

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
        new = model.generate(**ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                             pad_token_id=tok.pad_token_id)[0, ids["input_ids"].shape[1]:].tolist()
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
    assert dec.graphs is not None
    got = {i: (t, f) for i, t, f in dec.run(ids, NEW)}
    assert got == ref and len(dec.graphs) >= 1
