"""Drafter training: tokens/s and MFU per GPU, 2 GPUs against 1, and the time to the first step with a
cold compile cache against a warm one. Every number comes from the real trainer processes:
scripts/warmup.py, then scripts/train.py launched as the workflow launches it (launch.launch_argv: the
script itself for one process, `python -m torch.distributed.run` for several).

Setup (train_bench.setup, in --work, reused while its parameters match): a target directory with a Qwen3
config.json of the preset's shape, the toy tokenizer (the MASK id is set explicitly, so load_spec never
reads it: the trainer imports no transformers) and a model.safetensors holding only the random bf16
`model.embed_tokens.weight` and `lm_head.weight` (all the trainer reads of a target); and one real
hidden-state shard of random bf16 features `[S, K*H]` for a few samples of exactly S tokens with full loss
masks. The shard is listed many times on the command line, so one epoch holds more micro-batches than the
measured steps use: no epoch boundary (a new DataLoader) falls inside the measurement, and no more disk is
needed.

1. One warmup (its own emptied Inductor dir) compiles the step and writes artifacts.bin.
2. Throughput, per world size (`--gpus 1,2`): the launch line, --compile-cache from step 1, fresh empty
   Inductor cache dirs per run (the warmup's removed, as on another node), `--steps` steps logged every
   `--log-every`. tokens/s is the trainer's own (metrics CSV, all ranks summed) over the windows after the
   first (which holds the first step's tracing). The run is ended once its last row is logged, before the
   final checkpoint and export.
3. First step, for a cold process tree (no artifacts, fresh Inductor dir) and a warm one (the warmup's
   artifacts, fresh Inductor dir), at the largest world size, three ways:
   - launch (just before Popen) to the moment the trainer logs `bucket S: first step N s`: everything;
   - from its `train: ...` line (data opened) to that moment: the compile cache loaded, the drafter
     built, DDP, the first batch and the step; left out is the fixed startup no cache changes
     (the launcher, imports, NCCL, the target's config and tokenizer, opening the shards);
   - the step alone as the trainer logs it (N).
   The warm one is the throughput run of that world size: after its first step it runs every later step
   under fail_on_recompile (a recompile would end it), and its first-step line holds the cache counters
   (no FX graph or AOTAutograd misses).
   The cold one is ended right after its first-step line.
4. Resumed (one process only): a later stream-mode chunk's start. One process trains two steps and saves
   (--stop-at 2); the same command then resumes from that checkpoint with the warmup's artifacts and the
   Inductor dir the first left (chained chunk jobs on one node share it), ended after its first step.
   Launch to first step, warm and resumed, has the goal <= 10 s.
5. With `--baseline JSON` (train config overrides, e.g. today's defaults against a `--set` lever): one
   more warmup and one-process throughput run with them, on the same data; `comparison` holds both rates,
   `speedup_vs_baseline` (goal >= 1.3) and `mfu_required_grads` (goal >= 0.55, every matmul counted at
   the bf16 peak, FP8 ones too).

MFU counts matmul FLOPs (2*m*n*k) of one sample's forward and multiplies by 3 for forward + backward (the
activation-checkpoint recompute of the chunked LM head is not counted). A sample has context S, A valid
anchors, block B, Q = A*B block tokens, hidden H, intermediate I, nh heads, nkv KV heads, head dim d,
K target features, vocab V:
    fc           2*S*(K*H)*H
    per layer    q, o      2*2*Q*H*nh*d
                 k, v      2*2*(S+Q)*H*nkv*d      (context and block tokens: KV injection)
                 MLP       2*3*Q*H*I
                 attention 2*2*nh*d*P             (P = visible query-key pairs, B*(a+B) for anchor a)
    LM head      2*A*(B-1)*H*V
P is averaged over anchors drawn by loss.sample_anchors on the same length and full loss mask.
MFU = (tokens/s per GPU) * (FLOPs per token) / peak, peak the GPU's dense bf16 FLOP/s (shapes.PEAK_BF16_FLOPS:
989e12 for H100/H200), else null.
`mfu_required_grads` is the same with 2x instead of 3x for fc and the LM head, whose inputs (target
features, frozen head) need no gradient.

Usage: python benchmarks/train_drafter.py --preset tiny|qwen3-8b [--gpus 1,2] [--steps N]
           [--seq-len S] [--rows R] [--log-every N] [--work DIR]
           [--out benchmarks/results/train_drafter_<preset>.json]
           [--set JSON] [--drafter JSON] [--baseline JSON] [--profile PATH] [--runs throughput cold resumed]
A drafter family against another on the same data (one shard, with the target's last hidden state when
either trains on it): --drafter '{"family": "dspark", "block_size": 7}' --baseline
'{"drafter": {"family": "dflash"}}'.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import write_json, write_result
from shapes import peak_bf16_flops
from train_bench import (
    MILESTONES,
    PRESETS,
    REPO,
    Failed,
    Proc,
    base_env,
    check,
    drafter_config,
    drafter_json,
    flops,
    launch,
    live_rows,
    setup,
    train_config,
)

from flashdraft.config import needs_last_hidden
from flashdraft.train_step import load_spec

GOALS = {
    "mfu": 0.45,
    "scaling": 1.85,
    "warm_over_cold": 0.20,
    "launch_s": 10.0,
    "speedup": 1.3,
    "mfu_required_grads": 0.55,
}


# ---------------------------------------------------------------------------------------------------------
# the measurements


def run_warmup(preset, cfg, work: Path, shard: str, timeout: float) -> dict:
    env = base_env(preset, work / "inductor" / "warmup")
    cache = work / "compile_cache"
    shutil.rmtree(cache, ignore_errors=True)
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "warmup.py"),
        "--cfg",
        json.dumps(cfg),
        "--drafter-cfg",
        json.dumps(drafter_json(preset)),
        "--target",
        str(work / "target"),
        "--out-dir",
        str(cache),
        shard,
    ]
    p = Proc("warmup", cmd, env, work / "logs")
    try:
        p.wait_for(lambda: False, timeout)
    finally:
        p.stop()
    check(p, p.proc.returncode == 0, "warmup")
    meta = json.loads((cache / "meta.json").read_text())
    wall = round(time.perf_counter() - p.t0, 1)
    print(
        f"warmup: {wall} s, {meta['artifact_bytes']} bytes of compile caches, {meta['counters']}", flush=True
    )
    return {"wall_s": wall, **{k: meta[k] for k in ("seconds", "counters", "artifact_bytes", "key")}}


def run_throughput(
    preset, cfg, work: Path, world: int, shards: list[str], fl: dict, peak, timeout, name: str | None = None
) -> dict:
    """One launch with the warmup's artifacts and a fresh Inductor dir, ended after its last row."""
    name = name or f"train-{world}"
    env = base_env(preset, work / "inductor" / name)
    cmd = launch(preset, world, cfg, work, name, shards, ["--compile-cache", str(work / "compile_cache")])
    p = Proc(name, cmd, env, work / "logs")
    steps, run_dir = cfg["max_steps"], work / "runs" / name
    try:
        ok = p.wait_for(lambda: any(int(r["step"]) >= steps for r in live_rows(run_dir)), timeout)
        check(p, ok and p.first is not None, f"no metrics row for step {steps}")
    finally:
        p.stop()
    rows = live_rows(run_dir)
    windows = [r for r in rows if int(r["step"]) > cfg["log_every"]]  # the first window holds step 1
    check(p, bool(windows), "no window after the first")
    tps = [float(r["tokens_per_s"]) for r in windows]
    # every window trains the same tokens (full rows of S), so the rate over all of them is the harmonic mean
    agg = len(tps) / sum(1.0 / x for x in tps)
    per_gpu = agg / world
    achieved = per_gpu * fl["train_per_token"]
    out = {
        "world": world,
        "tokens_per_s": agg,
        "tokens_per_s_per_gpu": per_gpu,
        "tflops_per_gpu": achieved / 1e12,
        "mfu": achieved / peak if peak else None,
        "mfu_required_grads": per_gpu * fl["train_per_token_required_grads"] / peak if peak else None,
        "steps_measured": steps - cfg["log_every"],
        "windows_tokens_per_s": tps,
        "ms_per_step": 1e3 * world * cfg["batch_tokens"] / agg,
        "compile_cache_loaded": p.cache_loaded,
        **(p.first or {}),
        "steps_under_fail_on_recompile": int(rows[-1]["step"]) - 1 if rows else 0,
        "losses_finite": all(math.isfinite(float(r["loss"])) for r in rows),
        "losses": {r["step"]: float(r["loss"]) for r in rows},  # each window's mean, by its last step
        "log": str(p.err_log),
    }
    mfu = f", MFU {out['mfu']:.1%}" if out["mfu"] is not None else ""
    print(
        f"{name}: {agg:.0f} tokens/s ({per_gpu:.0f} per process{mfu}), first step after "
        f"{out.get('launch_to_first_step_s')} s {out.get('milestones')}, caches {out.get('counters')}",
        flush=True,
    )
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def run_cold(preset, cfg, work: Path, world: int, shards: list[str], timeout) -> dict:
    """A process tree with no artifacts and an empty Inductor dir, ended right after its first step."""
    name = f"cold-{world}"
    env = base_env(preset, work / "inductor" / name)
    p = Proc(name, launch(preset, world, cfg, work, name, shards), env, work / "logs")
    try:
        check(p, p.wait_for(lambda: p.first is not None, timeout), "no first-step line")
    finally:
        p.stop()
    print(
        f"{name}: first step after {p.first['launch_to_first_step_s']} s {p.first['milestones']}, "
        f"caches {p.first['counters']}",
        flush=True,
    )
    shutil.rmtree(work / "runs" / name, ignore_errors=True)
    return {"world": world, "compile_cache_loaded": p.cache_loaded, **p.first, "log": str(p.err_log)}


def run_resumed(preset, cfg, work: Path, shards: list[str], timeout) -> dict:
    """A later stream-mode chunk's start: one process trains two steps and saves (--stop-at 2), then the
    same command resumes from that checkpoint (read in the background from the job's start) with the
    warmup's artifacts and the Inductor dir the first process left, as chained chunk jobs on one node
    share it; ended right after its first step."""
    name = "resumed-1"
    env = base_env(preset, work / "inductor" / name)
    cmd = launch(preset, 1, cfg, work, name, shards, ["--compile-cache", str(work / "compile_cache")])
    try:
        saver = Proc(f"{name}-save", [*cmd, "--stop-at", "2"], env, work / "logs")
        try:
            check(saver, saver.wait_for(lambda: saver.proc.poll() is not None, timeout), "did not stop")
        finally:
            saver.stop()
        check(saver, saver.proc.returncode == 0, "--stop-at 2")
        p = Proc(name, cmd, env, work / "logs")
        try:
            check(p, p.wait_for(lambda: p.first is not None, timeout), "no first-step line")
        finally:
            p.stop()
    finally:
        shutil.rmtree(work / "runs" / name, ignore_errors=True)  # the drafter's full state
    print(
        f"{name}: first step after {p.first['launch_to_first_step_s']} s {p.first['milestones']}, "
        f"caches {p.first['counters']}",
        flush=True,
    )
    return {"world": 1, "compile_cache_loaded": p.cache_loaded, **p.first, "log": str(p.err_log)}


def run_baseline(preset, cfg, work: Path, shard: str, shards: list[str], fl: dict, peak, timeout) -> dict:
    """The same throughput measurement, one process, with the baseline's train config: its own warmup
    (its compiled step differs), the same data."""
    run_warmup(preset, cfg, work, shard, timeout)
    return run_throughput(preset, cfg, work, 1, shards, fl, peak, timeout, name="baseline-1")


def compare(new: dict, base: dict, changes: dict, baseline: dict) -> dict:
    """One process's throughput with `changes` (--set) against the baseline's, measured in one run."""
    return {
        "set": changes,
        "baseline": baseline,
        "tokens_per_s_per_gpu": new["tokens_per_s_per_gpu"],
        "baseline_tokens_per_s_per_gpu": base["tokens_per_s_per_gpu"],
        "speedup_vs_baseline": new["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"],
        "mfu_required_grads": new["mfu_required_grads"],
        "baseline_mfu_required_grads": base["mfu_required_grads"],
        "mfu_note": "every matmul at the bf16 dense peak (989 TFLOP/s on H100/H200), FP8 ones too",
        "baseline_start": {k: base.get(k) for k in ("launch_to_first_step_s", "first_step_s", "milestones")},
        **loss_difference(new.get("losses", {}), base.get("losses", {})),
    }


def loss_difference(new: dict, base: dict) -> dict:
    """The logged losses of both runs (same data, seed and steps), window by window: the largest
    relative difference, and at which step."""
    steps = sorted(set(new) & set(base), key=int)
    if not steps:
        return {}
    rel = {s: abs(new[s] - base[s]) / abs(base[s]) for s in steps}
    worst = max(rel, key=rel.get)
    return {
        "loss_steps_compared": len(steps),
        "loss_max_rel_diff": rel[worst],
        "loss_max_rel_diff_step": worst,
    }


def since_data(run: dict) -> float:
    """Seconds from the trainer's `train: ...` line (data opened) to the end of its first step."""
    return run["launch_to_first_step_s"] - run["milestones"]["data_opened_s"]


def startup_spans(run: dict | None) -> dict | None:
    """Seconds each start-up stage took, by the milestone that ends it, each from the one before (from
    launch for the first): worker_started is the launcher's share, imports_done the worker's imports, ..."""
    if not run or "milestones" not in run:
        return None
    spans, before = {}, 0.0
    for key in ("worker_started_s", *dict.fromkeys(MILESTONES.values())):  # model_built_s: two lines
        if key in run["milestones"]:
            spans[key.removesuffix("_s")] = round(run["milestones"][key] - before, 2)
            before = run["milestones"][key]
    return spans


def goal(value, target: float, higher: bool = True) -> dict:
    ok = None if value is None else (value >= target if higher else value <= target)
    return {"value": value, "goal": (">= " if higher else "<= ") + str(target), "pass": ok}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument(
        "--gpus",
        default=None,
        help="world sizes to compare, e.g. 1,2 (default: 1 and 2 where available; processes on CPU)",
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per throughput run")
    p.add_argument(
        "--runs",
        nargs="+",
        default=["throughput", "cold", "resumed"],
        choices=["throughput", "cold", "resumed"],
        help="which of the runs to make (default: all)",
    )
    p.add_argument("--log-every", type=int, default=None, help="steps per metrics window")
    p.add_argument("--work", default=None, help="work dir (default: <tmp>/flashdraft-train-bench-<preset>)")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--profile",
        default=None,
        metavar="PATH",
        help="after the measurements, profile one warm process's start to its first step here",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sample (the bucket trained), instead of the preset's",
    )
    p.add_argument(
        "--rows",
        type=int,
        default=None,
        help="samples per micro-batch (train.batch_tokens = rows x seq-len), not the preset's",
    )
    p.add_argument(
        "--set",
        type=json.loads,
        default={},
        metavar="JSON",
        help="train config overrides of every run, e.g. '{\"compile_loss\": true}'",
    )
    p.add_argument(
        "--drafter",
        type=json.loads,
        default={},
        metavar="JSON",
        help='drafter section overrides of every run, e.g. \'{"family": "dspark", "block_size": 7}\'',
    )
    p.add_argument(
        "--baseline",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="also measure one process with these overrides on top of --set (e.g. today's "
        'default), side by side on the same data: the `comparison` key; its "drafter" '
        "key, if any, overrides the drafter section instead (another family or block)",
    )
    p.add_argument(
        "--rescore",
        default=None,
        metavar="JSON",
        help="derive the ratios and goals of a saved result again from its raw measurements",
    )
    args = p.parse_args()
    if args.rescore:
        saved = Path(args.rescore)
        result = json.loads(saved.read_text())
        score(result)
        write_json(saved, result)  # the measurement's own envelope kept
        return print_table(result, saved)
    preset = dict(PRESETS[args.preset])
    preset |= {k: v for k, v in (("seq_len", args.seq_len), ("rows", args.rows)) if v is not None}
    preset["drafter"] = preset["drafter"] | args.drafter
    base_drafter = (args.baseline or {}).get("drafter")
    if base_drafter is not None:  # one shard serves both sides
        preset["last_hidden"] = needs_last_hidden(
            drafter_config({**preset, "drafter": preset["drafter"] | base_drafter})
        )
    cuda = preset["device"] == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"preset {args.preset} needs a CUDA GPU")
    available = torch.cuda.device_count() if cuda else 2
    sizes = [int(x) for x in args.gpus.split(",")] if args.gpus else [w for w in (1, 2) if w <= available]
    if cuda and max(sizes) > available:
        raise SystemExit(f"--gpus {args.gpus}: only {available} GPU(s) visible")
    steps, log_every = args.steps or preset["steps"], args.log_every or preset["log_every"]
    if steps < 2 * log_every:
        raise SystemExit("--steps must cover at least two --log-every windows (the first is skipped)")
    work = Path(args.work or Path(tempfile.gettempdir()) / f"flashdraft-train-bench-{args.preset}")
    (work / "logs").mkdir(parents=True, exist_ok=True)
    out = Path(args.out or REPO / "benchmarks" / "results" / f"train_drafter_{args.preset}.json")

    # a SIGTERM (a job's time limit) unwinds like an error, so every process tree started here is ended
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        run_all(args, preset, sizes, steps, log_every, work, out)
    finally:
        for p in Proc.live:
            p.stop()


def run_profiled(preset, cfg, work: Path, shards: list[str], timeout, path: Path) -> None:
    """One more warm run of one process under cProfile, stopped after its first step (--stop-at 1, so the
    profile is written): where its start-up goes, function by function (path, and path.txt the 60 most
    expensive by cumulative time). Not a timing: the profiler slows Python code down."""
    name = "profile-1"
    env = base_env(preset, work / "inductor" / name)
    cmd = launch(
        preset, 1, cfg, work, name, shards, ["--compile-cache", str(work / "compile_cache"), "--stop-at", "1"]
    )
    p = Proc(name, [cmd[0], "-m", "cProfile", "-o", str(path), *cmd[1:]], env, work / "logs")
    try:
        check(p, p.wait_for(lambda: p.proc.poll() is not None, timeout), "did not stop after step 1")
    finally:
        p.stop()
        shutil.rmtree(work / "runs" / name, ignore_errors=True)  # its checkpoint: the drafter's full state
    import pstats

    with open(f"{path}.txt", "w") as f:
        pstats.Stats(str(path), stream=f).sort_stats("cumulative").print_stats(60)
    print(f"{name}: profile in {path}.txt", flush=True)


def run_all(args, preset: dict, sizes: list[int], steps: int, log_every: int, work: Path, out: Path):
    cuda, timeout = preset["device"] == "cuda", preset["timeout"]
    t_start = time.perf_counter()
    setup(preset, work)
    spec = load_spec(work / "target", drafter_config(preset))
    cfg = train_config(preset, steps, log_every) | args.set
    shard = str(work / "hidden" / "shard-00000.arrow")
    # list the shard often enough that one epoch outlasts the measured steps of the largest world size
    repeat = math.ceil((steps + 1) * max(sizes) * preset["rows"] / preset["samples"])
    shards = [shard] * repeat
    fl = flops(preset, spec)

    result = {
        "what": "drafter training throughput, MFU, scaling over GPUs and first-step time with a cold vs "
        "warm compile cache; real warmup.py / train.py processes as the workflow launches them, "
        "random features",
        "preset": args.preset,
        "date": time.strftime("%Y-%m-%d"),
        "shapes": {
            "target": preset["target"],
            "drafter": drafter_json(preset),
            "target_layer_ids": spec.target_layer_ids,
            "seq_len": preset["seq_len"],
            "rows_per_micro_batch": preset["rows"],
            "dtype": preset["dtype"],
            "attention": preset["attention"],
            "device": preset["device"],
        },
        "train_cfg": cfg,
        "data": {
            "unique_samples": preset["samples"],
            "shard_listed": repeat,
            "samples_per_epoch": repeat * preset["samples"],
            "shard_bytes": Path(shard).stat().st_size,
        },
        "world_sizes": sizes,
        "flops": fl,
        "flops_note": "DFlash's matmuls (module docstring); another family's own heads (DSpark: the Markov "
        "and confidence heads, the target's distribution over the last hidden state) are "
        "not counted, so its MFU is a lower bound",
        "errors": [],
    }
    throughput, warmup_meta, cold, resumed, baseline = {}, None, None, None, None
    try:
        warmup_meta = run_warmup(preset, cfg, work, shard, timeout)
        peak = peak_bf16_flops(warmup_meta["key"]["device"]) if cuda else None
        result["flops"]["peak_flops_per_gpu"] = peak
        for w in sizes if "throughput" in args.runs else ():
            try:
                throughput[str(w)] = run_throughput(preset, cfg, work, w, shards, fl, peak, timeout)
            except (Failed, TimeoutError) as e:
                result["errors"].append(str(e))
        try:
            cold = run_cold(preset, cfg, work, max(sizes), shards, timeout) if "cold" in args.runs else None
        except (Failed, TimeoutError) as e:
            result["errors"].append(str(e))
        if max(sizes) == 1 and "resumed" in args.runs:
            try:
                resumed = run_resumed(preset, cfg, work, shards, timeout)
            except (Failed, TimeoutError) as e:
                result["errors"].append(str(e))
        if args.baseline is not None and "1" in throughput:
            base = {k: v for k, v in args.baseline.items() if k != "drafter"}
            base_preset = {**preset, "drafter": preset["drafter"] | args.baseline.get("drafter", {})}
            try:
                baseline = run_baseline(base_preset, cfg | base, work, shard, shards, fl, peak, timeout)
            except (Failed, TimeoutError) as e:
                result["errors"].append(str(e))
        if args.profile:
            try:
                run_profiled(preset, cfg, work, shards, timeout, Path(args.profile))
            except (Failed, TimeoutError) as e:
                result["errors"].append(str(e))
    except (Failed, TimeoutError) as e:
        result["errors"].append(str(e))

    warm = throughput.get(str(max(sizes)))
    result |= {
        "warmup": warmup_meta and {k: v for k, v in warmup_meta.items() if k != "key"},
        "throughput": throughput,
        "first_step": {
            "world": max(sizes),
            "cold": cold,
            "warm": warm
            and {
                k: warm.get(k)
                for k in (
                    "launch_to_first_step_s",
                    "first_step_s",
                    "milestones",
                    "counters",
                    "compile_cache_loaded",
                    "steps_under_fail_on_recompile",
                    "log",
                )
            },
            "resumed": resumed,
        },
    }
    if baseline is not None:
        result["comparison"] = compare(throughput["1"], baseline, args.set, args.baseline)
    score(result)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    written = write_result(out, result, params=vars(args), device=preset["device"])
    print_table(written, out)


def score(result: dict) -> None:
    """Scaling, the warm/cold ratios and the goals, derived from the raw measurements in `result` (so a
    saved result can be scored again with --rescore)."""
    throughput, first = result["throughput"], result["first_step"]
    one, two = throughput.get("1"), throughput.get("2")
    ratio = two["tokens_per_s"] / one["tokens_per_s"] if one and two else None
    warm, cold = first["warm"], first["cold"]
    both = bool(warm and cold and "launch_to_first_step_s" in warm)
    launch_ratio = warm["launch_to_first_step_s"] / cold["launch_to_first_step_s"] if both else None
    step_ratio = warm["first_step_s"] / cold["first_step_s"] if both else None
    opened = both and "data_opened_s" in warm["milestones"] and "data_opened_s" in cold["milestones"]
    setup_ratio = since_data(warm) / since_data(cold) if opened else None
    counters = (warm or {}).get("counters") or {}
    misses = sum(v for k, v in counters.items() if k.endswith("_miss")) if counters else None
    mfus = [t["mfu"] for t in throughput.values() if t["mfu"] is not None]
    result["scaling"] = {
        "measured": ratio is not None,
        "tokens_per_s_2_over_1": ratio,
        "note": None if ratio is not None else "needs world sizes 1 and 2",
    }
    first.pop("warm_over_cold", None)  # the launch-based ratio, under its name before the three spans
    resumed = first.get("resumed")
    first |= {
        "warm_startup_spans_s": startup_spans(warm),
        "cold_startup_spans_s": startup_spans(cold),
        "resumed_startup_spans_s": startup_spans(resumed),
        "first_step_warm_over_cold": step_ratio,
        "data_opened_to_first_step_warm_over_cold": setup_ratio,
        "launch_to_first_step_warm_over_cold": launch_ratio,
    }
    result["goals"] = {
        "mfu_per_gpu": goal(min(mfus) if mfus else None, GOALS["mfu"]),
        "scaling_2_over_1": goal(ratio, GOALS["scaling"]),
        # three spans ending at the first step's end (see the docstring, 3.)
        "first_step_warm_over_cold": goal(step_ratio, GOALS["warm_over_cold"], higher=False),
        "data_opened_to_first_step_warm_over_cold": goal(setup_ratio, GOALS["warm_over_cold"], higher=False),
        "launch_to_first_step_warm_over_cold": goal(launch_ratio, GOALS["warm_over_cold"], higher=False),
        "launch_to_first_step_warm_s": goal(
            warm and warm.get("launch_to_first_step_s"), GOALS["launch_s"], higher=False
        ),
        "launch_to_first_step_resumed_s": goal(
            resumed and resumed["launch_to_first_step_s"], GOALS["launch_s"], higher=False
        ),
        **(
            {
                "speedup_vs_baseline": goal(result["comparison"]["speedup_vs_baseline"], GOALS["speedup"]),
                "mfu_required_grads": goal(
                    result["comparison"]["mfu_required_grads"], GOALS["mfu_required_grads"]
                ),
            }
            if "comparison" in result
            else {}
        ),
        "warm_cache_misses": {
            "value": misses,
            "goal": "== 0 (FX graph and AOTAutograd cache misses in the warm run)",
            "pass": None if misses is None else misses == 0,
        },
    }


def print_table(result: dict, out: Path) -> None:
    cfg, cold = result["train_cfg"], result["first_step"]["cold"]
    shapes, throughput = result["shapes"], result["throughput"]
    print(
        f"\n{result['preset']} on {result['machine'].get('device', '?')}, S={shapes['seq_len']}, "
        f"{shapes['rows_per_micro_batch']} rows/micro-batch, {cfg['max_steps']} steps, "
        f"{result.get('wall_s')} s -> {out}"
    )
    print(
        f"{'world':>5}{'tok/s':>12}{'tok/s/gpu':>12}{'TFLOP/s/gpu':>13}{'MFU':>8}{'MFU req':>9}"
        f"{'ms/step':>9}{'launch-1st s':>13}{'1st step s':>11}"
    )
    for w, t in throughput.items():
        mfu = (
            f"{t['mfu']:>8.1%}{t['mfu_required_grads']:>9.1%}"
            if t["mfu"] is not None
            else f"{'-':>8}{'-':>9}"
        )
        print(
            f"{w:>5}{t['tokens_per_s']:>12.0f}{t['tokens_per_s_per_gpu']:>12.0f}{t['tflops_per_gpu']:>13.2f}"
            f"{mfu}{t['ms_per_step']:>9.1f}{t.get('launch_to_first_step_s', float('nan')):>13.1f}"
            f"{t.get('first_step_s', float('nan')):>11.1f}"
        )
    if cold:
        print(f"{'cold':>5}{'':>63}{cold['launch_to_first_step_s']:>13.1f}{cold['first_step_s']:>11.1f}")
    resumed = result["first_step"].get("resumed")
    if resumed:
        print(
            f"{'resumed':>7}{'':>61}{resumed['launch_to_first_step_s']:>13.1f}{resumed['first_step_s']:>11.1f}"
        )
    for which in ("warm", "cold", "resumed"):
        spans = result["first_step"].get(f"{which}_startup_spans_s")
        if spans:
            print(
                f"{which} start-up (s, each stage from the one before): "
                + ", ".join(f"{k} {v:.1f}" for k, v in spans.items())
            )
    if "comparison" in result:
        c = result["comparison"]
        print(
            f"{json.dumps(c['set'])} against {json.dumps(c['baseline'])}: {c['tokens_per_s_per_gpu']:.0f} "
            f"against {c['baseline_tokens_per_s_per_gpu']:.0f} tokens/s, {c['speedup_vs_baseline']:.3f}x"
        )
    for g, v in result["goals"].items():
        val = v["value"]
        shown = f"{val:.3f}" if isinstance(val, float) else str(val)
        status = {True: "pass", False: "FAIL", None: "not measured"}[v["pass"]]
        print(f"goal {g:<42} {shown:>8}  ({v['goal']})  {status}")
    for e in result["errors"]:
        print(f"error: {e}")
    if result["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
