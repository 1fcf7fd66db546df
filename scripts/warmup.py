"""Compile the drafter's training step once per length bucket and save the compile caches.

python scripts/warmup.py --cfg '{"buckets": [128, 256]}' --drafter-cfg '{}' --target results/toy/target \
    --out-dir results/compile_cache results/hidden/shard-*.arrow

One process, main thread (torch.compile is not thread-safe). Writes <out-dir>/artifacts.bin (the
Mega-Cache blob; empty with compile: false), <out-dir>/inductor.tar (the files of the fresh Inductor
cache dir it compiled into) and <out-dir>/meta.json (the cache key and counters). SIGTERM or Ctrl-C
stops it with exit status 128 + the signal's number (143, 130), as training, keeping none of the three.
"""

import argparse
import json

from flashdraft import memory
from flashdraft.compile_cache import warmup
from flashdraft.config import Config, DrafterConfig, TargetConfig, TrainConfig, load_section
from flashdraft.errors import cli
from flashdraft.io import exit_on_stop_signals


@cli
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", default="{}", help="the `train` config section as JSON")
    p.add_argument("--drafter-cfg", default="{}", help="the `drafter` config section as JSON")
    p.add_argument("--target", required=True, help="HF model directory of the target")
    p.add_argument("--out-dir", required=True, help="where artifacts.bin, inductor.tar and meta.json go")
    p.add_argument(
        "--world",
        type=int,
        default=1,
        help="processes the training will run (train.parallel may shard the drafter over them)",
    )
    p.add_argument("shards", nargs="*", help="hidden-state shards (.arrow); their manifests give K*H")
    args = p.parse_args(argv)
    exit_on_stop_signals()
    cfg = load_section(TrainConfig, args.cfg, "train")
    drafter_cfg = load_section(DrafterConfig, args.drafter_cfg, "drafter")
    memory.on_oom(
        "warmup",
        Config(train=cfg, drafter=drafter_cfg, target=TargetConfig(path=args.target)),
        args.world,
        peak_of="train",
    )
    meta = warmup(cfg, drafter_cfg, args.target, args.shards, args.out_dir, world=args.world)
    keys = ("compile", "fsdp", "seconds", "counters", "artifact_bytes", "inductor_files")
    print(json.dumps({k: meta[k] for k in keys}))


if __name__ == "__main__":
    main()
