"""Drafter quality with hidden states stored in bf16 and in fp8 (e4m3, one scale per token), per seed.

Runs the real workflow on the embedded default (config/config.yaml) in one work directory, once per
(hidden.dtype, train.seed): the toy target, prompts and regeneration are built once and shared; a new
dtype reruns the hidden-state precompute onward, a new seed the compile warmup onward. tau is the trained
drafter's `tau_pooled` in `results/eval/summary.json` (tokens emitted per verify step, pooled over all
steps, as flashdraft.evaluate.summarize counts it).

Usage: nice -n 10 .venv/bin/python benchmarks/fp8_quality.py [--seeds 0 1] [--work DIR] [--cores 2]
Writes benchmarks/results/fp8_quality.json and prints a table.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from harness import write_result

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3"}  # hidden.dtype names the schema accepts


def run_variant(work: Path, dtype: str, seed: int, cores: int) -> dict:
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["hidden"]["dtype"] = dtype
    cfg["train"]["seed"] = seed
    config = work / f"config-{dtype}-{seed}.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "workflow" / "Snakefile"),
        "-d",
        str(work),
        "--configfile",
        str(config),
        "--cores",
        str(cores),
        "results/eval/summary.json",
    ]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}  # the embedded default: CPU
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"snakemake failed (hidden.dtype={dtype}, seed={seed}):\n{proc.stderr[-4000:]}")
    summary = json.loads((work / "results" / "eval" / "summary.json").read_text())
    manifest = json.loads((work / "results" / "hidden" / "shard-00000.json").read_text())
    assert manifest["dtype"] == dtype, manifest["dtype"]  # the shards really are in this dtype
    manifests = (work / "results" / "hidden").glob("shard-*.json")
    d = summary["dflash"]
    return {
        "tau_pooled": d["tau_pooled"],
        "tau_prompt_mean": d["tau_prompt_mean"],
        "lossless_all": d["lossless_all"],
        "wall_s": round(wall, 1),
        "hidden_bytes": sum(json.loads(p.read_text())["bytes"] for p in manifests),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--work", default=None, help="work directory (default: a fresh temporary one)")
    p.add_argument("--cores", type=int, default=os.cpu_count())
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fp8_quality.json"))
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="fp8-quality-"))
    work.mkdir(parents=True, exist_ok=True)

    runs = {}
    for name, dtype in DTYPES.items():  # dtype outermost: each precompute runs once per dtype
        for seed in args.seeds:
            runs[(name, seed)] = r = run_variant(work, dtype, seed, args.cores)
            print(f"{name} seed {seed}: tau_pooled {r['tau_pooled']:.3f} ({r['wall_s']:.0f} s)", flush=True)

    def taus(name):
        return [runs[(name, s)]["tau_pooled"] for s in args.seeds]

    def spread(xs):
        return max(xs) - min(xs)

    bf16, fp8 = taus("bf16"), taus("fp8")
    diff = abs(statistics.mean(fp8) - statistics.mean(bf16))
    seed_spread = max(spread(bf16), spread(fp8))
    result = {
        "what": "trained drafter's tau_pooled on the embedded default (config/config.yaml) with hidden "
        "states stored in bf16 and in fp8 (hidden.dtype float8_e4m3), per train.seed",
        "seeds": args.seeds,
        "tau_bf16": bf16,
        "tau_fp8": fp8,
        "fp8_minus_bf16_per_seed": [f - b for f, b in zip(fp8, bf16, strict=True)],
        "mean_difference": diff,
        "seed_spread": seed_spread,  # the larger max - min over seeds of the two dtypes
        "within_seed_spread": diff <= seed_spread,
        "hidden_bytes": {name: runs[(name, args.seeds[0])]["hidden_bytes"] for name in DTYPES},
        "runs": {f"{name}/seed{s}": r for (name, s), r in runs.items()},
    }
    write_result(args.out, result, params=vars(args), device="cpu")
    print(f"{'dtype':6} " + " ".join(f"seed {s:<5}" for s in args.seeds) + "  mean")
    for name, xs in (("bf16", bf16), ("fp8", fp8)):
        print(f"{name:6} " + " ".join(f"{x:<10.3f}" for x in xs) + f"  {statistics.mean(xs):.3f}")
    print(
        f"|mean difference| {diff:.3f}, seed spread {seed_spread:.3f}: "
        f"{'within' if result['within_seed_spread'] else 'outside'} the spread -> {args.out}"
    )


if __name__ == "__main__":
    main()
