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

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .chat import prompt_messages, render
from .config import EvalConfig, layers_out_of_range
from .io import progress, write_json, write_parquet
from .model import DraftCache
from .session import DraftSession, HFSession, StaticSession
from .shards import shard_of
from .target import eos_ids

# ---------------------------------------------------------------------------------------------------------
# drafters: each proposes draft tokens from the verified tokens (and the target's features of them)


class DFlashProposer:
    """A DFlash drafter: one parallel block prediction from the target features of the verified context.

    The context's keys/values live in a `DraftCache` that grows by the positions each verify step
    accepts, or, after `static(max_len)`, in a `session.DraftSession` (static cache, CUDA-graph steps);
    `cached=False` recomputes them over the whole context every step (the reference)."""

    uses_features = True

    def __init__(self, drafter, embed_weight, lm_head_weight, cached: bool = True):
        self.drafter, self.embed, self.head, self.cached = drafter, embed_weight, lm_head_weight, cached
        self.block_size = drafter.spec.block_size
        self.session = None
        self.reset()

    def static(self, max_len: int) -> DFlashProposer:
        """Draft over a static cache of `max_len` context positions (a cached proposer only)."""
        if self.cached:
            self.session = DraftSession(self.drafter, self.embed, self.head, max_len)
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
        size = min(self.block_size, max_draft + 1)
        if self.session is not None:
            self.session.extend(new_features)
            assert self.session.length == len(tokens) - 1, "the drafter's context is the verified tokens"
            logits = self.session.draft(tokens[-1], size)
        elif self.cached:
            logits = self.drafter.predict_block_cached(
                new_features, tokens[-1], self.embed, self.head, self.cache, len(tokens) - 1, size
            )
        else:
            f = self.features
            self.features = new_features if f is None else torch.cat([f, new_features], 1)
            logits = self.drafter.predict_block(self.features, tokens[-1], self.embed, self.head, size)
        logits = logits.float()
        if temperature == 0:
            return logits.argmax(-1).tolist(), None
        q = torch.softmax(logits / temperature, -1)
        return torch.multinomial(q, 1, generator=generator).squeeze(-1).tolist(), q


class NgramProposer:
    """Prompt lookup: the continuation after the latest earlier match of the last n tokens, n = max_n..1."""

    uses_features = False

    def __init__(self, num_draft: int, max_n: int = 3):
        self.num_draft, self.max_n = num_draft, max_n

    def reset(self):
        pass  # stateless: it reads the tokens it is given

    def propose(self, tokens, new_features, max_draft, temperature, generator):
        num_draft = min(self.num_draft, max_draft)
        for n in range(min(self.max_n, len(tokens) - 1), 0, -1):
            tail = tokens[-n:]
            # start <= len - n - 1: the match must be followed by at least one token
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    return tokens[start + n : start + n + num_draft], None
        return [], None  # a step with no draft is a plain target step (tau 1)


def check_drafter(spec, target_config) -> None:
    """Refuse a drafter built for another target, naming every mismatch."""
    n, problems = target_config.num_hidden_layers, []
    if spec.hidden_size != target_config.hidden_size:
        problems.append(f"hidden_size {spec.hidden_size} != target hidden_size {target_config.hidden_size}")
    if spec.vocab_size != target_config.vocab_size:
        problems.append(f"vocab_size {spec.vocab_size} != target vocab_size {target_config.vocab_size}")
    if spec.num_target_layers != n:
        problems.append(f"num_target_layers {spec.num_target_layers} != target num_hidden_layers {n}")
    bad = layers_out_of_range(spec.target_layer_ids, n)
    if bad:
        problems.append(f"target_layer_ids {bad} out of range for a target with {n} layers")
    if not 0 <= spec.mask_token_id < target_config.vocab_size:
        problems.append(
            f"mask_token_id {spec.mask_token_id} outside the target embedding ({target_config.vocab_size})"
        )
    if problems:
        raise ValueError("drafter does not match the target: " + "; ".join(problems))


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


def _pick(logits, temperature, generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator))


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


@torch.no_grad()
def target_decode(session, prompt_ids, max_new_tokens, eos, temperature=0.0, generator=None) -> Decoded:
    """Plain autoregressive decoding, one token per forward over the session's cache."""
    dev = session.model.device
    logits, _ = session.prefill(prompt_ids)
    out = [_pick(logits, temperature, generator)]
    _sync(dev)
    t0 = time.perf_counter()
    while len(out) < max_new_tokens and out[-1] not in eos:
        logits, _ = session.forward([out[-1]])
        out.append(_pick(logits[-1], temperature, generator))
    _sync(dev)
    steps = len(out) - 1
    return Decoded(out, [1] * steps, [0] * steps, [0] * steps, time.perf_counter() - t0)


@torch.no_grad()
def speculative_decode(session, proposer, prompt_ids, max_new_tokens, eos, temperature=0.0,
                       generator=None) -> Decoded:
    """Draft, verify [last, drafts] in one forward, keep the accepted prefix and the bonus token. The
    session's features are the drafter's input (a session without layer ids suits a proposer that
    needs none)."""
    dev = session.model.device
    proposer.reset()
    # the drafter's context is every verified token but the last; it is handed over in increments:
    # first the prompt's features, then after each verify those of last + the accepted drafts
    logits, feats = session.prefill(prompt_ids)
    new = [_pick(logits, temperature, generator)]
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
    from .step import unsupported

    why = unsupported(model)
    if engine == "static" and why:
        raise ValueError(f"eval.engine 'static' cannot run this target: {why}; use 'auto' or 'hf'")
    if engine == "hf" or why:
        return HFSession(model, layer_ids)
    return StaticSession(model, max_len, layer_ids, block)


# A divergence is a numerical tie when both choices lie within this many ulps (of the target's dtype, at
# the top logit's magnitude) of the top logit. Each logit leaves the LM head rounded to the dtype (half an
# ulp each, so one ulp between two of them), and the hidden state feeding the head was rounded in every
# layer along another reduction order in a B-token verify than in a 1-token step: a few ulps more. In
# bf16 (8 significant bits) an ulp at a logit of 20 is 0.125, so the tolerance there is 0.5.
TIE_ULPS = 4


def tie_tolerance(magnitude: float, dtype: torch.dtype = torch.bfloat16, ulps: int = TIE_ULPS) -> float:
    """`ulps` units in the last place of `dtype` at `magnitude` (an ulp: eps * 2^floor(log2 |m|))."""
    m = abs(float(magnitude))
    if m == 0 or not math.isfinite(m):
        return 0.0
    return ulps * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(m))


@torch.no_grad()
def first_mismatch(model, prompt_ids, ref: list[int], out: list[int]) -> tuple[int, float, bool]:
    """Where `out` first leaves the target-only output `ref` (-1: never), the target's logit gap there
    between the two choices, and whether that is a numerical tie: both choices within `tie_tolerance` of
    the top logit, so the rounding of a B-token verify forward and a 1-token forward decided it
    differently (bf16 on GPU), not a decoding bug."""
    if out == ref:
        return -1, float("nan"), False
    j = next((i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), min(len(ref), len(out)))
    if j == min(len(ref), len(out)):
        return j, float("nan"), False  # one is a prefix of the other
    logits = model(input_ids=torch.tensor([[*prompt_ids, *ref[:j]]], device=model.device), logits_to_keep=1)
    logits = logits.logits[0, -1].float()
    top = float(logits.max())
    tol = tie_tolerance(top, model.dtype)
    tie = top - float(logits[ref[j]]) <= tol and top - float(logits[out[j]]) <= tol
    return j, float(logits[ref[j]] - logits[out[j]]), tie


# ---------------------------------------------------------------------------------------------------------
# evaluation over a prompt set


def prompt_ids(tokenizer, messages) -> list[int]:
    text = render(tokenizer, prompt_messages(messages), add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


NO_MISMATCH = (-1, float("nan"), False)


def _row(pid, name, d: Decoded, num_prompt_tokens, lossless, mismatch=NO_MISMATCH, index=0) -> dict:
    steps = len(d.emitted)
    return {
        "prompt_index": index,  # position in the evaluated prompt set: the merged shards' order
        "id": pid,
        "drafter": name,
        "prompt_tokens": num_prompt_tokens,
        "new_tokens": len(d.tokens),
        "verify_steps": steps,
        "tau": sum(d.emitted) / steps if steps else float("nan"),
        "emitted": list(d.emitted),
        "accepted": list(d.accepted),
        "verified": list(d.verified),
        "decode_s": d.seconds,
        "tokens_per_s": (len(d.tokens) - 1) / d.seconds if d.seconds > 0 else float("nan"),
        "lossless": lossless,
        "first_mismatch": mismatch[0],
        "mismatch_logit_gap": mismatch[1],
        "numerical_tie": mismatch[2] if lossless is not None else None,  # None: sampled, not compared
        "output": list(d.tokens),
    }


def evaluate(model, tokenizer, proposers: dict, prompts, layer_ids, block_size, cfg: EvalConfig, seed=0,
             indices=None):
    """Run target-only and every drafter on each prompt; return per-prompt rows (dicts). `indices`: the
    prompts' positions in the whole evaluated set (default 0, 1, ...), which seed their sampling, so a
    shard of the set decodes each prompt exactly as one job over the whole set does."""
    eos, dev, temp = eos_ids(model, tokenizer), model.device, cfg.temperature
    gen = torch.Generator(device=dev)
    indices = range(len(prompts)) if indices is None else indices
    encoded = [(i, p["id"], prompt_ids(tokenizer, list(p["messages"])))
               for i, p in zip(indices, prompts, strict=True)]
    # target-only and the n-gram lookup need no features; a DFlash drafter reads them at its layer ids
    max_len = max((len(ids) for _, _, ids in encoded), default=1) + cfg.max_new_tokens
    plain = make_session(model, cfg.engine, max_len, (), block_size)
    featured = make_session(model, cfg.engine, max_len, layer_ids, block_size)
    if isinstance(featured, StaticSession):  # the drafters' caches static too
        proposers = {name: p.static(max_len) if isinstance(p, DFlashProposer) else p
                     for name, p in proposers.items()}
    session = {name: featured if prop.uses_features else plain for name, prop in proposers.items()}
    if encoded:  # warm up every path on the first prompt so the first timed prompt is not a cold start
        warm = min(cfg.max_new_tokens, 2 * block_size)
        target_decode(plain, encoded[0][2], warm, eos, temp, gen)
        for name, prop in proposers.items():
            speculative_decode(session[name], prop, encoded[0][2], warm, eos, temp, gen)
    rows = []
    for i, pid, ids in progress(encoded, desc="evaluate", unit="prompt"):
        gen.manual_seed(seed + i)
        ref = target_decode(plain, ids, cfg.max_new_tokens, eos, temp, gen)
        rows.append(_row(pid, "target_only", ref, len(ids), None if temp else True, index=i))
        for name, prop in proposers.items():
            gen.manual_seed(seed + i)
            d = speculative_decode(session[name], prop, ids, cfg.max_new_tokens, eos, temp, gen)
            if temp:  # sampled outputs differ by design; losslessness is checked greedily
                rows.append(_row(pid, name, d, len(ids), None, index=i))
            else:
                mismatch = first_mismatch(model, ids, ref.tokens, d.tokens)
                rows.append(_row(pid, name, d, len(ids), mismatch[0] < 0, mismatch, index=i))
    return rows


def _ratio(a, b):
    return a / b if b > 0 else None  # None, not NaN: summary.json stays strict JSON


def summarize(rows, block_size) -> dict:
    """Per drafter: tau pooled over all verify steps (emitted tokens / steps) and the mean of the prompts'
    own tau (what the reference's benchmark prints), the histogram of tokens emitted per step (1..B), and
    per draft position k the fraction of steps that verified a draft at k it could emit and accepted it."""

    def rate(rs):  # decode tokens/s: tokens after the prefill's first one, over decode time
        return _ratio(sum(r["new_tokens"] - 1 for r in rs), sum(r["decode_s"] for r in rs))

    base = rate([r for r in rows if r["drafter"] == "target_only"])
    summary = {"target_only": {"tokens_per_s": base}}
    for name in dict.fromkeys(r["drafter"] for r in rows if r["drafter"] != "target_only"):
        rs = [r for r in rows if r["drafter"] == name]
        emitted, acc, ver = ([x for r in rs for x in r[key]] for key in ("emitted", "accepted", "verified"))
        taus = [r["tau"] for r in rs if r["verify_steps"]]
        flags = [r["lossless"] for r in rs]
        compared = None not in flags  # greedy: every output compared token for token with target-only
        differ = [r for r in rs if r["lossless"] is False]
        tps = rate(rs)
        summary[name] = {
            "tau_pooled": _ratio(sum(emitted), len(emitted)),
            "tau_prompt_mean": _ratio(sum(taus), len(taus)),
            "tau_hist": [sum(e == t for e in emitted) for t in range(1, block_size + 1)],
            "per_position_acceptance": [
                _ratio(sum(a >= k for a in acc), sum(v >= k for v in ver)) for k in range(1, block_size)
            ],
            "tokens_per_s": tps,
            "speedup": _ratio(tps, base) if tps is not None and base else None,
            "lossless_all": all(flags) if compared else None,
            "exact_match_rate": _ratio(sum(flags), len(flags)) if compared else None,
            "mismatches": len(differ) if compared else None,
            "numerical_ties": sum(bool(r["numerical_tie"]) for r in differ) if compared else None,
            # where each differing output first left target-only's, and whether that was a numerical tie
            "divergences": [
                {"id": r["id"], "position": r["first_mismatch"], "numerical_tie": bool(r["numerical_tie"]),
                 "logit_gap": None if math.isnan(r["mismatch_logit_gap"]) else r["mismatch_logit_gap"]}
                for r in differ
            ],
            "prompts": len(rs),
        }
    return summary


def shard_prompts(prompts_path, num_prompts: int, shard: int = 0, num_shards: int = 1):
    """The evaluated prompts (the first `num_prompts` of the set) of one shard, with their positions in
    the whole set. The split is `shards.shard_of` on the prompt id, as for every sharded stage."""
    import pandas as pd

    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is outside 0..{num_shards - 1}")
    prompts = pd.read_parquet(prompts_path).head(num_prompts).to_dict("records")
    mine = [(i, p) for i, p in enumerate(prompts) if shard_of(p["id"], num_shards) == shard]
    return [i for i, _ in mine], [p for _, p in mine]


def run_rows(cfg: EvalConfig, target_dir, drafter_dir, prompts_path, dtype="bfloat16", seed=0, shard=0,
             num_shards=1) -> tuple[list[dict], int]:
    """Trained drafter, untrained drafter and n-gram lookup against target-only on one shard of the
    prompts: its rows and the block size."""
    from .model import DFlashDrafter, load_drafter
    from .target import load_target

    indices, prompts = shard_prompts(prompts_path, cfg.num_prompts, shard, num_shards)
    model, tokenizer = load_target(target_dir, dtype)
    drafter, spec = load_drafter(drafter_dir)
    check_drafter(spec, model.config)
    dev, dt = model.device, model.get_input_embeddings().weight.dtype
    torch.manual_seed(seed)
    untrained = DFlashDrafter(spec)  # same shape, random init: what training adds over nothing
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    proposers = {
        "dflash": DFlashProposer(drafter.to(dev, dt).eval(), embed, head),
        "dflash_untrained": DFlashProposer(untrained.to(dev, dt).eval(), embed, head),
        "ngram": NgramProposer(spec.block_size - 1),
    }
    layer_ids = list(spec.target_layer_ids)
    rows = evaluate(model, tokenizer, proposers, prompts, layer_ids, spec.block_size, cfg, seed, indices)
    return rows, spec.block_size


def write_rows(rows: list[dict], path) -> None:
    import pandas as pd

    columns = list(_row("", "", Decoded([], [], [], [], 0.0), 0, True))  # a shard without prompts: no rows
    write_parquet(pd.DataFrame(rows, columns=columns), path)


def read_rows(paths) -> list[dict]:
    """The rows of shard files, in the order one job over the whole set writes them (prompt order;
    within a prompt, target-only then the drafters), as plain Python values."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = [t for t in (pq.read_table(p) for p in paths) if t.num_rows]
    if not tables:
        return []
    # promote: a column that is all null in one shard (lossless when sampling) is typed in another
    table = pa.concat_tables(tables, promote_options="default")
    floats = [f.name for f in table.schema if pa.types.is_floating(f.type)]
    rows = table.to_pylist()
    for r in rows:  # the parquet writer stored NaN (no value: a tau without steps, a gap without one) as null
        r.update({k: float("nan") for k in floats if r[k] is None})
    return sorted(rows, key=lambda r: r["prompt_index"])  # stable: keeps the drafters' order


def write_outputs(rows: list[dict], block_size: int, out_dir) -> dict:
    """per_prompt.parquet and summary.json (computed from exactly these rows) in `out_dir`."""
    summary = summarize(rows, block_size)
    out = Path(out_dir)
    write_rows(rows, out / "per_prompt.parquet")
    write_json(out / "summary.json", summary)
    return summary


def merge(shard_paths, drafter_dir, out_dir) -> dict:
    """The `evaluate_merge` stage: the shards' rows as one per_prompt.parquet and summary.json."""
    from .model import DrafterSpec

    spec = DrafterSpec.from_config_dict(json.loads((Path(drafter_dir) / "config.json").read_text()))
    return write_outputs(read_rows(shard_paths), spec.block_size, out_dir)


def summary_text(summary: dict) -> str:
    """A few lines for a stage's log: tokens/s, tau, speedup and losslessness per drafter."""
    lines = [f"target_only: {summary['target_only']['tokens_per_s'] or 0:.1f} tok/s"]
    for name, s in summary.items():
        if name != "target_only":
            pooled, mean, speedup = s["tau_pooled"] or 0, s["tau_prompt_mean"] or 0, s["speedup"] or 0
            lines.append(f"{name}: tau {pooled:.2f} pooled, {mean:.2f} mean of prompts  "
                         f"speedup {speedup:.2f}x  lossless {s['lossless_all']}")
    return "\n".join(lines)


def run(cfg: EvalConfig, target_dir, drafter_dir, prompts_path, out_dir, dtype="bfloat16", seed=0) -> dict:
    """The whole evaluation in one job: every prompt, then per_prompt.parquet and summary.json."""
    rows, block_size = run_rows(cfg, target_dir, drafter_dir, prompts_path, dtype, seed)
    return write_outputs(rows, block_size, out_dir)
