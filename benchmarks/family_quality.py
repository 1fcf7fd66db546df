"""DSpark against DFlash on the embedded default: the evaluation's tau, 3 seeds per variant.

Usage: nice -n 10 .venv/bin/python benchmarks/family_quality.py [--work DIR] [--seeds 0 1 2]
Writes benchmarks/results/dspark_vs_dflash_toy.json and prints a table.

The real workflow runs on config/config.yaml, as benchmarks/recipe_ablation.py runs its variants
(toy_bench.run_one): the same samples, steps and drafter size (2 layers) for every variant, only the family
and the block differ:
- dflash_b7:  drafter.family dflash, block 7 (6 drafts per verify step), the paper's decay loss (gamma 4)
- dflash_b8:  DFlash at the embedded default's block 8 (7 drafts), decay loss, gamma 4
- dspark_b7:  config/dspark.yaml: block 7 (7 drafts: the anchor is the first prediction slot), Markov rank
              256, confidence head, 0.1 CE + 0.9 L1 + 1.0 BCE, gamma 4
- dflash_paper_b7: config/dflash_paper.yaml, the DSpark paper's DFlash baseline: dspark_b7's network
              without either head, CE alone, gamma 4
Runs whose shards hold no last hidden state (the DFlash ones and the paper's baseline) share one work dir
(its hidden states), DSpark its own (its shards hold the last hidden state too). tau is the evaluation's
`tau_pooled` (emitted tokens per verify step, accepted drafts + the bonus token, as the reference
`dflash_generate` counts it), pooled over the held-out prompts; lossless: every
greedy output equals target-only decoding's. The goal the JSON reports: DSpark's mean tau at block 7 at
least 1.1x DFlash's at block 7 (the paper's gap on Qwen3-8B is 1.16-1.20x).
"""

import argparse
import time
from pathlib import Path

import yaml
from harness import write_result
from toy_bench import REPO, run_one, stats

DSPARK = yaml.safe_load((REPO / "config" / "dspark.yaml").read_text())
PAPER = yaml.safe_load((REPO / "config" / "dflash_paper.yaml").read_text())
VARIANTS = {  # name: (family, overrides)
    "dflash_b7": ("dflash", {"train.loss": "decay", "drafter.block_size": 7, "train.gamma": 4.0}),
    "dflash_b8": ("dflash", {"train.loss": "decay", "drafter.block_size": 8, "train.gamma": 4.0}),
    "dspark_b7": ("dspark", {"drafter.family": "dspark", "drafter.block_size": 7, "train.gamma": 4.0,
                             **{f"drafter.dspark.{k}": v for k, v in DSPARK["drafter"]["dspark"].items()}}),
    "dflash_paper_b7": ("dspark", {"drafter.family": "dspark", "drafter.block_size": 7, "train.gamma": 4.0,
                                   **{f"drafter.dspark.{k}": v
                                      for k, v in PAPER["drafter"]["dspark"].items()}}),
}
STORE = {"dspark_b7": "dspark"}  # the work dir of a variant whose shards hold the last hidden state
GOAL = 1.1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, default=Path("/tmp/flashdraft-family-quality"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "dspark_vs_dflash_toy.json")
    args = p.parse_args()
    t0 = time.perf_counter()
    runs = {}
    for seed in args.seeds:
        for v in args.variants:
            family, overrides = VARIANTS[v]
            work = args.work / STORE.get(v, "dflash")  # runs of the same shards share their hidden states
            work.mkdir(parents=True, exist_ok=True)
            name = f"{v}-seed{seed}"
            runs[name] = r = run_one(work, name, {"train.seed": seed, **overrides}, drafter=family)
            print(f"{name:18s} tau_pooled {r['tau_pooled']:.3f}  lossless {r['lossless_all']}  "
                  f"steps {r['train_steps']}  {r['wall_s']:.0f} s", flush=True)
    variants = {}
    for v in args.variants:
        rs = [runs[f"{v}-seed{s}"] for s in args.seeds]
        variants[v] = {"family": VARIANTS[v][0], "overrides": VARIANTS[v][1],
                       "tau_pooled": stats([r["tau_pooled"] for r in rs]),
                       "tau_prompt_mean": stats([r["tau_prompt_mean"] for r in rs]),
                       "train_steps": sorted({r["train_steps"] for r in rs}),
                       "lossless_all": all(r["lossless_all"] for r in rs)}
    goal = None
    if {"dspark_b7", "dflash_b7"} <= variants.keys():
        ratio = variants["dspark_b7"]["tau_pooled"]["mean"] / variants["dflash_b7"]["tau_pooled"]["mean"]
        goal = {"dspark_over_dflash_b7": round(ratio, 4), "goal": GOAL, "met": ratio >= GOAL}
    result = {
        "what": "tau_pooled of the trained drafter on the embedded default (config/config.yaml), DSpark "
                "against DFlash, the same samples, steps and drafter layers; 3 seeds per variant",
        "tau": "emitted tokens per verify step (accepted drafts + bonus, cut at stop and max_new_tokens), "
               "pooled over all verify steps of the held-out prompts (eval summary tau_pooled)",
        "seeds": args.seeds, "variants": variants, "goal": goal, "runs": runs,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_result(args.out, result, params=vars(args), device="cpu")
    print(f"\n{'variant':10s} {'tau_pooled mean':>15s} {'sd':>6s} {'min':>6s} {'max':>6s}  lossless")
    for v, s in variants.items():
        t = s["tau_pooled"]
        print(f"{v:10s} {t['mean']:15.3f} {t['sd']:6.3f} {t['min']:6.3f} {t['max']:6.3f}  "
              f"{s['lossless_all']}")
    if goal:
        print(f"dspark_b7 / dflash_b7: {goal['dspark_over_dflash_b7']:.3f} (goal {GOAL}: "
              f"{'met' if goal['met'] else 'not met'})")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
