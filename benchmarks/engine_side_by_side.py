"""The static decode engines' speed against an earlier commit's, side by side on one GPU.

Both sides run their own copy of `benchmarks/eval_decode.py` (evaluation's sessions: target-only, DFlash,
oracle) and `benchmarks/regenerate.py --mode gpu` (regeneration's SlotDecoder, static engine only), the
older one from `git archive REF src benchmarks` in a temp dir. Runs alternate (old, new, old, new, ...)
so drift of the machine falls on both sides alike. Each rate is the benchmark's own: tokens/s of
eval_decode's modes, regenerate's `tokens_per_s` (new tokens over the generate time).

Usage: python benchmarks/engine_side_by_side.py --ref COMMIT [--ref-dir DIR] [--repeats 2]
           [--preset qwen3-8b|tiny] [--only eval_decode regenerate] [--out JSON]
--ref-dir: COMMIT's src and benchmarks unpacked there already (`git archive COMMIT src benchmarks | tar -x
-C DIR`), for a copy of the repository without its history (a GPU machine's).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import write_result

REPO = Path(__file__).resolve().parents[1]
RUNS = {  # name -> (script, args), each with --preset
    "eval_decode": ("eval_decode.py", ["--prompts", "4", "--engines", "static"]),
    "regenerate": ("regenerate.py", ["--mode", "gpu", "--prompts", "256", "--batch", "0",
                                     "--baseline-batch", "0"]),
}


def rates(name: str, result: dict) -> dict:
    if name == "eval_decode":
        return {mode: r["tokens_per_s"] for mode, r in result["modes"].items()}
    return {"static": result["tokens_per_s_per_gpu"]}


def run(root: Path, name: str, preset: str, out: Path) -> dict:
    script, args = RUNS[name]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "benchmarks"),
                                                        os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, str(root / "benchmarks" / script), *args, "--preset", preset, "--out", str(out)]
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    return rates(name, json.loads(out.read_text()))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ref", required=True, help="the earlier commit")
    p.add_argument("--ref-dir", type=Path, default=None, help="its src and benchmarks, unpacked")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--preset", default="qwen3-8b", choices=["qwen3-8b", "tiny"])
    p.add_argument("--only", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "engine_side_by_side.json")
    args = p.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        old = args.ref_dir or Path(tmp) / "old"
        if args.ref_dir is None:
            old.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.ref, "src", "benchmarks"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        sides = {"old": old, "new": REPO}
        got = {name: {side: [] for side in sides} for name in args.only}
        for name in args.only:
            for _ in range(args.repeats):
                for side, root in sides.items():
                    got[name][side].append(run(root, name, args.preset, Path(tmp) / f"{name}-{side}.json"))
    result = {"what": __doc__.splitlines()[0], "ref": args.ref, "repeats": args.repeats,
              "runs": got, "wall_s": round(time.perf_counter() - t0, 1), "new_over_old": {}}
    for name, by_side in got.items():
        for key in by_side["new"][0]:
            mean = {s: statistics.mean(r[key] for r in by_side[s]) for s in by_side}
            result["new_over_old"][f"{name}.{key}"] = round(mean["new"] / mean["old"], 4)
    write_result(args.out, result, params=vars(args))
    print(json.dumps(result["new_over_old"], indent=2))


if __name__ == "__main__":
    main()
