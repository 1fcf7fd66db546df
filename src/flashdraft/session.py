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

from functools import partial

import torch
import torch.nn.functional as F

from .model import dflash_mask_mod, rope_cos_sin
from .step import Graphs, Layers, SlotCache, prefill, round_len, target_step
from .target import select_features


class StaticSession:
    """See the module docstring. `layer_ids`: decoder layers whose outputs `forward` and `prefill` return
    as features. `compiled`, `graphs`: default on CUDA."""

    static = True  # a cache of fixed size: the drafters' caches can be static too (Proposer.static)

    def __init__(
        self,
        model,
        max_len: int,
        layer_ids=(),
        block: int = 1,
        compiled: bool | None = None,
        graphs: bool | None = None,
    ):
        dev = model.device
        self.model, self.layer_ids, self.block = model, list(layer_ids), block
        self.compiled = dev.type == "cuda" if compiled is None else compiled
        self.max_len = round_len(max_len + block)  # a padded block may write `block` past the end
        self.layers = Layers.of_target(model, self.compiled)
        self.head = model.get_output_embeddings()
        self.cache = SlotCache(model, 1, self.max_len)
        self.ids, self.pos = torch.zeros(block, dtype=torch.long, device=dev), 0  # pos: that of ids[0]
        self.pos_t = torch.zeros(1, dtype=torch.long, device=dev)  # the same, on the device
        self.arange = torch.arange(self.max_len, device=dev)
        self.graphs = Graphs(dev, graphs)
        pos = self.pos_t
        self._mask_mod = lambda b, h, q, kv: kv <= pos[0] + q

    def _step(self, size: int):
        """ids[:size] at positions pos_t.. : logits [size, V] and features [size, K*H] (or None)."""
        positions = self.pos_t + self.arange[:size]
        write, attend = self.layers.over_sequence(
            self.cache.k, self.cache.v, positions, self._mask_mod, self.arange
        )
        h, feats = target_step(
            self.model, self.layers, self.ids[:size], positions, write, attend, self.layer_ids
        )
        return self.head(h), feats

    @torch.inference_mode()
    def prepare(self):
        """Compile both step shapes and capture their graphs (once; `forward` calls it when not done)."""
        if not self.graphs.ready:
            self.graphs.capture({size: partial(self._step, size) for size in sorted({1, self.block})})
            self.pos_t.zero_()

    @torch.inference_mode()
    def prefill(self, ids: list[int]):
        """A new sequence: the prompt's keys and values at positions 0..n-1. Returns the logits at its
        last position [V] and its features [1, n, K*H] (None without layer ids)."""
        self.prepare()
        dev = self.model.device
        h, feats = prefill(
            self.model,
            self.cache,
            torch.zeros(1, dtype=torch.long, device=dev),
            torch.tensor([ids], device=dev),
            self.layer_ids,
        )
        self.pos = len(ids)
        return self.head(h[0, -1]), feats

    @torch.inference_mode()
    def forward(self, tokens: list[int]):
        """`tokens` at the current position: logits [S, V] and features [1, S, K*H] (or None)."""
        n = len(tokens)
        size = 1 if n == 1 else self.block
        if not 1 <= n <= self.block or self.pos + size > self.max_len:
            raise ValueError(
                f"{n} tokens at position {self.pos}: the session holds blocks of "
                f"1..{self.block} tokens within {self.max_len} positions"
            )
        self.prepare()
        self.ids[:n] = torch.tensor(tokens)
        self.pos_t.fill_(self.pos)
        logits, feats = self.graphs.run(size, self._step, size)
        self.pos += n
        return logits[:n].clone(), None if feats is None else feats[None, :n].clone()  # replays reuse them

    def crop(self, n: int):
        """Forget the last n positions."""
        self.pos -= n


class HFSession:
    """The same interface over the model's own forward and a DynamicCache."""

    static = False

    def __init__(self, model, layer_ids=()):
        self.model, self.layer_ids, self.cache = model, list(layer_ids), None

    def _run(self, ids, **kw):
        hs = bool(self.layer_ids)
        o = self.model(
            input_ids=torch.tensor([ids], device=self.model.device),
            past_key_values=self.cache,
            output_hidden_states=hs,
            **kw,
        )
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


class DraftSession:
    """A DFlash drafter over a static cache of its context's keys and values (evaluation's drafting).

    `extend(features)` projects the target features of newly verified positions into every layer's
    keys and values at the end of the context; `draft(last_token, size)` predicts the block anchored
    at the context's end: [last_token, MASK x (size-1)] at positions length.., bidirectional inside the
    block, over the whole context (or its window). Both run on `block`-row steps: a block shorter than
    `block` is padded (its pad keys masked), an extend longer than `block` goes in `block`-row pieces,
    a shorter one is padded (its pad rows land past the context, where the next draft writes its own
    block first). On CUDA both steps are compiled and captured as CUDA graphs. `hidden_states`: `draft`
    gives the block's hidden states (after the final norm) instead of logits, for a family that picks its
    drafts from them itself (DSpark: the anchor's slot predicts too, and each pick biases the next)."""

    def __init__(
        self,
        drafter,
        embed_weight,
        lm_head_weight,
        max_len: int,
        compiled: bool | None = None,
        graphs: bool | None = None,
        hidden_states: bool = False,
    ):
        spec, dev = drafter.spec, drafter.fc.weight.device
        self.drafter, self.spec, self.block = drafter, spec, spec.block_size
        self.embed, self.head, self.hidden_states = embed_weight, lm_head_weight, hidden_states
        self.compiled = dev.type == "cuda" if compiled is None else compiled
        self.max_len = round_len(max_len + 2 * self.block)
        self.layers = Layers(
            drafter.layers,
            eps=spec.rms_norm_eps,
            heads=spec.num_heads,
            kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            act=F.silu,
            scaling=spec.head_dim**-0.5,
            compiled=self.compiled,
        )
        kv = drafter.context_kv
        self._kv = torch.compile(kv, fullgraph=True, dynamic=False) if self.compiled else kv
        dtype = drafter.fc.weight.dtype
        shape = (1, spec.num_kv_heads, self.max_len, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=dev) for _ in drafter.layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=dev) for _ in drafter.layers]
        self.length = 0  # context positions held
        self.len_t = torch.zeros(1, dtype=torch.long, device=dev)  # the same, on the device
        self.size_t = torch.zeros(1, dtype=torch.long, device=dev)  # the block's real size
        self.feats = torch.zeros(self.block, spec.num_features * spec.hidden_size, dtype=dtype, device=dev)
        self.ids = torch.full((self.block,), spec.mask_token_id, dtype=torch.long, device=dev)
        self.arange = torch.arange(self.max_len, device=dev)
        self.graphs = Graphs(dev, graphs)
        # training's mask for one block anchored at the context's end, less the pad keys of a shorter block
        length, size = self.len_t, self.size_t
        every = torch.ones(1, 1, dtype=torch.bool, device=dev)
        trained = dflash_mask_mod(length.view(1, 1), every, length[0], self.block, spec.sliding_window)
        self._mask_mod = lambda b, h, q, kv: trained(b, h, q, kv) & (kv < length[0] + size[0])

    def reset(self):
        """A new sequence: no context."""
        self.length = 0

    def _rope(self, n):
        """Positions len_t.. of n rows and their RoPE cos, sin [1, n, d] (float32)."""
        positions = self.len_t + self.arange[:n]
        return (positions, *rope_cos_sin(positions[None], self.spec.head_dim, self.spec.rope_theta))

    def _extend_step(self):
        """feats (block rows) -> keys and values at positions len_t.."""
        positions, cos, sin = self._rope(self.block)
        for (k, v), kc, vc in zip(self._kv(self.feats[None], cos, sin), self.k, self.v, strict=True):
            kc.index_copy_(2, positions, k)
            vc.index_copy_(2, positions, v)

    def _draft_step(self):
        """ids (the block) at positions len_t..: the block's logits at positions 1..block-1 (or its hidden
        states at every position). Its keys and values go right after the context (never committed)."""
        positions, cos, sin = self._rope(self.block)
        write, attend = self.layers.over_sequence(
            self.k, self.v, positions, self._mask_mod, self.arange, mask_all=True
        )
        x = F.embedding(self.ids, self.embed).to(self.feats.dtype)
        h, _ = self.layers.run(x, cos[0, :, None, None], sin[0, :, None, None], write, attend)
        out = self.drafter.norm(h)
        return out if self.hidden_states else out[1:] @ self.head.to(out.dtype).T

    @torch.inference_mode()
    def prepare(self):
        """Compile both steps and capture their graphs, once, before any context is held: the capture's
        runs write keys and values at positions 0..block-1, which the first extend overwrites."""
        if self.graphs.ready:
            return
        assert self.length == 0, "the drafter's graphs are captured before any context"
        self.len_t.zero_()
        self.size_t.fill_(self.block)
        self.graphs.capture({"extend": self._extend_step, "draft": self._draft_step})

    @torch.inference_mode()
    def extend(self, features):
        """features [1, n, K*H] of context positions length..length+n-1."""
        self.prepare()
        feats = features[0].to(self.feats.dtype)
        for i in range(0, feats.shape[0], self.block):
            piece = feats[i : i + self.block]
            if self.length + self.block > self.max_len - self.block:
                raise ValueError(f"the drafter's context would pass its {self.max_len} cache positions")
            self.feats[: piece.shape[0]] = piece
            self.len_t.fill_(self.length)
            self.graphs.run("extend", self._extend_step)
            self.length += piece.shape[0]

    @torch.inference_mode()
    def draft(self, last_token: int, size: int):
        """Logits [size-1, V] of the block [last_token, MASK x (size-1)] after the context (hidden_states:
        its hidden states [size, H])."""
        if not 1 <= size <= self.block:
            raise ValueError(f"a block of {size}: the drafter's blocks hold 1..{self.block} tokens")
        self.prepare()
        self.ids[0] = int(last_token)
        self.len_t.fill_(self.length)
        self.size_t.fill_(size)
        rows = size if self.hidden_states else size - 1  # logits: the anchor's row predicts nothing
        return self.graphs.run("draft", self._draft_step)[:rows].clone()
