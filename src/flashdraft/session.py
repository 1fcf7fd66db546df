"""One sequence over a static KV cache: the target's side of evaluation's decoding.

`forward(tokens)` scores one token (a decode step) or up to `block` tokens (a verify of
[last, drafts...]) at the current position, writes their keys and values, and returns their logits and
the selected layers' features; `crop(n)` drops the last n positions (rejected drafts) by moving the
position back: a query reads only positions up to its own, and every step writes its own positions
before reading them, so what lies past the position is never read. A shorter block is padded to
`block` tokens (the pad's outputs are dropped), so there are two step shapes; on CUDA each is compiled
and captured as a CUDA graph (flashdraft.step). The prompt's prefill runs the model's own layers.

`HFSession` is the same interface over transformers' DynamicCache and the model's own forward: the
path for models the static engine cannot run, and the reference the tests hold it to.
"""

from __future__ import annotations

import torch

from .step import (
    KV_BLOCK,
    Layers,
    SlotCache,
    block_mask,
    capture,
    prefill,
    round_len,
    target_step,
    unsupported,
)
from .target import select_features


class StaticSession:
    """See the module docstring. `layer_ids`: decoder layers whose outputs `forward` and `prefill` return
    as features. `compiled`, `graphs`: default on CUDA."""

    def __init__(self, model, max_len: int, layer_ids=(), block: int = 1, compiled: bool | None = None,
                 graphs: bool | None = None):
        why = unsupported(model)
        if why:
            raise ValueError(f"the static-cache session cannot run this model: {why}")
        dev = model.device
        cuda = dev.type == "cuda"
        self.model, self.layer_ids, self.block = model, list(layer_ids), block
        self.compiled = cuda if compiled is None else compiled
        self.max_len = round_len(max_len + block)  # a padded block may write `block` past the end
        self.layers = Layers.of_target(model, self.compiled)
        self.head = model.get_output_embeddings()
        self.cache = SlotCache(model, 1, self.max_len)
        self.ids = torch.zeros(block, dtype=torch.long, device=dev)
        self.pos_t = torch.zeros(1, dtype=torch.long, device=dev)  # the position of ids[0], on the device
        self.pos = 0
        self.arange = torch.arange(self.max_len, device=dev)
        self.graphs = {} if (cuda if graphs is None else graphs) else None
        pos = self.pos_t
        self._mask_mod = lambda b, h, q, kv: kv <= pos[0] + q

    def _step(self, size: int):
        """ids[:size] at positions pos_t.. : logits [size, V] and features [size, K*H] (or None)."""
        L, cache = self.layers, self.cache
        positions = self.pos_t + self.arange[:size]

        def write(i, k, v):  # k, v [size, kv_heads, 1, d] -> the sequence's positions
            cache.k[i][0].index_copy_(1, positions, k[:, :, 0].transpose(0, 1))
            cache.v[i][0].index_copy_(1, positions, v[:, :, 0].transpose(0, 1))

        if self.compiled:
            first = (self.pos_t // KV_BLOCK).to(torch.int32).view(1, 1, 1)
            last = ((self.pos_t + size - 1) // KV_BLOCK).to(torch.int32).view(1, 1, 1)
            mask = block_mask(first, last, self.max_len, size, self._mask_mod)

            def attend(q, i):  # q [size, heads, 1, d] as one sequence's queries [1, heads, size, d]
                return L.sparse(q.permute(2, 1, 0, 3), cache.k[i], cache.v[i], mask).permute(2, 1, 0, 3)
        else:
            mask = (self.arange <= positions[:, None])[None, None]

            def attend(q, i):
                return L.dense(q.permute(2, 1, 0, 3), cache.k[i], cache.v[i], mask).permute(2, 1, 0, 3)

        h, feats = target_step(self.model, L, self.ids[:size], positions, write, attend, self.layer_ids)
        return self.head(h), feats

    @torch.inference_mode()
    def prepare(self):
        """Compile both step shapes and capture their graphs (once; `forward` calls it when not done)."""
        if self.graphs is not None and not self.graphs:
            for size in sorted({1, self.block}):
                pool = next(iter(self.graphs.values()))[0].pool() if self.graphs else None
                self.graphs[size] = capture(lambda s=size: self._step(s), self.model.device, pool)
            self.pos_t.zero_()

    @torch.inference_mode()
    def prefill(self, ids: list[int]):
        """A new sequence: the prompt's keys and values at positions 0..n-1. Returns the logits at its
        last position [V] and its features [1, n, K*H] (None without layer ids)."""
        self.prepare()
        dev = self.model.device
        h, feats = prefill(self.model, self.cache, torch.zeros(1, dtype=torch.long, device=dev),
                           torch.tensor([ids], device=dev), self.layer_ids)
        self.pos = len(ids)
        return self.head(h[0, -1]), feats

    @torch.inference_mode()
    def forward(self, tokens: list[int]):
        """`tokens` at the current position: logits [S, V] and features [1, S, K*H] (or None)."""
        n = len(tokens)
        size = 1 if n == 1 else self.block
        if not 1 <= n <= self.block or self.pos + size > self.max_len:
            raise ValueError(f"{n} tokens at position {self.pos}: the session holds blocks of "
                             f"1..{self.block} tokens within {self.max_len} positions")
        self.prepare()
        self.ids[:n] = torch.tensor(tokens)
        self.pos_t.fill_(self.pos)
        if self.graphs is None:
            logits, feats = self._step(size)
        else:
            graph, (logits, feats) = self.graphs[size]
            graph.replay()
        self.pos += n
        # copies: the graph's outputs are overwritten by its next replay
        return logits[:n].clone(), None if feats is None else feats[None, :n].clone()

    def crop(self, n: int):
        """Forget the last n positions."""
        self.pos -= n


class HFSession:
    """The same interface over the model's own forward and a DynamicCache."""

    def __init__(self, model, layer_ids=()):
        self.model, self.layer_ids, self.cache = model, list(layer_ids), None

    def _run(self, ids, **kw):
        hs = bool(self.layer_ids)
        o = self.model(input_ids=torch.tensor([ids], device=self.model.device), past_key_values=self.cache,
                       output_hidden_states=hs, **kw)
        return o.logits[0], select_features(o.hidden_states, self.layer_ids) if hs else None

    @torch.no_grad()
    def prefill(self, ids: list[int]):
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        logits, feats = self._run(ids, logits_to_keep=1)
        return logits[-1], feats

    @torch.no_grad()
    def forward(self, tokens: list[int]):
        return self._run(tokens)

    def crop(self, n: int):
        if n:
            self.cache.crop(-n)  # negative: tokens to remove
