"""Tokenize one hidden shard's samples for stream mode, in the order a store-mode shard holds them.

python scripts/hidden_tokens.py --cfg '{"max_length": 256}' --target results/toy/target \
    --data results/regenerated/train/shard-00000.parquet --shard 0 --num-shards 2 \
    --out results/tokens/shard-00000.parquet
"""

import argparse
import json

from flashdraft.config import HiddenConfig, load_section
from flashdraft.errors import cli
from flashdraft.stream import hidden_tokens


@cli
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", default="{}", help="the `hidden` config section as JSON")
    p.add_argument("--target", required=True, help="HF model directory of the target (its tokenizer)")
    p.add_argument("--data", required=True, nargs="+", help="parquet files with columns id and messages")
    p.add_argument("--shard", type=int, required=True)
    p.add_argument("--num-shards", type=int, default=None, help="default: hidden.shards")
    p.add_argument("--out", required=True, help="the shard's tokens (parquet)")
    args = p.parse_args(argv)
    cfg = load_section(HiddenConfig, args.cfg, "hidden")
    print(
        json.dumps(
            hidden_tokens(args.target, args.data, args.shard, args.num_shards or cfg.shards, cfg, args.out)
        )
    )


if __name__ == "__main__":
    main()
