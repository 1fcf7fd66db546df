"""Stream mode end to end through Snakemake at the production shape, on the GPUs of one machine.

    python benchmarks/stream_rehearsal.py [--preset qwen3-8b] [--prompts 300] [--gpus-target 1]

A random Qwen3-8B-shaped target saved as an HF directory (with the toy's byte-level tokenizer), a
ShareGPT-shaped source of synthetic prompts, and the whole workflow with `hidden.mode: stream`:
prompts, regeneration (static engine), tokens, the data plan (hidden.chunk_tokens set so that every
epoch has `--chunks` chunks), per chunk the fp8 hidden parts, their verify and the chunk's training
(the production drafter: 5 layers, block 16), the export, evaluation and the report. With one GPU
(`--resources gpu=1`) the chunks' shard jobs queue behind the training; with gpus.target + gpus.drafter
GPUs they run beside it.

From Snakemake's log: every job's interval, the fraction of the training chain's wall time during which
a shard job ran, each chunk job's start-up (launch to its first step done, from the job's start in the
log and the trainer's own clock) as a fraction of its job's time; the peak bytes under results/hidden
(sampled). `benchmarks/results/stream_rehearsal_<N>x<gpu>.json`. `--preset tiny` checks the script on
a CPU (gpus 0).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import yaml
from harness import write_result
from shapes import PRESETS
from target_bench import saved_target

from flashdraft.timeline import DiskWatch, job_times, latest_log, overlap_s

REPO = Path(__file__).resolve().parents[1]
SHAPES = {  # the run's sizes on each benchmark preset (shapes.py: the target and drafter)
    "qwen3-8b": {
        "train": {"batch_tokens": 16384, "global_batch_tokens": 16384, "buckets": [2048], "lr": 6e-4},
        "max_length": 2048,
        "hidden_batch": 32768,
        "chars": (300, 1500),
    },
    "tiny": {
        "train": {"batch_tokens": 1024, "global_batch_tokens": 1024, "buckets": [128, 256], "lr": 3e-3},
        "max_length": 256,
        "hidden_batch": 4096,
        "chars": (40, 160),
    },
}


def sharegpt_prompts(path: Path, n: int, lo: int, hi: int, seed: int = 0) -> None:
    """`n` ShareGPT-shaped conversations of random words, lo..hi characters (the byte-level tokenizer
    gives about a token per character)."""
    g = np.random.default_rng(seed)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    words = ["".join(g.choice(letters, int(g.integers(2, 9)))) for _ in range(3000)]
    with open(path, "w") as f:
        for i in range(n):
            text, want = "", int(g.integers(lo, hi))
            while len(text) < want:
                text += " ".join(g.choice(words, 16)) + ". "
            f.write(
                json.dumps(
                    {
                        "id": f"p{i}",
                        "conversations": [
                            {"from": "human", "value": text[:want]},
                            {"from": "gpt", "value": "ok"},
                        ],
                    }
                )
                + "\n"
            )


def config(args, target: Path, source: Path, work: Path) -> dict:
    shape = SHAPES[args.preset]
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg.pop("toy", None)
    cfg["target"] = {"path": str(target), "build_toy": False, "dtype": "bfloat16"}
    cfg["prompts"] = {
        "total": args.prompts + 8,
        "eval_count": 8,
        "min_chars": 4,
        "max_chars": 100000,
        "sources": [{"name": "synthetic", "path": str(source), "shape": "sharegpt"}],
    }
    cfg["regenerate"] = {
        "enabled": True,
        "max_new_tokens": args.new_tokens,
        "engine": "auto",
        "batch_size": 0,
        "shards": 1,
    }
    cfg["hidden"] = {
        "mode": "stream",
        "shards": 1,
        "max_length": shape["max_length"],
        "dtype": "float8_e4m3",
        "batch_tokens": shape["hidden_batch"],
        "chunk_tokens": args.chunk_tokens,
    }
    cfg["drafter"] = dict(PRESETS[args.preset]["drafter"])
    cfg["train"] = {
        **shape["train"],
        "max_anchors": PRESETS[args.preset]["max_anchors"],
        "epochs": args.epochs,
        "compile": True,
        "checkpoint_every": 1000,
        "log_every": 1,
        "keep_checkpoints": 2,
        "val_samples": 0,
    }
    cfg["eval"] = {"num_prompts": args.eval_prompts, "max_new_tokens": args.new_tokens}
    cfg["gpus"] = {"target": args.gpus_target, "drafter": args.gpus_drafter, "lock_dir": str(work / "locks")}
    return cfg


def chunk_tokens_for(args, work: Path) -> int:
    """hidden.chunk_tokens that cuts every epoch into about `--chunks` chunks: one epoch's tokens (the
    prompts' characters, about a token each, plus the answers) / (chunks - 1/2). Chunks hold whole steps,
    so a budget of exactly 1/chunks of the epoch would leave a short extra chunk at its end."""
    per_epoch = sum(
        len(json.loads(line)["conversations"][0]["value"]) + args.new_tokens + 16
        for line in (work / "sources.jsonl").read_text().splitlines()[: args.prompts]
    )
    return int(per_epoch / (args.chunks - 0.5))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--prompts", type=int, default=300)
    p.add_argument("--chars", type=int, nargs=2, default=None, help="prompt lengths (default: the preset's)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--eval-prompts", type=int, default=4)
    p.add_argument("--chunks", type=int, default=3, help="chunks per epoch")
    p.add_argument("--gpus-target", type=int, default=None, help="default: 1 with a GPU, else 0")
    p.add_argument("--gpus-drafter", type=int, default=None, help="default: 1 with a GPU, else 0")
    p.add_argument("--work", default="/tmp/flashdraft-stream-rehearsal")
    p.add_argument("--device", default="unknown", help="with --summarize: the machine the run was made on")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--summarize",
        nargs=2,
        metavar=("RESULTS", "SNAKEMAKE_LOG"),
        default=None,
        help="only summarize a run's results/ tree and Snakemake log (one cut short, say)",
    )
    args = p.parse_args()
    if args.summarize:
        results, log = map(Path, args.summarize)
        args.gpus_target = 1 if args.gpus_target is None else args.gpus_target
        args.gpus_drafter = 1 if args.gpus_drafter is None else args.gpus_drafter
        gpus = max(args.gpus_target, args.gpus_drafter)
        result = summarize(results, log, None, None, args, gpus, args.device)
        write_result(args.out, result, params=vars(args))
        print(json.dumps({k: v for k, v in result.items() if k not in ("jobs", "chunks")}, indent=1))
        return
    gpus = torch.cuda.device_count()
    args.gpus_target = min(1, gpus) if args.gpus_target is None else args.gpus_target
    args.gpus_drafter = min(1, gpus) if args.gpus_drafter is None else args.gpus_drafter
    work = Path(args.work)
    run = work / "run"
    if run.exists():
        subprocess.run(["rm", "-rf", str(run)], check=True)
    run.mkdir(parents=True)
    target = saved_target(args.preset, work)
    torch.cuda.empty_cache()  # the target was built here: leave its memory to the workflow's jobs
    sharegpt_prompts(work / "sources.jsonl", args.prompts + 8, *(args.chars or SHAPES[args.preset]["chars"]))
    args.chunk_tokens = chunk_tokens_for(args, work)
    cfg = config(args, target, work / "sources.jsonl", work)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "workflow" / "Snakefile"),
        "-d",
        str(run),
        "--configfile",
        str(run / "config.yaml"),
        "--cores",
        str(os.cpu_count()),
        "--resources",
        f"gpu={max(1, gpus)}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    watch = DiskWatch(run / "results" / "hidden", every_s=0.05)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    peak = watch.close()
    (work / "snakemake.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"snakemake failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    device = f"{torch.cuda.get_device_name() if gpus else 'cpu'}, torch {torch.__version__}"
    result = summarize(run / "results", latest_log(run), wall, peak, args, gpus, device)
    name = f"stream_rehearsal_{max(1, gpus)}x{'h200' if 'H200' in result['device'] else 'cpu'}"
    out = Path(args.out or REPO / "benchmarks" / "results" / f"{name}.json")
    write_result(out, result, params=vars(args))
    print(json.dumps({k: v for k, v in result.items() if k not in ("jobs", "chunks")}, indent=1))


def summarize(results: Path, log: Path, wall, peak, args, gpus: int, device: str) -> dict:
    """The run's figures from its results/ tree and Snakemake's log; a run cut short gives what it did."""
    jobs = job_times(log)
    plan = json.loads((results / "plan" / "plan.json").read_text())
    trains = [j for j in jobs if j.rule == "train_chunk"]
    shards = [j for j in jobs if j.rule == "hidden_chunk"]
    chain = (max(j.end for j in trains) - min(j.start for j in trains)).total_seconds() if trains else 0.0
    during = sum(overlap_s(t, s) for t in trains for s in shards)
    chunks = []
    for t in trains:
        done = json.loads((results / "train" / "chunks" / f"{t.wildcards['chunk']}.json").read_text())
        if done.get("trained_already"):  # a rerun's chunk that the run had got past: it trained nothing
            continue
        start_up = datetime.fromtimestamp(done["first_step_done_at"]) - t.start
        chunks.append(
            {
                "chunk": t.wildcards["chunk"],
                "job_s": t.seconds,
                "steps": done["step"] - done["chunk"]["start_step"],
                "tokens": done["chunk"]["tokens"],
                "launch_to_first_step_s": start_up.total_seconds(),
                "first_step_done_s_worker": done["first_step_done_s"],
            }
        )
    start_up = [c["launch_to_first_step_s"] for c in chunks] or [float("nan")]
    summary_file = results / "eval" / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    complete = summary_file.exists() and len(trains) == len(plan["chunks"])
    return {
        "what": "stream mode through Snakemake: prompts -> regenerate -> tokens -> plan -> per chunk hidden "
        "parts (fp8), verify, training -> export -> evaluate -> report",
        "complete": complete,
        "chunks_trained": len(trains),
        "chunks_planned": len(plan["chunks"]),
        "device": device,
        "gpus": gpus,
        "python": platform.python_version() if wall is not None else None,
        "preset": args.preset,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "epochs": args.epochs,
        "gpus_target": args.gpus_target,
        "gpus_drafter": args.gpus_drafter,
        "chunk_tokens": plan["chunk_tokens"],
        "chunks_per_epoch": [sum(c["epoch"] == e for c in plan["chunks"]) for e in range(args.epochs)],
        "total_steps": plan["total_steps"],
        "samples": plan["samples"],
        "tokens_per_epoch": plan["tokens"],
        "wall_s": wall,
        "all_jobs_passed": complete,
        "rules": sorted({j.rule for j in jobs}),
        "train_chain_s": chain,
        "shard_jobs_during_training_s": during,
        "fraction_of_chain_with_a_shard_job": during / chain if chain else 0.0,
        "queued_on_one_gpu": gpus <= 1,
        "launch_to_first_step_s": {"median": float(np.median(start_up)), "max": max(start_up)},
        "chain_overhead_fraction_of_job": float(
            np.median([c["launch_to_first_step_s"] / c["job_s"] for c in chunks])
        )
        if chunks
        else None,
        "peak_hidden_bytes_sampled": peak,
        "peak_hidden_bytes_planned": plan["peak_bytes"],
        "eval_tau_pooled": {
            k: v.get("tau_pooled") for k, v in summary.get("decoders", summary).items() if isinstance(v, dict)
        },
        "chunks": chunks,
        "jobs": [
            {"rule": j.rule, "wildcards": j.wildcards, "start": j.start.isoformat(), "s": j.seconds}
            for j in jobs
        ],
    }


if __name__ == "__main__":
    main()
