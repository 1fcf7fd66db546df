"""Precompute the target's hidden states of one part of one chunk of stream mode's data plan.

python scripts/hidden_chunk.py --cfg '{"dtype": "bfloat16"}' --drafter-cfg '{}' \
    --target-cfg '{"path": "results/toy/target", "dtype": "float32"}' --plan results/plan \
    --epoch 0 --chunk 0 --part 0 --parts 1 \
    --out results/hidden/stream/epoch-000/chunk-00000/part-00000.arrow
"""

import argparse
import json

from flashdraft.config import DrafterConfig, HiddenConfig, TargetConfig, load_section
from flashdraft.errors import cli
from flashdraft.stream import hidden_chunk


@cli
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", default="{}", help="the `hidden` config section as JSON")
    p.add_argument("--drafter-cfg", default="{}", help="the `drafter` config section as JSON (layer ids)")
    p.add_argument("--target-cfg", required=True, help="JSON of the `target` config section")
    p.add_argument("--plan", required=True, help="the data plan's directory")
    p.add_argument("--epoch", type=int, required=True)
    p.add_argument("--chunk", type=int, required=True, help="the chunk within its epoch")
    p.add_argument("--part", type=int, required=True)
    p.add_argument("--parts", type=int, required=True, help="jobs the chunk's samples are split into")
    p.add_argument("--out", required=True, help="the part's .arrow file; its manifest goes next to it")
    p.add_argument(
        "--last-hidden",
        action="store_true",
        help="store the target's last hidden state per token too (for a drafter family that "
        "trains on it: config.needs_last_hidden)",
    )
    args = p.parse_args(argv)
    manifest = hidden_chunk(
        load_section(TargetConfig, args.target_cfg, "target"),
        args.plan,
        args.epoch,
        args.chunk,
        args.part,
        args.parts,
        load_section(HiddenConfig, args.cfg, "hidden"),
        load_section(DrafterConfig, args.drafter_cfg, "drafter"),
        args.out,
        last_hidden=args.last_hidden,
    )
    print(json.dumps({k: manifest[k] for k in ("epoch", "chunk", "part", "rows", "tokens", "bytes")}))


if __name__ == "__main__":
    main()
