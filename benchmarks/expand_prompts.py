"""Benchmark the prompts stage at production scale: a synthetic ShareGPT jsonl source with planted exact
and near duplicates, expanded to `total` prompts (the gap filled by augmentation) with near-dup on.

Reports wall time and the peak RSS of the expansion process, plus what dedup found versus what was
planted. Usage: python benchmarks/expand_prompts.py [--rows 1100000] [--out benchmarks/results/...json]
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import write_result

ROOT = Path(__file__).resolve().parents[1]


def write_source(path: Path, rows: int, dup_frac: float, near_frac: float, seed: int = 0) -> dict:
    """Blocks of new prompts followed by exact copies and near copies (upper-cased, one word appended)
    of prompts of the same block; written block by block so memory stays small."""
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(30_000)])
    planted = {"exact": 0, "near": 0}
    block = 100_000
    with open(path, "w") as f:
        for start in range(0, rows, block):
            n = min(block, rows - start)
            n_dup, n_near = int(n * dup_frac), int(n * near_frac)
            n_new = n - n_dup - n_near
            lens = rng.integers(20, 80, n_new)
            ids = rng.integers(0, len(vocab), lens.sum())
            words = np.split(vocab[ids], np.cumsum(lens)[:-1])
            new = [" ".join(w) + "?" for w in words]
            texts = new + [new[i] for i in rng.integers(0, n_new, n_dup)]
            texts += [new[i].upper() + " thanks" for i in rng.choice(n_new, n_near, replace=False)]
            planted["exact"] += n_dup
            planted["near"] += n_near
            f.writelines(
                json.dumps({"conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "ok"}]})
                + "\n"
                for t in texts
            )
    return planted


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1_100_000)
    ap.add_argument("--total", type=int, default=1_100_000)
    ap.add_argument("--eval-count", type=int, default=1000)
    ap.add_argument("--dup-frac", type=float, default=0.05)
    ap.add_argument("--near-frac", type=float, default=0.05)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/expand_prompts_1m.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-prompts-") as tmp:
        src = Path(tmp) / "source.jsonl"
        t0 = time.perf_counter()
        planted = write_source(src, args.rows, args.dup_frac, args.near_frac)
        gen_s = time.perf_counter() - t0
        cfg = {
            "total": args.total,
            "eval_count": args.eval_count,
            "sources": [{"name": "synthetic", "path": str(src)}],
        }
        cmd = [sys.executable, str(ROOT / "scripts/prompts.py"), "--cfg", json.dumps(cfg)]
        t0 = time.perf_counter()
        subprocess.run(cmd + ["--out-dir", f"{tmp}/out"], check=True, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
        stats = json.loads(Path(f"{tmp}/out/stats.json").read_text())
        source_mib = src.stat().st_size / 2**20
    t = stats["totals"]
    result = {
        "rows": args.rows,
        "total": args.total,
        "eval_count": args.eval_count,
        "source_mib": round(source_mib, 1),
        "planted_exact": planted["exact"],
        "planted_near": planted["near"],
        "found_exact": t["duplicates"],
        "found_near": t["near_duplicates"],
        "kept": t["kept"],
        "augmented": t["augmented"],
        "sampled_train": t["sampled_train"],
        "sampled_eval": t["sampled_eval"],
        "generate_s": round(gen_s, 1),
        "expand_wall_s": round(wall, 1),
        "expand_peak_rss_gib": round(peak_kib / 2**20, 2),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    write_result(args.out, result, params=vars(args), device="cpu")
    width = max(map(len, result))
    for k, v in result.items():
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
