"""Train the DFlash drafter on precomputed hidden states; one process per device.

torchrun --standalone --nproc_per_node 2 scripts/train.py --cfg '{"epochs": 1}' --drafter-cfg '{}' \
    --target results/toy/target --compile-cache results/compile_cache --checkpoints results/checkpoints \
    --metrics results/train/metrics.csv --out results/drafter results/hidden/shard-*.arrow

`python scripts/train.py ...` runs one process. A rerun with the same configs and shards resumes from the
latest checkpoint under --checkpoints/<run key>. On SIGTERM or Ctrl-C (SIGINT) it saves a checkpoint at
the next log step (train.log_every) and exits with 128 + the signal's number (143, 130); Ctrl-C twice
stops at once.
"""

import argparse
import json
import os
import sys
from pathlib import Path

from flashdraft import memory
from flashdraft.config import Config, DrafterConfig, TargetConfig, TrainConfig, load_section
from flashdraft.errors import cli
from flashdraft.io import log, write_json
from flashdraft.train import train
from flashdraft.train_data import train_data
from flashdraft.train_setup import TrainJob


@cli
def main(argv=None):
    if int(os.environ.get("RANK", 0)) == 0:
        log("imports done")  # by the process's age: what the imports cost before any work starts
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", default="{}", help="the `train` config section as JSON")
    p.add_argument("--drafter-cfg", default="{}", help="the `drafter` config section as JSON")
    p.add_argument("--target", required=True, help="HF model directory of the target")
    p.add_argument("--compile-cache", default=None, help="the warmup's directory (artifacts.bin, meta.json)")
    p.add_argument("--checkpoints", required=True, help="resumable state goes to <this>/<run key>/")
    p.add_argument("--metrics", default=None, help="final metrics CSV (not with --chunk)")
    p.add_argument("--out", default=None, help="export directory of the trained drafter (not with --chunk)")
    p.add_argument(
        "--stop-at",
        type=int,
        default=None,
        help="save a checkpoint after this step and exit without exporting (simulated preemption)",
    )
    p.add_argument(
        "--plan",
        default=None,
        help="stream mode: the data plan's directory; the shards then hold --chunk's samples",
    )
    p.add_argument(
        "--chunk",
        default=None,
        help="stream mode: train this chunk of the plan (epoch-EEE/chunk-CCCCC); without: export",
    )
    p.add_argument("--done", default=None, help="stream mode: the chunk's summary (JSON) once it has trained")
    p.add_argument(
        "--val",
        action="append",
        default=None,
        help="stream mode: the validation shard (train.val_samples; store mode splits the shards)",
    )
    p.add_argument("shards", nargs="*", help="hidden-state shards (.arrow)")
    args = p.parse_args(argv)
    if not args.shards and (args.plan is None or args.chunk is not None):
        p.error("no hidden-state shards given")
    if args.chunk is None and not (args.metrics and args.out):
        p.error("--metrics and --out are needed to export the drafter")
    cfg = load_section(TrainConfig, args.cfg, "train")
    drafter_cfg = load_section(DrafterConfig, args.drafter_cfg, "drafter")
    memory.on_oom(
        "train",
        Config(train=cfg, drafter=drafter_cfg, target=TargetConfig(path=args.target)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )
    data = train_data(cfg, args.shards, args.plan, args.chunk, args.val)
    opt = lambda path: path and Path(path)  # noqa: E731
    job = TrainJob(
        cfg,
        drafter_cfg,
        Path(args.target),
        data,
        Path(args.checkpoints),
        opt(args.metrics),
        opt(args.out),
        opt(args.compile_cache),
        args.stop_at,
    )
    result = train(job)
    if result.stopped:
        sys.exit(128 + result.signal if result.signal else 0)  # stopped by a signal: not finished
    if int(os.environ.get("RANK", 0)) != 0:
        return
    if args.done:
        write_json(args.done, result.to_json())
    print(json.dumps(result.to_json()))


if __name__ == "__main__":
    main()
