"""What the target-side benchmarks share (precompute_hidden.py, regenerate.py, decode_step.py,
stream_rehearsal.py): a random target of a preset's shapes, built in memory or saved as an HF directory
with the toy's tokenizer, and one workflow rule run alone through Snakemake.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from shapes import PRESETS
from transformers import AutoModelForCausalLM, Qwen3Config

from flashdraft.io import run_dtype, torch_dtype

REPO = Path(__file__).resolve().parents[1]


def build_target(preset: str, dev):
    """A random target of the preset's shapes on `dev`: bf16 on a GPU, float32 on the CPU."""
    config = Qwen3Config(**PRESETS[preset]["target"])
    dtype = torch_dtype(run_dtype("bfloat16", dev))
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def saved_target(preset: str, work: Path, seed_tokens: int = 3000) -> Path:
    """work/target: a random target of the preset's shape on disk with the toy's byte-level chat
    tokenizer (built once), read into the page cache so that every measured run starts alike."""
    from flashdraft.toy import build_tokenizer, task_conversations

    out = work / "target"
    if not (out / "config.json").exists():
        model = build_target(preset, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        model.to(torch.bfloat16).save_pretrained(out)
        del model
        build_tokenizer(task_conversations(seed_tokens, seed=0), 512).save_pretrained(out)
    for f in out.iterdir():
        f.read_bytes()
    return out


def run_rule(run_dir: Path, rule: str, targets: list[str], gpus: int) -> tuple[float, list[float], dict]:
    """Snakemake builds `targets` with `rule` alone in `run_dir` (its config.yaml) and `gpus` GPUs to share:
    the wall time, each job's time from its `benchmark:` file, and the tail of each job's log."""
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "workflow" / "Snakefile"),
        "-d",
        str(run_dir),
        "--configfile",
        str(run_dir / "config.yaml"),
        "--cores",
        str(os.cpu_count()),
        "--resources",
        f"gpu={gpus}",
        "--allowed-rules",
        rule,
        "--",
        *targets,
    ]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"snakemake failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    bench, logs = run_dir / "results" / "benchmarks" / rule, run_dir / "results" / "logs" / rule
    job_s = [float(f.read_text().splitlines()[1].split("\t")[0]) for f in sorted(bench.glob("*.tsv"))]
    return wall, job_s, {f.name: f.read_text()[-800:] for f in sorted(logs.glob("*.log"))}
