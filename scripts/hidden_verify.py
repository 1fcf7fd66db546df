"""Verify hidden-state shards against their manifests; exit non-zero naming every bad shard and row.

A bad shard and its manifest are moved into `--bad-dir` (kept for inspection), so that a rerun of the
workflow rebuilds exactly those shards.

python scripts/hidden_verify.py --out results/hidden/verify.json results/hidden/shard-*.arrow
"""

import argparse
import sys

from flashdraft.errors import RERUN_ENV, cli, rerun_command
from flashdraft.hidden import manifest_path
from flashdraft.hidden_verify import move_aside, verify_shard
from flashdraft.io import write_json


@cli
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON summary to write")
    p.add_argument(
        "--bad-dir", default=None, help="where bad shards are moved (default: bad/ next to each shard)"
    )
    p.add_argument("--keep-bad", action="store_true", help="leave bad shards where they are")
    p.add_argument(
        "--rerun",
        default=rerun_command(),
        help=f"the command the error message names to rebuild bad shards (default: ${RERUN_ENV})",
    )
    p.add_argument("shards", nargs="+", help="shard .arrow files (manifest: the same name with .json)")
    args = p.parse_args(argv)
    results = [verify_shard(s, manifest_path(s)) for s in args.shards]
    bad = [r for r in results if not r["ok"]]
    if not args.keep_bad:
        for r in bad:
            r["moved"] = move_aside(r["shard"], args.bad_dir)
    write_json(args.out, {"ok": not bad, "shards": results})
    for r in bad:
        for e in r["errors"]:
            print(e, file=sys.stderr)
    if bad:
        names = ", ".join(r["shard"] for r in bad)
        msg = f"{len(bad)} of {len(results)} hidden shard(s) failed verification: {names}"
        if not args.keep_bad:
            moves = "\n".join(f"  moved {src} -> {dst}" for r in bad for src, dst in r["moved"])
            msg += f"\n{moves}\nRerun to rebuild exactly these shards: {args.rerun}"
        sys.exit(msg)
    print(f"{len(results)} hidden shard(s) verified")


if __name__ == "__main__":
    main()
