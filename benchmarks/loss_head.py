"""The LM head's chunked cross-entropy (loss.LinearCrossEntropy) eager against compiled
(train.compile_loss), side by side at a preset's shape: milliseconds per micro-batch (the forward, which
also makes the gradient for h; the backward only scales it), peak memory, and how far the compiled
result lies from the eager one.

One micro-batch of the preset (shapes.py, as train_drafter.py trains it): rows x max_anchors blocks of B-1
positions, random drafter outputs h and a random frozen head in the step's dtype, every position labelled,
D-PACE weights (the default objective).

Usage: python benchmarks/loss_head.py --preset tiny|qwen3-8b [--repeats N] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from harness import time_it, write_result
from train_bench import PRESETS, REPO

from flashdraft.loss import LinearCrossEntropy
from flashdraft.objectives import DPace


def inputs(preset: dict, device: torch.device, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    width = preset["drafter"]["block_size"] - 1
    n = preset["rows"] * preset["max_anchors"] * width
    hidden, vocab = preset["target"]["hidden_size"], preset["target"]["vocab_size"]
    h = torch.randn(n, hidden, generator=g, device=device, dtype=dtype)
    head = torch.randn(vocab, hidden, generator=g, device=device, dtype=dtype) * hidden**-0.5
    labels = torch.randint(0, vocab, (n,), generator=g, device=device)
    return h, head, labels, torch.ones(n, device=device), width


def run(h, head, labels, mask, chunk: int, dpace: DPace, compiled: bool):
    x = h.detach().requires_grad_(True)
    total, correct, _ = LinearCrossEntropy.apply(x, head, labels, mask, chunk, dpace, compiled)
    total.backward()
    return total.detach(), correct, x.grad


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--chunk-blocks", type=int, default=128, help="blocks per chunk (dflash_loss's)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    preset = PRESETS[args.preset]
    cuda = preset["device"] == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"preset {args.preset} needs a CUDA GPU")
    device = torch.device("cuda:0" if cuda else "cpu")
    dtype = getattr(torch, preset["dtype"]) if cuda else torch.float32
    h, head, labels, mask, width = inputs(preset, device, dtype)
    chunk, dpace = args.chunk_blocks * width, DPace(0.5, width + 1)
    result = {
        "what": __doc__.split("\n\n")[0].replace("\n", " "),
        "preset": args.preset,
        "shape": {
            "rows": h.shape[0],
            "hidden": h.shape[1],
            "vocab": head.shape[0],
            "chunk_rows": chunk,
            "dtype": str(dtype).removeprefix("torch."),
        },
        "repeats": args.repeats,
        "modes": {},
    }
    outs = {}
    for compiled in (False, True):
        name = "compiled" if compiled else "eager"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        # two warm calls first (the compile)
        t = time_it(
            lambda c=compiled: run(h, head, labels, mask, chunk, dpace, c),
            warmup=2,
            repeats=args.repeats,
            device=device,
        )
        ms = 1e3 * t.median_s
        outs[name] = t.out
        result["modes"][name] = {
            "ms_per_micro_batch": ms,
            "ms_spread": 1e3 * t.spread_s,
            "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
        }
        print(f"{name}: {ms:.2f} ms per micro-batch", flush=True)
    (te, ce, ge), (tc, cc, gc) = outs["eager"], outs["compiled"]
    result["speedup"] = (
        result["modes"]["eager"]["ms_per_micro_batch"] / result["modes"]["compiled"]["ms_per_micro_batch"]
    )
    result["agreement"] = {
        "loss_rel_diff": float((tc - te).abs() / te.abs()),
        "grad_max_abs_diff": float((gc.float() - ge.float()).abs().max()),
        "grad_max_abs": float(ge.float().abs().max()),
        "argmax_equal_fraction": float((cc == ce).float().mean()),
    }
    print(json.dumps({k: result[k] for k in ("modes", "speedup", "agreement")}, indent=1))
    out = Path(args.out or REPO / "benchmarks" / "results" / f"loss_head_{args.preset}.json")
    write_result(out, result, params=vars(args), device=device)


if __name__ == "__main__":
    main()
