"""What the benchmarks that train the toy drafter through the real workflow share (recipe_ablation.py,
family_quality.py, val_vs_eval.py, train_quality.py, and fp8_gate.py's interval): a config/config.yaml
with overrides, one run of the workflow to the evaluation and its figures (kept in the work dir, so a
killed benchmark resumes), and the statistics over seeds.
"""

import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
# recipe_ablation.py's variants (val_vs_eval.py runs two of them): each names its loss, the baseline is the
# paper's recipe whatever the default
RECIPES = {
    "baseline": {"train.loss": "decay"},
    "dpace": {"train.loss": "dpace"},
    "block16": {"train.loss": "decay", "drafter.block_size": 16},
    "window": {"train.loss": "decay", "drafter.sliding_window": 32},
    "window2048": {"train.loss": "decay", "drafter.sliding_window": 2048},
}


def write_config(path: Path, overrides: dict) -> Path:
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for key, value in overrides.items():  # "section.name" or deeper ("drafter.dspark.markov_rank")
        *sections, name = key.split(".")
        node = cfg
        for part in sections:
            node = node.setdefault(part, {})
        node[name] = value
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def stage_seconds(work: Path) -> dict:
    """Wall seconds of the stages this run executed, from their Snakemake `benchmark:` files."""
    out = {}
    for stage in ("warmup", "train", "evaluate"):
        tsv = work / "results" / "benchmarks" / f"{stage}.tsv"
        if tsv.exists():
            with open(tsv) as f:
                out[stage] = float(next(csv.DictReader(f, delimiter="\t"))["s"])
    return out


def snakemake(work: Path, config: Path, log: Path, name: str = "") -> None:
    """The workflow in `work` with `config`, to the evaluation's summary, on 2 cores; its output in `log`."""
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "workflow" / "Snakefile"),
        "-d",
        str(work),
        "--cores",
        "2",
        f"--configfile={config}",
        "results/eval/summary.json",
    ]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name + ': ' if name else ''}snakemake failed, see {log}")


def run_one(work: Path, name: str, overrides: dict, drafter: str = "dflash") -> dict:
    """One run of the workflow with `overrides`; `drafter`: the evaluation summary's name of the trained
    drafter (its family's)."""
    done = work / "runs" / name / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    done.parent.mkdir(parents=True, exist_ok=True)
    config = write_config(done.parent / "config.yaml", overrides)
    before = {p: p.stat().st_mtime for p in (work / "results" / "benchmarks").glob("*.tsv")}
    t0 = time.perf_counter()
    snakemake(work, config, done.parent / "snakemake.log", name)
    wall = time.perf_counter() - t0
    summary = json.loads((work / "results" / "eval" / "summary.json").read_text())
    with open(work / "results" / "train" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    train_log = (work / "results" / "logs" / "train.log").read_text()
    bench = work / "results" / "benchmarks"
    ran = {
        s: v
        for s, v in stage_seconds(work).items()
        if (bench / f"{s}.tsv").stat().st_mtime != before.get(bench / f"{s}.tsv")
    }
    d = summary[drafter]
    # the per-prompt rows, for intervals over prompts: the next run in this work dir overwrites the file
    shutil.copy(work / "results" / "eval" / "per_prompt.parquet", done.parent / "per_prompt.parquet")
    result = {
        "name": name,
        "overrides": overrides,
        "tau_pooled": d["tau_pooled"],
        "tau_prompt_mean": d["tau_prompt_mean"],
        "lossless_all": d["lossless_all"],
        "speedup_cpu": d["speedup"],
        "per_position_acceptance": d["per_position_acceptance"],
        "untrained_tau_pooled": summary[f"{drafter}_untrained"]["tau_pooled"],
        "tau_pooled_by_temperature": {t: x["tau_pooled"] for t, x in d.get("by_temperature", {}).items()},
        "train_steps": int(rows[-1]["step"]),
        "final_train_loss": float(rows[-1]["loss"]),
        "final_sim_tau": float(rows[-1]["sim_tau"]),
        "global_batch_line": next(
            (x.split("] ", 1)[1] for x in train_log.splitlines() if "global batch:" in x), None
        ),
        "stage_s": ran,
        "wall_s": round(wall, 1),
    }
    done.write_text(json.dumps(result, indent=2) + "\n")
    return result


def stats(xs: list[float]) -> dict:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return {
        "mean": round(statistics.mean(xs), 4),
        "sd": round(sd, 4),
        "min": round(min(xs), 4),
        "max": round(max(xs), 4),
        "values": [round(x, 4) for x in xs],
    }


def bootstrap_diff(
    xs: list[float], ys: list[float], draws: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """95% bootstrap interval of mean(xs) - mean(ys), each resampled with replacement."""
    g = np.random.default_rng(seed)
    x, y = np.asarray(xs), np.asarray(ys)
    d = g.choice(x, (draws, len(x))).mean(1) - g.choice(y, (draws, len(y))).mean(1)
    return float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))
