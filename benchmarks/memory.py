"""GPU memory of the training step, predicted (flashdraft.memory) against measured, at many shapes; and
config/production.yaml's own warmup and training steps on this GPU.

Setup (train_bench.setup, in --work): a target directory of the preset's shapes (config, toy tokenizer,
random embedding and LM head) as train_drafter.py builds it; for --production also one hidden-state shard
of samples of mixed lengths (every bucket's rows full, every position labelled: the most anchors).

1. Points: each shape in its own fresh process (its own compile, its own allocator): the step that
   training builds (train_step.build_step) and fused AdamW, then three steps on a random micro-batch of
   `rows` rows of `bucket` tokens with every anchor slot used, each forward+backward followed by the
   optimizer step. `first` is the peak of the first step (compiling: Inductor's autotuning workspace
   included), `steady` the peak of the two after it (torch.cuda.max_memory_allocated and the reserved
   peak). The points cover both families, the buckets' extremes, float8 and bf16, compile on and off.
2. The model's fit: the activation coefficients of flashdraft.memory fitted to the points' steady peaks
   (memory.fit); each point's prediction, and its leave-one-out prediction (the fit without that point):
   `max_rel_error` is the largest leave-one-out relative error, the honest figure for a shape the fit
   has not seen. The fitted coefficients are what the planner and the checks read (memory.COEFFICIENTS).
3. --production: production.yaml's train and drafter sections as they are, one process: scripts/warmup.py
   (its per-bucket peaks), then scripts/train.py for --steps steps (one micro-batch a step on one GPU,
   the rest of the keys as production's), its logged peak; both against the model's prediction and the
   card.

Usage: python benchmarks/memory.py --preset tiny|qwen3-8b [--production] [--steps 200] [--out PATH]
       python benchmarks/memory.py --refit benchmarks/results/memory_h100.json  (step 2 again, no GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from harness import write_result
from train_bench import PRESETS, REPO, drafter_json, setup

from flashdraft import memory
from flashdraft.config import Config, DrafterConfig, TrainConfig, from_dict
from flashdraft.config_load import load
from flashdraft.shapes import QWEN3_8B

# The measured points: (name, family overrides, train overrides, bucket, rows). Production's keys are the
# first group's (float8 tensorwise, compiled loss, layer scope).
FP8 = {"fp8": "tensorwise", "compile_loss": True, "compile_scope": "layer"}
BF16 = {"compile_scope": "model"}
EAGER = {"compile": False, "attention": "sdpa"}
DSPARK = {"family": "dspark", "block_size": 7}
POINTS = {
    "qwen3-8b": [
        ("fp8 3072x5", {}, FP8, 3072, 5),
        ("fp8 3072x2", {}, FP8, 3072, 2),
        ("fp8 2048x4", {}, FP8, 2048, 4),
        ("fp8 1024x4", {}, FP8, 1024, 4),
        ("fp8 1024x8", {}, FP8, 1024, 8),
        ("bf16 3072x4", {}, BF16, 3072, 4),
        ("bf16 1024x6", {}, BF16, 1024, 6),
        ("eager 3072x2", {}, EAGER, 3072, 2),
        ("eager 1024x3", {}, EAGER, 1024, 3),
        ("dspark fp8 3072x5", DSPARK, FP8, 3072, 5),
        ("dspark fp8 1024x8", DSPARK, FP8, 1024, 8),
    ],
    "tiny": [
        ("eager 256x4", {}, {"compile": False}, 256, 4),
        ("eager 128x2", {}, {"compile": False}, 128, 2),
        ("dspark eager 256x2", {"family": "dspark", "block_size": 7}, {"compile": False}, 256, 2),
    ],
}
PEAK = re.compile(r"peak GPU memory ([\d.]+) GiB allocated, ([\d.]+) GiB reserved")
WARMUP_PEAK = re.compile(r"bucket (\d+): .*peak GPU memory ([\d.]+) GiB")


def point_configs(preset: dict, family: dict, train: dict, bucket: int, rows: int):
    drafter = from_dict(DrafterConfig, {**drafter_json(preset), **family})
    cfg = TrainConfig(
        **{
            "max_anchors": preset["max_anchors"],
            "dtype": preset["dtype"],
            "attention": preset["attention"],
            "batch_tokens": bucket * rows,
            "buckets": [bucket],
            **train,
        }
    )
    return drafter, cfg


# ---------------------------------------------------------------------------------------------------------
# one point, in its own process


def measure(preset_name: str, work: Path, point: list) -> dict:
    from flashdraft.compile_cache import random_batch
    from flashdraft.config import needs_last_hidden
    from flashdraft.train_step import anchors_for, build_step, forward_backward, load_spec

    _, family, train, bucket, rows = point
    preset = PRESETS[preset_name]
    drafter, cfg = point_configs(preset, family, train, bucket, rows)
    dev = torch.device("cuda:0" if preset["device"] == "cuda" else "cpu")
    cuda = dev.type == "cuda"
    target = work / "target"
    spec = load_spec(target, drafter)
    step = build_step(cfg, spec, target, dev, drafter_cfg=drafter)
    opt = torch.optim.AdamW(step.model.parameters(), lr=1e-6, fused=cuda)
    g = torch.Generator().manual_seed(0)
    batch = random_batch(
        bucket,
        rows,
        spec.num_features * spec.hidden_size,
        spec.vocab_size,
        step.amp_dtype or torch.float32,
        g,
        spec.hidden_size if needs_last_hidden(drafter) else 0,
    )
    anchors, valid = anchors_for(step, batch["loss_mask"], g)
    built = torch.cuda.memory_allocated(dev) if cuda else None
    out = {"built_bytes": built}
    for name, steps in (("first", 1), ("steady", 2)):
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            forward_backward(step, batch, anchors, valid)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(dev)
        out[name] = {
            "seconds": round(time.perf_counter() - t0, 3),
            "allocated_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
            "reserved_bytes": torch.cuda.max_memory_reserved(dev) if cuda else None,
        }
    out["state_bytes"] = torch.cuda.memory_allocated(dev) if cuda else None  # weights, moments, head
    out["anchor_slots"] = int(anchors.shape[1])
    return out


def run_point(preset_name: str, work: Path, point, timeout: float) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--preset",
        preset_name,
        "--work",
        str(work),
        "--point",
        json.dumps(point),
    ]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if p.returncode:
        tail = p.stderr.strip().splitlines()[-3:]
        oom = "out of memory" in p.stderr
        return {"error": "out of memory" if oom else " | ".join(tail), "exit": p.returncode}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["process_seconds"] = round(time.perf_counter() - t0, 1)
    return res


# ---------------------------------------------------------------------------------------------------------
# the model's fit


def point_train(preset: dict, point) -> tuple[Config, dict]:
    """The Config and target shapes the model predicts a point from."""
    _, family, train, bucket, rows = point
    drafter, cfg = point_configs(preset, family, train, bucket, rows)
    return Config(drafter=drafter, train=cfg), {**preset["target"]}


def summarize(preset_name: str, rows: list[dict], gpu_bytes: int | None) -> dict:
    """The fit over the measured points, each point's prediction and leave-one-out prediction, and the
    largest leave-one-out relative error."""
    preset = PRESETS[preset_name]
    ok = [r for r in rows if r.get("steady", {}).get("allocated_bytes")]
    samples = [memory.Sample(*point_train(preset, r["point"]), r["steady"]["allocated_bytes"]) for r in ok]
    coefficients = memory.fit(samples) if samples else None
    errors = []
    for i, (r, s) in enumerate(zip(ok, samples, strict=True)):
        predicted = memory.train_peak(s.cfg, s.shapes, coefficients=coefficients).bytes
        loo = memory.fit(samples[:i] + samples[i + 1 :])
        held_out = memory.train_peak(s.cfg, s.shapes, coefficients=loo).bytes
        r["predicted_bytes"], r["held_out_predicted_bytes"] = predicted, held_out
        r["rel_error"] = round(predicted / s.measured - 1, 4)
        r["held_out_rel_error"] = round(held_out / s.measured - 1, 4)
        errors.append(abs(r["held_out_rel_error"]))
    return {
        "coefficients": coefficients,
        "max_rel_error": max(errors) if errors else None,
        "max_in_sample_rel_error": max((abs(r["rel_error"]) for r in ok), default=None),
        "gpu_bytes": gpu_bytes,
    }


def judge_production(preset_name: str, prod: dict, coefficients: dict | None, gpu_bytes: int | None) -> dict:
    """Production's measured training peak beside the model's prediction (its keys as run, one process)
    and as a share of the card."""
    measured = prod.get("train_peak_gib")
    if not measured or not gpu_bytes:
        return {}
    drafter, train = from_dict(DrafterConfig, prod["drafter"]), from_dict(TrainConfig, prod["train"])
    cfg = Config(drafter=drafter, train=train)
    predicted = memory.train_peak(cfg, PRESETS[preset_name]["target"], 1, gpu_bytes, coefficients).bytes
    last = json.loads(prod["train_tail"][-1]) if prod.get("train_tail", [""])[-1].startswith("{") else {}
    return {
        "tokens_per_s_per_gpu": last.get("tokens_per_s") and round(last["tokens_per_s"], 1),
        "predicted_gib": round(predicted / memory.GIB, 2),
        "rel_error": round(predicted / (measured * memory.GIB) - 1, 4),
        "peak_of_card": round(measured * memory.GIB / gpu_bytes, 3),
        "reserved_of_card": round(prod["train_reserved_gib"] * memory.GIB / gpu_bytes, 3),
    }


# ---------------------------------------------------------------------------------------------------------
# production.yaml on this GPU


def production_shard(work: Path, drafter: dict, buckets: list[int], samples: int) -> Path:
    """One shard of `samples` samples whose lengths fill every bucket (each bucket's longest and
    shortest), every position labelled."""
    from flashdraft.config import needs_last_hidden
    from flashdraft.hidden import ShardMeta, manifest_path
    from flashdraft.hidden_write import open_shard, write_manifest
    from flashdraft.train_step import load_spec

    path = work / "production" / "shard-00000.arrow"
    if manifest_path(path).exists():
        return path
    drafter_cfg = from_dict(DrafterConfig, drafter)
    spec = load_spec(work / "target", drafter_cfg)
    width, last = spec.num_features * spec.hidden_size, needs_last_hidden(drafter_cfg)
    edges = sorted(buckets)
    lengths = [n for lo, hi in zip([64, *edges], edges, strict=False) for n in (lo + 1, hi)]
    g = torch.Generator().manual_seed(0)
    meta = ShardMeta(
        target="random",
        target_layer_ids=spec.target_layer_ids,
        hidden_size=spec.hidden_size,
        dtype="bfloat16",
        last_hidden=last,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_shard(path, meta) as w:
        for i in range(samples):
            n = lengths[i % len(lengths)]
            w.write(
                f"p{i}",
                torch.randint(0, spec.mask_token_id, (n,), generator=g).tolist(),
                [1] * n,
                torch.randn(n, width, generator=g, dtype=torch.bfloat16),
            )
    write_manifest(manifest_path(path), w)
    return path


def logged(cmd: list[str], log: Path, timeout: float) -> tuple[int, str]:
    """Run `cmd` with its output going to `log` as it comes (kept when the run is stopped part-way); its
    exit status and output."""
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, log.read_text()


def production(preset_name: str, work: Path, steps: int, timeout: float, logs: Path) -> dict:
    """production.yaml's warmup, then its training for `steps` steps; their logs go to `logs`/."""
    preset = PRESETS[preset_name]
    prod = load(REPO / "config" / "production.yaml", target=QWEN3_8B)  # its train section
    train = {
        **json.loads(json.dumps(prod.train.__dict__)),
        "max_steps": steps,
        "checkpoint_every": 10**9,
        "val_samples": 0,
        "global_batch_tokens": 0,
        "log_every": 20,
    }
    if preset["device"] != "cuda":  # the CPU's smallest run: production's keys a CPU can run
        train.update(
            fp8=None,
            compile=False,
            batch_tokens=1024,
            batch_anchors=0,
            max_anchors=32,
            buckets=[256, 512],
            attention="sdpa",
        )
    drafter = {
        **drafter_json(preset),
        "num_layers": prod.drafter.num_layers,
        "block_size": prod.drafter.block_size,
    }
    shard = production_shard(work, drafter, train["buckets"], 4 * (len(train["buckets"]) * 2) * 4)
    cache = work / "production" / "compile_cache"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rc, text = logged(
        [
            sys.executable,
            str(REPO / "scripts" / "warmup.py"),
            "--cfg",
            json.dumps(train),
            "--drafter-cfg",
            json.dumps(drafter),
            "--target",
            str(work / "target"),
            "--out-dir",
            str(cache),
            str(shard),
        ],
        logs / "production_warmup.log",
        timeout,
    )
    out = {
        "train": train,
        "drafter": drafter,
        "warmup_seconds": round(time.perf_counter() - t0, 1),
        "warmup_exit": rc,
        "warmup_tail": text.strip().splitlines()[-4:],
        "warmup_peak_gib": {int(b): float(x) for b, x in WARMUP_PEAK.findall(text)},
    }
    if rc:
        return out
    run = work / "production" / "run"
    shutil.rmtree(run, ignore_errors=True)  # a fresh run: no checkpoint to resume, no export in the way
    t0 = time.perf_counter()
    rc, text = logged(
        [
            sys.executable,
            str(REPO / "scripts" / "train.py"),
            "--cfg",
            json.dumps(train),
            "--drafter-cfg",
            json.dumps(drafter),
            "--target",
            str(work / "target"),
            "--checkpoints",
            str(run / "checkpoints"),
            "--metrics",
            str(run / "metrics.csv"),
            "--out",
            str(run / "drafter"),
            "--compile-cache",
            str(cache),
            *[str(shard)] * 40,
        ],
        logs / "production_train.log",
        timeout,
    )
    peaks = PEAK.findall(text)
    out.update(
        train_seconds=round(time.perf_counter() - t0, 1),
        train_exit=rc,
        train_tail=text.strip().splitlines()[-4:],
        train_peak_gib=float(peaks[-1][0]) if peaks else None,
        train_reserved_gib=float(peaks[-1][1]) if peaks else None,
    )
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--work", default=None, help="setup dir (default: /tmp/flashdraft-memory-<preset>)")
    p.add_argument("--only", default=None, help="comma-separated point names (default: all)")
    p.add_argument("--production", action="store_true", help="also production.yaml's warmup and training")
    p.add_argument("--no-points", action="store_true", help="skip the points (with --production)")
    p.add_argument("--steps", type=int, default=200, help="--production: training steps")
    p.add_argument("--timeout", type=float, default=300, help="seconds a point's process may take")
    p.add_argument(
        "--production-timeout",
        type=float,
        default=600,
        help="--production: seconds the warmup, and then the training, may take each",
    )
    p.add_argument("--refit", default=None, help="a result file: fit its measured points again, no GPU")
    p.add_argument("--point", default=None, help=argparse.SUPPRESS)  # internal: measure one point
    p.add_argument("--out", default=None)
    args = p.parse_args()
    work = Path(args.work or f"/tmp/flashdraft-memory-{args.preset}")
    if args.point:
        print(json.dumps(measure(args.preset, work, json.loads(args.point))))
        return
    if args.refit:
        old = json.loads(Path(args.refit).read_text())
        old.update(summarize(old["preset"], old["points"], old.get("gpu_bytes")))
        if "production" in old:
            old["production"].update(
                judge_production(old["preset"], old["production"], old["coefficients"], old.get("gpu_bytes"))
            )
        Path(args.refit).write_text(json.dumps(old, indent=2) + "\n")
        print(f"refit {args.refit}: max_rel_error {old['max_rel_error']}")
        return
    preset = PRESETS[args.preset]
    cuda = preset["device"] == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"preset {args.preset} needs a CUDA GPU")
    gpu = torch.cuda.get_device_properties(0) if cuda else None
    setup({**preset, "samples": 1}, work)
    wanted = set(args.only.split(",")) if args.only else None
    name = "h100" if gpu and "H100" in gpu.name else "h200" if gpu and "H200" in gpu.name else args.preset
    out = Path(args.out or REPO / "benchmarks" / "results" / f"memory_{name}.json")

    def write(result):  # after every point: a run stopped part-way keeps what it measured
        params = {
            "preset": args.preset,
            "only": args.only,
            "production": args.production,
            "steps": args.steps,
            "timeout_s": args.timeout,
        }
        write_result(
            out,
            result,
            params,
            goals={"max_rel_error": 0.10, "production_peak_of_card": 0.92},
            device=torch.device("cuda:0") if cuda else None,
        )

    rows = []
    for point in [] if args.no_points else POINTS[args.preset]:
        if wanted and point[0] not in wanted:
            continue
        r = {"point": list(point), **run_point(args.preset, work, list(point), args.timeout)}
        rows.append(r)
        steady = r.get("steady", {}).get("allocated_bytes")
        said = r.get("error") or (f"steady {steady / 2**30:.2f} GiB" if steady else "ran (no GPU to measure)")
        print(f"{point[0]:>20}: {said}", flush=True)
        write({"preset": args.preset, "points": rows})
    result = {
        "what": __doc__.split("\n\n")[0].replace("\n", " "),
        "preset": args.preset,
        "points": rows,
        **summarize(args.preset, rows, gpu.total_memory if gpu else None),
    }
    if args.production:
        steps = args.steps if cuda else 6
        result["production"] = production(args.preset, work, steps, args.production_timeout, out.parent)
        result["production"].update(
            judge_production(args.preset, result["production"], result["coefficients"], result["gpu_bytes"])
        )
        print(json.dumps(result["production"], indent=1), flush=True)
    write(result)
    print(f"max_rel_error {result['max_rel_error']} -> {out}")


if __name__ == "__main__":
    main()
