"""Write the toy prompt sources (ShareGPT jsonl, messages parquet, Alpaca json) from the toy tasks."""

import argparse

from flashdraft.config import ToyConfig, load_section
from flashdraft.errors import cli
from flashdraft.toy import write_toy_sources


@cli
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cfg", default="{}", help="JSON of the `toy` config section")
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args(argv)
    paths = write_toy_sources(load_section(ToyConfig, args.cfg, "toy"), args.out_dir)
    print("toy sources: " + ", ".join(f"{k} -> {v}" for k, v in paths.items()))


if __name__ == "__main__":
    main()
