"""Precompute the target's hidden states of stream mode's validation samples (train.val_samples) into one
shard, which lives through every chunk's training.

python scripts/hidden_val.py --cfg '{"dtype": "bfloat16"}' --drafter-cfg '{}' \
    --target-cfg '{"path": "results/toy/target", "dtype": "float32"}' --plan results/plan \
    --out results/hidden/val.arrow
"""

import argparse
import json

from flashdraft.config import DrafterConfig, HiddenConfig, TargetConfig, load_section
from flashdraft.errors import cli
from flashdraft.stream import hidden_val


@cli
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", default="{}", help="the `hidden` config section as JSON")
    p.add_argument("--drafter-cfg", default="{}", help="the `drafter` config section as JSON (layer ids)")
    p.add_argument("--target-cfg", required=True, help="JSON of the `target` config section")
    p.add_argument("--plan", required=True, help="the data plan's directory (its val.parquet)")
    p.add_argument("--out", required=True, help="the validation shard (.arrow); its manifest goes next to it")
    p.add_argument(
        "--last-hidden",
        action="store_true",
        help="store the target's last hidden state per token too (for a drafter family that "
        "trains on it: config.needs_last_hidden)",
    )
    args = p.parse_args(argv)
    manifest = hidden_val(
        load_section(TargetConfig, args.target_cfg, "target"),
        args.plan,
        load_section(HiddenConfig, args.cfg, "hidden"),
        load_section(DrafterConfig, args.drafter_cfg, "drafter"),
        args.out,
        last_hidden=args.last_hidden,
    )
    print(json.dumps({k: manifest[k] for k in ("rows", "tokens", "bytes")}))


if __name__ == "__main__":
    main()
