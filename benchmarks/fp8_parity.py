"""float8 training against bf16 on one optimizer step: per parameter tensor of the drafter, the relative L2
distance of the gradient and of the first AdamW update from the reference's, with a noise floor.

    python benchmarks/fp8_parity.py --preset tiny|qwen3-8b [--work DIR] [--out JSON]

Variants, each from the same initialization (train.seed), on the same micro-batches with the same anchors,
with config/production.yaml's training keys (lr, weight decay, clipping, loss, compile scope, compiled
loss) on train_drafter.py's preset (its target directory and shard, in --work):
- `bf16`: the reference, train.fp8 null (autocast bf16 on a GPU);
- `bf16_split`: the reference with its micro-batch split in two (the same global batch and normalizer: the
  same gradient in exact arithmetic, reached by another reduction order): the noise floor;
- `fp8_tensorwise`, `fp8_rowwise`: train.fp8 with torchao's recipe of that name.
The step is train.py's: the global normalizer over the micro-batches, forward_backward per micro-batch,
clip_grad_norm_ to train.grad_clip, then one AdamW step (fused on a GPU) at train.lr. For each variant and
parameter tensor: rel_l2(x) = ||x - x_ref|| / ||x_ref|| of the (unclipped) gradient and of the update
(weights after the step minus before), and the same over all parameters as one vector (`all`). AdamW's
first update is lr * g / (|g| + eps) elementwise (plus weight decay): it keeps only each gradient
element's sign, so entries near zero whose sign flips dominate its distance; the noise floor shows how
large that is with no float8 at all. `ratio_to_noise` divides a variant's distance by the floor's.

`--preset tiny` runs the same on the CPU (float32, eager, float8 matmuls emulated by torch's CPU kernels):
a check of the machinery, seconds. The qwen3-8b preset needs one GPU with FP8 matmuls.
Writes benchmarks/results/fp8_parity_<preset>.json and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml
from harness import write_result
from train_bench import PRESETS, REPO, drafter_config, setup, train_config

from flashdraft.batches import Collate, anchor_seeds
from flashdraft.config import TrainConfig, from_dict
from flashdraft.float8 import to_float8
from flashdraft.hidden import HiddenStore
from flashdraft.train_step import anchors_for, batch_normalizer, build_step, forward_backward, load_spec

# production.yaml's keys of the step's arithmetic; the data's shape comes from the preset
PRODUCTION_KEYS = (
    "lr",
    "grad_clip",
    "weight_decay",
    "loss",
    "gamma",
    "dpace_alpha",
    "compile",
    "compile_scope",
    "compile_loss",
    "dtype",
    "seed",
)
VARIANTS = {
    "bf16": {"fp8": None},
    "bf16_split": {"fp8": None},
    "fp8_tensorwise": {"fp8": "tensorwise"},
    "fp8_rowwise": {"fp8": "rowwise"},
}
NOISE = "bf16_split"


def production_train(preset: dict) -> dict:
    keys = yaml.safe_load((REPO / "config" / "production.yaml").read_text())["train"]
    cfg = train_config(preset, steps=1, log_every=1) | {k: keys[k] for k in PRODUCTION_KEYS if k in keys}
    if preset["device"] == "cpu":
        cfg["compile"] = False  # the machinery check: eager is seconds, a compile minutes
    return cfg


def build(cfg: TrainConfig, spec, target: Path, device: torch.device):
    """train_step.build_step; on the CPU, whose float8 matmuls the trainer refuses (slow), the linear layers
    are converted here with the trainer's own conversion."""
    if cfg.fp8 and device.type == "cpu":
        step = build_step(dataclasses.replace(cfg, fp8=None), spec, target, device)
        to_float8(step.model, cfg.fp8)
        return step
    return build_step(cfg, spec, target, device)


def micro_batches(preset: dict, cfg: TrainConfig, store: HiddenStore, amp, parts: int) -> list[tuple]:
    """The preset's one global batch (its first `rows` samples, one bucket) as `parts` micro-batches, each
    with its samples' indices."""
    rows = preset["rows"]
    collate = Collate(cfg.buckets, cfg.batch_tokens // parts, amp or torch.float32)
    share = rows // parts
    return [
        (list(range(i, i + share)), collate([store[j] for j in range(i, i + share)]))
        for i in range(0, rows, share)
    ]


def one_step(cfg: TrainConfig, spec, target: Path, store, preset: dict, parts: int) -> dict:
    """Gradients and update of one optimizer step, by parameter name (float32, on the step's device)."""
    device = torch.device(preset["device"])
    step = build(cfg, spec, target, device)
    micro = micro_batches(preset, cfg, store, step.amp_dtype, parts)
    anchors = [
        anchors_for(step, b["loss_mask"], seeds=anchor_seeds(cfg.seed, 0, idx, len(b["loss_mask"])))
        for idx, b in micro
    ]
    norm = sum(batch_normalizer(step, b, *av) for (_, b), av in zip(micro, anchors, strict=True)).float()
    loss = 0.0
    for (_, batch), (a, v) in zip(micro, anchors, strict=True):
        part, _ = forward_backward(step, batch, a, v, norm)
        loss += float(part)
    params = dict(step.model.named_parameters())
    grads = {name(n): p.grad.detach().float().clone() for n, p in params.items()}
    torch.nn.utils.clip_grad_norm_(params.values(), cfg.grad_clip)
    before = {name(n): p.detach().float().clone() for n, p in params.items()}
    opt = torch.optim.AdamW(
        params.values(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=device.type == "cuda"
    )
    opt.step()
    updates = {name(n): p.detach().float() - before[name(n)] for n, p in params.items()}
    return {"loss": loss, "grad": grads, "update": updates}


def name(param: str) -> str:
    return param.replace("_orig_mod.", "")  # a compiled submodule's wrapper


def rel_l2(x: dict, ref: dict) -> dict:
    """Per tensor and over all tensors as one vector: ||x - ref|| / ||ref||."""
    out, num, den = {}, 0.0, 0.0
    for n, r in ref.items():
        d2, r2 = float((x[n] - r).double().pow(2).sum()), float(r.double().pow(2).sum())
        out[n] = (d2 / r2) ** 0.5 if r2 > 0 else None
        num, den = num + d2, den + r2
    return {"all": (num / den) ** 0.5, "per_tensor": out}


def sig(x: float) -> float:
    return float(f"{x:.6g}")


def summary(dist: dict) -> dict:
    values = [v for v in dist["per_tensor"].values() if v is not None]
    return {
        "all": sig(dist["all"]),
        "median_tensor": sig(statistics.median(values)),
        "max_tensor": sig(max(values)),
        "max_tensor_name": max((v, n) for n, v in dist["per_tensor"].items() if v is not None)[1],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--work", type=Path, default=None, help="work dir (default: train_drafter.py's)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    preset = dict(PRESETS[args.preset])
    if preset["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"preset {args.preset} needs a CUDA GPU")
    work = args.work or Path(tempfile.gettempdir()) / f"flashdraft-train-bench-{args.preset}"
    out = args.out or REPO / "benchmarks" / "results" / f"fp8_parity_{args.preset}.json"
    work.mkdir(parents=True, exist_ok=True)
    setup(preset, work)
    cfg = from_dict(TrainConfig, production_train(preset), "train")
    spec = load_spec(work / "target", drafter_config(preset))
    store = HiddenStore([str(work / "hidden" / "shard-00000.arrow")])
    ref, results, t0 = None, {}, time.perf_counter()
    for variant in ["bf16", *[v for v in args.variants if v != "bf16"]]:
        t = time.perf_counter()
        got = one_step(
            dataclasses.replace(cfg, **VARIANTS[variant]),
            spec,
            work / "target",
            store,
            preset,
            parts=2 if variant == NOISE else 1,
        )
        if ref is None:
            ref = got
            results[variant] = {"loss": got["loss"], "s": round(time.perf_counter() - t, 1)}
        else:
            dist = {k: rel_l2(got[k], ref[k]) for k in ("grad", "update")}
            results[variant] = {
                "loss": got["loss"],
                "loss_rel_diff": abs(got["loss"] / ref["loss"] - 1),
                "grad": summary(dist["grad"]),
                "update": summary(dist["update"]),
                "per_tensor": {
                    n: {"grad": dist["grad"]["per_tensor"][n], "update": dist["update"]["per_tensor"][n]}
                    for n in ref["grad"]
                },
                "s": round(time.perf_counter() - t, 1),
            }
            del got
        print(f"{variant}: loss {results[variant]['loss']:.5f} ({results[variant]['s']} s)", flush=True)
        write(args, preset, cfg, results, t0, out)  # after each variant: a stopped run keeps what ran
    print(
        f"{'variant':16} {'grad all':>10} {'median':>10} {'max':>10} {'update all':>11} {'median':>10} "
        f"{'x noise':>8}"
    )
    for v, r in results.items():
        if v == "bf16":
            continue
        g, u = r["grad"], r["update"]
        ratio = r.get("ratio_to_noise", {}).get("update")
        print(
            f"{v:16} {g['all']:10.4g} {g['median_tensor']:10.4g} {g['max_tensor']:10.4g} {u['all']:11.4g} "
            f"{u['median_tensor']:10.4g} {ratio if ratio is not None else '':>8} "
        )
    print(f"-> {out}")


def write(args, preset: dict, cfg: TrainConfig, results: dict, t0: float, out: Path) -> None:
    noise = results.get(NOISE)
    for v, r in results.items():
        if v not in ("bf16", NOISE) and noise:
            r["ratio_to_noise"] = {
                k: round(r[k]["all"] / noise[k]["all"], 3) if noise[k]["all"] else None
                for k in ("grad", "update")
            }
    device = torch.cuda.get_device_name(0) if preset["device"] == "cuda" else platform.processor() or "cpu"
    result = {
        "what": "one optimizer step of the drafter, each variant against bf16 from the same init on the same "
        "micro-batches: relative L2 of the gradient and of the first AdamW update, per parameter "
        "tensor and over all (`all`); bf16_split (the micro-batch in two) is the noise floor",
        "preset": args.preset,
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "train": {k: getattr(cfg, k) for k in (*PRODUCTION_KEYS, "batch_tokens", "max_anchors")},
        "rows": preset["rows"],
        "seq_len": preset["seq_len"],
        "variants": results,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_result(out, result, params=vars(args), device=preset["device"])


if __name__ == "__main__":
    main()
