"""Fast batched decoding of the target: fixed KV-cache slots, CUDA-graph steps, continuous batching.

HF `generate` pays the Python and kernel-launch cost of every layer at every token, and a batch runs
until its longest row ends. Here:
- the KV cache is static: `slots` rows of `max_len` positions per layer, allocated once;
- a decode step (every slot, one token each) is captured as a CUDA graph per attention length bucket,
  so one replay launches the whole step and attention reads only the keys up to the bucket;
- a row that ends frees its slot, and the next waiting prompts are prefilled into free slots
  (in groups, so each prefill is a real batch), so the batch stays full.

It runs the model's own decoder layers (their norms, biases, RoPE variant stay the model's) through
two transformers hooks: a cache object whose `update` writes each row's keys and values at that row's
own position, and an attention function registered with `AttentionInterface`. `unsupported(model)`
says when a model's layers need more than that (sliding windows, other layouts); regeneration then
falls back to HF `generate`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION = "flashdraft_slots"
# Decoder layouts whose layers take (hidden, attention_mask, position_embeddings, past_key_values) and
# call `past_key_values.update` then the configured attention function; checked against HF generate.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
BUCKET = 256  # attention length granularity: one captured graph per multiple of this


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Prefill (no mask): causal attention over the right-padded prompts themselves. Decode: one query
    per row against its cached keys, `attention_mask` [B, 1, 1, L] marking the row's valid positions.
    The query heads sharing a KV head are read as one group, so each KV head is read once."""
    if attention_mask is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                             enable_gqa=True)
    else:
        b, hq, s, d = query.shape
        q = query.reshape(b, key.shape[1], hq // key.shape[1] * s, d)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
        out = out.reshape(b, hq, s, d)
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
    """Keys and values of every slot: `update` is what an HF attention layer calls with its new ones."""

    def __init__(self, layers, slots, kv_heads, max_len, head_dim, dtype, device):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.rows = None  # prefill: the slots of the batch rows, written at positions 0..S-1
        self.pos = None  # decode: [slots] the position each slot writes
        self.length = 0  # decode: positions attention reads

    def update(self, key, value, layer_idx, *args, **kwargs):
        k, v = self.k[layer_idx], self.v[layer_idx]
        if self.rows is not None:
            k[self.rows, :, : key.shape[2]] = key
            v[self.rows, :, : key.shape[2]] = value
            return key, value
        idx = self.pos.view(-1, 1, 1, 1).expand(-1, key.shape[1], 1, key.shape[3])
        k.scatter_(2, idx, key)
        v.scatter_(2, idx, value)
        return k[:, :, : self.length], v[:, :, : self.length]


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

    `graphs`: capture decode steps as CUDA graphs (default: on CUDA). `refill`: free slots that trigger
    a prefill of waiting prompts while others decode (default: an eighth of the slots).
    `prefill_tokens`: padded tokens per prefill forward."""

    def __init__(self, model, slots: int, max_len: int, eos: list[int], pad_id: int,
                 temperature: float = 0.0, seed: int = 0, graphs: bool | None = None,
                 refill: int | None = None, prefill_tokens: int = 16384):
        why = unsupported(model)
        if why:
            raise ValueError(f"the static-cache decoder cannot run this model: {why}")
        cfg, dev = model.config, model.device
        self.model, self.base, self.head = model, model.base_model, model.get_output_embeddings()
        self.slots, self.eos, self.pad_id, self.temperature = slots, set(eos), pad_id, temperature
        self.max_len = -(-max_len // BUCKET) * BUCKET if dev.type == "cuda" else max_len
        self.refill = refill or max(1, slots // 8)
        self.prefill_tokens = prefill_tokens
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.cache = _SlotCache(cfg.num_hidden_layers, slots, kv_heads, self.max_len, head_dim,
                                model.dtype, dev)
        self.tokens = torch.full((slots,), pad_id, dtype=torch.long, device=dev)
        self.pos = torch.zeros(slots, dtype=torch.long, device=dev)
        self.arange = torch.arange(self.max_len, device=dev)
        self.generator = torch.Generator(dev).manual_seed(seed)
        self.graphs = {} if (dev.type == "cuda" if graphs is None else graphs) else None
        self._attn = cfg._attn_implementation

    # ----------------------------------------------------------------------------------------- model

    def _forward(self, ids, positions, mask):
        h = self.base.embed_tokens(ids)
        pe = self.base.rotary_emb(h, positions)
        for layer in self.base.layers:
            h = layer(h, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                      position_embeddings=pe)
            h = h[0] if isinstance(h, tuple) else h
        return self.base.norm(h)

    def _pick(self, logits):
        if self.temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / self.temperature, -1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def _step(self, length: int):
        """One token for every slot: logits [slots, V] and the greedy pick; positions advance (clamped, so
        an idle slot never writes past its row)."""
        self.cache.pos, self.cache.length = self.pos, length
        mask = (self.arange[:length] <= self.pos[:, None])[:, None, None, :]
        h = self._forward(self.tokens[:, None], self.pos[:, None], mask)
        logits = self.head(h[:, -1])
        self.pos.add_(1).clamp_(max=self.max_len - 1)
        return logits, logits.argmax(-1)

    def _capture(self, length: int):
        """A CUDA graph of `_step(length)`. Captured while no slot holds a sequence: the warm-up runs
        write only position 0 of each slot, which every prefill overwrites."""
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # cuBLAS handles, workspaces and lazy inits happen outside the capture
                self._step(length)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        pool = next(iter(self.graphs.values()))[0].pool() if self.graphs else None
        with torch.cuda.graph(graph, pool=pool):
            out = self._step(length)
        self.pos.zero_()
        return graph, out

    def _decode(self, length: int) -> list[int]:
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
        dev, n = self.model.device, [len(p) for p in prompts]
        ids = torch.full((len(prompts), max(n)), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        rows, lengths = torch.tensor(slots, device=dev), torch.tensor(n, device=dev)
        self.cache.rows = rows
        try:
            h = self._forward(ids.to(dev), torch.arange(max(n), device=dev)[None].expand(len(n), -1), None)
        finally:
            self.cache.rows = None
        first = self._pick(self.head(h[torch.arange(len(n), device=dev), lengths - 1]))
        self.tokens[rows], self.pos[rows] = first, lengths
        return first.tolist()

    # ----------------------------------------------------------------------------------------- loop

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_new_tokens: int) -> Iterator[tuple[int, list[int], str]]:
        """Yield (index into `prompts`, new tokens, "stop" | "length") as each row ends, in finishing order.
        New tokens exclude the stop token, as `regenerate.generate` does."""
        too_long = [i for i, p in enumerate(prompts) if len(p) + max_new_tokens > self.max_len]
        if too_long:
            raise ValueError(f"{len(too_long)} prompts exceed max_len {self.max_len} with their answers")
        self.model.config._attn_implementation = ATTENTION
        try:
            if self.graphs is not None and not self.graphs:
                for length in range(BUCKET, self.max_len + 1, BUCKET):
                    self.graphs[length] = self._capture(length)
            yield from self._loop(prompts, max_new_tokens)
        finally:
            self.model.config._attn_implementation = self._attn

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
            length = max(pos[s] for s in active) + 1
            length = min(self.max_len, -(-length // BUCKET) * BUCKET) if self.graphs is not None else length
            nxt = self._decode(length)
            for slot in list(active):
                active[slot][1].append(nxt[slot])
                pos[slot] += 1
                yield from self._finish(slot, nxt[slot], active, free, max_new_tokens)

    def _finish(self, slot, token, active, free, max_new_tokens):
        i, tokens = active[slot]
        if token in self.eos or len(tokens) >= max_new_tokens:
            del active[slot]
            free.append(slot)
            yield (i, tokens[:-1], "stop") if token in self.eos else (i, tokens, "length")
