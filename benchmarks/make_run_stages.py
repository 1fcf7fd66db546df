"""Per-stage wall time of a finished `make run`, from Snakemake's `benchmark:` files.

Usage: make run && .venv/bin/python benchmarks/make_run_stages.py [--results results] [--wall SECONDS]
Writes benchmarks/results/make_run_stages.json and prints a table.
"""

import argparse
import json
from pathlib import Path

import pandas as pd
from harness import write_result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--results", default="results")
    p.add_argument("--wall", type=float, default=None, help="measured wall time of the whole `make run`")
    p.add_argument("--out", default="benchmarks/results/make_run_stages.json")
    p.add_argument(
        "--what", default="wall time per stage of `make run` on the embedded default (config/config.yaml)"
    )
    p.add_argument(
        "--machine",
        default=None,
        help="where the run happened, if not on this machine (written as `device`; `machine` is "
        "this one: its CPU and the kernels torch picks, which the toy's floats depend on)",
    )
    args = p.parse_args()

    rows = []
    for tsv in sorted(Path(args.results, "benchmarks").rglob("*.tsv")):
        df = pd.read_csv(tsv, sep="\t")
        job = str(tsv.relative_to(Path(args.results, "benchmarks")).with_suffix(""))
        rows.append(
            {
                "job": job,
                "stage": job.split("/")[0],
                "s": float(df["s"].iloc[0]),
                "max_rss_mb": float(df["max_rss"].iloc[0]) if "max_rss" in df else None,
            }
        )
    if not rows:
        raise SystemExit(f"no benchmark files under {args.results}/benchmarks: run `make run` first")
    stages = (
        pd.DataFrame(rows)
        .groupby("stage", sort=False)
        .agg(jobs=("job", "count"), s=("s", "sum"), max_rss_mb=("max_rss_mb", "max"))
    )
    result = {
        "what": args.what,
        **({"device": args.machine} if args.machine else {}),
        "wall_s_make_run": args.wall,
        "sum_of_jobs_s": round(float(stages.s.sum()), 1),
        "stages": {
            k: {"jobs": int(v.jobs), "s": round(float(v.s), 1), "max_rss_mb": v.max_rss_mb}
            for k, v in stages.iterrows()
        },
    }
    summary = Path(args.results, "eval", "summary.json")
    if summary.exists():  # what the run bought, next to what it cost
        keys = ("tau_pooled", "tau_prompt_mean", "speedup", "lossless_all", "tokens_per_s")
        result["eval"] = {k: {m: v.get(m) for m in keys} for k, v in json.loads(summary.read_text()).items()}
    write_result(args.out, result, params=vars(args))
    print(stages.to_string())
    print(f"sum of jobs: {result['sum_of_jobs_s']} s; make run wall: {args.wall} s -> {args.out}")


if __name__ == "__main__":
    main()
