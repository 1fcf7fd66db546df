"""float8 training against bf16 over a whole training curve: the production drafter trained by the real
trainer for --steps optimizer steps per variant, same data and seed, validation every --val-every steps.

    python benchmarks/fp8_curves.py --preset qwen3-8b|tiny [--steps 300] [--val-every 50] [--work DIR]

Data (in --work, reused while its parameters match): train_drafter.py's target directory (train_bench.setup:
a Qwen3-8B-shaped config, random bf16 embedding and LM head) and one fp8 hidden-state shard (hidden.dtype
float8_e4m3, as production.yaml stores them) of `samples` sequences with something to learn: the tokens
follow a fixed random Markov chain over a 4,096-token slice of the vocabulary (the toy: its 512; each token
has four successors, with probabilities 0.55, 0.25, 0.12, 0.08), and target feature k (of K) at position t
is the target's LM-head row of the token k + 1 places ahead (a trained target's states point at the tokens
to come, its last layer at the next one) plus half of a fixed random embedding of the token at t, with
Gaussian noise, each feature at unit scale. Block positions up to K are then read off the context, the later
ones follow the chain, whose next-token entropy is known (`chain_entropy_nats`): a curve that falls shows
the drafter learning; a curve that stays flat (acc near 0, val_sim_tau 1) compares nothing but the first
steps' arithmetic, whatever its gap says.

Each variant is scripts/train.py, launched as the workflow launches it, with config/production.yaml's
training keys (lr, warmup, clipping, loss, compile scope, compiled loss) but train.fp8 as the variant
says, `rows` sequences of `seq_len` tokens per optimizer step, train.val_samples held out and validated
every --val-every steps (val_loss, val_sim_tau), the loss logged every 10 steps; the variants run
--concurrent at a time on one GPU (their speed is not measured here), each ended after its last row,
or all at --timeout (then `complete` false). Reported per variant: the logged rows; against bf16: the
largest relative gap of the logged training loss over the last 100 steps
(|loss_v / loss_bf16 - 1| per logged step), and the validation gap (val_loss relative, val_sim_tau
absolute) at every validation and the last. `--preset tiny` runs bf16 alone on the CPU (float8 needs a
GPU) on the toy's shapes, eager (neither the drafter nor the loss compiled): a check of the machinery,
about a minute (`--steps 2 --val-every 1`: seconds).
Writes benchmarks/results/fp8_curves_<preset>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from harness import write_result
from safetensors.torch import load_file
from train_bench import PRESETS, REPO, Proc, base_env, drafter_config, launch, live_rows, setup

from flashdraft.hidden import ShardMeta, manifest_path, quantize_fp8
from flashdraft.hidden_write import open_shard, write_manifest
from flashdraft.train_step import load_spec

SHAPES = {  # the curve's data and step on each preset
    # short samples: over 2,048 tokens of context the chain's signal is diluted past what 300 steps learn
    # (on the toy's shapes, 2,048-token samples learn nothing in 120 steps where 256-token ones do)
    "qwen3-8b": dict(
        seq_len=256,
        rows=16,
        samples=512,
        val_samples=32,
        steps=300,
        val_every=50,
        variants=["bf16", "fp8_tensorwise", "fp8_rowwise"],
        timeout=420,
    ),
    "tiny": dict(
        seq_len=256, rows=4, samples=48, val_samples=8, steps=20, val_every=10, variants=["bf16"], timeout=300
    ),
}
VARIANTS = {"bf16": None, "fp8_tensorwise": "tensorwise", "fp8_rowwise": "rowwise"}
PRODUCTION_KEYS = (
    "lr",
    "warmup_ratio",
    "grad_clip",
    "weight_decay",
    "loss",
    "gamma",
    "dpace_alpha",
    "compile_scope",
    "compile_loss",
    "dtype",
    "seed",
)
CHAIN = dict(tokens=4096, probs=(0.55, 0.25, 0.12, 0.08), ahead="lm_head", now=0.5, noise=0.1)
LOG_EVERY = 10
LAST = 100  # the loss gap is taken over the last LAST steps


def markov_shard(work: Path, preset: dict, shape: dict) -> Path:
    """The chain's shard in `work`/curves (kept while its parameters match)."""
    params = {"target": preset["target"], "shape": shape, "chain": CHAIN}
    path, marker = work / "curves" / "shard-00000.arrow", work / "curves" / "data.json"
    if marker.exists() and json.loads(marker.read_text()) == params:
        return path
    shutil.rmtree(path.parent, ignore_errors=True)
    path.parent.mkdir(parents=True)
    spec = load_spec(work / "target", drafter_config(preset))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(dev).manual_seed(0)
    n, s = min(CHAIN["tokens"], spec.mask_token_id), shape["seq_len"]
    h, k = spec.hidden_size, spec.num_features
    vocab = torch.randperm(spec.mask_token_id, generator=torch.Generator().manual_seed(0))[:n].to(dev)
    succ = torch.randint(0, n, (n, len(CHAIN["probs"])), generator=g, device=dev)
    head = load_file(work / "target" / "model.safetensors")["lm_head.weight"][vocab.cpu()].to(dev).float()
    head = head / head.std(dim=-1, keepdim=True)  # each chain token's LM-head row, unit scale
    now = torch.randn(n, k * h, generator=g, device=dev)
    scale = (1 + CHAIN["now"] ** 2 + CHAIN["noise"] ** 2) ** -0.5  # unit variance
    meta = ShardMeta(
        target="markov", target_layer_ids=spec.target_layer_ids, hidden_size=h, dtype="float8_e4m3"
    )
    chains = np.random.default_rng(0)
    succ_np, x = succ.cpu().numpy(), np.empty((shape["samples"], s + k), dtype=np.int64)
    x[:, 0] = chains.integers(0, n, shape["samples"])
    picks = chains.choice(len(CHAIN["probs"]), size=x.shape, p=CHAIN["probs"])
    for t in range(1, s + k):  # every sample's chain at once, k tokens past the end for the last features
        x[:, t] = succ_np[x[:, t - 1], picks[:, t]]
    t0 = time.perf_counter()
    with open_shard(path, meta) as w:
        for i, row in enumerate(torch.from_numpy(x).to(dev)):
            ahead = torch.cat([head[row[j + 1 : j + 1 + s]] for j in range(k)], dim=-1)  # [s, k * h]
            feats = (
                ahead
                + CHAIN["now"] * now[row[:s]]
                + CHAIN["noise"] * torch.randn(s, k * h, generator=g, device=dev)
            )
            q, sc = quantize_fp8(feats * scale)
            w.write(f"m{i:05d}", vocab[row[:s]].tolist(), [1] * s, q.cpu(), sc.cpu())
    write_manifest(manifest_path(path), w)
    marker.write_text(json.dumps(params))
    took = time.perf_counter() - t0
    print(f"data: {shape['samples']} chain samples x {s} tokens in {took:.1f} s", flush=True)
    return path


def entropy() -> float:
    return -sum(p * math.log(p) for p in CHAIN["probs"])


def train_cfg(preset: dict, shape: dict, fp8: str | None) -> dict:
    keys = yaml.safe_load((REPO / "config" / "production.yaml").read_text())["train"]
    s, cuda = shape["seq_len"], preset["device"] == "cuda"
    cfg = {k: keys[k] for k in PRODUCTION_KEYS if k in keys}
    return cfg | {
        "max_steps": shape["steps"],
        "batch_tokens": shape["rows"] * s,
        "global_batch_tokens": 0,
        "buckets": [s],
        "max_anchors": preset["max_anchors"],
        "attention": preset["attention"],
        # on the CPU (tiny: a check of the machinery) eager, the loss too: a compile takes longer than the run
        "compile": cuda,
        "compile_loss": cuda and cfg.get("compile_loss", False),
        "dtype": preset["dtype"],
        "fp8": fp8,
        "checkpoint_every": 10**9,
        "keep_checkpoints": 1,
        "log_every": LOG_EVERY,
        "val_samples": shape["val_samples"],
        "val_every": shape["val_every"],
        "export": "last",
    }


def gaps(rows: dict, base: dict, steps: int) -> dict:
    """The variant's rows against bf16's, by step."""

    def at(rs, key):
        return {int(r["step"]): float(r[key]) for r in rs if r.get(key) not in (None, "")}

    loss, ref = at(rows, "loss"), at(base, "loss")
    late = [s for s in sorted(ref) if s > steps - LAST and s in loss]
    rel = [loss[s] / ref[s] - 1 for s in late]
    out = {
        "loss_rel_gap_last_100": max(map(abs, rel)) if rel else None,
        "loss_mean_rel_diff_last_100": sum(rel) / len(rel) if rel else None,
    }
    for key in ("val_loss", "val_sim_tau"):
        v, r = at(rows, key), at(base, key)
        common = sorted(set(v) & set(r))
        out[key] = {s: {"variant": v[s], "bf16": r[s], "diff": v[s] - r[s]} for s in common}
    return out


def kept_runs(path: Path | None, preset: dict, shape: dict) -> dict:
    """The complete runs of an earlier result of the same data and training (--merge): variants can be run
    in separate calls, each adding to the one file."""
    if path is None or not path.exists():
        return {}
    old, plain = json.loads(path.read_text()), lambda x: json.loads(json.dumps(x))
    train = train_cfg(preset, shape, None) | {"fp8": "per variant"}
    same = (
        old["shape"] | {"timeout": None} == plain(shape | {"timeout": None})
        and old["chain"] == plain(CHAIN)
        and old["train"] == plain(train)
    )
    if not same:
        raise SystemExit(f"{path}: another shape, chain or training; not merged")
    return {v: r for v, r in old["runs"].items() if r["complete"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--val-every", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample")
    p.add_argument("--rows", type=int, default=None, help="samples per optimizer step")
    p.add_argument("--timeout", type=float, default=None, help="seconds for the variants' runs, together")
    p.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS))
    p.add_argument(
        "--concurrent",
        type=int,
        default=None,
        help="variants training at once on the GPU "
        "(default: 2 on a card of 120 GB or more, else 1: each holds up to 63 GB at the qwen3-8b "
        "shape)",
    )
    p.add_argument(
        "--merge",
        type=Path,
        default=None,
        metavar="JSON",
        help="keep the complete runs of this earlier result (same data and training) and run "
        "only the other variants",
    )
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    preset, shape = dict(PRESETS[args.preset]), dict(SHAPES[args.preset])
    shape.update(
        {
            k: v
            for k, v in (
                ("steps", args.steps),
                ("val_every", args.val_every),
                ("rows", args.rows),
                ("seq_len", args.seq_len),
                ("timeout", args.timeout),
            )
            if v
        }
    )
    variants = args.variants or shape.pop("variants")
    shape.pop("variants", None)
    cuda = preset["device"] == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"preset {args.preset} needs a CUDA GPU")
    if not cuda and any(VARIANTS[v] for v in variants):
        raise SystemExit("float8 variants need a GPU; --preset tiny runs bf16 alone")
    work = args.work or Path(tempfile.gettempdir()) / f"flashdraft-train-bench-{args.preset}"
    out = args.out or REPO / "benchmarks" / "results" / f"fp8_curves_{args.preset}.json"
    (work / "logs").mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.perf_counter()
    setup(preset, work)
    shard = str(markov_shard(work, preset, shape))
    steps, runs = shape["steps"], kept_runs(args.merge, preset, shape)
    variants = [v for v in variants if v not in runs]
    if args.concurrent is None:
        big = cuda and torch.cuda.get_device_properties(0).total_memory >= 120e9
        args.concurrent = 2 if big else 1
    deadline = time.perf_counter() + shape["timeout"]  # all of them: the JSON is written after
    try:
        for wave in range(0, len(variants), args.concurrent):  # at most --concurrent share the GPU
            procs = {}
            for v in variants[wave : wave + args.concurrent]:
                cfg = train_cfg(preset, shape, VARIANTS[v])
                name = f"curve-{v}"
                procs[v] = Proc(
                    name,
                    launch(preset, 1, cfg, work, name, [shard]),
                    base_env(preset, work / "inductor" / name),
                    work / "logs",
                )
            for v, proc in procs.items():
                run_dir = work / "runs" / f"curve-{v}"
                try:
                    done = proc.wait_for(
                        lambda d=run_dir: any(
                            int(r["step"]) >= steps and r.get("val_sim_tau") for r in live_rows(d)
                        ),
                        max(1.0, deadline - time.perf_counter()),
                    )
                except TimeoutError:
                    done = False
                proc.stop()
                runs[v] = {"complete": done, "rows": live_rows(run_dir), "log": str(proc.err_log)}
                if not done:
                    print(f"{v}: did not finish\n{proc.tail()}", flush=True)
    finally:
        for proc in Proc.live:
            proc.stop()
    base = runs.get("bf16")
    compare = {
        v: gaps(r["rows"], base["rows"], steps)
        for v, r in runs.items()
        if v != "bf16" and base and r["complete"] and base["complete"]
    }
    device = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"
    result = {
        "what": "the production drafter trained by scripts/train.py per variant on the same Markov-chain "
        "data and seed: logged rows (loss every 10 steps, validation every val_every), and each "
        "float8 variant against bf16",
        "preset": args.preset,
        "device": device,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "shape": shape,
        "chain": CHAIN,
        "chain_entropy_nats": entropy(),
        "train": train_cfg(preset, shape, None) | {"fp8": "per variant"},
        "complete": all(r["complete"] for r in runs.values()),
        "runs": runs,
        "vs_bf16": compare,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_result(out, result, params=vars(args), device=preset["device"])
    for v, r in runs.items():
        last = r["rows"][-1] if r["rows"] else {}
        print(
            f"{v:16} complete {r['complete']}  last loss {last.get('loss')}  val_sim_tau "
            f"{last.get('val_sim_tau')}  {compare.get(v, {}).get('loss_rel_gap_last_100', '')}"
        )
    print(f"-> {out}")


if __name__ == "__main__":
    main()
