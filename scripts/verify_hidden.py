"""Verify hidden-state shards against their manifests; exit non-zero naming every bad shard and row.

python scripts/verify_hidden.py --out results/hidden/verify.json results/hidden/shard-*.arrow
"""

import argparse
import sys

from flashdraft.errors import cli
from flashdraft.hidden import manifest_path, verify_shard
from flashdraft.io import write_json


@cli
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON summary to write")
    p.add_argument("shards", nargs="+", help="shard .arrow files (manifest: the same name with .json)")
    args = p.parse_args(argv)
    results = [verify_shard(s, manifest_path(s)) for s in args.shards]
    bad = [r for r in results if not r["ok"]]
    write_json(args.out, {"ok": not bad, "shards": results})
    for r in bad:
        for e in r["errors"]:
            print(e, file=sys.stderr)
    if bad:
        names = ", ".join(r["shard"] for r in bad)
        sys.exit(f"{len(bad)} of {len(results)} hidden shard(s) failed verification: {names}")
    print(f"{len(results)} hidden shard(s) verified")


if __name__ == "__main__":
    main()
