"""Build the toy target (synthetic corpus, BPE tokenizer, tiny Qwen3, CPU training) as an HF model dir."""

import argparse
import time

from flashdraft.config import ToyConfig, load_section
from flashdraft.errors import cli
from flashdraft.toy import build_toy_target


@cli
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cfg", default="{}", help="JSON of the `toy` config section")
    ap.add_argument("--out", required=True, help="output HF model directory")
    args = ap.parse_args(argv)
    cfg = load_section(ToyConfig, args.cfg, "toy")
    t0 = time.time()
    build_toy_target(cfg, args.out)
    print(f"toy target -> {args.out} ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
