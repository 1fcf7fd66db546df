"""The target model: loading, feature-layer ids, MASK id, answering chat prompts with generate. One place
for each of these facts."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from .chat import render
from .config import DrafterConfig, TargetConfig, feature_layers
from .hf_config import read_target_config
from .io import device, run_dtype, torch_dtype


def load_target(path: str, dtype: str = TargetConfig.dtype, dev=None):
    """Load a target exactly as any HF causal LM: AutoModelForCausalLM + AutoTokenizer, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    read_target_config(path)  # refuses remote code before transformers sees the directory
    dev = dev or device()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype(run_dtype(dtype, dev)), attn_implementation="sdpa"
    )
    model.to(dev).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    return model, tokenizer


def num_layers(target_config) -> int:
    return target_config.num_hidden_layers


def feature_layer_ids(target_config, drafter: DrafterConfig) -> list[int]:
    """0-indexed decoder layers whose outputs feed the drafter (config override or DFlash formula)."""
    return feature_layers(num_layers(target_config), drafter)


def select_features(hidden_states, layer_ids: list[int]):
    """Concatenate decoder-layer outputs `[.., S, H]` -> `[.., S, K*H]`.

    HF `hidden_states[0]` is the embedding output, so decoder layer i is `hidden_states[i + 1]`."""
    import torch

    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def layers_needed(num_layers: int, layer_ids: list[int]) -> int:
    """Decoder layers a forward must run so `select_features` sees every layer it selects: through the
    deepest selected layer, plus one, because HF's last hidden state comes after the final norm."""
    return min(num_layers, max(layer_ids) + 2)


@contextlib.contextmanager
def decoder_prefix(model, n: int):
    """Run only the first `n` decoder layers of an HF model whose decoder keeps them in `.layers`
    (Llama, Qwen, Mistral, ...); the layers after the deepest selected one would compute nothing we keep.
    Other layouts run whole."""
    base = model.base_model
    layers = getattr(base, "layers", None)
    if not hasattr(layers, "__getitem__") or n >= len(layers):
        yield
        return
    base.layers = layers[:n]
    try:
        yield
    finally:
        base.layers = layers


def eos_ids(model, tokenizer) -> list[int]:
    """Tokens that end an answer: the generation config's eos ids plus the tokenizer's eos token."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    extra = tokenizer.eos_token_id
    return sorted({int(i) for i in ids} | ({int(extra)} if isinstance(extra, int) else set()))


def load_for_generate(target: str, dtype: str):
    """The target ready for batched generate: left padding, a pad token, and its end-of-turn ids."""
    model, tokenizer = load_target(target, dtype)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, eos_ids(model, tokenizer)


def generate(
    model,
    tokenizer,
    prompts: list[list[dict]],
    max_new_tokens: int,
    temperature: float,
    thinking: bool,
    eos: list[int],
    top_p: float = 1.0,
    top_k: int = 0,
) -> list[tuple[str, int, int, str]]:
    """Answer a batch of chat prompts: (answer, prompt tokens, answer tokens, finish_reason) each. Sampled
    above temperature 0, within `top_p` and `top_k` where set (else as the model's generation_config says)."""
    import torch

    texts = [render(tokenizer, p, add_generation_prompt=True, thinking=thinking) for p in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    # greedy: unset the model's sampling defaults so generate does not warn that they are ignored
    sampling = (
        dict(
            do_sample=True,
            temperature=temperature,
            **({"top_p": top_p} if top_p < 1 else {}),
            **({"top_k": top_k} if top_k else {}),
        )
        if temperature > 0
        else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    )
    with torch.inference_mode():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
    results, new_ids = [], out[:, enc["input_ids"].shape[1] :].tolist()
    for mask, new in zip(enc["attention_mask"].tolist(), new_ids, strict=True):
        stop = next((i for i, t in enumerate(new) if t in eos), None)
        tokens = new if stop is None else new[:stop]
        answer = tokenizer.decode(tokens, skip_special_tokens=True)
        results.append((answer, sum(mask), len(tokens), "length" if stop is None else "stop"))
    return results


def mask_token_id(tokenizer, target_config, drafter: DrafterConfig) -> int:
    """MASK = the first embedding row no token uses (len(tokenizer)), a frozen row of the target embedding."""
    mid = drafter.mask_token_id if drafter.mask_token_id is not None else len(tokenizer)
    if not 0 <= mid < target_config.vocab_size:
        raise ValueError(
            f"mask token id {mid} is outside the target embedding ({target_config.vocab_size} rows); "
            "set drafter.mask_token_id to an unused row"
        )
    return mid


def load_target_head(target_dir, device="cpu"):
    """(embed_weight, lm_head_weight) read straight from the target's safetensors onto `device`, without
    building the target (nor a host copy of them first). Handles sharded checkpoints
    (model.safetensors.index.json) and tied embeddings."""
    from safetensors import safe_open  # here, not at the top: appended to this module

    target_dir = Path(target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(target_dir / "model.safetensors", framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}

    def find(*suffixes):
        for suffix in suffixes:
            for key in sorted(weight_map):
                if key.endswith(suffix):
                    with safe_open(target_dir / weight_map[key], framework="pt", device=str(device)) as f:
                        return f.get_tensor(key)
        return None

    embed = find("embed_tokens.weight", "wte.weight", "word_embeddings.weight")
    if embed is None:
        raise ValueError(f"{target_dir}: no input embedding (embed_tokens.weight) in the safetensors")
    head = None if config.get("tie_word_embeddings", False) else find("lm_head.weight")
    return embed, embed if head is None else head
