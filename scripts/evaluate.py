"""Evaluate the trained drafter (plus untrained and n-gram baselines) against target-only decoding.

One job over the whole prompt set (--out-dir: per_prompt.parquet and summary.json), or one shard of it
(--shard, --num-shards, --out-rows: that shard's per-prompt rows; scripts/evaluate_merge.py joins them).
"""

import argparse

from flashdraft import memory
from flashdraft.config import Config, EvalConfig, TargetConfig, load_section
from flashdraft.errors import cli
from flashdraft.evaluate import run, run_rows, summary_text, write_rows


@cli
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", default=None, help="the `eval` config section as JSON")
    p.add_argument("--target-cfg", required=True, help="JSON of the `target` config section")
    p.add_argument("--drafter", required=True, help="DFlash drafter export directory")
    p.add_argument("--prompts", required=True, help="eval prompts parquet (messages column)")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--out-dir", help="writes per_prompt.parquet and summary.json here")
    out.add_argument("--out-rows", help="writes this shard's per-prompt rows (parquet) here")
    p.add_argument("--shard", type=int, default=0, help="evaluate only this shard's prompts (--out-rows)")
    p.add_argument("--num-shards", type=int, default=1)
    a = p.parse_args(argv)
    if not 0 <= a.shard < a.num_shards:
        p.error(f"--shard {a.shard} is not in 0..{a.num_shards - 1}")
    if a.out_dir and a.num_shards > 1:
        p.error("--out-dir evaluates the whole set; write a shard with --out-rows")
    cfg = load_section(EvalConfig, a.cfg, "eval")
    target = load_section(TargetConfig, a.target_cfg, "target")
    memory.on_oom("evaluate", Config(eval=cfg, target=target))
    if a.out_rows:
        rows, _ = run_rows(cfg, target, a.drafter, a.prompts, a.shard, a.num_shards)
        write_rows(rows, a.out_rows)
        prompts = len({r["id"] for r in rows})
        print(f"evaluate shard {a.shard}/{a.num_shards}: {prompts} prompts -> {a.out_rows}")
        return
    print(summary_text(run(cfg, target, a.drafter, a.prompts, a.out_dir)))
    print(f"-> {a.out_dir}/summary.json, {a.out_dir}/per_prompt.parquet")


if __name__ == "__main__":
    main()
