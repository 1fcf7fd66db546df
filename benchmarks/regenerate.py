"""Regeneration speed through the real stage code (`flashdraft.regenerate.regenerate`), side by side.

`--mode gpu` (one GPU): a random-weight target of the preset's shape saved as an HF model dir (with the
toy's byte-level chat tokenizer), and synthetic prompts of --min-len..--max-len tokens. On the same
prompts in one run:
  - baseline: `regenerate.engine: generate` (HF generate, dynamic cache, fixed batches of
    --baseline-batch), the path regeneration took before the static engine;
  - ours: `regenerate.engine: static` (flashdraft.decode) at each of --batch (0: sized from free memory);
  - bound: the memory-bandwidth bound of a decode step at our batch, from the shapes: every weight but
    the input embedding (a gather of B rows) read once per step, plus the KV cache of B rows at the
    mean context (prompt + half the answer), at the GPU's HBM bandwidth.
  Tokens/s count new tokens over the stage's generate time (model load and the static engine's one-off
  compile and graph capture excluded, every row's answer decoded and committed included); the runs'
  `setup_s` and `tokens_per_s_with_setup` give that one-off and the rate that counts it.
`--mode snakemake` (2 GPUs): the workflow's `regenerate` rule, 2 shard jobs through Snakemake and the
  GPU lease, with `--resources gpu=1` (the jobs queue) and then gpu=2; wall time ratio.

Usage: python benchmarks/regenerate.py --mode gpu|snakemake [--preset qwen3-8b|tiny] [--prompts N]
Writes benchmarks/results/regenerate[_snakemake]_<preset>.json and prints a table.
"""

import argparse
import json
import platform
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import transformers
import yaml
from harness import write_json, write_result
from shapes import hbm_bytes_per_s, peak_bf16_flops
from target_bench import run_rule, saved_target
from transformers import AutoConfig, AutoTokenizer

from flashdraft.config import RegenerateConfig, TargetConfig
from flashdraft.hf_config import kv_bytes_per_token
from flashdraft.regenerate import regenerate

REPO = Path(__file__).resolve().parents[1]


def synthetic_prompts(path: Path, tokenizer_dir: Path, n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """`n` single-turn prompts of about lo..hi tokens of random words; returns their token counts."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    g = np.random.default_rng(seed)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    words = ["".join(g.choice(letters, int(g.integers(2, 9)))) for _ in range(2000)]
    per_word = len(tok(" ".join(g.choice(words, 400)))["input_ids"]) / 400
    rows = []
    for i in range(n):
        text = " ".join(g.choice(words, max(1, int(int(g.integers(lo, hi + 1)) / per_word))))
        rows.append({"id": f"p{i}", "source": "synthetic", "messages": [{"role": "user", "content": text}]})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    chat = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in rows]
    return [len(x) for x in tok(chat, add_special_tokens=False)["input_ids"]]


def run_stage(target, prompts, work: Path, **cfg) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    c = RegenerateConfig(**cfg)
    t = TargetConfig(path=str(target), dtype="bfloat16")
    s = regenerate(c, t, str(prompts), str(work / "train.parquet"), str(work / "parts"))
    s["tokens_per_s"] = s["new_tokens"] / s["generate_s"]
    # the static engine's compile and graph capture, once per job (minutes against a shard's hours)
    s["tokens_per_s_with_setup"] = s["new_tokens"] / (s["generate_s"] + s.get("setup_s", 0.0))
    return s


def weight_bytes_per_step(target) -> int:
    """Bytes of weights one decode step reads: all of them but the input embedding (B rows gathered)."""
    from safetensors import safe_open

    total = 0
    for f in Path(target).glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                if "embed_tokens" not in k:
                    sl = st.get_slice(k)
                    total += int(np.prod(sl.get_shape())) * 2  # bf16
    return total


def bench_gpu(args) -> dict:
    work = Path(args.work)
    target = saved_target(args.preset, work)
    lengths = synthetic_prompts(work / "prompts.parquet", target, args.prompts, args.min_len, args.max_len)
    common = dict(max_new_tokens=args.new_tokens, temperature=0.0, part_rows=256)
    runs = {}
    if args.baseline_batch:
        runs[f"generate_batch{args.baseline_batch}"] = run_stage(
            target,
            work / "prompts.parquet",
            work / "generate",
            engine="generate",
            batch_size=args.baseline_batch,
            **common,
        )
    config = AutoConfig.from_pretrained(target)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    hbm = hbm_bytes_per_s(dev) or args.hbm_bytes_per_s
    for b in args.batch:
        runs[f"static_batch{b or 'auto'}"] = run_stage(
            target, work / "prompts.parquet", work / f"static{b}", engine="static", batch_size=b, **common
        )
    return score(
        {
            "main_run": f"static_batch{args.batch[-1] or 'auto'}",
            "baseline_run": f"generate_batch{args.baseline_batch}" if args.baseline_batch else None,
            "runs": runs,
            "setup": {
                "preset": args.preset,
                "device": dev,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
                "prompts": args.prompts,
                "prompt_tokens": [args.min_len, args.max_len],
                "mean_prompt_tokens": float(np.mean(lengths)),
                "new_tokens": args.new_tokens,
                "weight_bytes_per_step": weight_bytes_per_step(target),
                "kv_bytes_per_token": kv_bytes_per_token(config, torch.bfloat16.itemsize),
                "hbm_bytes_per_s": hbm,
                "peak_flops": peak_bf16_flops(dev),
            },
        }
    )


def score(r: dict) -> dict:
    """Bounds, ratios and goals from a result's raw measurements (`--rescore` applies it to a saved one).

    bound: a decode step at the run's batch reads every weight but the input embedding once, plus the KV
    cache of the batch at the mean context (prompt + half the answer): tokens/s = batch / (bytes / HBM
    bandwidth). bound_with_prefill adds what that bound leaves out, the prompts' prefill at the GPU's
    peak dense bf16 FLOP rate (2 FLOPs per weight and prompt token)."""
    s, main, base = r["setup"], r["runs"][r["main_run"]], r["runs"].get(r["baseline_run"])
    r["tokens_per_s_per_gpu"] = main["tokens_per_s"]
    if base:
        r["baseline_tokens_per_s_per_gpu"] = base["tokens_per_s"]
        r["speedup_vs_baseline"] = main["tokens_per_s"] / base["tokens_per_s"]
    if not s["hbm_bytes_per_s"]:  # a GPU not in the table, or the CPU: no bound
        return r
    s["bound_context_tokens"] = s["mean_prompt_tokens"] + s["new_tokens"] / 2
    for run in r["runs"].values():
        b, weights = run["batch"], s["weight_bytes_per_step"]
        step_s = (weights + b * s["bound_context_tokens"] * s["kv_bytes_per_token"]) / s["hbm_bytes_per_s"]
        run["bound_tokens_per_s"] = b / step_s
        if s.get("peak_flops"):
            prefill_s = s["prompts"] * s["mean_prompt_tokens"] * weights / s["peak_flops"]  # 2 x weights/2
            run["bound_with_prefill_tokens_per_s"] = run["new_tokens"] / (
                run["new_tokens"] / b * step_s + prefill_s
            )
    r["bound_tokens_per_s_per_gpu"] = main["bound_tokens_per_s"]
    r["fraction_of_bound"] = main["tokens_per_s"] / main["bound_tokens_per_s"]
    if "bound_with_prefill_tokens_per_s" in main:
        r["bound_with_prefill_tokens_per_s_per_gpu"] = main["bound_with_prefill_tokens_per_s"]
        r["fraction_of_bound_with_prefill"] = main["tokens_per_s"] / main["bound_with_prefill_tokens_per_s"]
    r["goals"] = {"fraction_of_bound>=0.3": r["fraction_of_bound"] >= 0.3}
    if base:
        r["goals"]["speedup>=4"] = r["speedup_vs_baseline"] >= 4
    return r


def bench_snakemake(args) -> dict:
    work = Path(args.work)
    target = saved_target(args.preset, work)
    gpus = torch.cuda.device_count()
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["target"] = {"path": str(target), "build_toy": False, "dtype": "bfloat16"}
    cfg["regenerate"] = {"max_new_tokens": args.new_tokens, "shards": 2, "engine": "static"}
    cfg["hidden"] = {"shards": 2}
    cfg["gpus"] = {"target": min(2, gpus), "drafter": 0, "lock_dir": str(work / "locks")}
    runs = {}
    for n in (1, 2):
        if gpus and n > gpus:
            continue
        run_dir = work / f"gpu{n}"
        shutil.rmtree(run_dir, ignore_errors=True)
        synthetic_prompts(
            run_dir / "results/prompts/train.parquet", target, args.prompts, args.min_len, args.max_len
        )
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
        outs = [f"results/regenerated/train/shard-{i:05d}.parquet" for i in range(2)]
        wall, job_s, logs = run_rule(run_dir, "regenerate", outs, gpus=n)
        rows = sum(pq.read_metadata(run_dir / o).num_rows for o in outs)
        runs[f"gpu={n}"] = {"wall_s": wall, "job_s": job_s, "rows": rows, "logs": logs}
    result = {
        "runs": runs,
        "setup": {
            "preset": args.preset,
            "gpus_visible": gpus,
            "prompts": args.prompts,
            "prompt_tokens": [args.min_len, args.max_len],
            "new_tokens": args.new_tokens,
        },
    }
    if "gpu=2" in runs:
        result["speedup_2_vs_1"] = runs["gpu=1"]["wall_s"] / runs["gpu=2"]["wall_s"]
        result["goals"] = {"speedup_2_vs_1>=1.8": result["speedup_2_vs_1"] >= 1.8}
    return result


def table(r: dict) -> str:
    if "speedup_2_vs_1" in r or "tokens_per_s_per_gpu" not in r:
        lines = [f"{'run':10s}{'wall s':>10s}{'job s':>20s}{'rows':>8s}"]
        for k, v in r["runs"].items():
            job_s = str([round(x, 1) for x in v["job_s"]])
            lines.append(f"{k:10s}{v['wall_s']:10.1f}{job_s:>20s}{v['rows']:8d}")
        if "speedup_2_vs_1" in r:
            lines.append(f"2 GPUs vs 1: {r['speedup_2_vs_1']:.2f}x; goals {r['goals']}")
        return "\n".join(lines)
    lines = [
        f"{'run':22s}{'new tokens':>12s}{'generate s':>12s}{'tok/s':>10s}{'bound':>10s}{'+prefill':>10s}"
    ]
    for k, v in r["runs"].items():
        bounds = [v.get("bound_tokens_per_s"), v.get("bound_with_prefill_tokens_per_s")]
        lines.append(
            f"{k:22s}{v['new_tokens']:12d}{v['generate_s']:12.1f}{v['tokens_per_s']:10.0f}"
            + "".join(f"{'-' if b is None else round(b):>10}" for b in bounds)
        )
    lines.append(
        f"ours / baseline: {r.get('speedup_vs_baseline', float('nan')):.2f}x; of the bound: "
        f"{r.get('fraction_of_bound', 0):.3f} (with the prefill: "
        f"{r.get('fraction_of_bound_with_prefill', 0):.3f}); goals {r.get('goals')}"
    )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["gpu", "snakemake"], default="gpu")
    p.add_argument("--preset", choices=["qwen3-8b", "tiny"], default="qwen3-8b")
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--baseline-batch", type=int, default=64, help="HF generate's batch (0: no baseline run)")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 0], help="static engine batches (0: auto)")
    p.add_argument("--hbm-bytes-per-s", type=float, default=None, help="for GPUs not in the table")
    p.add_argument("--work", default="/tmp/flashdraft-regenerate-bench")
    p.add_argument("--out", default=None)
    p.add_argument("--rescore", default=None, help="derive bounds and goals of a saved gpu-mode result again")
    args = p.parse_args()
    if args.rescore:
        result = score(json.loads(Path(args.rescore).read_text()))
        write_json(args.rescore, result)  # the measurement's own envelope kept
        print(table(result))
        return
    result = bench_gpu(args) if args.mode == "gpu" else bench_snakemake(args)
    name = "regenerate" if args.mode == "gpu" else "regenerate_snakemake"
    out = Path(args.out or REPO / "benchmarks" / "results" / f"{name}_{args.preset}.json")
    write_result(out, result, params=vars(args))
    print(table(result))


if __name__ == "__main__":
    main()
