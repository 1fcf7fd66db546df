"""An earlier commit's speed side by side with this checkout's on one GPU: decode engines, the trainer.

Both sides run their own copy of a benchmark, the older one from `git archive REF src scripts config
workflow benchmarks` in a temp dir: `eval_decode` (benchmarks/eval_decode.py, evaluation's sessions:
target-only, DFlash, oracle), `regenerate` (benchmarks/regenerate.py --mode gpu, regeneration's
SlotDecoder, static engine only), `train_drafter` (benchmarks/train_drafter.py, one process's throughput
run with config/production.yaml's float8 and compile keys: the trainer's tokens/s and its warm launch to
first step, whose goal is "not slower"). Runs alternate (old, new, old, new, ...) so drift of the machine
falls on both sides alike; the result is written after every pair. Each rate is the benchmark's own:
tokens/s of eval_decode's modes, regenerate's `tokens_per_s` (new tokens over the generate time), the
trainer's tokens/s per GPU (its metrics windows after the first).

Usage: python benchmarks/side_by_side.py --ref COMMIT [--ref-dir DIR] [--repeats 2]
           [--preset qwen3-8b|tiny] [--only eval_decode regenerate train_drafter] [--out JSON]
--ref-dir: COMMIT's tree unpacked there already (`git archive COMMIT src scripts config workflow
benchmarks | tar -x -C DIR`), for a copy of the repository without its history (a GPU machine's).
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from harness import write_result

REPO = Path(__file__).resolve().parents[1]
TREE = ["src", "scripts", "config", "workflow", "benchmarks"]  # what a side runs from
FP8_KEYS = ("fp8", "compile_loss", "compile_scope")  # production.yaml's, on a GPU


def train_args(preset: str, work: Path) -> list[str]:
    prod = yaml.safe_load((REPO / "config" / "production.yaml").read_text())["train"]
    keys = {k: prod[k] for k in FP8_KEYS} if preset != "tiny" else {"compile": False}  # CPU: eager, bf16
    return [
        "--gpus",
        "1",
        "--runs",
        "throughput",
        "--steps",
        "24",
        "--set",
        json.dumps(keys),
        "--work",
        str(work),
    ]  # each side's own data and caches


RUNS = {  # name -> (script, its args for a preset and a side's work dir)
    "eval_decode": ("eval_decode.py", lambda preset, work: ["--prompts", "4", "--engines", "static"]),
    "regenerate": (
        "regenerate.py",
        lambda preset, work: ["--mode", "gpu", "--prompts", "256", "--batch", "0", "--baseline-batch", "0"],
    ),
    "train_drafter": ("train_drafter.py", train_args),
}
DEFAULT = ["eval_decode", "regenerate"]


def rates(name: str, result: dict) -> dict:
    if name == "eval_decode":
        return {mode: r["tokens_per_s"] for mode, r in result["modes"].items()}
    if name == "train_drafter":
        one = result["throughput"]["1"]
        return {
            "tokens_per_s": one["tokens_per_s_per_gpu"],
            "launch_to_first_step_warm_s": one["launch_to_first_step_s"],
        }
    return {"static": result["tokens_per_s_per_gpu"]}


def run(root: Path, name: str, preset: str, out: Path, work: Path) -> dict:
    script, args = RUNS[name]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(root / "src"), str(root / "benchmarks"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    argv = [
        sys.executable,
        str(root / "benchmarks" / script),
        *args(preset, work),
        "--preset",
        preset,
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    try:
        code = proc.wait()
    finally:  # this benchmark stopped (SIGTERM, Ctrl-C): the side's benchmark stops its own processes
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    if code:
        raise SystemExit(f"{root / 'benchmarks' / script} failed (exit {code}); its messages are above")
    return rates(name, json.loads(out.read_text()))


def commit(ref: str) -> str:
    """The commit `ref` names in this checkout; a ref that looks like an option (`--output=F`) stays a ref."""
    got = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if got.returncode:
        raise SystemExit(f"--ref {ref}: names no commit of {REPO}")
    return got.stdout.strip()


def unpack(ref: str, sha: str, dest: Path):
    """TREE at commit `sha` (--ref `ref`) into `dest`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", sha, "--", *TREE], capture_output=True)
    if archive.returncode:
        raise SystemExit(f"--ref {ref}: {' '.join(archive.stderr.decode().split())}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ref", required=True, help="the earlier commit")
    p.add_argument("--ref-dir", type=Path, default=None, help="its tree, unpacked")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--preset", default="qwen3-8b", choices=["qwen3-8b", "tiny"])
    p.add_argument("--only", nargs="+", default=DEFAULT, choices=list(RUNS))
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: benchmarks/results/"
        "train_side_by_side_<preset>.json for train_drafter alone, else engine_side_by_side.json",
    )
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.ref_dir and not (args.ref_dir / "benchmarks").is_dir():
        raise SystemExit(
            f"--ref-dir {args.ref_dir}: no benchmarks/ there; unpack `git archive {args.ref} "
            f"{' '.join(TREE)}` into it"
        )
    name = f"train_side_by_side_{args.preset}" if args.only == ["train_drafter"] else "engine_side_by_side"
    args.out = args.out or REPO / "benchmarks" / "results" / f"{name}.json"
    sha = commit(args.ref) if args.ref_dir is None else None  # a bad --ref: one line, before any run
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        old = args.ref_dir.resolve() if args.ref_dir else Path(tmp) / "old"
        if sha:
            old.mkdir()
            unpack(args.ref, sha, old)
        sides = {"old": old, "new": REPO}
        got = {name: {side: [] for side in sides} for name in args.only}
        for name in args.only:
            for _ in range(args.repeats):
                for side, root in sides.items():
                    got[name][side].append(
                        run(
                            root,
                            name,
                            args.preset,
                            Path(tmp) / f"{name}-{side}.json",
                            Path(tmp) / f"work-{side}",
                        )
                    )
                write(args, got, t0)


def write(args, got: dict, t0: float):
    result = {
        "what": __doc__.splitlines()[0],
        "ref": args.ref,
        "repeats": args.repeats,
        "runs": got,
        "wall_s": round(time.perf_counter() - t0, 1),
        "new_over_old": {},
    }
    for name, by_side in got.items():
        if not by_side["new"]:
            continue
        ratios = result["new_over_old"][name] = {}
        for key in by_side["new"][0]:
            mean = {s: statistics.mean(r[key] for r in by_side[s]) for s in by_side}
            ratios[key] = round(mean["new"] / mean["old"], 4)
    write_result(args.out, result, params=vars(args))
    print(json.dumps(result["new_over_old"], indent=2), flush=True)


if __name__ == "__main__":
    main()
