"""Where one training step's time goes: torch.profiler over the real step, kernel time by kind.

One process, no torchrun: the run is built by `train_setup.setup` as scripts/train.py builds it (compiled
drafter, the target's frozen head, fused AdamW on CUDA, the schedule) on train_drafter.py's preset target
and random hidden-state shard (made in --work, reused), and fed by the same path as train.py's loop:
`epoch_batches`, `rank_share`, `step_batches` (DataLoader workers on CUDA), per-sample anchor seeds, the
global normalizer, `accumulate` (fail_on_recompile after the first step), gradient clipping, the
optimizer and the schedule, metrics rows every log_every steps. No checkpoints are saved.

--warmup steps compile the step, --steps more are timed without the profiler, then --steps under
torch.profiler (CPU + CUDA activity, no shapes, no stacks). From the profiled steps' trace:

- kinds: device time per step by kernel kind (gemm, attention, triton pointwise / reduction, eager ATen,
  optimizer, memcpy, memset, nccl, other), its share and launches per step; on CPU the self time of the
  ops (aten::mm etc.) instead of kernels;
- regions: the same time by where the kernel was launched: the step's phases (data, prep: anchors and
  normalizer, fwd_bwd, clip, optimizer, log), fwd_bwd split into the compiled drafter forward, its
  backward, and the rest (eager: block mask, embedding, LM head + cross-entropy, labels);
- gpu: busy time (the union of kernel, memcpy and memset intervals) against wall time per step, the idle
  remainder, and the idle gaps by size, by the region of the kernel after them, and the largest ones;
- host: time in the loader's next() per step, synchronizing calls (cudaStreamSynchronize, ...) and
  device-to-host copies per step, and the time the CPU sat in synchronizing calls;
- compile: Dynamo's graph and frame counters and the compile-cache counters before and after the
  profiled steps (recompiles must be 0);
- tokens/s with and without the profiler, and MFU (train_drafter.py's FLOP formula) on H100/H200.

The JSON holds a dict of labelled runs (--label before, after, ...): a run with another label adds to the
file and keeps the others; the table compares every label in it.

Usage: python benchmarks/train_profile.py --preset tiny|qwen3-8b [--steps 6] [--warmup 3] [--label before]
           [--out benchmarks/results/train_profile_<preset>.json] [--trace trace.json] [--work DIR]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gzip
import json
import math
import os
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from harness import code_version, machine, time_it, write_result
from shapes import peak_bf16_flops
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile, record_function
from train_bench import PRESETS, REPO, drafter_config, drafter_json, flops, setup, train_config

from flashdraft.batches import anchor_seeds
from flashdraft.compile_cache import cache_counters
from flashdraft.config import TrainConfig, from_dict
from flashdraft.distributed import setup_dist
from flashdraft.metrics import MetricsLogger
from flashdraft.train import accumulate, global_normalizer
from flashdraft.train_data import StoreData, run_dir
from flashdraft.train_setup import TrainJob
from flashdraft.train_setup import setup as train_setup
from flashdraft.train_step import anchors_for

PHASES = ("data", "prep", "fwd_bwd", "clip", "optimizer", "log")  # record_function names, in step order
# kernel kind: the first rule with a substring of the lower-cased name wins (memcpy / memset by category)
CUDA_KINDS = [
    ("nccl", ("nccl",)),
    ("multi-tensor (adam, clip)", ("multi_tensor", "fused_adam", "adamw", "_foreach")),
    ("attention", ("flex", "attention", "fmha", "flash", "sdpa")),
    (
        "gemm",
        (
            "gemm",
            "nvjet",
            "cutlass",
            "xmma",
            "cublas",
            "splitk",
            "triton_tem_fused_mm",
            "triton_tem_fused_addmm",
            "triton_tem_fused_bmm",
        ),
    ),
    ("attention", ("triton_tem",)),  # Inductor's templates here are flex attention's (no max-autotune)
    ("triton pointwise", ("triton_poi",)),
    ("triton reduction", ("triton_red", "triton_per")),
    ("triton other", ("triton",)),
    ("aten eager", ("at::", "at_cuda_detail", "cub::", "elementwise", "reduce_kernel", "index")),
]
CPU_KINDS = [
    ("optimizer", ("optimizer.", "_foreach", "adam")),
    ("attention", ("attention", "flex", "sdpa")),
    ("gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")),
    (
        "inductor fused",
        ("compiledfxgraph", "torch-compiled region", "compiledfunction", "cpp_fused", "inductor"),
    ),
    ("memcpy", ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous")),
    ("aten eager", ("aten::",)),
    (
        "autograd, dynamo wrappers",
        ("autograd::", "backward", "dynamo", "aotdispatcher", "bytecode", "detach"),
    ),
]
# enclosing ranges that mark the compiled drafter, innermost first; the rest of fwd_bwd is eager
COMPILED = [
    ("CompiledFunctionBackward", "fwd_bwd: drafter backward (compiled)"),
    ("CompiledFunction", "fwd_bwd: drafter forward (compiled)"),
    ("Torch-Compiled Region", "fwd_bwd: drafter forward (compiled)"),
]
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
GAP_BINS = ((10, "<10us"), (100, "10-100us"), (1000, "0.1-1ms"), (math.inf, ">1ms"))


def compiled_label(name: str) -> str | None:
    return next((label for key, label in COMPILED if name.startswith(key)), None)


def kind_of(name: str, cat: str, cuda: bool) -> str:
    if cat in ("gpu_memcpy", "gpu_memset"):
        return cat.removeprefix("gpu_")
    low = name.lower()
    for kind, keys in CUDA_KINDS if cuda else CPU_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


# ---------------------------------------------------------------------------------------------------------
# the run


def build(preset: dict, work: Path, steps: int, changes: dict):
    """train_setup.setup's run on the preset's target and shard (listed often enough for every step of one
    epoch) and its metrics logger; `changes`: train config overrides (--set)."""
    setup(preset, work)
    cfg = from_dict(TrainConfig, train_config(preset, steps, preset["log_every"]) | changes, "train")
    shard = str(work / "hidden" / "shard-00000.arrow")
    shards = [shard] * math.ceil((steps + 1) * preset["rows"] / preset["samples"])
    d = setup_dist()  # no RANK in the environment: one process, cuda:0 or the CPU
    checkpoints = work / "profile" / "checkpoints"
    shutil.rmtree(checkpoints, ignore_errors=True)  # never resume: every run starts at step 0
    drafter = drafter_config(preset)
    job = TrainJob(cfg, drafter, work / "target", StoreData(shards, cfg), checkpoints)
    run, _ = train_setup(d, job, run_dir(checkpoints, cfg, drafter, job.data))
    run.run_dir.mkdir(parents=True, exist_ok=True)
    metrics = MetricsLogger(run.run_dir, d, run.spec.block_size, 0, run.total)
    return run, metrics


class Loop:
    """train.py's loop body, step by step, each phase under a record_function of its name."""

    def __init__(self, run, metrics: MetricsLogger):
        self.run, self.metrics = run, metrics
        self.batches, self.it = run.ahead  # the first epoch, its loader started by train_setup.setup
        self.step, self.seen = 0, set()
        self.data_wait, self.tokens = 0.0, 0

    def __call__(self):
        run, cfg = self.run, self.run.cfg
        with record_function("data"):
            t = time.perf_counter()
            ks, micro = next(self.it)
            self.data_wait += time.perf_counter() - t
        with record_function("prep"):
            anchors = [
                anchors_for(
                    run.step,
                    b["loss_mask"],
                    seeds=anchor_seeds(cfg.seed, 0, self.batches[k], len(b["loss_mask"])),
                )
                for k, b in zip(ks, micro, strict=True)
            ]
            norm = global_normalizer(run, micro, anchors)
        with record_function("fwd_bwd"):
            accumulate(run, micro, anchors, norm, self.metrics, self.seen)
        with record_function("clip"):
            grad_norm = torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), cfg.grad_clip)
        with record_function("optimizer"):
            lr = run.scheduler.get_last_lr()[0]
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            run.scheduler.step()
        self.step += 1
        self.tokens += sum(b["tokens"] for b in micro)
        if self.step % cfg.log_every == 0:
            with record_function("log"):
                epoch = self.step * run.micro_per_step / len(self.batches)
                self.metrics.log(self.step, epoch, lr, float(grad_norm))

    def timed(self, steps: int, prof=None) -> dict:
        """`steps` steps between two device syncs: wall time, tokens, time in the loader's next()."""
        self.data_wait, self.tokens, marks = 0.0, 0, []
        graphs = counters["stats"]["unique_graphs"]

        def step():
            self()
            marks.append(time.perf_counter())

        t = time.perf_counter()
        with prof or contextlib.nullcontext():
            wall = steps * time_it(step, warmup=0, repeats=1, number=steps, device=self.run.d.device).median_s
        return {
            "steps": steps,
            "wall_ms_per_step": 1e3 * wall / steps,
            "tokens_per_s": self.tokens / wall,
            "data_wait_ms_per_step": 1e3 * self.data_wait / steps,
            # when each step's launches were done, from the start (ahead of the device on CUDA)
            "steps_issued_ms": [round(1e3 * (m - t), 1) for m in marks],
            "graphs_compiled": counters["stats"]["unique_graphs"] - graphs,
        }


def dynamo_counters() -> dict:
    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "frames": counters["frames"]["total"],
        "frames_ok": counters["frames"]["ok"],
        **cache_counters(),
    }


# ---------------------------------------------------------------------------------------------------------
# the trace


def self_times(events: list[dict]) -> list[dict]:
    """CPU ops with their self time (`dur` less their children's), per thread; the step's own phase
    ranges are left out (their self time is Python outside any op)."""
    out = []
    by_tid = defaultdict(list)
    for e in events:
        if e["name"] not in PHASES:
            by_tid[e["tid"]].append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                stack[-1]["self"] -= e["dur"]
            e = {**e, "self": e["dur"]}
            stack.append(e)
            out.append(e)
    for e in out:
        e["dur"] = max(0.0, e["self"])
    return out


def gaps(work: list[dict], where: dict, steps: int) -> dict:
    """Busy time (the union of the intervals) and the idle gaps between them: by size, by the region of
    the kernel after the gap (what the device waited for), the largest."""
    merged, found = [], []
    for s, t, r, n in sorted((e["ts"], e["ts"] + e["dur"], where[id(e)], e["name"]) for e in work):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t)
            continue
        if merged:
            found.append((s - merged[-1][1], r, n))
        merged.append([s, t])
    by_size, count, by_region = Counter(), Counter(), Counter()
    for g, r, _ in found:
        label = next(label for lim, label in GAP_BINS if g < lim)
        by_size[label] += g
        count[label] += 1
        by_region[r] += g
    return {
        "busy_ms_per_step": sum(t - s for s, t in merged) / 1e3 / steps,
        "gaps_ms_per_step_by_size": {label: by_size[label] / 1e3 / steps for _, label in GAP_BINS},
        "gaps_per_step_by_size": {label: count[label] / steps for _, label in GAP_BINS},
        "gaps_ms_per_step_by_next_region": {r: g / 1e3 / steps for r, g in by_region.most_common()},
        "largest_gaps": [
            {"us": round(g, 1), "next_region": r, "next": n[:120]}
            for g, r, n in sorted(found, reverse=True)[:8]
        ],
    }


def analyse(trace: dict, cuda: bool, steps: int, wall_ms: float) -> dict:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    phases = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in cpu if e["name"] in PHASES)
    marks = [(e["ts"], e["ts"] + e["dur"], e["tid"], compiled_label(e["name"])) for e in cpu]
    marks = [m for m in marks if m[3]]

    def region(ts: float, tid) -> str:
        i = bisect.bisect_right(phases, (ts, math.inf, "")) - 1
        phase = phases[i][2] if i >= 0 and ts <= phases[i][1] else "outside the step's phases"
        if phase != "fwd_bwd":
            return phase
        inner = [m for m in marks if m[0] <= ts <= m[1] and m[2] == tid]
        return min(inner, key=lambda m: m[1] - m[0])[3] if inner else "fwd_bwd: rest (eager)"

    if cuda:
        launches = {
            e["args"]["correlation"]: e
            for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
        }
        work = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        where = {}
        for e in work:
            launch = launches.get(e.get("args", {}).get("correlation"))
            where[id(e)] = region(launch["ts"], launch["tid"]) if launch else "unknown"
    else:
        work = self_times(cpu)
        where = {id(e): region(e["ts"], e["tid"]) for e in work}

    # by kind, by region, by kernel name
    kinds, regions, names = defaultdict(Counter), defaultdict(Counter), defaultdict(Counter)
    for e in work:
        k = kind_of(e["name"], e.get("cat", ""), cuda)
        for table, key in ((kinds, k), (regions, where[id(e)]), (names, (e["name"], k, where[id(e)]))):
            table[key]["us"] += e["dur"]
            table[key]["n"] += 1
        regions[where[id(e)]][k] += e["dur"]
    total_us = sum(c["us"] for c in kinds.values()) or 1.0

    def row(c: Counter) -> dict:
        return {
            "ms_per_step": c["us"] / 1e3 / steps,
            "share": c["us"] / total_us,
            "launches_per_step": c["n"] / steps,
        }

    by_kind = {k: row(c) for k, c in sorted(kinds.items(), key=lambda kv: -kv[1]["us"])}
    by_region = {
        r: {
            **row(c),
            "ms_per_step_by_kind": {k: v / 1e3 / steps for k, v in c.items() if k not in ("us", "n")},
        }
        for r, c in sorted(regions.items(), key=lambda kv: -kv[1]["us"])
    }
    top = [
        {"name": n[:200], "kind": k, "region": r, **row(c)}
        for (n, k, r), c in sorted(names.items(), key=lambda kv: -kv[1]["us"])[:15]
    ]
    others = [n[:200] for (n, k, _), _c in sorted(names.items(), key=lambda kv: -kv[1]["us"]) if k == "other"]

    busy = {"what": "sum of the CPU ops' self time", "busy_ms_per_step": total_us / 1e3 / steps}
    if cuda:
        busy = {"what": "union of kernel, memcpy and memset intervals", **gaps(work, where, steps)}
    busy |= {
        "wall_ms_per_step": wall_ms,
        "idle_ms_per_step": wall_ms - busy["busy_ms_per_step"],
        "idle_fraction": 1 - busy["busy_ms_per_step"] / wall_ms,
    }

    host = {}
    if cuda:
        runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
        syncs = Counter(e["name"] for e in runtime if e["name"] in SYNCS)
        blocked = sum(e["dur"] for e in runtime if e["name"] in SYNCS)
        dtoh = [e for e in work if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]]
        host = {
            "syncs_per_step": {k: v / steps for k, v in syncs.items()},
            "cpu_blocked_in_syncs_ms_per_step": blocked / 1e3 / steps,
            "dtoh_copies_per_step": len(dtoh) / steps,
            "syncs_per_step_by_region": {
                r: n / steps
                for r, n in Counter(region(e["ts"], e["tid"]) for e in runtime if e["name"] in SYNCS).items()
            },
        }
    return {
        "kinds": by_kind,
        "regions": by_region,
        "top": top,
        "other_names": others[:20],
        "device": busy,
        "host": host,
        "device_ms_per_step": total_us / 1e3 / steps,
    }


# ---------------------------------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--steps", type=int, default=6, help="profiled steps (and as many timed without)")
    p.add_argument("--warmup", type=int, default=3, help="steps before, the first compiles")
    p.add_argument("--label", default="before", help="the run's key in the JSON's runs")
    p.add_argument("--out", default=None, help="default: benchmarks/results/train_profile_<preset>.json")
    p.add_argument("--trace", default=None, help="also write the profiled steps' chrome trace here")
    p.add_argument(
        "--work",
        default=None,
        help="work dir (default: <tmp>/flashdraft-train-bench-<preset>, shared with train_drafter.py)",
    )
    p.add_argument(
        "--set",
        type=json.loads,
        default={},
        metavar="JSON",
        help='train config overrides, e.g. \'{"fp8": "tensorwise"}\' (kept in the run\'s entry)',
    )
    args = p.parse_args()
    preset = dict(PRESETS[args.preset])
    cuda = preset["device"] == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"preset {args.preset} needs a CUDA GPU")
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    work = Path(args.work or Path(tempfile.gettempdir()) / f"flashdraft-train-bench-{args.preset}")
    out = Path(args.out or REPO / "benchmarks" / "results" / f"train_profile_{args.preset}.json")

    t0 = time.perf_counter()
    total_steps = args.warmup + 2 * args.steps
    run, metrics = build(preset, work, total_steps, args.set)
    loop = Loop(run, metrics)
    try:
        t = time.perf_counter()
        warm = loop.timed(args.warmup)
        print(f"warm-up: {args.warmup} steps in {time.perf_counter() - t:.1f} s (compiles)", flush=True)
        plain = loop.timed(args.steps)
        before = dynamo_counters()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof = profile(activities=activities, record_shapes=False, with_stack=False)
        profiled = loop.timed(args.steps, prof)
        after = dynamo_counters()
    finally:
        metrics.close()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.trace or Path(tmp) / "trace.json")
        prof.export_chrome_trace(str(path))
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            trace = json.load(f)
    res = analyse(trace, cuda, args.steps, profiled["wall_ms_per_step"])

    spec, fl = run.spec, flops(preset, run.spec)
    this = machine(preset["device"])  # each labelled run records its own machine and commit
    peak = peak_bf16_flops(this["device"]) if cuda else None
    delta = {k: after[k] - before[k] for k in after}
    entry = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "git": code_version(),
        "machine": this,
        "preset": args.preset,
        "set": args.set,
        "shapes": {
            "target": preset["target"],
            "drafter": drafter_json(preset),
            "target_layer_ids": spec.target_layer_ids,
            "seq_len": preset["seq_len"],
            "rows_per_micro_batch": preset["rows"],
            "micro_batches_per_step": run.micro_per_step,
            "tokens_per_step": run.cfg.batch_tokens * run.micro_per_step,
            "dtype": preset["dtype"] if cuda else "float32",
            "attention": run.step.attention,
            "compile": run.cfg.compile,
            "device": preset["device"],
        },
        "steps": {
            "warmup": args.warmup,
            "timed": args.steps,
            "profiled": args.steps,
            "log_every": run.cfg.log_every,
        },
        "timing": {
            "warmup": warm,
            "without_profiler": plain,
            "with_profiler": profiled,
            "mfu": plain["tokens_per_s"] * fl["train_per_token"] / peak if peak else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        },
        "compile": {"before": before, "after": after, "delta": delta, "recompiles": delta["unique_graphs"]},
        "kinds": res["kinds"],
        "regions": res["regions"],
        "top_kernels": res["top"],
        "other_kernel_names": res["other_names"],
        "device_time_ms_per_step": res["device_ms_per_step"],
        "busy": res["device"],
        "host": {"data_wait_ms_per_step": profiled["data_wait_ms_per_step"], **res["host"]},
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    saved = json.loads(out.read_text()) if out.exists() else {}
    result = {
        "what": "one training step under torch.profiler: device time by kernel kind and by region, idle "
        "gaps, data waits, host syncs, recompiles; runs by label (before / after a change); the "
        "envelope is the last run's",
        "runs": {**saved.get("runs", {}), args.label: entry},
    }
    write_result(out, result, params=vars(args), device=preset["device"])
    print_table(result, args.label, out)


def print_table(result: dict, label: str, out: Path) -> None:
    runs = result["runs"]
    r = runs[label]
    unit = "kernel" if r["shapes"]["device"] == "cuda" else "CPU op self"
    print(
        f"\n{label}: {r['preset']} on {r['machine']['device']}, {r['steps']['profiled']} profiled steps "
        f"-> {out}"
    )
    t = r["timing"]
    print(
        f"tokens/s {t['without_profiler']['tokens_per_s']:.0f} ({t['with_profiler']['tokens_per_s']:.0f} "
        f"profiled), {t['without_profiler']['wall_ms_per_step']:.1f} ms/step"
        + (f", MFU {t['mfu']:.1%}" if t["mfu"] else "")
    )
    b = r["busy"]
    h = r["host"]
    print(
        f"busy {b['busy_ms_per_step']:.1f} of {b['wall_ms_per_step']:.1f} ms/step, idle "
        f"{b['idle_fraction']:.1%}; data wait {h['data_wait_ms_per_step']:.2f} ms/step; recompiles "
        f"{r['compile']['recompiles']}"
    )
    if "syncs_per_step" in h:
        print(
            f"host syncs per step {h['syncs_per_step']} ({h['cpu_blocked_in_syncs_ms_per_step']:.1f} ms "
            f"blocked), DtoH copies {h['dtoh_copies_per_step']:.1f}; idle gaps ms/step by size "
            f"{ {k: round(v, 2) for k, v in b['gaps_ms_per_step_by_size'].items()} }"
        )
    labels = list(runs)
    print(f"\n{unit} time, ms/step" + "".join(f"{x:>12}" for x in labels) + f"{'share':>8}{'launches':>10}")
    kinds = list(dict.fromkeys(k for x in labels for k in runs[x]["kinds"]))
    for k in kinds:
        cells = "".join(f"{runs[x]['kinds'].get(k, {}).get('ms_per_step', 0.0):>12.2f}" for x in labels)
        own = r["kinds"].get(k, {"share": 0.0, "launches_per_step": 0.0})
        print(f"{k:<22}{cells}{own['share']:>8.1%}{own['launches_per_step']:>10.0f}")
    print(f"\nregion ({label})")
    for name, reg in r["regions"].items():
        print(f"{name:<42}{reg['ms_per_step']:>10.2f} ms{reg['share']:>8.1%}{reg['launches_per_step']:>8.0f}")
    print(f"\ntop {unit}s ({label})")
    for k in r["top_kernels"][:10]:
        print(
            f"{k['ms_per_step']:>9.2f} ms {k['launches_per_step']:>5.0f}x  {k['kind']:<18} "
            f"{k['region'][:24]:<25}{k['name'][:60]}"
        )


if __name__ == "__main__":
    main()
