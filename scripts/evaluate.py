"""Evaluate the trained drafter (plus untrained and n-gram baselines) against target-only decoding."""

import argparse

from flashdraft.config import EvalConfig, load_section
from flashdraft.errors import cli
from flashdraft.evaluate import run


@cli
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cfg", default=None, help="the `eval` config section as JSON")
    p.add_argument("--target", required=True, help="HF target model directory")
    p.add_argument("--dtype", default="bfloat16", help="target dtype: float32 | bfloat16 | float16")
    p.add_argument("--drafter", required=True, help="DFlash drafter export directory")
    p.add_argument("--prompts", required=True, help="eval prompts parquet (messages column)")
    p.add_argument("--out-dir", required=True, help="writes per_prompt.parquet and summary.json here")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cfg = load_section(EvalConfig, a.cfg, "eval")
    summary = run(cfg, a.target, a.drafter, a.prompts, a.out_dir, dtype=a.dtype, seed=a.seed)
    print(f"target_only: {summary['target_only']['tokens_per_s'] or 0:.1f} tok/s")
    for name, s in summary.items():
        if name != "target_only":
            pooled, mean, speedup = s["tau_pooled"] or 0, s["tau_prompt_mean"] or 0, s["speedup"] or 0
            print(f"{name}: tau {pooled:.2f} pooled, {mean:.2f} mean of prompts  speedup {speedup:.2f}x  "
                  f"lossless {s['lossless_all']}")
    print(f"-> {a.out_dir}/summary.json, {a.out_dir}/per_prompt.parquet")


if __name__ == "__main__":
    main()
