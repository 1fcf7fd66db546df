"""Where a static-engine decode step's time goes, against the bytes it must move.

One GPU, a random Qwen3-8B built in memory: for each batch (slots) and variant (`compiled`: compiled
layer halves and FlexAttention over each row's own KV blocks, the default on CUDA; `eager`: the same
math uncompiled, SDPA over a dense mask) the step `flashdraft.decode` replays as a CUDA graph with
every row at one attention length, timed over many replays, against the memory-bandwidth bound
of the same step (every weight but the input embedding, plus the KV cache of every slot up to that
length, at the GPU's HBM bandwidth); the GPU time of the step's kernels by kind (matmuls, attention,
the rest: norms, RoPE, activations, adds, cache writes); and one prefill of 64 prompts of 300 tokens
(compute-bound, against the bare forward's FLOPs).

Usage: python benchmarks/decode_step.py [--batch 64 256] [--length 512] [--variants compiled eager]
Writes benchmarks/results/decode_step_qwen3-8b.json and prints a table.
"""

import argparse
from functools import partial
from pathlib import Path

import torch
from harness import sync, time_it, write_result
from shapes import hbm_bytes_per_s
from target_bench import build_target

from flashdraft.decode import SlotDecoder
from flashdraft.hf_config import kv_bytes_per_token

REPO = Path(__file__).resolve().parents[1]


def timed(fn, n: int) -> float:
    """Seconds per call of `fn`, over `n` calls between two syncs after a warm one."""
    return time_it(fn, warmup=1, repeats=1, number=n, device="cuda").median_s


def kernel_split(dec, length: int) -> dict:
    """GPU milliseconds of one eager step's kernels, by kind."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dec.pos.fill_(length - 1)
        dec._step(length)
        sync("cuda")
    split = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for e in prof.key_averages():
        name, ms = e.key.lower(), e.device_time_total / 1e3
        attention = ("sdpa", "flash", "attention", "fmha", "flex", "triton_tem")  # tem: flex's template
        kind = (
            "attention"
            if any(k in name for k in attention)
            else "matmul"
            if any(k in name for k in ("gemm", "nvjet", "cutlass", "splitk"))
            else "other"
        )
        split[kind] += ms
    return split


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--variants", nargs="+", default=["compiled", "eager"], choices=["compiled", "eager"])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "decode_step_qwen3-8b.json"))
    args = p.parse_args()
    model = build_target("qwen3-8b", torch.device("cuda"))
    dev = torch.cuda.get_device_name()
    hbm = hbm_bytes_per_s(dev)
    if hbm is None:
        raise SystemExit(f"{dev}: no HBM bandwidth in shapes.HBM_BYTES_PER_S")
    weights = sum(
        t.numel() * t.element_size() for n, t in model.named_parameters() if "embed_tokens" not in n
    )
    kv = kv_bytes_per_token(model.config, model.dtype.itemsize)
    rows = []
    for b in args.batch:
        for variant in args.variants:
            dec = SlotDecoder(model, b, args.length, [0], 0, compiled=variant == "compiled")
            with torch.inference_mode():
                t = time_it(partial(dec._capture, args.length), warmup=0, repeats=1, device="cuda")
                (graph, _), capture = t.out, t.median_s
                dec.pos.fill_(args.length - 1)
                step = timed(graph.replay, 50)
                split = kernel_split(dec, args.length)
                n = min(b, 64)
                prefill = timed(partial(dec._prefill, list(range(n)), [[5] * 300] * n), 3)
            bound = (weights + b * args.length * kv) / hbm
            n_pre = n * 300
            rows.append(
                {
                    "batch": b,
                    "variant": variant,
                    "length": args.length,
                    "step_ms": step * 1e3,
                    "bound_step_ms": bound * 1e3,
                    "step_over_bound": bound / step,
                    "kernels_ms": split,
                    "tokens_per_s": b / step,
                    "capture_s": capture,
                    "prefill_tokens": n_pre,
                    "prefill_ms": prefill * 1e3,
                    "prefill_tflops": 2 * (weights / 2) * n_pre / prefill / 1e12,
                }
            )  # 2 FLOPs/bf16 weight
            del dec, graph
            torch.cuda.empty_cache()
    result = {
        "device": dev,
        "torch": torch.__version__,
        "weight_bytes_per_step": weights,
        "kv_bytes_per_token": kv,
        "hbm_bytes_per_s": hbm,
        "rows": rows,
    }
    write_result(args.out, result, params=vars(args))
    print(
        f"{'batch':>6}{'variant':>9}{'step ms':>9}{'bound ms':>10}{'ratio':>7}{'matmul':>8}{'attn':>7}"
        f"{'other':>7}{'prefill ms':>12}{'TFLOP/s':>9}"
    )
    for r in rows:
        k = r["kernels_ms"]
        print(
            f"{r['batch']:6d}{r['variant']:>9}{r['step_ms']:9.2f}{r['bound_step_ms']:10.2f}"
            f"{r['step_over_bound']:7.2f}{k['matmul']:8.2f}{k['attention']:7.2f}{k['other']:7.2f}{r['prefill_ms']:12.1f}"
            f"{r['prefill_tflops']:9.0f}"
        )


if __name__ == "__main__":
    main()
