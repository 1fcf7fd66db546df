"""The evaluate stage: every drafter against target-only decoding on the held-out prompts.

Each prompt is decoded by target-only and by each drafter (`flashdraft.speculative`) at each of
`eval.temperatures`; a row per prompt, temperature and drafter records the tokens emitted per verify step
(tau, counted as the reference counts it), the drafts accepted, tokens/s and, greedy, losslessness: where
an output first leaves target-only's, and whether the target's two choices there are a numerical tie.
`summarize` pools the rows per drafter and temperature. The stage runs in shards (`run_rows`, a split of
the prompts per job) that `merge` joins.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import torch

from .chat import prompt_ids
from .config import EvalConfig, TargetConfig, layers_out_of_range
from .io import progress, write_json, write_parquet
from .shards import shard_of
from .speculative import (
    Decoded,
    NgramProposer,
    make_session,
    speculative_decode,
    target_decode,
)
from .target import eos_ids


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


NO_MISMATCH = (-1, float("nan"), False)


def decoded_row(
    pid, name, d: Decoded, num_prompt_tokens, lossless, mismatch=NO_MISMATCH, index=0, temperature=0.0
) -> dict:
    steps = len(d.emitted)
    return {
        "prompt_index": index,  # position in the evaluated prompt set: the merged shards' order
        "id": pid,
        "drafter": name,
        "temperature": float(temperature),
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


def evaluate(
    model, tokenizer, proposers: dict, prompts, layer_ids, block_size, cfg: EvalConfig, indices=None
):
    """Run target-only and every drafter on each prompt at each of cfg.temperatures; return per-prompt rows
    (dicts). `indices`: the prompts' positions in the whole evaluated set (default 0, 1, ...), which seed
    their sampling (cfg.seed + index), so a shard of the set decodes each prompt exactly as one job over
    the whole set does."""
    eos, dev = eos_ids(model, tokenizer), model.device
    gen = torch.Generator(device=dev)
    indices = range(len(prompts)) if indices is None else indices
    encoded = [
        (i, p["id"], prompt_ids(tokenizer, list(p["messages"])))
        for i, p in zip(indices, prompts, strict=True)
    ]
    # target-only and the n-gram lookup need no features; a DFlash drafter reads them at its layer ids
    max_len = max((len(ids) for _, _, ids in encoded), default=1) + cfg.max_new_tokens
    plain = make_session(model, cfg.engine, max_len, (), block_size)
    featured = make_session(model, cfg.engine, max_len, layer_ids, block_size)
    if featured.static:  # the drafters' caches static too
        proposers = {name: p.static(max_len) for name, p in proposers.items()}
    session = {name: featured if prop.uses_features else plain for name, prop in proposers.items()}
    if encoded:  # warm up every path on the first prompt so the first timed prompt is not a cold start
        warm = min(cfg.max_new_tokens, 2 * block_size)
        for temp in cfg.temperatures:
            target_decode(plain, encoded[0][2], warm, eos, temp, gen)
            for name, prop in proposers.items():
                speculative_decode(session[name], prop, encoded[0][2], warm, eos, temp, gen)
    rows = []
    for i, pid, ids in progress(encoded, desc="evaluate", unit="prompt"):
        for temp in cfg.temperatures:
            row = partial(decoded_row, pid, num_prompt_tokens=len(ids), index=i, temperature=temp)
            gen.manual_seed(cfg.seed + i)
            ref = target_decode(plain, ids, cfg.max_new_tokens, eos, temp, gen)
            rows.append(row("target_only", ref, lossless=None if temp else True))
            for name, prop in proposers.items():
                gen.manual_seed(cfg.seed + i)
                d = speculative_decode(session[name], prop, ids, cfg.max_new_tokens, eos, temp, gen)
                if temp:  # sampled outputs differ by design; losslessness is checked greedily
                    rows.append(row(name, d, lossless=None))
                else:
                    mismatch = first_mismatch(model, ids, ref.tokens, d.tokens)
                    rows.append(row(name, d, lossless=mismatch[0] < 0, mismatch=mismatch))
    return rows


def _ratio(a, b):
    return a / b if b > 0 else None  # None, not NaN: summary.json stays strict JSON


def temperature_key(t: float) -> str:
    """A temperature as summary.json's by_temperature names it: "0", "1", "0.7"."""
    return f"{t:g}"


def summarize(rows, block_size) -> dict:
    """Per drafter, at each temperature of the rows (`summarize_at`): summary.json. A drafter's entry holds
    its numbers at the first temperature (the headline: the greedy ones under the default [0, 1]), which
    one that is (`temperature`), and its numbers at every temperature under `by_temperature`."""
    temps = list(dict.fromkeys(r.get("temperature", 0.0) for r in rows)) or [0.0]
    at = {t: summarize_at([r for r in rows if r.get("temperature", 0.0) == t], block_size) for t in temps}
    return {
        name: {
            **s,
            "temperature": temps[0],
            "by_temperature": {temperature_key(t): at[t][name] for t in temps if name in at[t]},
        }
        for name, s in at[temps[0]].items()
    }


def summarize_at(rows, block_size) -> dict:
    """Per drafter, over rows of one temperature: tau pooled over all verify steps (emitted tokens / steps)
    and the mean of the prompts' own tau (what the reference's benchmark prints), the histogram of tokens
    emitted per step (1..B), per draft position k the fraction of steps that verified a draft at k it could
    emit and accepted it, and (greedy) losslessness against target-only."""

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
                {
                    "id": r["id"],
                    "position": r["first_mismatch"],
                    "numerical_tie": bool(r["numerical_tie"]),
                    "logit_gap": None if math.isnan(r["mismatch_logit_gap"]) else r["mismatch_logit_gap"],
                }
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


def run_rows(
    cfg: EvalConfig, target: TargetConfig, drafter_dir, prompts_path, shard=0, num_shards=1
) -> tuple[list[dict], int]:
    """Trained drafter, untrained drafter and n-gram lookup against target-only on one shard of the
    prompts: its rows and the block size."""
    from .drafter_io import load_drafter
    from .families import family
    from .target import load_target

    indices, prompts = shard_prompts(prompts_path, cfg.num_prompts, shard, num_shards)
    model, tokenizer = load_target(target.path, target.dtype)
    drafter, spec = load_drafter(drafter_dir)
    check_drafter(spec, model.config)
    dev, dt = model.device, model.get_input_embeddings().weight.dtype
    torch.manual_seed(cfg.seed)
    kind = family(spec.family)
    untrained = kind.drafter(spec)  # same shape, random init: what training adds over nothing
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    width = spec.verify_width
    proposers = {
        kind.name: kind.proposer(drafter.to(dev, dt).eval(), embed, head),
        f"{kind.name}_untrained": kind.proposer(untrained.to(dev, dt).eval(), embed, head),
        "ngram": NgramProposer(width - 1),
    }
    layer_ids = list(spec.target_layer_ids)
    rows = evaluate(model, tokenizer, proposers, prompts, layer_ids, width, cfg, indices)
    return rows, width


def write_rows(rows: list[dict], path) -> None:
    import pandas as pd

    # a shard without prompts: no rows, the columns all the same
    columns = list(decoded_row("", "", Decoded([], [], [], [], 0.0), 0, True))
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
    from .families import family_of_export

    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    spec = family_of_export(config).spec.from_config_dict(config)
    return write_outputs(read_rows(shard_paths), spec.verify_width, out_dir)


def summary_text(summary: dict) -> str:
    """A few lines for a stage's log: tokens/s, tau, speedup and losslessness per drafter (the first
    temperature's), then tau and speedup at each other temperature."""
    base = summary["target_only"]
    drafters = {k: v for k, v in summary.items() if k != "target_only"}
    lines = [f"target_only: {base['tokens_per_s'] or 0:.1f} tok/s"]

    def tau(s):
        return (
            f"tau {s['tau_pooled'] or 0:.2f} pooled, {s['tau_prompt_mean'] or 0:.2f} mean of prompts  "
            f"speedup {s['speedup'] or 0:.2f}x"
        )

    lines += [f"{name}: {tau(s)}  lossless {s['lossless_all']}" for name, s in drafters.items()]
    others = [k for k in base.get("by_temperature", {}) if k != temperature_key(base["temperature"])]
    lines += [
        f"{name} at T={k}: {tau(s['by_temperature'][k])}" for k in others for name, s in drafters.items()
    ]
    return "\n".join(lines)


def run_end(results, target) -> list[str]:
    """What a finished run prints last: each drafter's tau, speedup and losslessness, the report's path and
    the commands that serve the drafter; [] before the run has a report."""
    from .report import serve_commands

    r = Path(results)
    summary, report, config = r / "eval" / "summary.json", r / "report.html", r / "drafter" / "config.json"
    if not (summary.exists() and report.exists()):
        return []
    lines = [
        "flashdraft: the drafter is trained and evaluated",
        *[f"  {x}" for x in summary_text(json.loads(summary.read_text())).splitlines()],
        f"  report: {report.resolve()}",
    ]
    if config.exists():
        cmds = serve_commands(
            str(Path(target).resolve()), str(config.parent.resolve()), json.loads(config.read_text())
        )
        lines += [f"  serve it with {engine}: {cmd}" for engine, cmd in cmds.items()]
    return lines


def run(cfg: EvalConfig, target: TargetConfig, drafter_dir, prompts_path, out_dir) -> dict:
    """The whole evaluation in one job: every prompt, then per_prompt.parquet and summary.json."""
    rows, block_size = run_rows(cfg, target, drafter_dir, prompts_path)
    return write_outputs(rows, block_size, out_dir)
