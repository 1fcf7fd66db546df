"""Speculative decoding with the target and a drafter: acceptance length (tau), losslessness, tokens/s.

One verify step: the drafter proposes up to B-1 tokens after the last verified token; the target scores
[last, d1..d_{B-1}] in one forward over its KV cache; the longest prefix the target agrees with is
accepted, plus the target's own next token (the bonus). The cache is then cropped to the verified tokens,
which leaves it exactly where target-only decoding would be.

tau counts what a step emits, as the reference `dflash.model.dflash_generate` does: accepted drafts plus
the bonus, cut at a stop token and at max_new_tokens. Where fewer than B tokens may still be emitted, the
block is shortened to them (drafts past the cap could never be emitted), as the reference's is.

The DFlash drafter keeps its own cache of the context's keys/values, fed only the verified tokens'
features, so it only grows. At T > 0 drafts are accepted by standard rejection sampling, which keeps the
target's output distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .model import DraftCache
from .proposer import Proposer as Proposer  # the base class, re-exported for the engines' users
from .session import DraftSession, HFSession, StaticSession
from .step import pick, unsupported

# ---------------------------------------------------------------------------------------------------------
# drafters: each proposes draft tokens from the verified tokens (and the target's features of them)


class DFlashProposer(Proposer):
    """A DFlash drafter: one parallel block prediction from the target features of the verified context.

    The context's keys/values live in a `DraftCache` that grows by the positions each verify step
    accepts, or, after `static(max_len)`, in a `session.DraftSession` (static cache, CUDA-graph steps);
    `cached=False` recomputes them over the whole context every step (the reference).

    A family whose drafts come from the block otherwise (dspark.DSparkProposer) keeps this context handling
    and overrides how the block is run and made drafts: `hidden_states` (the block's output is its slots'
    hidden states, not logits), `slots`, `cached_block`, `uncached_block` and `block_drafts`."""

    uses_features = True
    hidden_states = False  # the block's output: the hidden states of all its slots (else logits of 1..B-1)

    def __init__(self, drafter, embed_weight, lm_head_weight, cached: bool = True):
        self.drafter, self.embed, self.head, self.cached = drafter, embed_weight, lm_head_weight, cached
        self.block_size, self.session = drafter.spec.block_size, None
        self.reset()

    def static(self, max_len: int) -> DFlashProposer:
        """Draft over a static cache of `max_len` context positions (a cached proposer only)."""
        if self.cached:
            self.session = DraftSession(
                self.drafter, self.embed, self.head, max_len, hidden_states=self.hidden_states
            )
            self.reset()
        return self

    def reset(self):
        """A new sequence: forget the context."""
        self.cache, self.features = DraftCache(), None
        if self.session is not None:
            self.session.reset()

    def propose(self, tokens, new_features, max_draft, temperature, generator):
        """new_features: target features of the positions verified since the last call; the context is
        every verified token but the last, which anchors the block. At most `max_draft` drafts."""
        out = self.block(tokens, new_features, self.slots(max_draft))
        return self.block_drafts(out, tokens[-1], max_draft, temperature, generator)

    def block(self, tokens, new_features, size: int):
        """The block [last token, MASK x (size-1)] after the verified context, which takes in
        `new_features`: in the static session, over the DraftCache, or over the whole context."""
        if self.session is not None:
            self.session.extend(new_features)
            assert self.session.length == len(tokens) - 1, "the drafter's context is the verified tokens"
            return self.session.draft(tokens[-1], size)
        if self.cached:
            return self.cached_block(new_features, tokens[-1], len(tokens) - 1, size)
        f = self.features
        self.features = new_features if f is None else torch.cat([f, new_features], 1)
        return self.uncached_block(self.features, tokens[-1], size)

    def slots(self, max_draft: int) -> int:
        """The block's size for at most `max_draft` drafts: the anchor's slot predicts nothing."""
        return min(self.block_size, max_draft + 1)

    def cached_block(self, new_features, last_token: int, position: int, size: int):
        return self.drafter.predict_block_cached(
            new_features, last_token, self.embed, self.head, self.cache, position, size
        )

    def uncached_block(self, features, last_token: int, size: int):
        return self.drafter.predict_block(features, last_token, self.embed, self.head, size)

    def block_drafts(self, logits, last_token: int, max_draft: int, temperature, generator):
        """The drafts and their distributions (None at T=0) from the block's output: slots 1..size-1's
        logits, each picked on its own."""
        logits = logits.float()
        if temperature == 0:
            return logits.argmax(-1).tolist(), None
        q = torch.softmax(logits / temperature, -1)
        return torch.multinomial(q, 1, generator=generator).squeeze(-1).tolist(), q


class NgramProposer(Proposer):
    """Prompt lookup: the continuation after the latest earlier match of the last n tokens, n = max_n..1."""

    def __init__(self, num_draft: int, max_n: int = 3):
        self.num_draft, self.max_n = num_draft, max_n  # stateless: it reads the tokens it is given

    def propose(self, tokens, new_features, max_draft, temperature, generator):
        num_draft = min(self.num_draft, max_draft)
        if not num_draft:  # plain decoding (target_decode)
            return [], None
        for n in range(min(self.max_n, len(tokens) - 1), 0, -1):
            tail = tokens[-n:]
            # start <= len - n - 1: the match must be followed by at least one token
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + num_draft], None
        return [], None  # a step with no draft is a plain target step (tau 1)


# ---------------------------------------------------------------------------------------------------------
# decoding


@dataclass
class Decoded:
    """Per verify step (target-only: one step per token after the first): `emitted` tokens (accepted
    drafts + the bonus, cut at a stop token and at max_new_tokens; the reference's acceptance length),
    the drafts among them (`accepted`), and the draft positions that were verified and could have been
    emitted (`verified`: the block's drafts, or up to a stop token among the accepted ones)."""

    tokens: list[int]  # new tokens, the prompt excluded
    emitted: list[int]
    accepted: list[int]
    verified: list[int]
    seconds: float  # decode time after the prefill (which yields the first token)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def verify(draft, logits, q, temperature, generator) -> tuple[int, int]:
    """(accepted draft tokens, next token) from the target logits at [last, d1..dn]."""
    if temperature == 0:
        g = logits.argmax(-1).tolist()
        n = 0
        while n < len(draft) and draft[n] == g[n]:
            n += 1
        return n, g[n]
    p = torch.softmax(logits / temperature, -1)
    for i, d in enumerate(draft):
        qi = q[i] if q is not None else torch.nn.functional.one_hot(torch.tensor(d), p.shape[-1]).to(p)
        # accept with probability min(1, p/q); on rejection sample from the residual max(p - q, 0)
        if torch.rand((), generator=generator, device=p.device) * qi[d] < p[i, d]:
            continue
        resid = (p[i] - qi).clamp_min(0)
        resid = resid if resid.sum() > 0 else p[i]
        return i, int(torch.multinomial(resid / resid.sum(), 1, generator=generator))
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))


def target_decode(session, prompt_ids, max_new_tokens, eos, temperature=0.0, generator=None) -> Decoded:
    """Plain autoregressive decoding, one token per forward over the session's cache: speculative decoding
    without drafts."""
    return speculative_decode(
        session, NgramProposer(0), prompt_ids, max_new_tokens, eos, temperature, generator
    )


@torch.no_grad()
def speculative_decode(
    session, proposer: Proposer, prompt_ids, max_new_tokens, eos, temperature=0.0, generator=None
) -> Decoded:
    """Draft, verify [last, drafts] in one forward, keep the accepted prefix and the bonus token. The
    session's features are the drafter's input (a session without layer ids suits a proposer that
    needs none)."""
    dev = session.model.device
    proposer.reset()
    # the drafter's context is every verified token but the last; it is handed over in increments:
    # first the prompt's features, then after each verify those of last + the accepted drafts
    logits, feats = session.prefill(prompt_ids)
    new = [int(pick(logits, temperature, generator))]
    tokens, emitted, accepted, verified = [*prompt_ids, new[0]], [], [], []
    _sync(dev)
    t0 = time.perf_counter()
    while len(new) < max_new_tokens and new[-1] not in eos:
        room = max_new_tokens - len(new)  # tokens this step may still emit, so at most as many drafts
        draft, q = proposer.propose(tokens, feats, room, temperature, generator)
        logits, feats = session.forward([tokens[-1], *draft])
        n, nxt = verify(draft, logits.float(), q, temperature, generator)
        if feats is not None:  # the bonus token's features come with the next verify; rejected drafts' never
            feats = feats[:, : n + 1]
        session.crop(len(draft) - n)  # drop the rejected drafts
        out = [*draft[:n], nxt][:room]
        stop = next((i for i, t in enumerate(out) if t in eos), len(out))
        out = out[: stop + 1]
        tokens += out
        new += out
        emitted.append(len(out))
        accepted.append(min(n, len(out)))
        # ending on a draft (a stop token among them, or the cap): the positions after it never count
        verified.append(len(out) if len(out) <= n else len(draft))
    _sync(dev)
    return Decoded(new, emitted, accepted, verified, time.perf_counter() - t0)


def make_session(model, engine: str, max_len: int, layer_ids=(), block: int = 1):
    """The target's session for `eval.engine`: `static` (flashdraft.session), `hf` (the model's own
    forward over a DynamicCache), or `auto` (static where it runs the model)."""
    why = unsupported(model)
    if engine == "static" and why:
        raise ValueError(f"eval.engine 'static' cannot run this target: {why}; use 'auto' or 'hf'")
    if engine == "hf" or why:
        return HFSession(model, layer_ids)
    return StaticSession(model, max_len, layer_ids, block)
