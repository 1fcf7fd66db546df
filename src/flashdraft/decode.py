"""Fast batched decoding of the target: fixed KV-cache slots, CUDA-graph steps, continuous batching.

HF `generate` pays the Python and kernel-launch cost of every layer at every token, and a batch runs
until its longest row ends. Here:
- the KV cache is static: `slots` rows of `max_len` positions per layer, allocated once;
- a decode step (every slot, one token each) is captured as a CUDA graph, so one replay launches the
  whole step;
- on CUDA the step is compiled (flashdraft.step: each layer's small kernels fused between the matmuls),
  and attention is FlexAttention's decoding kernel over a block mask that lists, per row, only the KV
  blocks up to that row's own position: a row reads its own context, not the longest row's;
- a row that ends frees its slot, and the next waiting prompts are prefilled into free slots
  (in groups, so each prefill is a real batch), so the batch stays full.

`step.unsupported(model)` says when a model needs more than the step's layer math (sliding windows,
other layouts); regeneration then falls back to HF `generate`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from functools import partial

import torch
import torch.nn.functional as F

from .hf_config import kv_bytes_per_token
from .step import (
    BUCKET,
    KV_BLOCK,
    Graphs,
    Layers,
    SlotCache,
    block_mask,
    pick,
    prefill,
    round_len,
    target_step,
)


def auto_slots(model, max_len: int, limit: int = 256, reserve: float = 0.1) -> int:
    """Slots that fit in the GPU memory left after the weights: KV cache (max_len positions each) plus
    the step's logits, keeping `reserve` of the card and 2 GiB for prefill activations free."""
    free, total = torch.cuda.mem_get_info(model.device)
    per_slot = max_len * kv_bytes_per_token(model.config, model.dtype.itemsize) + 8 * model.config.vocab_size
    budget = free - reserve * total - (2 << 30)
    return max(1, min(limit, int(budget // per_slot)))


class SlotDecoder:
    """Decodes prompts (token ids) with the target, `slots` rows at a time; see the module docstring.

    `graphs`: capture decode steps as CUDA graphs (default: on CUDA). `compiled`: compiled layer halves
    and FlexAttention over each row's own KV blocks (default: on CUDA; off, the same math runs eagerly
    with SDPA over a dense mask). `refill`: free slots that trigger a prefill of waiting prompts while
    others decode (default: an eighth of the slots). `prefill_tokens`: padded tokens per prefill.
    `temperature` 0: greedy; above, sampled, within `top_k` and `top_p` where set (`step.pick`)."""

    def __init__(
        self,
        model,
        slots: int,
        max_len: int,
        eos: list[int],
        pad_id: int,
        temperature: float = 0.0,
        seed: int = 0,
        graphs: bool | None = None,
        compiled: bool | None = None,
        refill: int | None = None,
        prefill_tokens: int = 16384,
        top_p: float = 1.0,
        top_k: int = 0,
    ):
        dev = model.device
        cuda = dev.type == "cuda"
        self.model, self.head = model, model.get_output_embeddings()
        self.slots, self.eos, self.pad_id, self.temperature = slots, set(eos), pad_id, temperature
        self.sampling = dict(top_p=top_p, top_k=top_k)
        self.compiled = cuda if compiled is None else compiled
        self.max_len = round_len(max_len) if cuda or self.compiled else max_len
        self.refill = refill or max(1, slots // 8)
        self.prefill_tokens = prefill_tokens
        self.layers = Layers.of_target(model, self.compiled)
        self.cache = SlotCache(model, slots, self.max_len)
        self.tokens = torch.full((slots,), pad_id, dtype=torch.long, device=dev)
        self.pos = torch.zeros(slots, dtype=torch.long, device=dev)  # the position each slot writes next
        self.live = torch.zeros(slots, dtype=torch.long, device=dev)  # 1: the slot holds a sequence
        self._idle = []  # slots freed since the last step: their `live` and `pos` go to 0 before the next
        self.arange = torch.arange(self.max_len, device=dev)
        self.generator = torch.Generator(dev).manual_seed(seed)
        self.graphs = Graphs(dev, graphs)
        pos = self.pos
        self._mask_mod = lambda b, h, q, kv: kv <= pos[b]

    # ----------------------------------------------------------------------------------------- model

    def _attend(self, length: int):
        """Attention for one decode step: FlexAttention over each row's own blocks (compiled), else SDPA
        over the first `length` positions, a row's own marked valid, the query heads sharing a KV head
        read as one group so each KV head is read once."""
        L, k, v = self.layers, self.cache.k, self.cache.v
        if self.compiled:
            n = (self.pos // KV_BLOCK).to(torch.int32).view(-1, 1, 1)
            mask = block_mask(n, n, self.max_len, 1, self._mask_mod)
            return lambda q, i: L.attention(q, k[i], v[i], mask)
        mask = (self.arange[:length] <= self.pos[:, None])[:, None, None, :]
        shape = (self.slots, L.kv_heads, L.heads // L.kv_heads, L.head_dim)
        return lambda q, i: F.scaled_dot_product_attention(
            q.reshape(shape), k[i][:, :, :length], v[i][:, :, :length], attn_mask=mask, scale=L.scaling
        ).reshape(q.shape)

    def _step(self, length: int):
        """One token for every slot: logits [slots, V] and the greedy pick; live slots' positions advance
        (clamped, so no slot ever writes past its row)."""
        L, cache = self.layers, self.cache
        idx = self.pos.view(-1, 1, 1, 1).expand(-1, L.kv_heads, 1, L.head_dim)

        def write(i, k, v):
            cache.k[i].scatter_(2, idx, k)
            cache.v[i].scatter_(2, idx, v)

        h, _ = target_step(self.model, L, self.tokens, self.pos, write, self._attend(length))
        logits = self.head(h)
        self.pos.add_(self.live).clamp_(max=self.max_len - 1)
        return logits, logits.argmax(-1)

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
        elif self.graphs.on:
            length = min(self.max_len, -(-length // BUCKET) * BUCKET)
        logits, greedy = self.graphs.run(length, self._step, length)
        nxt = (
            greedy
            if self.temperature == 0
            else pick(logits, self.temperature, self.generator, **self.sampling)
        )
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
        h, _ = prefill(self.model, self.cache, rows, ids.to(dev))
        logits = self.head(h[torch.arange(len(n), device=dev), lengths - 1])
        first = pick(logits, self.temperature, self.generator, **self.sampling)
        self.tokens[rows], self.pos[rows], self.live[rows] = first, lengths, 1
        return first.tolist()

    # ----------------------------------------------------------------------------------------- loop

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_new_tokens: int) -> Iterator[tuple[int, list[int], str]]:
        """Yield (index into `prompts`, new tokens, "stop" | "length") as each row ends, in finishing order.
        New tokens exclude the stop token, as `target.generate` does."""
        too_long = [i for i, p in enumerate(prompts) if len(p) + max_new_tokens > self.max_len]
        if too_long:
            raise ValueError(f"{len(too_long)} prompts exceed max_len {self.max_len} with their answers")
        self.prepare()
        yield from self._loop(prompts, max_new_tokens)

    @torch.inference_mode()
    def prepare(self):
        """Compile the step and capture its CUDA graphs (once; `run` calls it when not done yet). Captured
        while no slot holds a sequence: the warm-up runs write only position 0 of each slot, which every
        prefill overwrites."""
        if not self.graphs.ready:
            self.graphs.capture({length: partial(self._step, length) for length in self._lengths()})
            self.pos.zero_()

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
                for slot, i, t in zip(
                    slots, take, self._prefill(slots, [prompts[i] for i in take]), strict=True
                ):
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
