import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from flashdraft.config import DrafterConfig, EvalConfig, TargetConfig, ToyConfig, to_json
from flashdraft.evaluate import check_drafter, decoded_row, evaluate, first_mismatch, prompt_ids, summarize
from flashdraft.speculative import (
    Decoded,
    DFlashProposer,
    NgramProposer,
    make_session,
    speculative_decode,
    target_decode,
    verify,
)
from flashdraft.target import eos_ids, feature_layer_ids, load_target, select_features
from flashdraft.toy import build_toy_target, task_conversations

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
B = 4
MAX_NEW = 40


@pytest.fixture(scope="session")
def toy(tmp_path_factory):
    """A real tiny random Qwen3 target with its tokenizer, plus tokenized eval prompts."""
    path = tmp_path_factory.mktemp("eval") / "target"
    build_toy_target(ToyConfig(steps=0, num_docs=200), str(path))
    model, tokenizer = load_target(str(path), "float32")
    prompts = [{"id": f"p{i}", "messages": c} for i, c in enumerate(task_conversations(3, seed=7))]
    layer_ids = feature_layer_ids(model.config, DrafterConfig(num_layers=2))
    return path, model, tokenizer, prompts, layer_ids


def untrained(model, tokenizer, seed=0):
    from flashdraft.model import DFlashDrafter, DrafterSpec

    spec = DrafterSpec.from_target(model.config, tokenizer, DrafterConfig(num_layers=2, block_size=B))
    torch.manual_seed(seed)
    return DFlashDrafter(spec).eval(), spec


@pytest.fixture(params=["static", "hf"])
def engine(request):
    """The target's side of decoding: the static-cache session, and the model's own forward."""
    return request.param


def sess(model, layer_ids=(), engine="static"):
    return make_session(model, engine, 256, layer_ids, B)


def head(model):
    return model.get_input_embeddings().weight, model.get_output_embeddings().weight


class OracleDrafter:
    """Test double, not a drafter: it knows the target's greedy continuation and returns it as one-hot
    logits. It also checks that the context features it is given are exactly the target's features of
    the verified tokens before the anchor, as one full forward over the final sequence computes them."""

    def __init__(self, model, sequence, layer_ids, miss_every_step=False):
        self.sequence, self.vocab, self.miss = sequence, model.config.vocab_size, miss_every_step
        self.spec = SimpleNamespace(block_size=B)
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([sequence]), output_hidden_states=True).hidden_states
        self.features = select_features(hs, layer_ids)
        self.calls, self.cache = 0, None

    def predict_block(self, target_hidden, last_token, embed_weight, lm_head_weight, size):
        s = target_hidden.shape[1]
        assert self.sequence[s] == last_token  # the anchor sits right after the context
        torch.testing.assert_close(target_hidden, self.features[:, :s], atol=1e-4, rtol=1e-4)
        draft = torch.tensor(self.sequence[s + 1 : s + size])
        if self.miss and self.calls % B < len(draft):  # call i gets draft position i % B wrong (B-1: none)
            draft[self.calls % B] = (draft[self.calls % B] + 1) % self.vocab
        self.calls += 1
        return torch.nn.functional.one_hot(draft, self.vocab).float() * 10

    def predict_block_cached(
        self, new_hidden, last_token, embed_weight, lm_head_weight, cache, context_len, size
    ):
        # the increments handed over since the cache was made must add up to the verified context
        if cache is not self.cache:
            self.cache, self.seen = cache, new_hidden
        else:
            self.seen = torch.cat([self.seen, new_hidden], 1)
        assert self.seen.shape[1] == context_len
        return self.predict_block(self.seen, last_token, embed_weight, lm_head_weight, size)


def test_ngram_lookup_proposes_the_latest_continuation():
    ngram = NgramProposer(num_draft=3)
    # the last 3 tokens (7 8 9) occur at 1 and 5; the latest earlier match (5) wins
    assert ngram.propose([1, 7, 8, 9, 4, 7, 8, 9, 5, 6, 7, 8, 9], None, 3, 0.0, None) == ([5, 6, 7], None)
    assert ngram.propose([1, 7, 8, 9, 4, 7, 8, 9, 5, 6, 7, 8, 9], None, 2, 0.0, None) == ([5, 6], None)
    # no 3- or 2-gram match: fall back to the last token alone, and keep the continuation short
    assert ngram.propose([3, 1, 2, 4, 5, 3], None, 3, 0.0, None) == ([1, 2, 4], None)
    assert ngram.propose([1, 2, 3], None, 3, 0.0, None) == ([], None)


def test_ngram_speculation_is_lossless_and_exercises_rejections(toy, engine):
    _, model, tokenizer, prompts, layer_ids = toy
    eos, steps = eos_ids(model, tokenizer), []
    for p in prompts:
        ids = prompt_ids(tokenizer, p["messages"])
        ref = target_decode(sess(model, engine=engine), ids, MAX_NEW, eos)
        d = speculative_decode(sess(model, layer_ids, engine), NgramProposer(B - 1), ids, MAX_NEW, eos)
        assert d.tokens == ref.tokens
        assert len(d.tokens) == MAX_NEW or d.tokens[-1] in eos
        steps += d.accepted
    assert all(0 <= a <= B - 1 for a in steps)
    assert 0 in steps and max(steps) >= 1  # both cache crops after rejections and accepted runs happened


def test_untrained_drafter_is_lossless(toy):
    _, model, tokenizer, prompts, layer_ids = toy
    drafter, spec = untrained(model, tokenizer)
    assert list(spec.target_layer_ids) == layer_ids
    cfg = EvalConfig(num_prompts=len(prompts), max_new_tokens=MAX_NEW, temperatures=[0.0])
    proposers = {"dflash_untrained": DFlashProposer(drafter, *head(model)), "ngram": NgramProposer(B - 1)}
    rows = evaluate(model, tokenizer, proposers, prompts, layer_ids, B, cfg)
    assert len(rows) == 3 * len(prompts)
    assert all(r["lossless"] for r in rows) and all(r["first_mismatch"] == -1 for r in rows)
    for r in rows:
        assert 1 <= r["tau"] <= B
        # the steps emit every token after the prefill's first, and tau counts exactly those
        assert r["new_tokens"] == 1 + sum(r["emitted"]) and r["tau"] == sum(r["emitted"]) / r["verify_steps"]
        # a step emits its accepted drafts plus the bonus, unless the cap or a stop token cut it
        last = len(r["emitted"]) - 1
        steps = list(zip(r["emitted"], r["accepted"], r["verified"], strict=True))
        assert all(e == a + 1 for e, a, _ in steps[:last]) and all(a <= v <= B - 1 for _, a, v in steps)
    assert all(r["tau"] == 1 for r in rows if r["drafter"] == "target_only")
    summary = summarize(rows, B)
    assert set(summary) == {"target_only", "dflash_untrained", "ngram"}
    for name in ("dflash_untrained", "ngram"):
        s = summary[name]
        assert s["lossless_all"] is True and s["prompts"] == len(prompts)
        assert 1 <= s["tau_pooled"] <= B and 1 <= s["tau_prompt_mean"] <= B
        assert len(s["tau_hist"]) == B and len(s["per_position_acceptance"]) == B - 1
        assert sum(s["tau_hist"]) == sum(r["verify_steps"] for r in rows if r["drafter"] == name)
    json.dumps(summary, allow_nan=False)  # strict JSON


@pytest.mark.parametrize("cached", [True, False])
def test_oracle_drafter_reaches_full_blocks_and_the_cap_cuts_the_last(toy, cached, engine):
    _, model, tokenizer, prompts, layer_ids = toy
    ids = prompt_ids(tokenizer, prompts[0]["messages"])
    # a long continuation without stopping at eos, so the oracle always knows B-1 tokens ahead
    ref = target_decode(sess(model, engine=engine), ids, MAX_NEW + B, eos=set())
    for max_new in (MAX_NEW, MAX_NEW - 2):  # the cap leaves B-1 tokens for the last step, then 1
        full, left = divmod(max_new - 1, B)  # after the prefill's token: full steps, then what is left
        assert 0 < left < B
        oracle = OracleDrafter(model, ids + ref.tokens, layer_ids)
        proposer = DFlashProposer(oracle, *head(model), cached=cached)
        d = speculative_decode(sess(model, layer_ids, engine), proposer, ids, max_new, set())
        assert d.tokens == ref.tokens[:max_new]  # truncated to max_new_tokens exactly
        assert oracle.calls == len(d.emitted)
        # the last block holds only the drafts the cap leaves room for: all emitted, no bonus
        assert d.emitted == [B] * full + [left]
        assert d.accepted == d.verified == [B - 1] * full + [left]
        s = summarize([decoded_row("p", "oracle", d, len(ids), True)], B)["oracle"]
        assert s["tau_pooled"] == s["tau_prompt_mean"] == (max_new - 1) / (full + 1) < B
        assert s["tau_hist"] == [int(t == left) + full * (t == B) for t in range(1, B + 1)]
        assert s["per_position_acceptance"] == [1.0] * (B - 1)
    # an oracle that misses at a different position each step: rejections at every depth, cache crops,
    # and context features appended for exactly the verified tokens (checked inside the double)
    oracle = OracleDrafter(model, ids + ref.tokens, layer_ids, miss_every_step=True)
    proposer = DFlashProposer(oracle, *head(model), cached=cached)
    d = speculative_decode(sess(model, layer_ids, engine), proposer, ids, MAX_NEW, set())
    assert d.tokens == ref.tokens[:MAX_NEW]
    assert d.accepted == [i % B for i in range(len(d.accepted))]


def test_summary_pools_steps_and_averages_prompts():
    def row(emitted, accepted, verified):
        return {
            "drafter": "d",
            "emitted": emitted,
            "accepted": accepted,
            "verified": verified,
            "verify_steps": len(emitted),
            "tau": sum(emitted) / len(emitted),
            "new_tokens": 1 + sum(emitted),
            "decode_s": 1.0,
            "lossless": True,
        }

    # prompt a: full, rejected at 2, cut by a stop token at draft 1; prompt b: one step the cap cut to 2
    rows = [row([4, 2, 1], [3, 1, 1], [3, 3, 1]), row([2], [2], [2])]
    s = summarize(rows, B)["d"]
    assert s["tau_pooled"] == 9 / 4 and s["tau_prompt_mean"] == (7 / 3 + 2) / 2
    assert s["tau_hist"] == [1, 2, 0, 1]
    # only positions a step verified and could emit count: 4 steps reach 1, 3 reach 2, 2 reach 3
    assert s["per_position_acceptance"] == [4 / 4, 2 / 3, 1 / 2]


class RecordingProposer(DFlashProposer):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.drafts = []

    def propose(self, *args):
        draft, q = super().propose(*args)
        self.drafts.append(draft)
        return draft, q


def test_cached_drafter_decodes_exactly_as_the_uncached_one(toy, engine):
    """The drafter's context cache changes the cost of a draft, not the draft: the same draft at every
    step as recomputing the whole context, so the same acceptance and output (target-only's)."""
    _, model, tokenizer, prompts, layer_ids = toy
    drafter, _ = untrained(model, tokenizer)
    eos = eos_ids(model, tokenizer)
    cached = RecordingProposer(drafter, *head(model))
    full = RecordingProposer(drafter, *head(model), cached=False)
    for p in prompts:  # one proposer over several prompts: each decode starts from an empty cache
        ids = prompt_ids(tokenizer, p["messages"])
        a = speculative_decode(sess(model, layer_ids, engine), cached, ids, MAX_NEW, eos)
        b = speculative_decode(sess(model, layer_ids, engine), full, ids, MAX_NEW, eos)
        assert a.tokens == b.tokens == target_decode(sess(model, engine=engine), ids, MAX_NEW, eos).tokens
        assert a.accepted == b.accepted
    assert cached.drafts == full.drafts and len(cached.drafts) > 2 * len(prompts)
    assert len({tuple(d) for d in cached.drafts}) > len(prompts)  # drafts that vary with the context


def test_eos_inside_an_accepted_run_stops_there(toy, engine):
    _, model, tokenizer, prompts, layer_ids = toy
    ids = prompt_ids(tokenizer, prompts[1]["messages"])
    ref = target_decode(sess(model, engine=engine), ids, MAX_NEW, eos=set())
    stop = {ref.tokens[6]}  # pretend the 7th generated token is an end of sequence
    oracle = OracleDrafter(model, ids + ref.tokens, layer_ids)
    proposer = DFlashProposer(oracle, *head(model))
    d = speculative_decode(sess(model, layer_ids, engine), proposer, ids, MAX_NEW, stop)
    assert d.tokens == target_decode(sess(model, engine=engine), ids, MAX_NEW, stop).tokens
    assert d.tokens[-1] in stop and len(d.tokens) == ref.tokens.index(ref.tokens[6]) + 1
    # the last step emits up to the stop token: a draft (r < B-1, the drafts after it never count) or the
    # bonus (r = B-1)
    j = len(d.tokens) - 1
    full, r = divmod(j - 1, B)
    assert d.emitted == [B] * full + [r + 1]
    assert d.accepted[-1] == d.verified[-1] == min(r + 1, B - 1)


def test_first_mismatch_locates_the_divergence_and_its_logit_gap(toy):
    _, model, tokenizer, prompts, _ = toy
    ids = prompt_ids(tokenizer, prompts[0]["messages"])
    ref = target_decode(sess(model), ids, 12, eos=set()).tokens
    assert first_mismatch(model, ids, ref, list(ref))[0] == -1
    wrong = [*ref[:5], (ref[5] + 1) % model.config.vocab_size, *ref[6:]]
    j, gap, tie = first_mismatch(model, ids, ref, wrong)
    assert j == 5 and gap > 0  # the greedy reference is the argmax, so it wins by a positive margin
    assert not tie  # a forced other token: a real divergence, not a rounding one
    assert first_mismatch(model, ids, ref, ref[:7])[0] == 7


def test_tie_tolerance_is_a_few_ulps_at_the_logits_magnitude():
    from flashdraft.evaluate import TIE_ULPS, tie_tolerance

    for m in (0.3, 1.0, 20.0, -20.0, 700.0):
        x = torch.tensor(abs(m), dtype=torch.bfloat16)
        ulp = 2.0 ** (math.floor(math.log2(abs(m))) - 7)  # bf16 keeps 8 significant bits
        # it is bf16's spacing at m: adding it moves x, a quarter of it rounds back to x
        assert float(x + ulp) != float(x) and float(x + ulp / 4) == float(x)
        assert tie_tolerance(m) == TIE_ULPS * ulp
    assert tie_tolerance(20.0) == 0.5
    assert tie_tolerance(20.0, torch.float32) == TIE_ULPS * 2.0 ** (4 - 23)
    assert tie_tolerance(0.0) == 0.0


def test_divergence_report_flags_a_numerical_tie(toy):
    """A real tie: another token's LM-head row made equal to the greedy token's, so both logits are the
    same bits at every position. The target's greedy pick (the first maximal index) is unchanged; an
    output that takes the twin at position j diverges there on a tie, one that takes a worse token not."""
    import copy

    _, model, tokenizer, prompts, _ = toy
    ids = prompt_ids(tokenizer, prompts[0]["messages"])
    ref = target_decode(sess(model), ids, 12, eos=set()).tokens
    j = 4
    twin = model.config.vocab_size - 1  # a free embedding row above the tokenizer's (never in the inputs)
    assert twin > ref[j] and twin not in ids + ref
    tied = copy.deepcopy(model)
    head = tied.get_output_embeddings().weight
    with torch.no_grad():
        head[twin] = head[ref[j]]
    assert target_decode(sess(tied), ids, 12, eos=set()).tokens == ref

    out = [*ref[:j], twin, *ref[j + 1 :]]
    position, gap, tie = first_mismatch(tied, ids, ref, out)
    assert (position, gap, tie) == (j, 0.0, True)
    worse = [*ref[:j], (ref[j] + 1) % tokenizer.vocab_size, *ref[j + 1 :]]
    assert first_mismatch(tied, ids, ref, worse)[2] is False

    def decoded(toks):
        steps = len(toks) - 1
        return Decoded(toks, [1] * steps, [0] * steps, [0] * steps, seconds=1.0)

    rows = [decoded_row("p", "target_only", decoded(ref), len(ids), True)]
    for pid, toks in (("p", out), ("q", worse), ("r", list(ref))):
        m = first_mismatch(tied, ids, ref, toks)
        rows.append(decoded_row(pid, "dflash", decoded(toks), len(ids), m[0] < 0, m))
    assert [r["numerical_tie"] for r in rows[1:]] == [True, False, False]
    s = summarize(rows, B)["dflash"]
    assert s["exact_match_rate"] == 1 / 3 and s["mismatches"] == 2 and s["numerical_ties"] == 1
    assert [(x["id"], x["position"], x["numerical_tie"]) for x in s["divergences"]] == [
        ("p", j, True),
        ("q", j, False),
    ]
    assert s["divergences"][0]["logit_gap"] == 0.0 and s["divergences"][1]["logit_gap"] > 0
    json.dumps(s, allow_nan=False)  # strict JSON: summary.json holds no NaN


def test_rejection_sampling_keeps_the_target_distribution():
    p_logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    q = torch.softmax(
        torch.tensor([[-1.0, 0.0, 1.5, 0.5]]), -1
    )  # a bad drafter: most mass where p has little
    p = torch.softmax(p_logits, -1)[0]
    gen, n = torch.Generator().manual_seed(0), 2000
    counts = torch.zeros(4)
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        accepted, nxt = verify([d], p_logits, q, 1.0, gen)
        counts[d if accepted else nxt] += 1
    assert torch.allclose(counts / n, p, atol=0.05), (counts / n, p)  # ~5 sigma
    # a deterministic draft (n-gram, q one-hot) is accepted with probability p(d)
    acc = sum(verify([0], p_logits, None, 1.0, gen)[0] for _ in range(n)) / n
    assert abs(acc - float(p[0])) < 0.05


def rejection_chain_counts(verify_fn, p_logits, q, n, gen, length=3):
    """How often each sequence of `length` tokens starts an output decoded by verify steps against a
    context-free target (its logits `p_logits` [V] at every position), with drafts of one token per row of
    q drawn from that row. Decoding goes on after a rejection, so later tokens come from later draft
    positions, residual samples and bonus tokens alike."""
    vocab = q.shape[-1]
    logits = p_logits.expand(len(q) + 1, vocab)
    counts = torch.zeros(vocab**length, dtype=torch.float64)
    for _ in range(n):
        out = []
        while len(out) < length:
            draft = [int(torch.multinomial(row, 1, generator=gen)) for row in q]
            accepted, nxt = verify_fn(draft, logits, q, 1.0, gen)
            out += [*draft[:accepted], nxt]
        counts[sum(t * vocab**i for i, t in enumerate(reversed(out[:length])))] += 1
    return counts


def test_rejection_sampling_keeps_the_target_distribution_at_every_draft_position():
    """Lossless in distribution over a whole verify step, not only its first draft: against a target
    whose next-token law is p whatever the context, speculative decoding must emit i.i.d. samples of p, so
    the first 3 tokens of an output follow p x p x p (64 cells), though each draft position drafts from
    its own q_k, far from p. A rule that resamples from p instead of the residual max(p - q, 0) after a
    rejection fails the same check: the test can tell."""
    p_logits = torch.tensor([1.0, 0.5, 0.0, -0.5])
    q = torch.softmax(torch.tensor([[-1.0, 0.0, 1.5, 0.5], [0.5, -1.0, 0.0, 1.5], [0.0, 1.0, -1.0, 1.0]]), -1)
    p = torch.softmax(p_logits, -1).double()
    exact = torch.einsum("i,j,k->ijk", p, p, p).flatten()
    n = 5000
    counts = rejection_chain_counts(verify, p_logits, q, n, torch.Generator().manual_seed(0))
    assert chi_square_p_value(counts, n * exact) > 1e-3

    def resample_from_p(draft, logits, q, temperature, generator):
        probs = torch.softmax(logits / temperature, -1)
        for i, d in enumerate(draft):
            if torch.rand((), generator=generator) * q[i][d] < probs[i, d]:
                continue
            return i, int(torch.multinomial(probs[i], 1, generator=generator))  # the bug: not the residual
        return len(draft), int(torch.multinomial(probs[len(draft)], 1, generator=generator))

    wrong = rejection_chain_counts(resample_from_p, p_logits, q, n, torch.Generator().manual_seed(0))
    assert chi_square_p_value(wrong, n * exact) < 1e-6


def chi_square_p_value(counts, expected):
    """Pearson's test of `counts` against `expected` (same total), cells expected below 5 pooled."""
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2), stat / 2))  # chi2 survival


def test_sampled_speculation_keeps_the_target_distribution(toy):
    """End to end at T > 0: the first token a verify step emits follows the target's exact distribution.
    At this temperature the untrained drafter's peaks miss the target's, so most steps take the rejection
    path (a residual sample). The exact law of that token (the second new one) sums over the first:
    P(t2) = sum_t1 p(t1) p(t2 | t1)."""
    _, model, tokenizer, prompts, layer_ids = toy
    temperature, n = 0.1, 1500
    ids = prompt_ids(tokenizer, prompts[2]["messages"])
    vocab = model.config.vocab_size
    with torch.no_grad():
        first = model(input_ids=torch.tensor([ids])).logits[0, -1]
        pairs = torch.cat([torch.tensor([ids]).expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
        second = model(input_ids=pairs, logits_to_keep=1).logits[:, -1]

    def law(t):
        return torch.softmax(first / t, -1) @ torch.softmax(second / t, -1)

    drafter, _ = untrained(model, tokenizer)
    proposer, gen = DFlashProposer(drafter, *head(model)), torch.Generator().manual_seed(0)
    counts, rejected, session = torch.zeros(vocab, dtype=torch.float64), 0, sess(model, layer_ids)
    for _ in range(n):
        d = speculative_decode(session, proposer, ids, 2, set(), temperature, gen)
        counts[d.tokens[1]] += 1
        rejected += d.accepted[0] == 0
    assert rejected > n / 2
    exact = law(temperature).double()
    assert chi_square_p_value(counts, n * exact) > 1e-3
    # total variation: its mean under exact sampling is at most sum sqrt(p(1-p)/n) / 2, and it exceeds
    # that by 3/sqrt(n) with probability below exp(-18) (McDiarmid: one sample moves it by 1/n at most)
    bound = float((exact * (1 - exact) / n).sqrt().sum() / 2 + 3 / n**0.5)
    assert float((counts / n - exact).abs().sum() / 2) < bound
    # and the test can tell: the same samples are far from the target at a 25% higher temperature
    assert chi_square_p_value(counts, n * law(1.25 * temperature).double()) < 1e-6


def test_sampled_speculation_runs_and_is_not_called_lossless(toy):
    _, model, tokenizer, prompts, layer_ids = toy
    cfg = EvalConfig(max_new_tokens=12, temperature=0.8)
    drafter, _ = untrained(model, tokenizer)
    proposers = {"ngram": NgramProposer(B - 1), "dflash_untrained": DFlashProposer(drafter, *head(model))}
    rows = evaluate(model, tokenizer, proposers, prompts[:1], layer_ids, B, cfg)
    assert [r["lossless"] for r in rows] == [None, None, None]
    assert all(0 < r["new_tokens"] <= 12 and 1 <= r["tau"] <= B for r in rows)
    assert summarize(rows, B)["ngram"]["lossless_all"] is None


def test_each_temperature_is_evaluated_and_the_greedy_numbers_stay_as_they_were(toy):
    """eval.temperatures [0, 1]: every prompt decoded at both; the T=0 rows and summary numbers are those of
    a greedy-only evaluation (the headline of summary.json), T=1's are under by_temperature, sampled and
    seeded by eval.seed (a different seed, other samples)."""
    _, model, tokenizer, prompts, layer_ids = toy
    drafter, _ = untrained(model, tokenizer)

    def run(**kw):
        proposers = {"ngram": NgramProposer(B - 1), "dflash_untrained": DFlashProposer(drafter, *head(model))}
        cfg = EvalConfig(max_new_tokens=16, **kw)
        return evaluate(model, tokenizer, proposers, prompts[:2], layer_ids, B, cfg)

    both, greedy = run(temperatures=[0.0, 1.0]), run(temperatures=[0.0])
    assert EvalConfig().temperatures == [0.0, 1.0]  # the default
    names = ("target_only", "ngram", "dflash_untrained")
    assert [(r["id"], r["temperature"], r["drafter"]) for r in both] == [
        (p, t, d) for p in ("p0", "p1") for t in (0.0, 1.0) for d in names
    ]

    def same(rows):  # as JSON text: NaN (no logit gap) equals NaN
        return json.dumps([{k: v for k, v in r.items() if k not in TIMING} for r in rows])

    assert same([r for r in both if r["temperature"] == 0]) == same(greedy)
    sampled = [r for r in both if r["temperature"] == 1]
    assert all(r["lossless"] is None for r in sampled) and all(r["lossless"] for r in greedy)
    s, g = summarize(both, B), summarize(greedy, B)
    assert s.keys() == g.keys() and all(s[k]["temperature"] == 0.0 for k in s)
    for name in ("ngram", "dflash_untrained"):
        assert without_timing({name: s[name]})[name] | {"by_temperature": None} == without_timing(
            {name: g[name]}
        )[name] | {"by_temperature": None}
        assert list(s[name]["by_temperature"]) == ["0", "1"]
        at1 = s[name]["by_temperature"]["1"]
        assert at1["lossless_all"] is None and at1["prompts"] == 2
        assert at1["tau_pooled"] == summarize(sampled, B)[name]["tau_pooled"]
        skip = TIMING | {"speedup", "temperature", "by_temperature"}
        assert {k: v for k, v in s[name]["by_temperature"]["0"].items() if k not in skip} == {
            k: v for k, v in s[name].items() if k not in skip
        }
    json.dumps(s, allow_nan=False)
    assert [r["output"] for r in run(temperatures=[1.0])] == [r["output"] for r in sampled]  # seeded
    assert [r["output"] for r in run(temperatures=[1.0], seed=5)] != [r["output"] for r in sampled]
    # the former single-temperature key: that temperature alone
    assert EvalConfig(temperature=0.7).temperatures == [0.7]


def test_mismatched_drafter_is_refused_by_name(toy):
    _, model, tokenizer, _, _ = toy
    _, spec = untrained(model, tokenizer)
    check_drafter(spec, model.config)
    n = model.config.num_hidden_layers
    with pytest.raises(ValueError, match=r"hidden_size 96 != target hidden_size"):
        check_drafter(dataclasses.replace(spec, hidden_size=96), model.config)
    with pytest.raises(ValueError, match=r"vocab_size .* != target vocab_size"):
        check_drafter(dataclasses.replace(spec, vocab_size=spec.vocab_size + 64), model.config)
    with pytest.raises(
        ValueError,
        match=rf"num_target_layers {n + 30} != target num_hidden_layers {n}.*"
        rf"target_layer_ids \[{n + 1}\] out of range",
    ):
        check_drafter(
            dataclasses.replace(spec, num_target_layers=n + 30, target_layer_ids=[0, n + 1]), model.config
        )


def test_evaluate_cli_writes_outputs(toy, tmp_path):
    from flashdraft.drafter_io import export_drafter

    path, model, tokenizer, prompts, _ = toy
    drafter, spec = untrained(model, tokenizer, seed=1)
    export_drafter(drafter, spec, tmp_path / "drafter")
    rows = [{"id": p["id"], "source": "toy", "messages": p["messages"]} for p in prompts]
    pd.DataFrame(rows).to_parquet(tmp_path / "eval.parquet")
    cfg = json.dumps({"num_prompts": 2, "max_new_tokens": 10, "temperature": 0.0})
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "evaluate.py"),
            "--cfg",
            cfg,
            "--target-cfg",
            to_json(TargetConfig(path=str(path), dtype="float32")),
            "--drafter",
            str(tmp_path / "drafter"),
            "--prompts",
            str(tmp_path / "eval.parquet"),
            "--out-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert set(summary) == {"target_only", "dflash", "dflash_untrained", "ngram"}
    assert all(
        summary[k]["lossless_all"] is True and summary[k]["prompts"] == 2
        for k in summary
        if k != "target_only"
    )
    df = pd.read_parquet(tmp_path / "out" / "per_prompt.parquet")
    assert sorted(df["id"].unique()) == ["p0", "p1"] and len(df) == 8
    assert (df["new_tokens"] <= 10).all() and df["lossless"].dropna().all()


TIMING = {"decode_s", "tokens_per_s"}  # wall-clock columns: differ from run to run


def without_timing(summary):
    """A summary without its wall-clock numbers, at every temperature too."""

    def strip(v):
        out = {m: x for m, x in v.items() if m not in {"tokens_per_s", "speedup"}}
        if "by_temperature" in out:
            out["by_temperature"] = {t: strip(x) for t, x in out["by_temperature"].items()}
        return out

    return {k: strip(v) for k, v in summary.items()}


def script(name):
    """A script of scripts/ as a module: its `main(argv)`, run in this process (the model loads fast)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"script_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize(
    "temperatures", [{"temperature": 0.0}, {"temperatures": [0.0, 0.8]}], ids=["greedy", "greedy-and-sampled"]
)
def test_merged_shards_equal_one_job(toy, tmp_path, temperatures):
    """scripts/evaluate.py over the whole set against 3 shard jobs of it joined by scripts/evaluate_merge.py,
    as the evaluate and evaluate_merge rules run them."""
    from flashdraft.drafter_io import export_drafter

    path, model, tokenizer, _, _ = toy
    drafter, spec = untrained(model, tokenizer, seed=1)
    export_drafter(drafter, spec, tmp_path / "drafter")
    conversations = task_conversations(7, seed=3)
    prompts = [{"id": f"q{i}", "source": "toy", "messages": c} for i, c in enumerate(conversations)]
    pd.DataFrame(prompts).to_parquet(tmp_path / "eval.parquet")
    cfg = json.dumps({"num_prompts": 6, "max_new_tokens": 10, **temperatures})  # not the 7th
    target = to_json(TargetConfig(path=str(path), dtype="float32"))
    common = [
        "--cfg",
        cfg,
        "--target-cfg",
        target,
        "--drafter",
        str(tmp_path / "drafter"),
        "--prompts",
        str(tmp_path / "eval.parquet"),
    ]
    evaluate_main, merge_main = script("evaluate"), script("evaluate_merge")

    evaluate_main([*common, "--out-dir", str(tmp_path / "one")])
    files = [str(tmp_path / "shards" / f"shard-{i:05d}.parquet") for i in range(3)]
    for i, f in enumerate(files):
        evaluate_main([*common, "--shard", str(i), "--num-shards", "3", "--out-rows", f])
    shards = [pd.read_parquet(f) for f in files]
    assert sum(len(d) > 0 for d in shards) >= 2  # the split really splits
    assert sorted(i for d in shards for i in d["id"].unique()) == [f"q{i}" for i in range(6)]
    merge_main(["--drafter", str(tmp_path / "drafter"), "--out-dir", str(tmp_path / "merged"), *files])

    a, b = (
        pd.read_parquet(tmp_path / d / "per_prompt.parquet").drop(columns=list(TIMING))
        for d in ("one", "merged")
    )
    count = len(temperatures.get("temperatures", [0]))
    assert len(a) == 6 * 4 * count and list(a.columns) == list(b.columns)
    pd.testing.assert_frame_equal(a, b)
    one, merged = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "merged"))
    assert one.keys() == merged.keys() and without_timing(merged) == without_timing(one)
