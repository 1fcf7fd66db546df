"""The drafter's quality with a training lever against without, on the toy target on a GPU: the
evaluation's tau, five seeds each.

Usage: python benchmarks/train_quality.py [--work DIR] [--seeds 0 1 2 3 4]
Writes benchmarks/results/train_quality_gpu.json and prints a table.

The real workflow runs in `--work` (default /tmp/flashdraft-train-quality) on config/config.yaml with one
GPU for the target side and one for training (gpus.target 1, gpus.drafter 1: the toy target in float32,
training under bf16 autocast), as benchmarks/recipe_ablation.py runs its variants. Every run (a variant and
a seed) has a work dir and GPU lease dir of its own (`--work`/NAME) and they all run at once: the toy uses
a sliver of the GPU, and the numbers do not depend on what runs beside them. Each builds the toy target,
prompts, answers and hidden states itself (the same, from the same config), so the runs share nothing.
Against bf16, each lever's difference of mean tau comes with a bootstrap 95% interval (the seeds of each
variant resampled with replacement, 10,000 times, percentiles 2.5 and 97.5), and the seed-to-seed spread
(the largest minus the smallest tau over one variant's seeds, the larger of the two).
`--runs-from` keeps the finished runs of an earlier JSON (a call that ended before all had run).
The JSON is rewritten as each run ends (`complete` false until all have), so a stopped call keeps what ran.
tau is the evaluation's `tau_pooled` (emitted tokens per verify step, as `dflash_generate` counts it).
"""

import argparse
import json
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch
from harness import write_result
from toy_bench import REPO, bootstrap_diff, run_one, stats

GPU = {"gpus.target": 1, "gpus.drafter": 1}
VARIANTS = {  # each against bf16: production.yaml's training step without float8
    "bf16": {"train.fp8": None, "train.compile_loss": True, "train.compile_scope": "layer"},
    # config/fp8.yaml, as config/production.yaml trains
    "fp8": {"train.fp8": "tensorwise", "train.compile_loss": True, "train.compile_scope": "layer"},
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, default=Path("/tmp/flashdraft-train-quality"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument(
        "--runs-from",
        type=Path,
        default=None,
        help="an earlier JSON of this benchmark whose finished runs are kept (not run again)",
    )
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "train_quality_gpu.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("train_quality measures training on a GPU; none is visible")
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def one(pair: tuple[str, int]) -> tuple[str, dict]:
        v, seed = pair
        name = f"{v}-seed{seed}"
        work = args.work / name
        work.mkdir(exist_ok=True)
        keys = {"train.seed": seed, **GPU, "gpus.lock_dir": str(work / "gpu-locks"), **VARIANTS[v]}
        try:
            r = run_one(work, name, keys)
        except SystemExit as e:  # a failed run is recorded with its log's end; the others go on
            logs = sorted((work / "results" / "logs").glob("*.log"), key=lambda f: f.stat().st_mtime)
            tail = logs[-1].read_text()[-3000:] if logs else ""
            print(f"{name}: FAILED: {e}\n{tail}", flush=True)
            return name, {"error": str(e), "last_log": str(logs[-1]) if logs else None, "log_tail": tail}
        print(
            f"{name:24s} tau_pooled {r['tau_pooled']:.3f}  final loss {r['final_train_loss']:.4f}  "
            f"{r['wall_s']:.0f} s",
            flush=True,
        )
        return name, r

    runs = {}
    if args.runs_from:
        runs = {k: r for k, r in json.loads(args.runs_from.read_text())["runs"].items() if "error" not in r}
    pairs = [(v, s) for s in args.seeds for v in args.variants if f"{v}-seed{s}" not in runs]
    with ThreadPoolExecutor(len(pairs)) as pool:
        for fut in as_completed([pool.submit(one, pair) for pair in pairs]):
            name, r = fut.result()
            runs[name] = r
            write(args, runs, t0)


def write(args, runs: dict, t0: float) -> None:
    base = "bf16"
    done = [
        v
        for v in args.variants
        if all("error" not in runs.get(f"{v}-seed{s}", {"error": 1}) for s in args.seeds)
    ]
    taus = {v: [runs[f"{v}-seed{s}"]["tau_pooled"] for s in args.seeds] for v in done}
    variants = {
        v: {
            "overrides": VARIANTS[v],
            "tau_pooled": stats(taus[v]),
            "final_train_loss": stats([runs[f"{v}-seed{s}"]["final_train_loss"] for s in args.seeds]),
            "lossless_all": all(runs[f"{v}-seed{s}"]["lossless_all"] for s in args.seeds),
        }
        for v in done
    }
    for v in done:
        if v == base or base not in done:
            continue
        spread = max(max(t) - min(t) for t in (taus[base], taus[v]))
        diff = statistics.mean(taus[v]) - statistics.mean(taus[base])
        lo, hi = bootstrap_diff(taus[v], taus[base])
        variants[v]["vs_bf16"] = {
            "tau_mean_diff": round(diff, 4),
            "ci95": [round(lo, 4), round(hi, 4)],
            "seed_spread": round(spread, 4),
            "within_seed_spread": abs(diff) <= spread,
        }
    result = {
        "what": "toy drafter trained on one GPU: evaluation tau_pooled per lever, seeds as listed",
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "seeds": args.seeds,
        "complete": len(done) == len(args.variants),
        "variants": variants,
        "runs": runs,
        "runs_from": str(args.runs_from) if args.runs_from else None,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_result(args.out, result, params=vars(args))
    if result["complete"]:
        for v, r in variants.items():
            t = r["tau_pooled"]
            print(f"{v:20s} tau {t['mean']:.3f} +- {t['sd']:.3f}  {r.get('vs_bf16', '')}")


if __name__ == "__main__":
    main()
