"""The run in numbers before it starts: hours per stage on the configured GPUs, and the disk the hidden
states take in bf16 and in fp8; then both hidden-state modes (store, stream) side by side, and the mode
and gpus.target/gpus.drafter split of N GPUs with the shortest wall time whose hidden states fit a disk
budget.

    python -m flashdraft.plan --configfile my.yaml [more.yaml ...] [--gpus N] [--disk-budget 2TB]
        [--results results] [--target-config config.json] [--json plan.json]

The config is read as the workflow reads it (each --configfile on top of the one before, every key left out
taking the dataclasses' default; config/config.yaml only where no file is given; checked
against workflow/schemas/config.schema.yaml and config_check.check); a mistake is one line naming the key.
Token statistics come from what earlier stages left under --results (prompt counts from
prompts/stats.json, prompt tokens from prompts/train.parquet, answer tokens from regenerated/train/,
exact totals from the hidden manifests) and otherwise from the assumptions below, printed as such.

Hours are work / (per-GPU rate x GPUs), per wave of shard jobs. The rates come from the committed
benchmarks (RATES, H200, a Qwen3-8B-shaped target); for another target they are scaled by parameter
count (a forward's work and its weight reads both grow with it; the drafter's layers take the target's
shapes). Prompts, verify, warmup, report and stream mode's tokenize and data-plan jobs take minutes and
are not counted.

Store mode runs the stages one after another. Stream mode cuts every epoch into chunks of whole optimizer
steps (as many tokens as half the disk budget holds: two chunks are on disk at once); a chunk's hidden
states are precomputed on gpus.target GPUs while the previous chunk trains on gpus.drafter GPUs. Its wall
time is regeneration + the pipeline (the first chunk's precompute, then each chunk as the slower of the
two sides, the next chunk's shard jobs waiting for the training two chunks back) + evaluation. Each chunk's
training job pays the measured launch-to-first-step (every chunk after the run's first: a resumed job's,
its checkpoint read and loaded) and its last save (the drafter in fp32 and AdamW's two moments, at the
local disk's measured speed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import memory
from .config import Config, needs_last_hidden, train_world
from .config_load import load
from .errors import UserError, cli
from .estimate import (
    EXHAUSTIVE_GPUS,
    RATES,
    REFERENCE_TARGET,
    ModePlan,
    Recommendation,
    Run,
    Split,
    drafter_parameters,
    hidden_disk,
    num_parameters,
    recommend,
    stage_table,
    store_mode,
    stream_mode,
    token_bytes,
)
from .estimate_inputs import read_shapes, target_shapes, token_stats
from .gpu import gpu_memory_bytes
from .io import FP8, human_bytes, parse_bytes

GOAL_HOURS = 36.0  # the whole DAG on one node, as configured
GOAL_RECOMMENDED = (19.0, 2e12)  # the recommended plan: hours of wall time, bytes of hidden states on disk
DEFAULT_DISK_BUDGET = 2 * 10**12  # hidden-state bytes allowed on disk when neither config nor --disk-budget
DEFAULT_GPU = (
    81559 * 2**20,
    "an 80 GB H100's 81,559 MiB: no GPU visible here and no --gpu-memory or gpus.memory_gib",
)  # the card planned for when nothing says which
MEMORY_STAGES = {
    "regenerate": "regeneration",
    "precompute": "precompute",
    "train": "training",
    "evaluate": "evaluation",
}  # flashdraft.memory's stage names, as the stage table's


def plan(
    cfg: Config,
    results="results",
    gpus: int | None = None,
    budget: int | None = None,
    target: dict | None = None,
    gpu_memory: tuple[int, str] | None = None,
) -> dict:
    """Hours per stage (None: on the CPU, or on a server the plan cannot see), hidden-state bytes and each
    GPU stage's peak memory on a card of `gpu_memory` (bytes, where that figure comes from; default
    `gpu_card`), for the config's split in both modes, and the recommended mode and split of `gpus` GPUs
    (default gpus.target) under the disk budget (default hidden.disk_budget, else DEFAULT_DISK_BUDGET)."""
    shapes = target_shapes(cfg, target)
    params, ref = num_parameters(shapes), num_parameters(REFERENCE_TARGET)
    scale = ref / params  # rates per GPU fall as the model grows
    g = cfg.gpus.target if gpus is None else gpus  # one-GPU jobs at a time (the profile's gpu resource)
    run = Run(cfg, token_stats(cfg, results), shapes, scale, g)
    if budget is not None:
        source = "--disk-budget"
    elif cfg.hidden.disk_budget:
        budget, source = cfg.hidden.disk_budget, "hidden.disk_budget"
    else:
        budget, source = DEFAULT_DISK_BUDGET, "the planner's default; set hidden.disk_budget or --disk-budget"
    split = Split(cfg.gpus.target, cfg.gpus.drafter)
    stages = stage_table(run, split)
    known = [s["hours"] for s in stages.values() if s["hours"] is not None]
    total = sum(known) if len(known) == len(stages) else None
    slowest = max(stages, key=lambda k: stages[k]["hours"] or 0)
    modes = {"store": store_mode(run, split)}
    try:
        modes["stream"] = stream_mode(run, split, budget)
    except UserError as e:
        modes["stream"] = str(e)
    rec = recommend(run, budget, source) if g and total is not None else None
    gpu_bytes, gpu_source = gpu_memory or gpu_card(cfg)
    world = train_world(cfg.gpus)
    peaks = {MEMORY_STAGES[p.stage]: p for p in memory.stage_peaks(cfg, shapes, world, gpu_bytes)}
    best = rec.best.split.drafter if rec and rec.best else 0
    best_world = train_world(cfg.gpus, best) if best else None
    best_train = memory.train_peak(cfg, shapes, best_world, gpu_bytes) if best_world else None
    return {
        "parameters": params,
        "reference_parameters": ref,
        "scale": scale,
        "gpus": g,
        "tokens": run.tok,
        "stages": stages,
        "total_hours": total,
        "slowest": slowest,
        "hidden_width": run.width,
        "hidden_bytes": hidden_disk(cfg, shapes, run.tok.total),
        "hidden_dtype": cfg.hidden.dtype,
        "hidden_token_bytes": {d: token_bytes(cfg, shapes, d) for d in ("bfloat16", FP8)},
        "last_hidden": needs_last_hidden(cfg.drafter),
        "drafter_parameters": drafter_parameters(cfg, shapes),
        "checkpoint_bytes": run.checkpoint_bytes(),
        "save_s": run.save_s(),
        "last_save_s": run.last_save_s(),
        "load_s": run.load_s(),
        "disk_budget": budget,
        "budget_source": source,
        "modes": modes,
        "recommendation": rec,
        "memory": {
            "gpu_bytes": gpu_bytes,
            "source": gpu_source,
            "peaks": peaks,
            "problems": memory.problems(cfg, shapes, world, gpu_bytes, gpu_source),
            "recommended_train": best_train,
        },
    }


def gpu_card(cfg: Config) -> tuple[int, str]:
    """The card the plan is for when --gpu-memory does not say: gpus.memory_gib, the visible GPU's, else
    DEFAULT_GPU."""
    size, source = memory.card(cfg, gpu_memory_bytes)
    return (size, source) if size else DEFAULT_GPU


def summary(p: dict) -> dict:
    """benchmarks/results/plan_production.json's figures: both modes on the config's split, the
    recommendation, the floor (every GPU-hour spread over the GPUs) and the share of it reached."""

    def figures(m):
        ok = isinstance(m, ModePlan)
        return {
            "wall_hours": _round(m.wall_hours, 2) if ok else None,
            "peak_disk_tb": round(m.peak_disk / 1e12, 3) if ok else None,
        }

    rec = p["recommendation"]
    best = rec.best if rec else None
    floor = rec.floor_hours if rec else None
    return {
        "store": figures(p["modes"]["store"]),
        "stream": figures(p["modes"]["stream"]),
        "recommended": best
        and {
            "mode": best.mode,
            "gpus": {"target": best.split.target, "drafter": best.split.drafter},
            **figures(best),
        },
        "floor_hours": _round(floor, 2),
        "floor_fraction": _round(floor / best.wall_hours, 3) if best else None,
    }


def _round(x, digits):
    return None if x is None else round(x, digits)


def _num(x: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def _hours(h) -> str:
    return "-" if h is None else f"{h:.1f}"


# Past this factor, rates scaled by parameter count overstate a small target's speed: its steps are bound by
# kernel launches, the KV cache and data movement rather than by its weights (no benchmark at such a shape)
SCALE_TRUSTED = 4.0


def render(p: dict, configfile) -> str:
    n, ref = _num(p["parameters"]), _num(p["reference_parameters"])
    lines = [
        f"plan for {configfile}: a target of {n} parameters; the benchmarks' rates (one H200, a "
        f"Qwen3-8B shape of {ref}) scaled by {ref} / {n} = {p['scale']:.3g}"
    ]
    if p["scale"] > SCALE_TRUSTED:
        lines.append(
            f"  ASSUMED: a target this much smaller than the benchmarks' does not run "
            f"{p['scale']:.3g}x faster (its steps are bound by kernel launches and data movement, "
            "not its weights): read the hours below as a lower bound"
        )
    lines += ["", "token statistics:"]
    lines += [f"  {note}" for note in p["tokens"].notes]
    lines += [
        "",
        f"store mode, stage after stage (gpus.target and --gpus {p['gpus']} for the one-GPU jobs, "
        "gpus.drafter for training):",
        "| stage | work | per-GPU rate | GPUs | hours | peak GPU memory |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    sources = []
    for name, s in p["stages"].items():
        rates = " + ".join(
            f"{r:,.4g}" if s["unit"] == "bytes" else f"{r:,.1f}"
            for k, r in s["rates"].items()
            if RATES[k].unit != "x"
        )
        rates += "".join(f" x {r:.3g}" for k, r in s["rates"].items() if RATES[k].unit == "x")  # factors
        unit = "GB" if s["unit"] == "bytes" else s["unit"]
        work = human_bytes(s["work"]) if s["unit"] == "bytes" else f"{_num(s['work'])} {s['unit']}"
        lines.append(
            f"| {name} | {work} | {rates} {unit}/s | {s['gpus']} | {_hours(s['hours'])} | "
            f"{_memory_cell(p['memory'], name)} |"
        )
        sources.append(f"  {name}: {', '.join(s['sources'])}")
    total = p["total_hours"]
    lines.append(f"| total | | | | {_hours(total)} | |")
    lines += render_memory(p["memory"])
    lines += ["", "rates (per second, before scaling) from benchmarks/results/:", *sources]
    if any(s["hours"] is None for s in p["stages"].values()):
        lines.append("  -: the stage runs on the CPU (gpus.* 0) or on a server elsewhere: no measured rate")
    b, w, per_token = p["hidden_bytes"], p["hidden_width"], p["hidden_token_bytes"]
    disk = ", ".join(f"{b[d] / 1e12:,.2f} TB in {d} ({per_token[d]:,} bytes/token)" for d in b)
    last = " + the target's last hidden state (drafter.family)" if p["last_hidden"] else ""
    lines += [
        "",
        f"hidden states ({p['tokens'].total:,} tokens x {w:,} values{last}): {disk}; "
        f"configured hidden.dtype: {p['hidden_dtype']}",
        f"checkpoints: {human_bytes(p['checkpoint_bytes'])} (the drafter's "
        f"{_num(p['drafter_parameters'])} parameters in fp32 + AdamW's two moments), "
        f"a save holds training up {p['save_s']:.1f} s (then writes in the background), a job's last "
        f"save {p['last_save_s']:.1f} s, a resume {p['load_s']:.1f} s to read (while the job starts: "
        "a resumed job's measured start-up holds it)",
    ]
    if total is None:
        lines.append("goal (whole DAG <= 36 h): not planned, some stages run without a GPU rate")
    else:
        slow = p["slowest"]
        verdict = "met" if total <= GOAL_HOURS else "NOT met"
        what = "the longest stage" if total <= GOAL_HOURS else "held back by"
        lines.append(
            f"goal (whole DAG <= {GOAL_HOURS:.0f} h): {verdict}, {total:.1f} h; {what}: {slow} "
            f"({p['stages'][slow]['hours']:.1f} h)"
        )
    lines += render_modes(p)
    if p["recommendation"]:
        lines += render_recommendation(p["recommendation"])
    return "\n".join(lines)


def _memory_cell(m: dict, stage: str) -> str:
    peak = m["peaks"].get(stage)
    if peak is None:
        return ""
    if peak.by_construction:
        return f"fits ({peak.note})"
    return f"{memory.human(peak.bytes)} ({peak.bytes / m['gpu_bytes']:.2f})"


def render_memory(m: dict) -> list[str]:
    """The card the peaks are for, the training peak's parts, and a line per stage that does not fit."""
    gpu, fit = m["gpu_bytes"], memory.FIT_FRACTION
    train = m["peaks"]["training"]
    lines = [
        f"peak GPU memory: per process, on a card of {memory.human(gpu)} ({m['source']}), as a share "
        f"of it in brackets; a stage fits at <= {fit} of the card less the CUDA context "
        f"({memory.human(memory.budget(gpu))}); flashdraft.memory, its coefficients "
        f"{memory.coefficients_source()}",
        f"  training ({train.note}): " + ", ".join(f"{k} {memory.human(v)}" for k, v in train.parts.items()),
    ]
    lines += [f"  does NOT fit: {line}" for line in m["problems"]]
    best = m["recommended_train"]
    if best is not None:
        verdict = "fits" if best.bytes <= memory.budget(gpu) else "does NOT fit"
        lines.append(
            f"  the recommended split's training: {memory.human(best.bytes)}, {verdict} ({best.note})"
        )
    return lines


MODE_ROWS = [  # label, store mode's stage, stream mode's
    ("regeneration", "regeneration", "regeneration"),
    ("precompute", "precompute", "precompute"),
    ("training", "training", "training"),
    ("checkpoints (stream: and each chunk job's start-up)", "checkpoints", "start-up and checkpoints"),
    ("pipeline: precompute and training at once", None, "pipeline"),
    ("evaluation", "evaluation", "evaluation"),
]


def _cells(m, key, overlapped=False) -> list[str]:
    """A mode's GPUs and hours for one stage (blank where the mode has no such stage)."""
    if not isinstance(m, ModePlan) or key is None:
        return ["", ""]
    mark = "*" if overlapped and m.hours[key] is not None else ""
    return [str(m.gpus[key]), f"{_hours(m.hours[key])}{mark}"]


def render_modes(p: dict) -> list[str]:
    store, stream = p["modes"]["store"], p["modes"]["stream"]
    lines = [
        "",
        f"both hidden-state modes as configured (gpus.target {store.split.target}, gpus.drafter "
        f"{store.split.drafter}), hidden states on disk <= {human_bytes(p['disk_budget'])} "
        f"({p['budget_source']}):",
        "| stage | store: GPUs | store: hours | stream: GPUs | stream: hours |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, a, b in MODE_ROWS:
        over = b in ("precompute", "training", "start-up and checkpoints")
        lines.append("| " + " | ".join([label, *_cells(store, a), *_cells(stream, b, over)]) + " |")
    wall = [f"{_hours(m.wall_hours) if isinstance(m, ModePlan) else '-'}" for m in (store, stream)]
    disk = [f"{m.peak_disk / 1e12:.2f}" if isinstance(m, ModePlan) else "-" for m in (store, stream)]
    lines += [
        f"| wall | | {wall[0]} | | {wall[1]} |",
        f"| peak hidden-state disk, TB | | {disk[0]} | | {disk[1]} |",
    ]
    if isinstance(stream, ModePlan):
        lines += [
            "* busy hours of those GPUs, at the same time as the other side's (the pipeline row)",
            f"stream: {describe_chunks(stream)}",
        ]
    else:
        lines.append(f"stream: not planned: {stream}")
    return lines


def describe_chunks(m: ModePlan) -> str:
    c = m.chunks
    slower = "training" if c.train_s + c.startup_s >= c.precompute_s else "precompute"
    return (
        f"chunks of <= {c.cap:,} hidden-state tokens ({c.source}), {c.cap // c.step_tokens:,} optimizer "
        f"steps of {c.step_tokens:,} tokens; {c.per_epoch} per epoch, {len(c.sizes)} in all. A full "
        f"chunk: precompute {c.precompute_s:,.0f} s on {max(1, m.split.target)} GPU(s), training "
        f"{c.train_s:,.0f} s on {m.gpus['training']} GPU(s) + {c.startup_s:.0f} s for its job's launch "
        f"to first step, checkpoint load and saves; the slower side: {slower}"
    )


def render_recommendation(r: Recommendation) -> list[str]:
    which = "every split" if r.gpus <= EXHAUSTIVE_GPUS else "the splits tried (a bounded search)"
    lines = [
        "",
        f"{which} of {r.gpus} GPUs, hidden states <= {human_bytes(r.budget)}:",
        "| mode | gpus.target | gpus.drafter | wall hours | peak hidden-state disk, TB | fits |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for m in r.candidates:
        fits = "yes" if m.peak_disk <= r.budget else "no"
        lines.append(
            f"| {m.mode} | {m.split.target} | {m.split.drafter} | {_hours(m.wall_hours)} | "
            f"{m.peak_disk / 1e12:.2f} | {fits} |"
        )
    lines += [f"  not planned, {k}: {why}" for k, why in r.refused.items()]
    b = r.best
    if b is None:
        return [*lines, "recommended: none (some stages run without a GPU rate)"]
    floor = r.floor_hours
    lines += [
        f"recommended: hidden.mode {b.mode}, gpus.target {b.split.target}, gpus.drafter "
        f"{b.split.drafter}: {b.wall_hours:.1f} h wall, {human_bytes(b.peak_disk)} of hidden states "
        "on disk",
        f"floor: {b.gpu_hours:,.1f} GPU-hours of regeneration, precompute, training and evaluation "
        f"over {r.gpus} GPUs = {floor:.1f} h; the recommendation reaches {floor / b.wall_hours:.2f} of "
        "it",
    ]
    hours, disk = GOAL_RECOMMENDED
    verdict = "met" if b.wall_hours <= hours and b.peak_disk <= disk else "NOT met"
    lines.append(
        f"goal (recommended <= {hours:.0f} h wall and <= {human_bytes(disk)} of hidden states): "
        f"{verdict}, {b.wall_hours:.1f} h and {human_bytes(b.peak_disk)}"
    )
    return lines


@cli
def main(argv=None):
    from .estimate import MAX_GPUS  # the most GPUs the planner plans for

    ap = argparse.ArgumentParser(
        prog="python -m flashdraft.plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--configfile",
        required=True,
        nargs="+",
        help="the config the workflow will run with (several: each on top of the one before)",
    )
    ap.add_argument(
        "--results",
        default=None,
        help="results of stages already run (token statistics); default: the config's `results`",
    )
    ap.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs the one-GPU jobs (regeneration, precompute, evaluation) share at once, "
        "e.g. the node's (the profile's gpu resource), and the GPUs the recommendation "
        f"splits (at most {MAX_GPUS:,}); default: gpus.target",
    )
    ap.add_argument(
        "--disk-budget",
        default=None,
        help="bytes of hidden states allowed on disk at once, e.g. 2TB; default: "
        f"hidden.disk_budget, else {human_bytes(DEFAULT_DISK_BUDGET)}",
    )
    ap.add_argument(
        "--target-config",
        default=None,
        help="the target's config.json when target.path does not hold it yet, or a preset of "
        "flashdraft.shapes (qwen3-8b, toy)",
    )
    ap.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="GiB of memory of one GPU to plan for; default: gpus.memory_gib, else the visible "
        "GPU's, else an 80 GB H100's",
    )
    ap.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write both modes, the recommendation and the floor as JSON to PATH (-: print only that)",
    )
    a = ap.parse_args(argv)
    if a.gpus is not None and not 0 <= a.gpus <= MAX_GPUS:
        raise UserError(f"--gpus {a.gpus}: give a GPU count from 0 to {MAX_GPUS:,} (the planner's limit)")
    try:
        budget = None if a.disk_budget is None else parse_bytes(a.disk_budget, "--disk-budget")
    except ValueError as e:
        raise UserError(str(e)) from e
    if a.json not in (None, "-") and not Path(a.json).resolve().parent.is_dir():
        raise UserError(f"--json {a.json}: no folder {Path(a.json).resolve().parent}; create it first")
    target = read_shapes(a.target_config) if a.target_config else None
    cfg = load(a.configfile, target=target)
    if a.gpus is None and cfg.gpus.target > MAX_GPUS:
        raise UserError(
            f"config key gpus.target: {cfg.gpus.target} GPUs, past the planner's limit of "
            f"{MAX_GPUS:,}; plan fewer with --gpus"
        )
    if a.gpu_memory is not None and a.gpu_memory <= 0:
        raise UserError(f"--gpu-memory {a.gpu_memory}: give the GiB of one GPU, e.g. 80")
    card = None if a.gpu_memory is None else (int(a.gpu_memory * memory.GIB), "--gpu-memory")
    p = plan(cfg, a.results or cfg.results, a.gpus, budget, target, card)
    if a.json == "-":
        print(json.dumps(summary(p), indent=2))
        return
    print(render(p, " + ".join(a.configfile)))
    if a.json:
        Path(a.json).write_text(json.dumps(summary(p), indent=2) + "\n")


if __name__ == "__main__":
    main()
