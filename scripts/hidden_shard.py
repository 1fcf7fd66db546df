"""Precompute the target's hidden states for one shard of the training set (one job per target GPU).

python scripts/hidden_shard.py --cfg '{"dtype": "bfloat16"}' --drafter-cfg '{}' \
    --target-cfg '{"path": "results/toy/target", "dtype": "float32"}' \
    --data results/regenerated/train/shard-00000.parquet --shard 0 --num-shards 2 \
    --out results/hidden/shard-00000.arrow
"""

import argparse
import json

from flashdraft import memory
from flashdraft.config import Config, DrafterConfig, HiddenConfig, TargetConfig, load_section
from flashdraft.errors import cli
from flashdraft.precompute import hidden_shard


@cli
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", default="{}", help="the `hidden` config section as JSON")
    p.add_argument("--drafter-cfg", default="{}", help="the `drafter` config section as JSON (layer ids)")
    p.add_argument("--target-cfg", required=True, help="JSON of the `target` config section")
    p.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="parquet files with columns id and messages (the shard's rows are taken from them)",
    )
    p.add_argument("--shard", type=int, required=True)
    p.add_argument("--num-shards", type=int, default=None, help="default: hidden.shards")
    p.add_argument("--out", required=True, help="the shard's .arrow file; its manifest goes next to it")
    p.add_argument(
        "--last-hidden",
        action="store_true",
        help="store the target's last hidden state per token too (for a drafter family that "
        "trains on it: config.needs_last_hidden)",
    )
    args = p.parse_args(argv)
    hidden_cfg = load_section(HiddenConfig, args.cfg, "hidden")
    drafter_cfg = load_section(DrafterConfig, args.drafter_cfg, "drafter")
    target = load_section(TargetConfig, args.target_cfg, "target")
    memory.on_oom("precompute", Config(hidden=hidden_cfg, drafter=drafter_cfg, target=target))
    num_shards = args.num_shards or hidden_cfg.shards
    manifest = hidden_shard(
        target,
        args.data,
        args.shard,
        num_shards,
        args.out,
        hidden_cfg,
        drafter_cfg,
        last_hidden=args.last_hidden,
    )
    keys = ("shard", "num_shards", "rows", "tokens", "truncated", "skipped", "bytes")
    print(json.dumps({k: manifest[k] for k in keys}))


if __name__ == "__main__":
    main()
