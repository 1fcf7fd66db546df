"""The target's layers as the static-cache engines run them (flashdraft.decode, flashdraft.session).

The prefill runs the model's own decoder layers through two transformers hooks: a cache object whose
`update` writes the rows' keys and values into their slots (`SlotCache`), and an attention function
registered with `AttentionInterface` (ATTENTION). A decode or verify step runs the same layer math
written out for the layouts in RECIPES (their weights, biases, QK-norms, activation and RoPE
variant are the model's), pinned against HF `generate` by the tests. Each layer is split around the
cache write and attention (`attn_in`, `attn_out`), so that on CUDA each half compiles into a few fused
kernels between the matmuls (`Layers`), and attention is FlexAttention over a block mask listing only
the KV blocks a query may read. `unsupported(model)` says when a model needs more (sliding windows,
other layouts).

A step's rows are tokens, each at its own position: one token for each slot (decode), or the tokens of
one sequence at consecutive positions (verify). h is [rows, H]; q [rows, heads, 1, d]; k and v
[rows, kv_heads, 1, d].
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface

from .hf_config import attention_shape

ATTENTION = "flashdraft_slots"
BUCKET = 256  # max_len granularity on CUDA, and the attention length granularity off it
KV_BLOCK = 128  # FlexAttention's KV block: a query reads the blocks up to its own position


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Prefill: causal attention over the right-padded prompts themselves (their keys and values also
    go to the slots through the cache's `update`)."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION, _attention)


def unsupported(model) -> str | None:
    """Why the static-cache engines cannot run `model` (None: they can)."""
    cfg = model.config
    if cfg.model_type not in RECIPES:
        return f"model_type {cfg.model_type!r} (supported: {', '.join(RECIPES)})"
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        return "sliding-window attention layers"
    if getattr(cfg, "use_sliding_window", False) or (cfg.model_type == "mistral" and cfg.sliding_window):
        return "sliding-window attention"
    base = model.base_model
    if not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(base).__name__} lacks embed_tokens/layers/norm/rotary_emb"
    return None


def round_len(n: int) -> int:
    """Cache positions for n: a multiple of BUCKET (of KV_BLOCK, too)."""
    return -(-n // BUCKET) * BUCKET


class SlotCache:
    """Keys and values of every slot. `update` is what an HF attention layer calls in the prefill: the
    batch rows' keys and values go to their slots at positions 0..S-1."""

    def __init__(self, model, slots: int, max_len: int):
        _, kv_heads, head_dim = attention_shape(model.config)
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in model.base_model.layers]
        self.v = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in model.base_model.layers]
        self.rows = None  # the slots of the prefill's batch rows

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.k[layer_idx][self.rows, :, : key.shape[2]] = key
        self.v[layer_idx][self.rows, :, : key.shape[2]] = value
        return key, value


def prefill(model, cache: SlotCache, rows, ids, layer_ids=()):
    """The model's own layers over right-padded prompts `ids` [B, S] (causal, no mask), their keys and
    values into slots `rows`: the final-normed hidden states, and the outputs of decoder layers
    `layer_ids` concatenated as `target.select_features` does (None without layer ids)."""
    base, attn = model.base_model, model.config._attn_implementation
    positions = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    h, feats = base.embed_tokens(ids), {}
    pe = base.rotary_emb(h, positions)
    model.config._attn_implementation, cache.rows = ATTENTION, rows
    try:
        for i, layer in enumerate(base.layers):
            h = layer(
                h, attention_mask=None, position_ids=positions, past_key_values=cache, position_embeddings=pe
            )
            h = h[0] if isinstance(h, tuple) else h
            feats[i] = h
    finally:
        model.config._attn_implementation, cache.rows = attn, None
    h = base.norm(h)
    return h, features(feats, h, layer_ids)


def features(outputs: dict, normed, layer_ids):
    """Decoder layers `layer_ids`' outputs, concatenated on the last dim; HF's hidden state of the last
    layer comes after the final norm, so that one is the normed output."""
    if not layer_ids:
        return None
    last = len(outputs) - 1
    return torch.cat([normed if i == last else outputs[i] for i in layer_ids], dim=-1)


# ------------------------------------------------------------------------------------------ one step


def _rms(x, weight, eps):
    dtype = x.dtype
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


Linear = tuple[torch.Tensor, "torch.Tensor | None"]  # a projection's weight and bias (None: no bias)


class LayerWeights(NamedTuple):
    """One decoder layer's tensors as `attn_in` and `attn_out` read them, detached (plain tensors: the
    compiled functions take every layer's as inputs of one graph); QK-norms None where the model has none."""

    input_norm: torch.Tensor
    q: Linear
    k: Linear
    v: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate: Linear
    up: Linear
    down: Linear


def attn_in(h, w: LayerWeights, cos, sin, *, eps, heads, kv_heads, head_dim):
    """Input norm, q/k/v projections, QK-norm (where the model has one), RoPE."""
    x, b = _rms(h, w.input_norm, eps), h.shape[0]
    q = F.linear(x, *w.q).view(b, heads, head_dim)
    k = F.linear(x, *w.k).view(b, kv_heads, head_dim)
    v = F.linear(x, *w.v).view(b, kv_heads, 1, head_dim)
    if w.q_norm is not None:
        q, k = _rms(q, w.q_norm, eps), _rms(k, w.k_norm, eps)
    # cos/sin in float32 (the drafter's RoPE) upcast q and k: attention wants v's dtype
    return _rope(q[:, :, None], cos, sin).to(v.dtype), _rope(k[:, :, None], cos, sin).to(v.dtype), v


def attn_out(h, attn, w: LayerWeights, *, eps, act):
    """Output projection and residual, post-attention norm, gated MLP and residual."""
    h = h + F.linear(attn.reshape(h.shape[0], -1), *w.o)
    x = _rms(h, w.post_norm, eps)
    return h + F.linear(act(F.linear(x, *w.gate)) * F.linear(x, *w.up), *w.down)


def hf_layer_weights(layer) -> LayerWeights:
    """A layer's LayerWeights by the HF Llama/Qwen names, as the drafter's layers have them (input_layernorm,
    self_attn.{q,k,v,o}_proj with any biases, q_norm/k_norm, post_attention_layernorm, mlp.*_proj)."""
    a, m = layer.self_attn, layer.mlp

    def linear(x) -> Linear:
        return x.weight.detach(), None if getattr(x, "bias", None) is None else x.bias.detach()

    def norm(x):
        return None if x is None else x.weight.detach()

    return LayerWeights(
        norm(layer.input_layernorm),
        linear(a.q_proj),
        linear(a.k_proj),
        linear(a.v_proj),
        norm(getattr(a, "q_norm", None)),
        norm(getattr(a, "k_norm", None)),
        linear(a.o_proj),
        norm(layer.post_attention_layernorm),
        linear(m.gate_proj),
        linear(m.up_proj),
        linear(m.down_proj),
    )


# model_type -> the recipe that reads one of its decoder layers as LayerWeights. A layout belongs here when
# its layers take (hidden, attention_mask, position_embeddings, past_key_values) and call
# `past_key_values.update` then the configured attention function (the prefill runs them as they are),
# and `attn_in`/`attn_out` are its math; tests/test_decode.py checks each against HF generate.
RECIPES = {
    "llama": hf_layer_weights,
    "mistral": hf_layer_weights,
    "qwen2": hf_layer_weights,
    "qwen3": hf_layer_weights,
}


class Layers:
    """Decoder layers as a step runs them: each layer's tensors, its two halves (compiled when `compiled`:
    the functions themselves, not wrappers, so each keeps its own compile cache), and the attention over
    a cache (FlexAttention when compiled, else SDPA over a dense mask). `recipe` reads a layer's tensors
    (RECIPES[model_type] for a target; the drafter's layers have the HF names of hf_layer_weights)."""

    def __init__(
        self,
        layers,
        *,
        eps: float,
        heads: int,
        kv_heads: int,
        head_dim: int,
        act,
        scaling: float,
        compiled: bool,
        recipe=hf_layer_weights,
    ):
        self.heads, self.kv_heads, self.head_dim, self.scaling = heads, kv_heads, head_dim, scaling
        self.compiled = compiled
        self.weights = [recipe(layer) for layer in layers]
        self.in_kw = {"eps": eps, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
        self.out_kw = {"eps": eps, "act": act}
        self.attn_in, self.attn_out, self.flex = attn_in, attn_out, None
        if compiled:
            compile = partial(torch.compile, fullgraph=True, dynamic=False)
            self.attn_in, self.attn_out = compile(attn_in), compile(attn_out)
            self.flex = compile(flex_attention)

    @classmethod
    def of_target(cls, model, compiled: bool) -> Layers:
        """The target's decoder layers; a model the engines cannot run (`unsupported`) is refused here."""
        if why := unsupported(model):
            raise ValueError(f"the static-cache engines cannot run this model: {why}")
        cfg, base = model.config, model.base_model
        heads, kv_heads, head_dim = attention_shape(cfg)
        return cls(
            base.layers,
            eps=cfg.rms_norm_eps,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            act=base.layers[0].mlp.act_fn,
            scaling=base.layers[0].self_attn.scaling,
            compiled=compiled,
            recipe=RECIPES[cfg.model_type],
        )

    def run(self, h, cos, sin, write, attend):
        """The layers over rows h [rows, H] with their RoPE cos/sin [rows, 1, 1, d]: `write(layer, k, v)`
        stores the new keys and values, `attend(q, layer)` reads the cache. Returns the last layer's
        output and every layer's (a dict by layer index)."""
        outputs = {}
        for i, w in enumerate(self.weights):
            q, k, v = self.attn_in(h, w, cos, sin, **self.in_kw)
            write(i, k, v)
            h = self.attn_out(h, attend(q, i), w, **self.out_kw)
            outputs[i] = h
        return h, outputs

    def over_sequence(self, k, v, positions, mask_mod, arange, mask_all: bool = False):
        """`write` and `attend` for `run` over one sequence's caches k[i], v[i] [1, kv_heads, max_len, d]
        (`arange`: the cache's positions 0..max_len-1): the rows, at `positions`, write there, then read
        it through `mask_mod` (compiled: FlexAttention over the KV blocks up to the last row's, those
        before the first row's read whole unless `mask_all`; else SDPA over the dense mask)."""
        n, max_len = positions.shape[0], arange.shape[0]

        def write(i, k_new, v_new):  # [n, kv_heads, 1, d] -> the sequence's positions
            k[i][0].index_copy_(1, positions, k_new[:, :, 0].transpose(0, 1))
            v[i][0].index_copy_(1, positions, v_new[:, :, 0].transpose(0, 1))

        if self.compiled:
            blocks = (positions // KV_BLOCK).to(torch.int32).view(-1, 1, 1)  # each row's KV block
            first = torch.zeros_like(blocks[:1]) if mask_all else blocks[:1]
            mask = block_mask(first, blocks[-1:], max_len, n, mask_mod)
        else:
            mask = mask_mod(0, 0, arange[:n, None], arange[None])[None, None]

        def attend(q, i):  # q [n, heads, 1, d] as the sequence's queries [1, heads, n, d]
            return self.attention(q.permute(2, 1, 0, 3), k[i], v[i], mask).permute(2, 1, 0, 3)

        return write, attend

    def attention(self, q, k, v, mask):
        """q [B, heads, S, d] over k, v [B, kv_heads, L, d]: FlexAttention over a BlockMask (compiled),
        else SDPA with a boolean mask [B, 1, S, L]."""
        if isinstance(mask, BlockMask):
            return self.flex(q, k, v, block_mask=mask, scale=self.scaling, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=True)


def target_step(model, layers: Layers, tokens, positions, write, attend, layer_ids=()):
    """The target over one token per row at `positions` [rows]: the final-normed hidden states and the
    features of `layer_ids` (see `features`)."""
    base = model.base_model
    h = base.embed_tokens(tokens)
    cos, sin = (x[:, None] for x in base.rotary_emb(h, positions[:, None]))  # [rows, 1, 1, d]
    h, outputs = layers.run(h, cos, sin, write, attend)
    h = base.norm(h)
    return h, features(outputs, h, layer_ids)


def pick(logits, temperature: float, generator=None, top_p: float = 1.0, top_k: int = 0):
    """The next token from `logits` [V] or [n, V]: greedy at temperature 0, else sampled from the softmax at
    `temperature`, restricted (as transformers and vLLM do, in this order) to the `top_k` likeliest tokens
    (0: all), then to the fewest likeliest whose probabilities add up to `top_p` (1.0: all)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits, index = logits.float() / temperature, None
    if 0 < top_k < logits.shape[-1]:
        logits, index = logits.topk(top_k, -1)  # sorted, largest first
    if top_p < 1:
        if index is None:
            logits, index = logits.sort(-1, descending=True)
        probs = torch.softmax(logits, -1)
        before = probs.cumsum(-1) - probs  # the mass of the likelier tokens: the first's is 0, always kept
        logits = logits.masked_fill(before >= top_p, -math.inf)
    token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
    return (token if index is None else index.gather(-1, token)).squeeze(-1)


def block_mask(first, last, max_len: int, q_len: int, mask_mod) -> BlockMask:
    """Queries of row b read KV blocks 0..first[b]-1 whole and first[b]..last[b] through `mask_mod`
    (first, last: int32 [B, 1, 1]). The index arrays are dense: the kernel reads them as [B, 1, 1, n]."""
    nblk = max_len // KV_BLOCK
    ar = torch.arange(nblk, dtype=torch.int32, device=first.device).expand(first.shape[0], 1, 1, -1)
    partial_idx = (first[..., None] + ar).clamp(max=nblk - 1).contiguous()
    return BlockMask.from_kv_blocks(
        last - first + 1,
        partial_idx,
        first,
        ar.contiguous(),
        KV_BLOCK,
        mask_mod,
        (q_len, max_len),
        compute_q_blocks=False,
    )


class Graphs:
    """The one owner of an engine's CUDA graphs: whether its steps run as graphs (default: on CUDA), the
    memory pool they share, their capture and replay-or-eager. A step is keyed by its shape (a length, a
    block size, a name)."""

    def __init__(self, device: torch.device, on: bool | None = None):
        self.device, self.on = device, device.type == "cuda" if on is None else on
        self.captured, self._pool = {}, None

    @property
    def ready(self) -> bool:
        """Nothing to capture: graphs are off, or captured."""
        return not self.on or bool(self.captured)

    def capture(self, steps: dict) -> None:
        """A CUDA graph of each `step()` and its outputs. The warm-up runs (which also compile, and make
        cuBLAS handles, workspaces and lazy inits) happen outside the capture, on a side stream."""
        current = torch.cuda.current_stream(self.device)
        for key, step in steps.items():
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step()
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = step()
            self._pool = self._pool or graph.pool()
            self.captured[key] = graph, out

    def run(self, key, step, *args):
        """`step(*args)`'s outputs: the graph captured under `key` replayed (outputs overwritten by the next
        replay), or the step run eagerly."""
        if not self.on:
            return step(*args)
        graph, out = self.captured[key]
        graph.replay()
        return out
