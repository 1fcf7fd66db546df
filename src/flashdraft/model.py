"""The DFlash drafter: K Qwen3-style layers that denoise a block of B tokens from target features, and
its spec (its export directory: drafter_io.py).

The context is a sequence of S tokens with the target's features `[S, K*H]` (outputs of K target
decoder layers). A block `[token[p], MASK x (B-1)]` sits at positions p..p+B-1 after its anchor p. Every
drafter layer attends from the block tokens to keys/values `[proj(context); proj(block)]` (KV
injection): a block sees the context strictly before its anchor and its own block (bidirectionally),
nothing else. Block position k predicts token[p+k] (same position, no shift). The training objective is
in loss.py.

The drafter has no embedding and no LM head: it uses the target's, frozen, passed in as tensors.
Parameter names are the DFlash export keys, so the state dict is the export.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from .config import DrafterConfig
from .families import FAMILIES, family
from .hf_config import kv_dims
from .target import feature_layer_ids, mask_token_id, num_layers


@dataclass
class DrafterSpec:
    family: ClassVar[str] = "dflash"  # the families.FAMILIES key of the drafter this spec shapes
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int  # K draft layers
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    sliding_window: int | None = None  # W: a block query at position q sees context kv > q - W (None: all)

    @property
    def num_features(self) -> int:
        """Target layers fused by `fc` (K in `[S, K*H]`)."""
        return len(self.target_layer_ids)

    @property
    def verify_width(self) -> int:
        """Tokens one verify step scores: the anchor and the drafts of one block (B-1 of them here)."""
        return self.block_size

    @classmethod
    def from_target(cls, target_config, tokenizer, drafter_cfg: DrafterConfig) -> DrafterSpec:
        """Shapes from the target's HF config; `tokenizer` (or its length) places the MASK row (None
        where drafter_cfg.mask_token_id sets it)."""
        c = target_config
        if isinstance(tokenizer, int):
            tokenizer = range(tokenizer)  # mask_token_id only needs len(tokenizer)
        return cls(
            **_qwen3_shape(lambda key, *default: getattr(c, key, *default)),
            num_layers=drafter_cfg.num_layers,
            block_size=drafter_cfg.block_size,
            mask_token_id=mask_token_id(tokenizer, c, drafter_cfg),
            target_layer_ids=feature_layer_ids(c, drafter_cfg),
            num_target_layers=num_layers(c),
            sliding_window=drafter_cfg.sliding_window,
        )

    def to_config_dict(self, dtype: str = "bfloat16") -> dict:
        """config.json in the DFlash format SGLang and vLLM load (a Qwen3 config plus DFlash keys).

        A sliding window is written in every form the engines read, all saying one thing (every layer
        windowed by W, not causal: the block stays bidirectional): `layer_types` sliding_attention with
        `sliding_window` W (the reference `dflash` 0.1.0; SGLang's `get_dflash_attention_sliding_window_size`
        reads W - 1 as its left window), top-level `is_causal: false` (the reference; vLLM's
        `_dflash_layer_causal`), and `dflash_config.{use_swa, swa_window_size, causal: false}` (vLLM's
        `_resolve_layer_attention`, TensorRT-LLM, as NVIDIA Model-Optimizer exports it)."""
        w = self.sliding_window
        swa = {} if w is None else {"use_swa": True, "swa_window_size": w, "causal": False}
        layer = "full_attention" if w is None else "sliding_attention"
        return {
            "architectures": [FAMILIES["dflash"].architecture],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                **swa,
            },
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "layer_types": [layer] * self.num_layers,
            "max_window_layers": self.num_layers,
            "use_sliding_window": w is not None,
            "sliding_window": w,
            **({} if w is None else {"is_causal": False}),
            "tie_word_embeddings": False,
            "use_cache": True,
            "dtype": dtype,
        }

    @classmethod
    def from_config_dict(cls, d: dict) -> DrafterSpec:
        """The spec of an export's config.json (to_config_dict's, or another DFlash exporter's)."""
        dflash = d.get("dflash_config", {})
        return cls(
            **_qwen3_shape(lambda key, *default: d[key] if key in d or not default else default[0]),
            num_layers=d["num_hidden_layers"],
            block_size=d.get("block_size", dflash.get("block_size", 16)),
            mask_token_id=dflash.get("mask_token_id", d.get("mask_token_id")),
            target_layer_ids=list(dflash.get("target_layer_ids", d.get("target_layer_ids", []))),
            num_target_layers=d["num_target_layers"],
            sliding_window=_sliding_window(d),
        )


def _sliding_window(d: dict) -> int | None:
    """The window of an export: dflash_config.swa_window_size when use_swa, else sliding_window where
    the layers say sliding_attention (one window for all layers, the only kind this drafter has)."""
    dflash = d.get("dflash_config", {})
    if dflash.get("use_swa"):
        return int(dflash.get("swa_window_size") or d["sliding_window"])
    types = d.get("layer_types") or []
    if "sliding_attention" in types:
        if set(types) != {"sliding_attention"}:
            raise ValueError(f"layer_types {types}: this drafter windows all layers or none")
        return int(d["sliding_window"])
    return None


def _qwen3_shape(get) -> dict:
    """The spec fields a Qwen3-style HF config gives, with their defaults: one mapping for a target's
    config object and an export's config.json. `get(key)` reads a key that must be there, `get(key,
    default)` one that may be missing.

    RoPE's base comes from transformers 5 (`rope_parameters`) or 4 (`rope_theta`) keys. The drafter
    always uses default (unscaled) RoPE: its export says so (`rope_scaling: null`), so it is consistent
    with itself whatever scaling the target uses for long contexts."""
    heads = get("num_attention_heads")
    kv_heads, head_dim = kv_dims(
        heads, get("num_key_value_heads", None), get("head_dim", None), get("hidden_size")
    )
    rope = get("rope_parameters", None) or {}
    theta = rope["rope_theta"] if "rope_theta" in rope else get("rope_theta", None) or 10000.0
    return {
        "hidden_size": get("hidden_size"),
        "intermediate_size": get("intermediate_size"),
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": get("rms_norm_eps", 1e-6),
        "rope_theta": float(theta),
        "vocab_size": get("vocab_size"),
        "max_position_embeddings": get("max_position_embeddings", 32768),
    }


# ---------------------------------------------------------------------------------------------------------
# the network


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalize in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions, head_dim: int, theta: float):
    """cos, sin `[b, L, head_dim]` in float32 for absolute `positions` `[b, L]` (default RoPE)."""
    dims = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    inv_freq = 1.0 / theta ** (dims / head_dim)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x `[b, heads, L, d]`; cos/sin `[b, L, d]`."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attend(q, k, v, mask):
    """Attention of block queries over `[context; blocks]` keys.

    mask: None (everything visible, inference), a flex BlockMask, or `(dense, keep)` for SDPA: `dense`
    `[b, 1, Q, KV]` boolean and `keep` `[b, 1, Q, 1]` zeroing padded blocks (see `dense_mask`)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if isinstance(mask, tuple):
        dense, keep = mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True) * keep
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_proj = nn.Linear(h, spec.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(spec.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)
        self.k_norm = RMSNorm(d, spec.rms_norm_eps)

    def kv(self, h, cos, sin):
        """Keys (QK-norm, RoPE) and values `[b, kv_heads, L, d]` of inputs h `[b, L, H]`."""
        b = h.shape[0]
        k = self.k_norm(self.k_proj(h).view(b, -1, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(h).view(b, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin).to(v.dtype), v  # RMSNorm/RoPE upcast; attention wants one dtype

    def forward(self, x, ctx, cos, sin, mask):
        """ctx: the normalized context features `[b, S, H]` (cos/sin then cover context and block), or
        the context's keys and values `(k, v)` already projected, as a `DraftCache` holds them."""
        b, q_len, _ = x.shape
        qcos, qsin = cos[:, -q_len:], sin[:, -q_len:]  # queries are the block tokens, the last q_len
        if isinstance(ctx, tuple):
            k, v = self.kv(x, qcos, qsin)
            k, v = torch.cat([ctx[0], k], dim=2), torch.cat([ctx[1], v], dim=2)
        else:  # KV injection: keys and values of the context features and of the block, same projections
            k, v = self.kv(torch.cat([ctx, x], dim=1), cos, sin)
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, qcos, qsin)
        out = attend(q.to(v.dtype), k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class MLP(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, mask):
        # the context is normalized once by hidden_norm, not by each layer's input_layernorm
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    spec_class = DrafterSpec  # the spec its export's config.json reads into
    foreign_keys: tuple[str, ...] = ()  # tensors a checkpoint of its family may carry that are not its own

    def __init__(self, spec: DrafterSpec, init: bool = True):
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.fc = nn.Linear(spec.num_features * spec.hidden_size, spec.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        for m in self.modules() if init else ():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, target_hidden, block_embeds, positions, mask=None):
        """target_hidden `[b, S, K*H]`, block_embeds `[b, Q, H]`, positions `[b, S+Q]` (context then
        block tokens, absolute), mask see `attend`. Returns the normalized block hidden states `[b, Q, H]`."""
        ctx = self.context(target_hidden)
        cos, sin = rope_cos_sin(positions, self.spec.head_dim, self.spec.rope_theta)
        x = block_embeds
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, mask)
        return self.norm(x)

    def context(self, target_hidden):
        """The fused target features `[b, S, K*H]` as the normalized context `[b, S, H]` every layer reads."""
        return self.hidden_norm(self.fc(target_hidden))

    def _block_mask(self, ctx_len: int, size: int, device):
        """None (everything visible) without a sliding window; with one, the training mask of one block
        anchored at ctx_len (`dense_mask`, the same mask function), so drafting sees what training saw."""
        if self.spec.sliding_window is None:
            return None
        anchors = torch.tensor([[ctx_len]], device=device)
        return dense_mask(anchors, anchors >= 0, ctx_len, size, self.spec.sliding_window)

    def _block_embeds(self, last_token: int, embed_weight, device, size: int):
        """`[token at anchor, MASK x (size-1)]` through the target's embedding, in the drafter's dtype."""
        ids = torch.full((1, size), self.spec.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = int(last_token)
        return F.embedding(ids, embed_weight).to(self.fc.weight.dtype)

    @torch.no_grad()
    def block_hidden(self, target_hidden, last_token: int, embed_weight, size: int | None = None):
        """The drafter's output `[size, H]` for the block anchored after a context of S verified tokens.

        target_hidden `[1, S, K*H]` covers positions 0..S-1; `last_token` (the token at S, whose
        features the target has not computed yet) is the anchor, so the block sits at S..S+size-1.
        `size`: a shorter block where fewer tokens may still be emitted, as the reference drafts it
        (default: the drafter's block size)."""
        dev, s = target_hidden.device, target_hidden.shape[1]
        size = size or self.spec.block_size
        positions = torch.arange(s + size, device=dev)[None]
        embeds = self._block_embeds(last_token, embed_weight, dev, size)
        mask = self._block_mask(s, size, dev)
        return self(target_hidden.to(self.fc.weight.dtype), embeds, positions, mask=mask)[0]

    @torch.no_grad()
    def predict_block(
        self, target_hidden, last_token: int, embed_weight, lm_head_weight, size: int | None = None
    ):
        """Logits `[B-1, V]` for the tokens at S+1..S+B-1 after a context of S verified tokens: block
        position k predicts the token at S+k (`block_hidden`'s block, B its size)."""
        out = self.block_hidden(target_hidden, last_token, embed_weight, size)
        return out[1:] @ lm_head_weight.to(out.dtype).T

    def context_kv(self, target_hidden, cos, sin) -> list:
        """Every layer's keys and values `(k, v)` `[b, kv_heads, S, d]` of the context features
        `[b, S, K*H]` at the positions of cos/sin `[b, S, d]`: what a cache of the context holds."""
        ctx = self.context(target_hidden)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    @torch.no_grad()
    def extend_cache(self, cache: DraftCache, new_hidden) -> None:
        """Project the features `[1, n, K*H]` of context positions cache.length..+n-1 into every layer's
        keys and values and append them: the context's share of the work, done once per position."""
        n = new_hidden.shape[1]
        if n == 0:
            return
        positions = torch.arange(cache.length, cache.length + n, device=new_hidden.device)[None]
        cos, sin = rope_cos_sin(positions, self.spec.head_dim, self.spec.rope_theta)
        cache.append(self.context_kv(new_hidden.to(self.fc.weight.dtype), cos, sin))

    @torch.no_grad()
    def block_hidden_cached(
        self,
        new_hidden,
        last_token: int,
        embed_weight,
        cache: DraftCache,
        context_len: int,
        size: int | None = None,
    ):
        """`block_hidden` over a context held in `cache`: new_hidden `[1, n, K*H]` are the features of
        the positions verified since the last call (all of the prompt on the first), appended first.

        `context_len` is the caller's count of verified tokens before the anchor; the cache must hold
        exactly that many positions (a rejected draft must never have entered it)."""
        self.extend_cache(cache, new_hidden)
        assert cache.length == context_len, f"drafter cache holds {cache.length} positions, not {context_len}"
        dev, s, size = new_hidden.device, context_len, size or self.spec.block_size
        positions = torch.arange(s, s + size, device=dev)[None]
        cos, sin = rope_cos_sin(positions, self.spec.head_dim, self.spec.rope_theta)
        x = self._block_embeds(last_token, embed_weight, dev, size)
        mask = self._block_mask(s, size, dev)
        for layer, k, v in zip(self.layers, cache.k, cache.v, strict=True):
            x = layer(x, (k, v), cos, sin, mask)
        return self.norm(x)[0]

    @torch.no_grad()
    def predict_block_cached(
        self,
        new_hidden,
        last_token: int,
        embed_weight,
        lm_head_weight,
        cache: DraftCache,
        context_len: int,
        size: int | None = None,
    ):
        """`predict_block` over a context held in `cache` (`block_hidden_cached`)."""
        out = self.block_hidden_cached(new_hidden, last_token, embed_weight, cache, context_len, size)
        return out[1:] @ lm_head_weight.to(out.dtype).T


def meta_drafter(spec: DrafterSpec, cls: type[DFlashDrafter] | None = None) -> DFlashDrafter:
    """The drafter's structure without its weights (meta tensors, not initialized: the meta device's
    normal_ imports Dynamo, a second of a trainer's start): its parameter count and shapes. `cls`: the
    family's drafter class (default: that of the spec's family)."""
    with torch.device("meta"):
        return (cls or family(spec.family).drafter)(spec, init=False)


class DraftCache:
    """Per drafter layer, the keys (QK-norm, RoPE'd) and values `[1, kv_heads, length, d]` of context
    positions 0..length-1. Only verified positions enter it and a rejected draft never becomes context,
    so it only grows (no crop). The block's own keys/values change every step and are never stored."""

    def __init__(self):
        self.k, self.v, self.length = [], [], 0

    def append(self, kv: list) -> None:
        """kv: one `(k, v)` per layer, `[1, kv_heads, n, d]`, for positions length..length+n-1."""
        if not self.k:
            self.k, self.v = [k for k, _ in kv], [v for _, v in kv]
        else:
            self.k = [torch.cat([old, k], dim=2) for old, (k, _) in zip(self.k, kv, strict=True)]
            self.v = [torch.cat([old, v], dim=2) for old, (_, v) in zip(self.v, kv, strict=True)]
        self.length += kv[0][0].shape[2]


# ---------------------------------------------------------------------------------------------------------
# the attention pattern (training builds it for many blocks, drafting for one)


def dflash_mask_mod(anchors, valid, ctx_len: int, block_size: int, window: int | None = None):
    """mask_mod(b, h, q_idx, kv_idx) over kv = [context (ctx_len); blocks (A*B)], queries = blocks.

    Block j sees context kv < anchor_j (strictly: the target features AT the anchor already encode the
    next token, and at inference the anchor's features do not exist yet), all of its own block, nothing
    else; padded blocks see nothing. With a sliding window W, the query at block position k (position
    anchor_j + k) sees only context kv > anchor_j + k - W: the W positions up to its own, as vLLM and
    the reference `dflash` window a non-causal layer (W >= B, so the block itself is never cut)."""

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block_size
        ctx = (kv_idx < ctx_len) & (kv_idx < anchors[b, blk])
        if window is not None:
            ctx = ctx & (kv_idx > anchors[b, blk] + q_idx % block_size - window)
        own = (kv_idx >= ctx_len) & ((kv_idx - ctx_len) // block_size == blk)
        return (ctx | own) & valid[b, blk]

    return mask_mod


def dense_mask(anchors, valid, ctx_len: int, block_size: int, window: int | None = None):
    """The same mask as a dense boolean `[b, 1, Q, KV]` for SDPA, plus `keep` `[b, 1, Q, 1]`.

    SDPA returns NaN on a fully masked row (and its backward too), so here a padded block attends to
    itself and `keep` zeroes its output afterwards: exactly the zeros flex_attention gives a row that
    sees nothing, and nothing else reads a padded block."""
    b, a = anchors.shape
    dev, q_len = anchors.device, a * block_size
    bi = torch.arange(b, device=dev)[:, None, None]
    qi = torch.arange(q_len, device=dev)[None, :, None]
    kvi = torch.arange(ctx_len + q_len, device=dev)[None, None, :]
    mask = dflash_mask_mod(anchors, valid, ctx_len, block_size, window)(bi, 0, qi, kvi)
    blk = qi // block_size
    own = (kvi >= ctx_len) & ((kvi - ctx_len) // block_size == blk)
    keep = valid[bi, blk]  # [b, Q, 1]
    mask = mask | (~keep & own)
    return mask[:, None], keep[:, None]
