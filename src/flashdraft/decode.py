"""Fast batched decoding of the target: fixed KV-cache slots, CUDA-graph steps, continuous batching.

HF `generate` pays the Python and kernel-launch cost of every layer at every token, and a batch runs
until its longest row ends. Here:
- the KV cache is static: `slots` rows of `max_len` positions per layer, allocated once;
- a decode step (every slot, one token each) is captured as a CUDA graph, so one replay launches the
  whole step;
- on CUDA the step's norms, projections, QK-norm, RoPE, activations and residual adds run as two
  compiled functions per layer (Inductor fuses the small elementwise kernels between the matmuls), and
  attention is FlexAttention's decoding kernel over a block mask that lists, per row, only the KV
  blocks up to that row's own position: a row reads its own context, not the longest row's;
- a row that ends frees its slot, and the next waiting prompts are prefilled into free slots
  (in groups, so each prefill is a real batch), so the batch stays full.

The prefill runs the model's own decoder layers through two transformers hooks: a cache object whose
`update` writes each row's keys and values into its slot, and an attention function registered with
`AttentionInterface`. The decode step is the same layer math written out for the layouts in
ARCHITECTURES (their weights, biases, QK-norms, activation and RoPE variant are the model's), pinned
against HF `generate` by the tests. `unsupported(model)` says when a model needs more (sliding
windows, other layouts); regeneration then falls back to HF `generate`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface

ATTENTION = "flashdraft_slots"
# Decoder layouts whose layers take (hidden, attention_mask, position_embeddings, past_key_values) and
# call `past_key_values.update` then the configured attention function; checked against HF generate.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
BUCKET = 256  # max_len granularity on CUDA, and the attention length granularity off it
KV_BLOCK = 128  # FlexAttention's KV block: a row reads the blocks up to its own position


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Prefill: causal attention over the right-padded prompts themselves (their keys and values also
    go to the slots through the cache's `update`)."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION, _attention)


def unsupported(model) -> str | None:
    """Why this engine cannot run `model` (None: it can)."""
    cfg = model.config
    if cfg.model_type not in ARCHITECTURES:
        return f"model_type {cfg.model_type!r} (supported: {', '.join(ARCHITECTURES)})"
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        return "sliding-window attention layers"
    if getattr(cfg, "use_sliding_window", False) or (cfg.model_type == "mistral" and cfg.sliding_window):
        return "sliding-window attention"
    base = model.base_model
    if not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(base).__name__} lacks embed_tokens/layers/norm/rotary_emb"
    return None


class _SlotCache:
    """Keys and values of every slot. `update` is what an HF attention layer calls in the prefill: the
    batch rows' keys and values go to their slots at positions 0..S-1."""

    def __init__(self, layers, slots, kv_heads, max_len, head_dim, dtype, device):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.rows = None  # the slots of the prefill's batch rows

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.k[layer_idx][self.rows, :, : key.shape[2]] = key
        self.v[layer_idx][self.rows, :, : key.shape[2]] = value
        return key, value


# ------------------------------------------------------------------------------------- one decode step
# One layer for every slot, one token each (h: [slots, H]), split around the cache write and attention
# so that each half compiles into a few fused kernels. `w` holds the layer's tensors (see _weights).


def _rms(x, weight, eps):
    dtype = x.dtype
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def _attn_in(h, w, cos, sin, *, eps, heads, kv_heads, head_dim):
    """Input norm, q/k/v projections, QK-norm (where the model has one), RoPE: q [slots, heads, 1, d],
    k and v [slots, kv_heads, 1, d]."""
    ln, wq, bq, wk, bk, wv, bv, qn, kn = w[:9]
    x, b = _rms(h, ln, eps), h.shape[0]
    q = F.linear(x, wq, bq).view(b, heads, head_dim)
    k = F.linear(x, wk, bk).view(b, kv_heads, head_dim)
    v = F.linear(x, wv, bv).view(b, kv_heads, 1, head_dim)
    if qn is not None:
        q, k = _rms(q, qn, eps), _rms(k, kn, eps)
    return _rope(q[:, :, None], cos, sin), _rope(k[:, :, None], cos, sin), v


def _attn_out(h, attn, w, *, eps, act):
    """Output projection and residual, post-attention norm, gated MLP and residual."""
    wo, bo, ln, wg, bg, wu, bu, wd, bd = w[9:]
    h = h + F.linear(attn.reshape(h.shape[0], -1), wo, bo)
    x = _rms(h, ln, eps)
    return h + F.linear(act(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)


def _weights(layer) -> tuple:
    """The tensors `_attn_in` and `_attn_out` read, detached (plain tensors: the compiled functions take
    every layer's as inputs of one graph)."""
    a, m = layer.self_attn, layer.mlp
    mods = (layer.input_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj, layer.post_attention_layernorm,
            m.gate_proj, m.up_proj, m.down_proj)
    ln1, q, k, v, o, ln2, g, u, d = [(x.weight.detach(), None if getattr(x, "bias", None) is None
                                      else x.bias.detach()) for x in mods]
    qn, kn = (getattr(a, n, None) for n in ("q_norm", "k_norm"))
    qk = (qn.weight.detach(), kn.weight.detach()) if qn is not None else (None, None)
    return (ln1[0], *q, *k, *v, *qk, *o, ln2[0], *g, *u, *d)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def auto_slots(model, max_len: int, limit: int = 256, reserve: float = 0.1) -> int:
    """Slots that fit in the GPU memory left after the weights: KV cache (max_len positions each) plus
    the step's logits, keeping `reserve` of the card and 2 GiB for prefill activations free."""
    free, total = torch.cuda.mem_get_info(model.device)
    per_slot = max_len * kv_bytes_per_token(model.config, model.dtype) + 8 * model.config.vocab_size
    budget = free - reserve * total - (2 << 30)
    return max(1, min(limit, int(budget // per_slot)))


class SlotDecoder:
    """Decodes prompts (token ids) with the target, `slots` rows at a time; see the module docstring.

    `graphs`: capture decode steps as CUDA graphs (default: on CUDA). `compiled`: compiled layer halves
    and FlexAttention over each row's own KV blocks (default: on CUDA; off, the same math runs eagerly
    with SDPA over a dense mask). `refill`: free slots that trigger a prefill of waiting prompts while
    others decode (default: an eighth of the slots). `prefill_tokens`: padded tokens per prefill."""

    def __init__(self, model, slots: int, max_len: int, eos: list[int], pad_id: int,
                 temperature: float = 0.0, seed: int = 0, graphs: bool | None = None,
                 compiled: bool | None = None, refill: int | None = None, prefill_tokens: int = 16384):
        why = unsupported(model)
        if why:
            raise ValueError(f"the static-cache decoder cannot run this model: {why}")
        cfg, dev = model.config, model.device
        cuda = dev.type == "cuda"
        self.model, self.base, self.head = model, model.base_model, model.get_output_embeddings()
        self.slots, self.eos, self.pad_id, self.temperature = slots, set(eos), pad_id, temperature
        self.compiled = cuda if compiled is None else compiled
        self.max_len = -(-max_len // BUCKET) * BUCKET if cuda or self.compiled else max_len
        self.refill = refill or max(1, slots // 8)
        self.prefill_tokens = prefill_tokens
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.scaling = self.base.layers[0].self_attn.scaling
        self.cache = _SlotCache(cfg.num_hidden_layers, slots, self.kv_heads, self.max_len, self.head_dim,
                                model.dtype, dev)
        self.tokens = torch.full((slots,), pad_id, dtype=torch.long, device=dev)
        self.pos = torch.zeros(slots, dtype=torch.long, device=dev)  # the position each slot writes next
        self.live = torch.zeros(slots, dtype=torch.long, device=dev)  # 1: the slot holds a sequence
        self._idle = []  # slots freed since the last step: their `live` and `pos` go to 0 before the next
        self.arange = torch.arange(self.max_len, device=dev)
        self.generator = torch.Generator(dev).manual_seed(seed)
        self.graphs = {} if (cuda if graphs is None else graphs) else None
        self.weights = [_weights(layer) for layer in self.base.layers]
        self._in_kw = {"eps": cfg.rms_norm_eps, "heads": self.heads, "kv_heads": self.kv_heads,
                       "head_dim": self.head_dim}
        self._out_kw = {"eps": cfg.rms_norm_eps, "act": self.base.layers[0].mlp.act_fn}
        self._in, self._out = _attn_in, _attn_out
        if self.compiled:  # the functions themselves, not wrappers: each keeps its own compile cache
            compile = partial(torch.compile, fullgraph=True, dynamic=False)
            self._in, self._out, self._flex = compile(_attn_in), compile(_attn_out), compile(flex_attention)
            nblk = self.max_len // KV_BLOCK
            # contiguous: the kernel reads the block indices as a dense [slots, 1, 1, nblk] array
            self._full_idx = torch.arange(nblk, dtype=torch.int32, device=dev).repeat(slots, 1, 1, 1)
            self._one = torch.ones(slots, 1, 1, dtype=torch.int32, device=dev)
            pos = self.pos
            self._mask_mod = lambda b, h, q, kv: kv <= pos[b]
        self._attn = cfg._attn_implementation

    # ----------------------------------------------------------------------------------------- model

    def _forward(self, ids, positions):
        """The prefill: the model's own layers over right-padded prompts, their KV into the slots."""
        h = self.base.embed_tokens(ids)
        pe = self.base.rotary_emb(h, positions)
        for layer in self.base.layers:
            h = layer(h, attention_mask=None, position_ids=positions, past_key_values=self.cache,
                      position_embeddings=pe)
            h = h[0] if isinstance(h, tuple) else h
        return self.base.norm(h)

    def _pick(self, logits):
        if self.temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / self.temperature, -1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def _sparse_attention(self):
        """FlexAttention where row b reads KV blocks 0..pos[b] // KV_BLOCK: the ones before full, its
        own block up to pos[b] (the mask)."""
        n = (self.pos // KV_BLOCK).to(torch.int32).view(-1, 1, 1)
        mask = BlockMask.from_kv_blocks(self._one, n[..., None].expand_as(self._full_idx).contiguous(),
                                        n, self._full_idx, KV_BLOCK, self._mask_mod, (1, self.max_len),
                                        compute_q_blocks=False)
        return partial(self._flex, block_mask=mask, scale=self.scaling, enable_gqa=True)

    def _dense_attention(self, length: int):
        """SDPA over the first `length` positions, a row's own marked valid; the query heads sharing a
        KV head are read as one group, so each KV head is read once."""
        mask = (self.arange[:length] <= self.pos[:, None])[:, None, None, :]
        shape = (self.slots, self.kv_heads, self.heads // self.kv_heads, self.head_dim)

        def attend(q, k, v):
            out = F.scaled_dot_product_attention(q.reshape(shape), k[:, :, :length], v[:, :, :length],
                                                 attn_mask=mask, scale=self.scaling)
            return out.reshape(q.shape)

        return attend

    def _step(self, length: int):
        """One token for every slot: logits [slots, V] and the greedy pick; live slots' positions advance
        (clamped, so no slot ever writes past its row)."""
        h = self.base.embed_tokens(self.tokens)
        cos, sin = (x[:, None] for x in self.base.rotary_emb(h, self.pos[:, None]))  # [slots, 1, 1, d]
        attend = self._sparse_attention() if self.compiled else self._dense_attention(length)
        idx = self.pos.view(-1, 1, 1, 1).expand(-1, self.kv_heads, 1, self.head_dim)
        for w, k_cache, v_cache in zip(self.weights, self.cache.k, self.cache.v, strict=True):
            q, k, v = self._in(h, w, cos, sin, **self._in_kw)
            k_cache.scatter_(2, idx, k)
            v_cache.scatter_(2, idx, v)
            h = self._out(h, attend(q, k_cache, v_cache), w, **self._out_kw)
        logits = self.head(self.base.norm(h))
        self.pos.add_(self.live).clamp_(max=self.max_len - 1)
        return logits, logits.argmax(-1)

    def _capture(self, length: int):
        """A CUDA graph of `_step(length)`. Captured while no slot holds a sequence: the warm-up runs
        (which also compile) write only position 0 of each slot, which every prefill overwrites."""
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles, cuBLAS handles, workspaces and lazy inits: outside the capture
                self._step(length)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        pool = next(iter(self.graphs.values()))[0].pool() if self.graphs else None
        with torch.cuda.graph(graph, pool=pool):
            out = self._step(length)
        self.pos.zero_()
        return graph, out

    def _lengths(self) -> list[int]:
        """The attention lengths steps are built for: one when FlexAttention reads each row's own blocks,
        else one per BUCKET."""
        return [self.max_len] if self.compiled else list(range(BUCKET, self.max_len + 1, BUCKET))

    def _free_idle(self):
        if self._idle:
            idle = torch.tensor(self._idle, device=self.pos.device)
            self.live[idle], self.pos[idle] = 0, 0
            self._idle.clear()

    def _decode(self, length: int) -> list[int]:
        self._free_idle()
        if self.compiled:
            length = self.max_len
        elif self.graphs is not None:
            length = min(self.max_len, -(-length // BUCKET) * BUCKET)
        if self.graphs is None:
            logits, greedy = self._step(length)
        else:
            graph, (logits, greedy) = self.graphs[length]
            graph.replay()
        nxt = greedy if self.temperature == 0 else self._pick(logits)
        self.tokens.copy_(nxt)
        return nxt.tolist()

    def _prefill(self, slots: list[int], prompts: list[list[int]]) -> list[int]:
        """Each prompt's KV into its slot (positions 0..n-1); returns each one's first new token."""
        self._free_idle()
        dev, n = self.model.device, [len(p) for p in prompts]
        ids = torch.full((len(prompts), max(n)), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        rows, lengths = torch.tensor(slots, device=dev), torch.tensor(n, device=dev)
        self.cache.rows = rows
        try:
            h = self._forward(ids.to(dev), torch.arange(max(n), device=dev)[None].expand(len(n), -1))
        finally:
            self.cache.rows = None
        first = self._pick(self.head(h[torch.arange(len(n), device=dev), lengths - 1]))
        self.tokens[rows], self.pos[rows], self.live[rows] = first, lengths, 1
        return first.tolist()

    # ----------------------------------------------------------------------------------------- loop

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_new_tokens: int) -> Iterator[tuple[int, list[int], str]]:
        """Yield (index into `prompts`, new tokens, "stop" | "length") as each row ends, in finishing order.
        New tokens exclude the stop token, as `regenerate.generate` does."""
        too_long = [i for i, p in enumerate(prompts) if len(p) + max_new_tokens > self.max_len]
        if too_long:
            raise ValueError(f"{len(too_long)} prompts exceed max_len {self.max_len} with their answers")
        self.prepare()
        self.model.config._attn_implementation = ATTENTION
        try:
            yield from self._loop(prompts, max_new_tokens)
        finally:
            self.model.config._attn_implementation = self._attn

    @torch.inference_mode()
    def prepare(self):
        """Compile the step and capture its CUDA graphs (once; `run` calls it when not done yet)."""
        if self.graphs is not None and not self.graphs:
            for length in self._lengths():
                self.graphs[length] = self._capture(length)

    def _loop(self, prompts, max_new_tokens):
        # longest first: similar lengths share a prefill, and a prompt too big for memory fails at once
        waiting = deque(sorted(range(len(prompts)), key=lambda i: -len(prompts[i])))
        free, active, pos = list(range(self.slots)), {}, [0] * self.slots  # active: slot -> (index, tokens)
        while waiting or active:
            if waiting and (len(free) >= self.refill or not active):
                take = []
                while waiting and len(take) < len(free):
                    # take[0], the longest of the group, sets its padded width
                    if take and (len(take) + 1) * len(prompts[take[0]]) > self.prefill_tokens:
                        break
                    take.append(waiting.popleft())
                slots = [free.pop() for _ in take]
                for slot, i, t in zip(slots, take, self._prefill(slots, [prompts[i] for i in take]),
                                      strict=True):
                    active[slot], pos[slot] = (i, [t]), len(prompts[i])
                    yield from self._finish(slot, t, active, free, max_new_tokens)
                continue
            nxt = self._decode(max(pos[s] for s in active) + 1)
            done = []
            for slot, (_, tokens) in active.items():  # per slot per step: kept lean
                tokens.append(nxt[slot])
                pos[slot] += 1
                if nxt[slot] in self.eos or len(tokens) >= max_new_tokens:
                    done.append(slot)
            for slot in done:
                yield from self._finish(slot, nxt[slot], active, free, max_new_tokens)

    def _finish(self, slot, token, active, free, max_new_tokens):
        i, tokens = active[slot]
        if token in self.eos or len(tokens) >= max_new_tokens:
            del active[slot]
            free.append(slot)
            self._idle.append(slot)
            yield (i, tokens[:-1], "stop") if token in self.eos else (i, tokens, "length")
