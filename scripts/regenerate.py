"""Regenerate the assistant answers of a prompt set (or of one shard of it) with the target (resumable).

SIGTERM or Ctrl-C stops it through its cleanup (committed parts kept, a managed server stopped) with
exit status 128 + the signal's number; a second one stops it at once.
"""

import argparse
import time

from flashdraft import memory
from flashdraft.config import Config, RegenerateConfig, TargetConfig, load_section
from flashdraft.errors import cli
from flashdraft.io import exit_on_stop_signals
from flashdraft.regenerate import regenerate


@cli
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cfg", default="{}", help="JSON of the `regenerate` config section")
    ap.add_argument("--target-cfg", required=True, help="JSON of the `target` config section")
    ap.add_argument("--prompts", required=True, help="prompt set parquet (from the prompts rule)")
    ap.add_argument("--out", required=True, help="output parquet")
    ap.add_argument("--errors", default=None, help="failed rows (default: errors.parquet beside --out)")
    ap.add_argument("--work-dir", required=True, help="resumable parts; kept between runs")
    ap.add_argument("--shard", type=int, default=0, help="answer only the prompts of this shard")
    ap.add_argument("--num-shards", type=int, default=1)
    args = ap.parse_args(argv)
    if not 0 <= args.shard < args.num_shards:
        ap.error(f"--shard {args.shard} is not in 0..{args.num_shards - 1}")
    cfg = load_section(RegenerateConfig, args.cfg, "regenerate")
    target = load_section(TargetConfig, args.target_cfg, "target")
    memory.on_oom("regenerate", Config(regenerate=cfg, target=target))
    exit_on_stop_signals()  # unwinds through every finally: parts flushed, server stopped
    t0 = time.time()
    s = regenerate(
        cfg, target, args.prompts, args.out, args.work_dir, args.shard, args.num_shards, args.errors
    )
    rate = f", {s['new_tokens'] / s['generate_s']:.0f} new tokens/s" if s.get("generate_s") else ""
    print(
        f"regenerate: {s['rows']} rows ({s['stop']} stop, {s['length']} length), {s['errors']} errors "
        f"-> {args.out} ({time.time() - t0:.1f} s{rate})"
    )


if __name__ == "__main__":
    main()
