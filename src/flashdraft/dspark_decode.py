"""DSpark's drafting (the dspark family's proposer): DFlashProposer's draft context with DSpark's block,
the hidden states of every slot, turned into drafts by the Markov picks (`DSparkDrafter.pick_block`, or
`GraphPicks` replayed as CUDA graphs on the static engine) and cut at the confidence threshold. A module
of its own so that training, which imports dspark.py, imports no decoding engine."""

from __future__ import annotations

from functools import partial

import torch

from .speculative import DFlashProposer
from .step import Graphs


class GraphPicks:
    """`DSparkDrafter.pick_block`'s left-to-right Markov picks as CUDA graphs, one greedy and one sampling,
    replayed after the draft session's step instead of a dozen small kernels per slot launched one by one.
    The slots' hidden states, the last token, the temperature and one uniform per slot (drawn from the
    caller's generator before the replay) sit in static buffers; a sample is the inverse of its
    distribution's CDF at that uniform (the distribution pick_block's torch.multinomial samples). A block
    shorter than the graph's runs all slots: a slot's pick depends on those before it only."""

    def __init__(self, drafter, lm_head_weight, block_size: int):
        dev = lm_head_weight.device
        self.drafter, self.head, self.vocab = drafter, lm_head_weight, drafter.spec.vocab_size
        self.h = torch.zeros(block_size, drafter.spec.hidden_size, dtype=drafter.fc.weight.dtype, device=dev)
        self.last = torch.zeros(1, dtype=torch.long, device=dev)
        self.temperature = torch.ones(1, device=dev)
        self.uniform = torch.zeros(block_size, device=dev)
        self.graphs = Graphs(dev)

    def _picks(self, sampled: bool):
        base = (self.h @ self.head.to(self.h.dtype).T).float()

        def choose(k, logits):
            if not sampled:
                return logits.argmax(-1, keepdim=True), None
            q = torch.softmax(logits / self.temperature, -1)
            cdf = q.cumsum(-1)
            return torch.searchsorted(cdf, self.uniform[k : k + 1] * cdf[-1:]).clamp_(max=self.vocab - 1), q

        return self.drafter.markov_picks(base, self.last, choose)

    @torch.inference_mode()
    def __call__(self, h, last_token: int, temperature: float, generator=None):
        """pick_block(h, last_token, ...)'s drafts `[n]` and distributions `[n, V]` (None at T=0)."""
        if not self.graphs.ready:
            self.graphs.capture({s: partial(self._picks, s) for s in (False, True)})
        n, sampled = h.shape[0], temperature > 0
        self.h[:n].copy_(h)
        self.last.fill_(int(last_token))
        if sampled:
            self.temperature.fill_(temperature)
            u = self.uniform
            u.copy_(torch.rand(u.shape, generator=generator, device=u.device))
        drafts, q = self.graphs.run(sampled, self._picks, sampled)
        return drafts[:n].clone(), None if q is None else q[:n].clone()


class DSparkProposer(DFlashProposer):
    """A DSpark drafter: DFlash's proposer (its context in a `DraftCache`, a static `session.DraftSession`
    after `static(max_len)`, or recomputed with `cached=False`) whose block gives the hidden states of all
    its slots, picked left to right with the Markov bias (`DSparkDrafter.pick_block`, or `GraphPicks` in a
    session with CUDA graphs); min(B, max_draft) drafts. `confidence_threshold` > 0: the proposal stops
    before the first slot whose confidence (sigmoid) is below it, as DeepSpec's evaluator can (default
    off)."""

    hidden_states = True

    def __init__(
        self, drafter, embed_weight, lm_head_weight, cached: bool = True, confidence_threshold: float = 0.0
    ):
        self.threshold, self.picks = confidence_threshold, None
        super().__init__(drafter, embed_weight, lm_head_weight, cached)

    def static(self, max_len: int) -> DSparkProposer:
        super().static(max_len)
        if self.session is not None and self.session.graphs.on and self.drafter.markov_head is not None:
            self.picks = GraphPicks(self.drafter, self.head, self.block_size)
        return self

    def slots(self, max_draft: int) -> int:
        return min(self.block_size, max(max_draft, 1))  # the block always runs: it takes in the new features

    def cached_block(self, new_features, last_token: int, position: int, size: int):
        return self.drafter.block_hidden_cached(
            new_features, last_token, self.embed, self.cache, position, size
        )

    def uncached_block(self, features, last_token: int, size: int):
        return self.drafter.block_hidden(features, last_token, self.embed, size)

    def block_drafts(self, h, last_token: int, max_draft: int, temperature, generator):
        if self.picks is not None:
            drafts, q = self.picks(h, last_token, temperature, generator)
        else:
            drafts, q, _ = self.drafter.pick_block(h, last_token, self.head, temperature, generator)
        n = min(max_draft, self._confident(h, last_token, drafts))
        return drafts[:n].tolist(), None if q is None else q[:n]

    @torch.no_grad()
    def _confident(self, h, last_token: int, drafts) -> int:
        """Slots before the first below the confidence threshold (all without a threshold or a head)."""
        if self.threshold <= 0 or self.drafter.confidence_head is None:
            return len(drafts)
        prev = torch.cat([torch.tensor([last_token], device=drafts.device), drafts[:-1]])
        conf = self.drafter.confidence(h, self.drafter.prev_embeds(prev)).float().sigmoid()
        low = (conf < self.threshold).nonzero()
        return int(low[0, 0]) if len(low) else len(drafts)
