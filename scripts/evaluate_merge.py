"""Join the evaluation shards' per-prompt rows into one per_prompt.parquet and summary.json.

The summary is computed from the merged rows, as one job over the whole prompt set computes it.
"""

import argparse

from flashdraft.errors import cli
from flashdraft.evaluate import merge, summary_text


@cli
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--drafter", required=True, help="DFlash drafter export directory (its block size)")
    p.add_argument("--out-dir", required=True, help="writes per_prompt.parquet and summary.json here")
    p.add_argument("shards", nargs="+", help="the shards' row files (scripts/evaluate.py --out-rows)")
    a = p.parse_args(argv)
    print(summary_text(merge(a.shards, a.drafter, a.out_dir)))
    print(f"{len(a.shards)} shard(s) -> {a.out_dir}/summary.json, {a.out_dir}/per_prompt.parquet")


if __name__ == "__main__":
    main()
