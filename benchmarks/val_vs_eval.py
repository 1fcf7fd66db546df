"""How far the held-out validation's sim_tau predicts the evaluation's tau on the embedded default.

Usage: nice -n 10 .venv/bin/python benchmarks/val_vs_eval.py [--work DIR] [--seeds 0 1 2 3 4] [--variants ...]
Writes benchmarks/results/val_vs_eval_toy.json and prints a table.

The real workflow runs in `--work` (default /tmp/flashdraft-val-vs-eval) on config/config.yaml with
`train.val_samples: 16` (validation every `train.val_every: 10` steps and at the end), per seed
(`train.seed`) and loss (recipe_ablation's variants, toy_bench.RECIPES: `dpace`, the default, and
`baseline`, the paper's decay loss). Each run is evaluated twice: with `train.export: last` (the final
validation row's `val_sim_tau` against the evaluation's `tau_pooled`) and, when the best validation step is
not the last one, with `train.export: best` (which exports again from the finished run without training
again). Every evaluated export is one pair (validation sim_tau of the exported step, evaluation tau_pooled);
the result holds their Spearman rank correlation, the mean gap (tau_pooled - val sim_tau) and, per run, last
against best. A run's pairs are kept in `--work`/runs/NAME/result.json, so a killed run resumes where it
stopped.
"""

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

from harness import write_result
from toy_bench import RECIPES, REPO, snakemake, stage_seconds, write_config

VAL = {"train.val_samples": 16, "train.val_every": 10}


def evaluated(work: Path) -> dict:
    d = json.loads((work / "results" / "eval" / "summary.json").read_text())["dflash"]
    return {
        "tau_pooled": d["tau_pooled"],
        "tau_prompt_mean": d["tau_prompt_mean"],
        "per_position_acceptance": d["per_position_acceptance"],
        "lossless_all": d["lossless_all"],
    }


def run_one(work: Path, name: str, overrides: dict) -> dict:
    done = work / "runs" / name / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    done.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    snakemake(
        work,
        write_config(done.parent / "config.yaml", {**overrides, "train.export": "last"}),
        done.parent / "snakemake.log",
    )
    with open(work / "results" / "train" / "metrics.csv") as f:
        val = [r for r in csv.DictReader(f) if r.get("val_sim_tau")]
    curve = {int(r["step"]): float(r["val_sim_tau"]) for r in val}
    val_pos = {
        int(r["step"]): [
            float(r[k])
            for k in sorted(
                (k for k in r if k.startswith("val_acc_pos_")), key=lambda k: int(k.rsplit("_", 1)[1])
            )
        ]
        for r in val
    }
    chosen = json.loads((work / "results" / "train" / "export.json").read_text())
    last, best = chosen["last_step"], chosen["best_step"]
    exports = {
        "last": {"step": last, "val_sim_tau": curve[last], "val_acc_pos": val_pos[last], **evaluated(work)}
    }
    if best != last:
        snakemake(
            work,
            write_config(done.parent / "config-best.yaml", {**overrides, "train.export": "best"}),
            done.parent / "snakemake-best.log",
        )
        assert json.loads((work / "results" / "train" / "export.json").read_text())["step"] == best
        exports["best"] = {
            "step": best,
            "val_sim_tau": curve[best],
            "val_acc_pos": val_pos[best],
            **evaluated(work),
        }
    else:
        exports["best"] = {**exports["last"], "same_as_last": True}
    result = {
        "name": name,
        "overrides": overrides,
        "last_step": last,
        "best_step": best,
        "val_sim_tau_curve": curve,
        "exports": exports,
        "stage_s": stage_seconds(work),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    done.write_text(json.dumps(result, indent=2) + "\n")
    return result


def ranks(xs: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def pearson(a: list[float], b: list[float]) -> float:
    ma, mb = statistics.mean(a), statistics.mean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    va, vb = sum((x - ma) ** 2 for x in a), sum((y - mb) ** 2 for y in b)
    return cov / (va * vb) ** 0.5 if va and vb else float("nan")


def spearman(a: list[float], b: list[float]) -> float:
    return pearson(ranks(a), ranks(b))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, default=Path("/tmp/flashdraft-val-vs-eval"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--variants", nargs="+", default=["dpace", "baseline"])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "val_vs_eval_toy.json")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    runs = {}
    for seed in args.seeds:  # seed-major: the variants share the seed's warmup
        for v in args.variants:
            name = f"{v}-seed{seed}"
            runs[name] = r = run_one(args.work, name, {"train.seed": seed, **RECIPES[v], **VAL})
            e = r["exports"]
            print(
                f"{name:16s} last step {r['last_step']:4d} val {e['last']['val_sim_tau']:.3f} "
                f"tau {e['last']['tau_pooled']:.3f} | best step {r['best_step']:4d} val "
                f"{e['best']['val_sim_tau']:.3f} tau {e['best']['tau_pooled']:.3f}  {r['wall_s']:.0f} s",
                flush=True,
            )

    pairs = [
        {
            "run": n,
            "export": k,
            "step": e["step"],
            "val_sim_tau": round(e["val_sim_tau"], 4),
            "tau_pooled": round(e["tau_pooled"], 4),
        }
        for n, r in runs.items()
        for k, e in r["exports"].items()
        if not e.get("same_as_last")
    ]
    last = [p for p in pairs if p["export"] == "last"]

    def fit(ps: list[dict]) -> dict:
        val, tau = [p["val_sim_tau"] for p in ps], [p["tau_pooled"] for p in ps]
        gaps = [t - v for v, t in zip(val, tau, strict=True)]
        return {
            "n": len(ps),
            "spearman": round(spearman(val, tau), 4),
            "pearson": round(pearson(val, tau), 4),
            "mean_gap": round(statistics.mean(gaps), 4),
            "gap_sd": round(statistics.stdev(gaps), 4) if len(gaps) > 1 else 0.0,
            "mean_abs_gap": round(statistics.mean(abs(g) for g in gaps), 4),
        }

    best_vs_last = {
        n: {
            "last_step": r["last_step"],
            "best_step": r["best_step"],
            "tau_last": round(r["exports"]["last"]["tau_pooled"], 4),
            "tau_best": round(r["exports"]["best"]["tau_pooled"], 4),
            "tau_prompt_mean_last": round(r["exports"]["last"]["tau_prompt_mean"], 4),
            "tau_prompt_mean_best": round(r["exports"]["best"]["tau_prompt_mean"], 4),
        }
        for n, r in runs.items()
    }
    deltas = [b["tau_best"] - b["tau_last"] for b in best_vs_last.values()]
    deltas_pm = [b["tau_prompt_mean_best"] - b["tau_prompt_mean_last"] for b in best_vs_last.values()]
    result = {
        "what": "validation sim_tau (16 held-out training samples, fixed anchors) against the evaluation's "
        "tau_pooled of the same exported weights, on the embedded default (config/config.yaml) with "
        "train.val_samples 16, train.val_every 10; per seed and loss, the last step's export and, "
        "where it differs, the best validation step's",
        "gap": "evaluation tau_pooled - validation sim_tau",
        "all_exports": fit(pairs),
        "last_exports": fit(last),
        "best_vs_last": {
            "runs": best_vs_last,
            "best_step_is_last": sum(b["best_step"] == b["last_step"] for b in best_vs_last.values()),
            "best_higher": sum(d > 0 for d in deltas),
            "best_lower": sum(d < 0 for d in deltas),
            "tie": sum(d == 0 for d in deltas),
            "mean_delta_tau": round(statistics.mean(deltas), 4),
            "tau_prompt_mean": {
                "best_higher": sum(d > 0 for d in deltas_pm),
                "best_lower": sum(d < 0 for d in deltas_pm),
                "tie": sum(d == 0 for d in deltas_pm),
                "mean_delta": round(statistics.mean(deltas_pm), 4),
            },
        },
        "pairs": pairs,
        "seeds": args.seeds,
        "variants": args.variants,
        "runs": runs,
    }
    write_result(args.out, result, params=vars(args), device="cpu")
    for k in ("all_exports", "last_exports"):
        print(k, result[k])
    print("best vs last", {k: v for k, v in result["best_vs_last"].items() if k != "runs"})
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
