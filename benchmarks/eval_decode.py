"""Decode tokens/s: target-only greedy decoding vs DFlash speculative decoding, side by side.

Both run evaluate.py's own loops (`target_decode`, `speculative_decode`, `DFlashProposer`), with the
target's KV cache and the drafter's context cache, on a random-weight target built in-process (no
download, no tokenizer: prompts are random token ids, and no token ends a sequence).

Random weights make the drafter's acceptance meaningless (tau ~ 1), so an oracle mode also runs: the real
drafter drafts (its cost is paid) but the proposal is the target's own greedy continuation, so every
draft is accepted. Its time per draft step and per verify step give tokens/s at any acceptance length:
tokens_per_s(tau) = tau / (t_draft + t_verify), a verify step always scoring a full block. tau is the
tokens emitted per verify step (evaluate.py's count), pooled over the prompts.

Usage: python benchmarks/eval_decode.py --preset tiny|qwen3-8b [--prompts 8] [--prompt-len 512]
           [--new-tokens 128] [--out benchmarks/results/eval_decode_<preset>.json]
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import transformers
from shapes import QWEN3_8B, TOY
from transformers import Qwen3Config, Qwen3ForCausalLM

from flashdraft.config import DrafterConfig
from flashdraft.evaluate import DFlashProposer, speculative_decode, target_decode
from flashdraft.model import DFlashDrafter, DrafterSpec

PRESETS = {
    # the toy target's shapes (flashdraft.toy) and the embedded default drafter (K=2, B=8)
    "tiny": dict(
        target=TOY,
        mask_token_id=512, drafter=DrafterConfig(num_layers=2, block_size=8), device="cpu", dtype="float32",
    ),
    "qwen3-8b": dict(
        target=QWEN3_8B,
        mask_token_id=151669, drafter=DrafterConfig(num_layers=5, block_size=16), device="cuda",
        dtype="bfloat16",
    ),
}
TAUS = (1.0, 3.5, 6.5)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Timed:
    """A proposer whose drafting time is measured, so a decode's time splits into draft and verify."""

    def __init__(self, inner, dev):
        self.inner, self.dev, self.uses_features, self.seconds = inner, dev, inner.uses_features, 0.0

    def reset(self):
        self.inner.reset()

    def propose(self, *args):
        sync(self.dev)
        t0 = time.perf_counter()
        out = self.inner.propose(*args)
        sync(self.dev)
        self.seconds += time.perf_counter() - t0
        return out


class Oracle:
    """Runs the real drafter, then proposes the target's greedy continuation instead: full acceptance at
    the real drafting cost."""

    def __init__(self, inner, prompts, outputs, num_draft):
        self.inner, self.num_draft, self.uses_features = inner, num_draft, True
        self.sequences = [[*p, *o] for p, o in zip(prompts, outputs, strict=True)]
        self.i = -1

    def reset(self):  # a new decode: the next prompt, in order
        self.inner.reset()
        self.i += 1

    def propose(self, tokens, new_features, max_draft, temperature, generator):
        self.inner.propose(tokens, new_features, max_draft, temperature, generator)
        # if a near-tie (bf16) sent decoding off the reference, the drafts miss: the measured tau shows it
        ref = self.sequences[self.i]
        return ref[len(tokens) : len(tokens) + min(self.num_draft, max_draft)], None


def build(preset: dict, seed: int = 0):
    """Random target and random drafter, created on the device in the preset's dtype."""
    dev, dtype = torch.device(preset["device"]), getattr(torch, preset["dtype"])
    config = Qwen3Config(**preset["target"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
        model.eval().requires_grad_(False)
        spec = DrafterSpec.from_target(config, preset["mask_token_id"], preset["drafter"])
        drafter = DFlashDrafter(spec).to(dtype).eval().requires_grad_(False)
    return model, drafter, spec


def run_mode(model, prompts, new_tokens, layer_ids, proposer=None):
    """Decode every prompt; totals of tokens (after the prefill's first), decode and draft seconds, steps."""
    tokens = seconds = steps = 0
    outputs = []
    if proposer is not None:
        proposer.seconds = 0.0
    for ids in prompts:
        if proposer is None:
            d = target_decode(model, ids, new_tokens, eos=set())
        else:
            d = speculative_decode(model, proposer, ids, layer_ids, new_tokens, eos=set())
        outputs.append(d.tokens)
        tokens += len(d.tokens) - 1
        seconds += d.seconds
        steps += len(d.emitted)
    r = {"tokens_per_s": tokens / seconds, "decode_s": round(seconds, 3), "tokens": tokens, "steps": steps,
         "tau": tokens / steps}  # the tokens after the prefill's first are the ones the steps emitted
    if proposer is not None:
        t_draft, t_verify = proposer.seconds / steps, (seconds - proposer.seconds) / steps
        r |= {"draft_ms_per_step": 1e3 * t_draft, "verify_ms_per_step": 1e3 * t_verify}
    else:
        r["ms_per_token"] = 1e3 * seconds / tokens
    return r, outputs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    preset = PRESETS[args.preset]
    if preset["device"] == "cpu":
        torch.set_num_threads(1)  # a tiny model is thousands of small ops: more threads only add contention
    out = Path(args.out or f"benchmarks/results/eval_decode_{args.preset}.json")

    t_start = time.perf_counter()
    model, drafter, spec = build(preset)
    dev, bs = model.device, spec.block_size
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    layer_ids = list(spec.target_layer_ids)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, spec.mask_token_id, (args.prompts, args.prompt_len), generator=gen).tolist()
    print(f"built {args.preset} in {time.perf_counter() - t_start:.1f} s; drafter layers {spec.num_layers}, "
          f"block {bs}, target layers {layer_ids}", flush=True)

    cached = Timed(DFlashProposer(drafter, embed, head), dev)
    uncached = Timed(DFlashProposer(drafter, embed, head, cached=False), dev)
    # warm up every path once (kernels, allocator, lazy inits) on a short decode of the first prompt
    warm = min(args.new_tokens, 2 * bs)
    _, ref = run_mode(model, prompts[:1], warm, layer_ids)
    oracle = Oracle(DFlashProposer(drafter, embed, head), prompts[:1], ref, bs - 1)
    for prop in (cached, uncached, Timed(oracle, dev)):
        run_mode(model, prompts[:1], warm, layer_ids, prop)

    modes = {}

    def timed_mode(name, proposer=None):
        t0 = time.perf_counter()
        modes[name], outputs = run_mode(model, prompts, args.new_tokens, layer_ids, proposer)
        if proposer is not None:  # greedy speculation gives target-only's output, bar bf16 near-ties
            modes[name]["outputs_equal_target_only"] = sum(a == b for a, b in zip(outputs, refs, strict=True))
        print(f"{name}: {modes[name]['tokens_per_s']:.1f} tokens/s, tau {modes[name]['tau']:.2f} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        return outputs

    refs = timed_mode("target_only")
    timed_mode("dflash", cached)
    timed_mode("dflash_nocache", uncached)
    timed_mode("oracle", Timed(Oracle(DFlashProposer(drafter, embed, head), prompts, refs, bs - 1), dev))
    base = modes["target_only"]["tokens_per_s"]
    for m in modes.values():
        m["speedup"] = m["tokens_per_s"] / base

    o = modes["oracle"]
    t_step = (o["draft_ms_per_step"] + o["verify_ms_per_step"]) / 1e3
    machinery = {
        "formula": "tokens_per_s(tau) = tau / (t_draft + t_verify), t_draft and t_verify per verify step, "
                   "measured in the oracle mode (every verify step scores a full block of B tokens and, all "
                   "drafts accepted, never crops the KV cache; the dflash mode's steps include the crop)",
        "draft_ms_per_step": o["draft_ms_per_step"],
        "verify_ms_per_step": o["verify_ms_per_step"],
        "target_only_ms_per_token": modes["target_only"]["ms_per_token"],
        "projected": {str(t): {"tokens_per_s": t / t_step, "speedup": t / t_step / base} for t in TAUS},
    }
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    result = {
        "what": "decode tokens/s (after the prefill), target-only greedy vs DFlash speculative decoding, "
                "random weights, evaluate.py code paths",
        "preset": args.preset,
        "machine": {
            "device": name,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "platform": platform.platform(),
        },
        "shapes": {"target": preset["target"], "dtype": preset["dtype"], "drafter_layers": spec.num_layers,
                   "block_size": bs, "target_layer_ids": layer_ids},
        "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "modes": modes,
        "machinery": machinery,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"\n{args.preset} on {result['machine']['device']}, {args.prompts} prompts x {args.prompt_len} "
          f"tokens, {args.new_tokens} new, {result['wall_s']} s -> {out}")
    print(f"{'mode':<16}{'tau':>7}{'tok/s':>10}{'speedup':>9}{'draft ms':>10}{'verify ms':>11}")
    for name, m in modes.items():
        if "draft_ms_per_step" in m:
            steps = f"{m['draft_ms_per_step']:>10.2f}{m['verify_ms_per_step']:>11.2f}"
        else:  # target-only: one forward per token
            steps = f"{'-':>10}{m['ms_per_token']:>11.2f}"
        print(f"{name:<16}{m['tau']:>7.2f}{m['tokens_per_s']:>10.1f}{m['speedup']:>9.2f}{steps}")
    for tau, v in machinery["projected"].items():
        print(f"{'projected':<16}{float(tau):>7.2f}{v['tokens_per_s']:>10.1f}{v['speedup']:>9.2f}")


if __name__ == "__main__":
    main()
