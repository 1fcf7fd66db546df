"""The float8 gate: whether config/production.yaml keeps `train.fp8`, decided from the committed results.

    python benchmarks/fp8_gate.py [--results benchmarks/results] [--out benchmarks/results/fp8_gate.json]

Reads, all under --results:
- fp8_curves_qwen3-8b.json (benchmarks/fp8_curves.py --preset qwen3-8b): the production drafter's training
  curve per variant at the production shape; against bf16, the largest relative loss gap over the last 100
  steps and the validation sim_tau gaps;
- train_quality_gpu.json (benchmarks/train_quality.py on a GPU): the toy drafter with production.yaml's
  training keys, bf16 against float8 over several seeds: evaluation tau and the final training sim_tau;
- fp8_parity_qwen3-8b.json (benchmarks/fp8_parity.py --preset qwen3-8b): one step's gradient and AdamW
  update against a bf16 noise floor (reported beside the decision, not a condition of it).

The rule: production's float8 mode (`train.fp8` of config/production.yaml) stays only if its training curve
is within LOSS_GAP of bf16's and the 95% bootstrap intervals of the float8-minus-bf16 difference of the
toy's tau and sim_tau each hold zero or lie above it; otherwise production moves to bf16. The curve's
measure is the logged loss (its largest relative gap over the last 100 steps) where that loss is a
weighted mean cross-entropy (train.loss decay); under train.loss dpace the logged loss is the CE weighted
by the drafter's own label probabilities per block, which grows as the drafter improves, so it is no
measure to compare two runs by: there the curve's measure is the validation sim_tau over the last 100
steps, float8's at most LOSS_GAP below bf16's at each validation. Until every input is complete the
decision is "undecided", with what is missing. Writes fp8_gate.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml
from harness import write_result
from toy_bench import bootstrap_diff

from flashdraft.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
LOSS_GAP = 0.01
LAST = 100  # the curve's last steps the measure looks at (fp8_curves.py's LAST)
CURVES, QUALITY, PARITY = "fp8_curves_qwen3-8b.json", "train_quality_gpu.json", "fp8_parity_qwen3-8b.json"


def interval(runs: dict, key: str, variant: str, base: str) -> dict:
    """The variant's mean minus the base's, with its 95% bootstrap interval, over the seeds both ran."""

    def values(v):
        return {
            r["name"].rsplit("-seed", 1)[1]: r[key]
            for r in runs.values()
            if r["name"].startswith(f"{v}-seed") and r.get(key) is not None
        }

    x, y = values(variant), values(base)
    seeds = sorted(set(x) & set(y))
    xs, ys = [x[s] for s in seeds], [y[s] for s in seeds]
    lo, hi = bootstrap_diff(xs, ys) if seeds else (None, None)
    diff = sum(xs) / len(xs) - sum(ys) / len(ys) if seeds else None
    # the interval holds zero or lies above it: its upper end is not below zero
    return {"seeds": len(seeds), "diff": diff, "ci95": [lo, hi], "passes": bool(seeds) and hi >= 0}


def curve_gaps(curves: dict, name: str) -> tuple[float | None, float | None]:
    """Variant `name` against bf16 over the curve's last LAST steps: the largest relative gap of the logged
    loss, and the smallest relative difference of the validation sim_tau (negative: below bf16's)."""
    versus = curves.get("vs_bf16", {}).get(name, {})
    steps = curves.get("shape", {}).get("steps", 0)
    late = [d for s, d in versus.get("val_sim_tau", {}).items() if int(s) > steps - LAST]
    return (
        versus.get("loss_rel_gap_last_100"),
        min((d["variant"] / d["bf16"] - 1 for d in late), default=None),
    )


def decide(curves: dict, quality: dict, mode: str) -> dict:
    """The gate's figures for float8 `mode` and its decision."""
    name = f"fp8_{mode}"
    missing = []
    if not curves.get("runs", {}).get("bf16", {}).get("complete"):
        missing.append(f"{CURVES}: bf16")
    if not curves.get("runs", {}).get(name, {}).get("complete"):
        missing.append(f"{CURVES}: {name}")
    versus = curves.get("vs_bf16", {}).get(name, {})
    gap, sim_gap = curve_gaps(curves, name)
    objective = curves.get("train", {}).get("loss", TrainConfig().loss)
    runs = quality.get("runs", {})
    fp8_variant = next(
        (v for v, d in quality.get("variants", {}).items() if d["overrides"].get("train.fp8") == mode), None
    )
    if fp8_variant is None:
        missing.append(f"{QUALITY}: a variant with train.fp8 {mode}")
    tau = interval(runs, "tau_pooled", fp8_variant, "bf16") if fp8_variant else None
    sim = interval(runs, "final_sim_tau", fp8_variant, "bf16") if fp8_variant else None
    by_loss = objective == "decay"
    figures = {
        "objective": objective,
        "loss_rel_gap_last_100": gap,
        "val_sim_tau_rel_diff_min_last_100": sim_gap,
        "loss_gap_limit": LOSS_GAP,
        "curve_measure": "loss_rel_gap_last_100 <= limit"
        if by_loss
        else "val_sim_tau_rel_diff_min_last_100 >= -limit (the dpace loss grows as the drafter improves)",
        "toy_tau": tau,
        "toy_sim_tau": sim,
        "val_sim_tau": versus.get("val_sim_tau"),
    }
    if missing:
        return figures | {"decision": "undecided", "missing": missing}
    curve_ok = gap <= LOSS_GAP if by_loss else sim_gap is not None and sim_gap >= -LOSS_GAP
    keep = curve_ok and tau["passes"] and sim["passes"]
    return figures | {"decision": f"keep train.fp8: {mode}" if keep else "move to bf16 (train.fp8: null)"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    read = lambda name: json.loads(p.read_text()) if (p := args.results / name).exists() else {}  # noqa: E731
    # production's float8 mode; tensorwise, the one measured fastest, once production has moved off float8
    mode = yaml.safe_load((REPO / "config" / "production.yaml").read_text())["train"]["fp8"] or "tensorwise"
    curves, quality, parity = read(CURVES), read(QUALITY), read(PARITY)
    gate = {
        "what": "whether config/production.yaml keeps train.fp8, by the rule of benchmarks/fp8_gate.py",
        "production_fp8": mode,
        "inputs": [CURVES, QUALITY, PARITY],
        "curves_device": curves.get("device"),
        "quality_device": quality.get("device"),
        "parity_ratio_to_noise": {
            v: r.get("ratio_to_noise") for v, r in parity.get("variants", {}).items() if v.startswith("fp8")
        },
        **decide(curves, quality, mode),
        # the other float8 modes' curves, beside the decision (not a condition of it)
        "other_modes": {
            v: dict(
                zip(
                    ("loss_rel_gap_last_100", "val_sim_tau_rel_diff_min_last_100"),
                    curve_gaps(curves, v),
                    strict=True,
                )
            )
            for v in curves.get("vs_bf16", {})
            if v != f"fp8_{mode}"
        },
    }
    out = args.out or args.results / "fp8_gate.json"
    write_result(out, gate, params=vars(args), device="cpu")
    print(f"{gate['decision']} -> {out}")


if __name__ == "__main__":
    main()
