"""Write stream mode's data plan: every epoch's micro-batches, cut into chunks of whole optimizer steps
whose hidden states fit the disk budget (see src/flashdraft/stream.py).

python scripts/data_plan.py --hidden-cfg '{"mode": "stream", "disk_budget": "2TB"}' --drafter-cfg '{}' \
    --train-cfg '{}' --world 1 --target results/toy/target --out-dir results/plan \
    results/tokens/shard-*.parquet
"""

import argparse
import json

from flashdraft.config import DrafterConfig, HiddenConfig, TrainConfig, load_section
from flashdraft.errors import cli
from flashdraft.stream import data_plan


@cli
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden-cfg", default="{}", help="the `hidden` config section as JSON")
    p.add_argument("--drafter-cfg", default="{}", help="the `drafter` config section as JSON")
    p.add_argument("--train-cfg", default="{}", help="the `train` config section as JSON")
    p.add_argument("--world", type=int, default=1, help="training processes (all nodes)")
    p.add_argument("--target", required=True, help="HF model directory of the target (its config.json)")
    p.add_argument("--out-dir", required=True, help="where plan.json, samples.parquet and the chunks go")
    p.add_argument(
        "--last-hidden",
        action="store_true",
        help="the shards hold the target's last hidden state too (config.needs_last_hidden): more "
        "bytes per token",
    )
    p.add_argument("tokens", nargs="+", help="the tokenized hidden shards, in shard order")
    args = p.parse_args(argv)
    plan = data_plan(
        args.target,
        args.tokens,
        load_section(HiddenConfig, args.hidden_cfg, "hidden"),
        load_section(DrafterConfig, args.drafter_cfg, "drafter"),
        load_section(TrainConfig, args.train_cfg, "train"),
        args.world,
        args.out_dir,
        last_hidden=args.last_hidden,
    )
    keys = ("samples", "tokens", "total_steps", "chunk_tokens", "chunk_tokens_from", "peak_bytes")
    print(json.dumps({**{k: plan[k] for k in keys}, "chunks": len(plan["chunks"])}))


if __name__ == "__main__":
    main()
