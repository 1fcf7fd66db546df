"""The training step compiled other ways than train.py does, each from a cold and from a warm compile cache:
first step, steady step and peak memory, side by side in one run on one device.

Variants (`--variants`, `SCOPE:MASK` each):
- SCOPE `whole`: the drafter compiled as one module (what train_step.build_step does); `regional`: each
  decoder layer compiled on its own (one layer's graph, reused by the others).
- MASK `eager`: flex's BlockMask built by an eager create_block_mask each step (what loss.flex_mask does);
  `compiled`: by torch.compile(create_block_mask). On CPU (SDPA, a dense mask) only `eager` applies.

Each (variant, cache) is a fresh process with an empty Inductor dir. The cold one compiles, then saves the
Mega-Cache blob and its Inductor dir's files (compile_cache.pack_inductor_dir); the warm one loads them
first, as compile_cache.load_compile_cache does. Both run train_step.forward_backward plus the optimizer
step on random data of the preset's shapes: the first step (compile or cache hits), two more, then 5 timed
under fail_on_recompile. Startup (imports, model build) is not counted: it does not depend on the variant.

Usage: python benchmarks/compile_variants.py [--preset qwen3-8b|tiny]
           [--variants whole:eager,regional:eager,whole:compiled] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import time_it, write_result
from shapes import PRESETS as SHAPES
from torch.nn.attention.flex_attention import create_block_mask
from transformers import Qwen3Config

import flashdraft.loss as loss_module
import flashdraft.model as model
from flashdraft.compile_cache import (
    cache_counters,
    compile_phases,
    inductor_cache_dir,
    merge_inductor_files,
    pack_inductor_dir,
    random_batch,
)
from flashdraft.config import DrafterConfig
from flashdraft.families import family
from flashdraft.objectives import Decay
from flashdraft.train_step import Step, anchors_for, forward_backward

REPO = Path(__file__).resolve().parents[1]
PRESETS = {  # the benchmark presets (shapes.py) and the variants each compares by default
    "tiny": {**SHAPES["tiny"], "variants": "whole:eager,regional:eager"},
    "qwen3-8b": {**SHAPES["qwen3-8b"], "variants": "whole:eager,regional:eager,whole:compiled"},
}
STEADY = 5


def child(preset: dict, scope: str, mask: str, phase: str, cache: Path) -> dict:
    """One process: build, (warm: load the caches), first step, steady steps; (cold: save the caches)."""
    dev = torch.device(preset["device"])
    if mask == "compiled":
        compiled = torch.compile(create_block_mask, dynamic=False)

        def flex_mask(anchors, valid, ctx_len, block_size):
            b, a = anchors.shape
            mod = model.dflash_mask_mod(anchors, valid, ctx_len, block_size)
            return compiled(
                mod, B=b, H=None, Q_LEN=a * block_size, KV_LEN=ctx_len + a * block_size, device=anchors.device
            )

        loss_module.flex_mask = flex_mask  # train_forward looks it up in its module
    if phase == "warm":
        torch.compiler.load_cache_artifacts((cache / "artifacts.bin").read_bytes())
        merge_inductor_files(cache / "inductor.tar", inductor_cache_dir())
    drafter_cfg = DrafterConfig(**preset["drafter"], mask_token_id=preset["mask_token_id"])
    spec = model.DrafterSpec.from_target(
        Qwen3Config(**preset["target"]), preset["target"]["vocab_size"], drafter_cfg
    )
    torch.manual_seed(0)
    with torch.device(dev):
        drafter = model.DFlashDrafter(spec)
    for m in drafter.layers if scope == "regional" else [drafter]:
        m.compile(dynamic=False)
    amp = torch.bfloat16 if dev.type == "cuda" else None
    head = [
        torch.randn(spec.vocab_size, spec.hidden_size, device=dev, dtype=amp or torch.float32) * 0.02
        for _ in range(2)
    ]
    step = Step(
        drafter,
        spec,
        family("dflash"),
        head[0],
        head[1],
        Decay(7.0),
        preset["attention"],
        preset["max_anchors"],
        False,
        dev,
        amp,
    )
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=dev.type == "cuda")
    g = torch.Generator().manual_seed(0)
    batch = random_batch(
        preset["seq_len"],
        preset["rows"],
        spec.num_features * spec.hidden_size,
        spec.vocab_size,
        amp or torch.float32,
        g,
    )

    def one():
        anchors, valid = anchors_for(step, batch["loss_mask"], g)
        loss, _ = forward_backward(step, batch, anchors, valid)
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    t = time_it(one, warmup=0, repeats=1, device=dev)  # the compile, or the cache hits
    first, loss = t.median_s, float(t.out)
    counters, phases = cache_counters(), compile_phases(8)
    for _ in range(2):
        one()
    with torch.compiler.set_stance("fail_on_recompile"):
        steady = time_it(one, warmup=0, repeats=1, number=STEADY, device=dev).median_s
    out = {
        "scope": scope,
        "mask": mask,
        "phase": phase,
        "first_step_s": round(first, 2),
        "steady_ms": round(1e3 * steady, 1),
        "loss": loss,
        "counters": counters,
        "phases": phases,
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev.type == "cuda" else None,
    }
    if phase == "cold":
        artifacts = torch.compiler.save_cache_artifacts()
        (cache / "artifacts.bin").write_bytes(artifacts[0] if artifacts else b"")
        pack_inductor_dir(inductor_cache_dir(), cache / "inductor.tar")
    return out


def run_child(preset_name: str, scope: str, mask: str, phase: str, cache: Path, work: Path) -> dict:
    inductor = Path(tempfile.mkdtemp(prefix=f"inductor-{scope}-{mask}-{phase}-", dir=work))
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(inductor),
        "TRITON_CACHE_DIR": str(inductor / "triton"),
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    if PRESETS[preset_name]["device"] == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        __file__,
        "--preset",
        preset_name,
        "--child",
        f"{scope}:{mask}:{phase}",
        str(cache),
    ]
    log = work / f"{scope}-{mask}-{phase}.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(
            f"{scope}:{mask} {phase} failed (exit {proc.returncode}); see {log}:\n" + log.read_text()[-3000:]
        )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"{scope}:{mask} {phase}: first step {result['first_step_s']} s, steady {result['steady_ms']} ms, "
        f"caches {result['counters']}",
        flush=True,
    )
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--variants", default=None, help="SCOPE:MASK,... (default: the preset's)")
    p.add_argument("--work", default=None, help="work dir (default: a new temporary dir)")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("cache", nargs="?", help=argparse.SUPPRESS)
    args = p.parse_args()
    preset = PRESETS[args.preset]
    if args.child:
        scope, mask, phase = args.child.split(":")
        print(json.dumps(child(preset, scope, mask, phase, Path(args.cache))), flush=True)
        return

    work = Path(args.work or tempfile.mkdtemp(prefix="flashdraft-compile-variants-"))
    work.mkdir(parents=True, exist_ok=True)
    variants = (args.variants or preset["variants"]).split(",")
    for v in variants:
        scope, mask = v.split(":")
        if scope not in ("whole", "regional") or mask not in ("eager", "compiled"):
            raise SystemExit(
                f"--variants: {v!r} is not SCOPE:MASK (SCOPE whole|regional, MASK eager|compiled)"
            )
        if mask == "compiled" and preset["attention"] != "flex":
            raise SystemExit(f"--variants: {v!r}: a compiled block mask needs flex attention (GPU presets)")
    t0 = time.perf_counter()
    rows = []
    for v in variants:
        scope, mask = v.split(":")
        cache = work / f"cache-{scope}-{mask}"
        cache.mkdir(parents=True, exist_ok=True)
        cold = run_child(args.preset, scope, mask, "cold", cache, work)
        warm = run_child(args.preset, scope, mask, "warm", cache, work)
        rows.append(
            {
                "variant": v,
                "cold": cold,
                "warm": warm,
                "warm_over_cold": round(warm["first_step_s"] / cold["first_step_s"], 3),
            }
        )
    result = {
        "what": "first and steady training step per compile variant, cold vs warm compile cache, fresh "
        "processes and Inductor dirs; random data",
        "preset": args.preset,
        "shapes": {
            k: preset[k] for k in ("target", "drafter", "seq_len", "rows", "max_anchors", "attention")
        },
        "steady_steps": STEADY,
        "variants": rows,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    out = Path(args.out or REPO / "benchmarks" / "results" / f"compile_variants_{args.preset}.json")
    write_result(out, result, params=vars(args), device=preset["device"])
    print(f"\n{args.preset} -> {out}")
    print(
        f"{'variant':18} {'cold 1st s':>10} {'warm 1st s':>10} {'warm/cold':>9} {'steady ms':>9} "
        f"{'peak GiB':>8}"
    )
    for r in rows:
        print(
            f"{r['variant']:18} {r['cold']['first_step_s']:10.2f} {r['warm']['first_step_s']:10.2f} "
            f"{r['warm_over_cold']:9.3f} {r['warm']['steady_ms']:9.1f} {str(r['warm']['peak_gib']):>8}"
        )


if __name__ == "__main__":
    main()
