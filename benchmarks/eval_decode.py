"""Decode tokens/s: target-only greedy decoding vs DFlash speculative decoding, side by side.

Both run evaluation's own loops (flashdraft.speculative: `target_decode`, `speculative_decode`,
`DFlashProposer`) on a random-weight target built in-process (no download, no tokenizer: prompts are
random token ids, and no token ends a sequence), over each of the target's engines in one run:
`static` (flashdraft.session: static KV cache, compiled one-token step and block verify captured as
CUDA graphs on a GPU; `modes`) and `hf` (the model's own forward over a DynamicCache, the eager loop
evaluation ran before; `modes_hf`).

Random weights make the drafter's acceptance meaningless (tau ~ 1), so an oracle mode also runs: the real
drafter drafts (its cost is paid) but the proposal is the target's greedy continuation as the verify
path itself computes it (each draft position fixed by a verify whose earlier positions already hold it;
a position's output depends only on the positions before it), so every draft is accepted whatever the
rounding: tau is the block size (short of it only where the cap cuts the last block). Its time per
draft step and per verify step give tokens/s at any acceptance length: tokens_per_s(tau) = tau /
(t_draft + t_verify), a verify step always scoring a full block. tau is the tokens emitted per verify
step (evaluate.py's count), pooled over the prompts.

Against the shapes: `target_only_over_bound` is target-only tokens/s over the memory-bandwidth bound of
a one-token step at batch 1 (every weight but the input embedding, plus the KV cache at the mean
context, read once per token at the GPU's HBM bandwidth); `oracle_speedup` is the oracle's tokens/s over
target-only's, both on the main (first) engine.

Usage: python benchmarks/eval_decode.py --preset tiny|qwen3-8b [--prompts 8] [--prompt-len 512]
           [--new-tokens 128] [--engines static hf] [--out benchmarks/results/eval_decode_<preset>.json]
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
from flashdraft.hf_config import kv_bytes_per_token
from flashdraft.model import DFlashDrafter, DrafterSpec
from flashdraft.speculative import DFlashProposer, make_session, speculative_decode, target_decode

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
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}  # spec sheet, SXM


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Timed:
    """A proposer whose drafting time is measured, so a decode's time splits into draft and verify."""

    def __init__(self, inner, dev):
        self.inner, self.dev, self.uses_features, self.seconds = inner, dev, inner.uses_features, 0.0

    def reset(self):
        self.inner.reset()

    def static(self, max_len: int):
        self.inner = self.inner.static(max_len)
        return self

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

    def static(self, max_len: int):
        self.inner = self.inner.static(max_len)
        return self

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


def run_mode(plain, featured, prompts, new_tokens, proposer=None):
    """Decode every prompt; totals of tokens (after the prefill's first), decode and draft seconds, steps."""
    tokens = seconds = steps = 0
    outputs = []
    if proposer is not None:
        proposer.seconds = 0.0
    for ids in prompts:
        if proposer is None:
            d = target_decode(plain, ids, new_tokens, eos=set())
        else:
            d = speculative_decode(featured, proposer, ids, new_tokens, eos=set())
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


def verify_path_continuation(session, prompt, new_tokens, block) -> list[int]:
    """The greedy continuation as the verify path computes it, block by block as speculative_decode
    verifies them (the same block sizes): draft j is the verify's pick at position j-1 with drafts
    1..j-1 already in place, so a proposal of these drafts is accepted whole."""
    logits, _ = session.prefill(prompt)
    out = [int(logits.argmax())]
    while len(out) < new_tokens:
        room = new_tokens - len(out)
        n = min(block - 1, room)  # the drafts speculative_decode's proposer may make
        drafts = []
        for j in range(n):
            logits, _ = session.forward([out[-1], *drafts, *[0] * (n - j)])
            session.crop(n + 1)
            drafts.append(int(logits[j].argmax()))
        logits, _ = session.forward([out[-1], *drafts])
        out += [*drafts, int(logits[n].argmax())][:room]
    return out


def bench_engine(engine, model, drafter, spec, prompts, args) -> dict:
    """Every mode on one engine of the target, and the one-off compile and capture time (setup_s)."""
    dev, bs = model.device, spec.block_size
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    max_len = args.prompt_len + args.new_tokens
    plain = make_session(model, engine, max_len, (), bs)
    featured = make_session(model, engine, max_len, list(spec.target_layer_ids), bs)
    t0 = time.perf_counter()
    for s in (plain, featured):  # compile and capture (static, on a GPU) apart from the timed decodes
        getattr(s, "prepare", lambda: None)()
    setup_s = time.perf_counter() - t0
    oracle_refs = [verify_path_continuation(featured, p, args.new_tokens, bs) for p in prompts]

    def proposer(cached=True):  # on the static engine the drafter's cache is static too
        p = DFlashProposer(drafter, embed, head, cached=cached)
        return p.static(max_len) if engine == "static" else p

    cached, uncached = Timed(proposer(), dev), Timed(proposer(cached=False), dev)
    # warm up every path once (kernels, allocator, lazy inits) on a short decode of the first prompt
    warm = min(args.new_tokens, 2 * bs)
    run_mode(plain, featured, prompts[:1], warm)
    oracle = Oracle(proposer(), prompts[:1], oracle_refs[:1], bs - 1)
    for prop in (cached, uncached, Timed(oracle, dev)):
        run_mode(plain, featured, prompts[:1], warm, prop)

    modes = {}

    def timed_mode(name, proposer=None):
        t0 = time.perf_counter()
        modes[name], outputs = run_mode(plain, featured, prompts, args.new_tokens, proposer)
        if proposer is not None:  # greedy speculation gives target-only's output, bar bf16 near-ties
            modes[name]["outputs_equal_target_only"] = sum(a == b for a, b in zip(outputs, refs, strict=True))
        print(f"{engine} {name}: {modes[name]['tokens_per_s']:.1f} tokens/s, tau {modes[name]['tau']:.2f} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        return outputs

    refs = timed_mode("target_only")
    timed_mode("dflash", cached)
    timed_mode("dflash_nocache", uncached)
    outputs = timed_mode("oracle", Timed(Oracle(proposer(), prompts, oracle_refs, bs - 1), dev))
    modes["oracle"]["outputs_equal_verify_path"] = sum(a == b for a, b in zip(outputs, oracle_refs,
                                                                              strict=True))
    base = modes["target_only"]["tokens_per_s"]
    for m in modes.values():
        m["speedup"] = m["tokens_per_s"] / base
    return {"modes": modes, "setup_s": setup_s}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--engines", nargs="+", default=["static", "hf"], choices=["static", "hf"],
                   help="the first is the main one (modes, goals); the others are reported beside it")
    p.add_argument("--hbm-bytes-per-s", type=float, default=None, help="for GPUs not in the table")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    preset = PRESETS[args.preset]
    if preset["device"] == "cpu":
        torch.set_num_threads(1)  # a tiny model is thousands of small ops: more threads only add contention
    out = Path(args.out or f"benchmarks/results/eval_decode_{args.preset}.json")

    t_start = time.perf_counter()
    model, drafter, spec = build(preset)
    dev, bs = model.device, spec.block_size
    layer_ids = list(spec.target_layer_ids)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, spec.mask_token_id, (args.prompts, args.prompt_len), generator=gen).tolist()
    print(f"built {args.preset} in {time.perf_counter() - t_start:.1f} s; drafter layers {spec.num_layers}, "
          f"block {bs}, target layers {layer_ids}", flush=True)

    runs = {engine: bench_engine(engine, model, drafter, spec, prompts, args) for engine in args.engines}
    main_engine = args.engines[0]
    modes = runs[main_engine]["modes"]
    base, o = modes["target_only"]["tokens_per_s"], modes["oracle"]
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
    weights = sum(t.numel() * t.element_size() for n, t in model.named_parameters()
                  if "embed_tokens" not in n)
    context = args.prompt_len + args.new_tokens / 2
    hbm = args.hbm_bytes_per_s or next((v for k, v in HBM_BYTES_PER_S.items()
                                        if dev.type == "cuda" and k in torch.cuda.get_device_name(dev)), None)
    kv = kv_bytes_per_token(model.config, model.dtype.itemsize)
    bound = hbm / (weights + context * kv) if hbm else None
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
        "engine": main_engine,
        "modes": modes,
        **{f"modes_{e}": r["modes"] for e, r in runs.items() if e != main_engine},
        "setup_s": {e: r["setup_s"] for e, r in runs.items()},
        "bound_tokens_per_s": bound,
        "bound": "batch 1: HBM bytes/s over (every weight but the input embedding + the KV cache at the mean "
                 "context, prompt_len + new_tokens/2) per token",
        "target_only_over_bound": base / bound if bound else None,
        "oracle_speedup": o["tokens_per_s"] / base,
        "goals": {"target_only_over_bound>=0.4": base / bound >= 0.4 if bound else None,
                  "oracle_speedup>=8": o["tokens_per_s"] / base >= 8},
        "machinery": machinery,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"\n{args.preset} on {result['machine']['device']}, {args.prompts} prompts x {args.prompt_len} "
          f"tokens, {args.new_tokens} new, {result['wall_s']} s -> {out}")
    print(f"{'mode':<20}{'tau':>7}{'tok/s':>10}{'speedup':>9}{'draft ms':>10}{'verify ms':>11}")
    for name, m in [(f"{e} {n}", m) for e, r in runs.items() for n, m in r["modes"].items()]:
        if "draft_ms_per_step" in m:
            steps = f"{m['draft_ms_per_step']:>10.2f}{m['verify_ms_per_step']:>11.2f}"
        else:  # target-only: one forward per token
            steps = f"{'-':>10}{m['ms_per_token']:>11.2f}"
        print(f"{name:<20}{m['tau']:>7.2f}{m['tokens_per_s']:>10.1f}{m['speedup']:>9.2f}{steps}")
    for tau, v in machinery["projected"].items():
        print(f"{'projected':<20}{float(tau):>7.2f}{v['tokens_per_s']:>10.1f}{v['speedup']:>9.2f}")
    ratio = result["target_only_over_bound"]
    print(f"target-only over its bound: {'-' if ratio is None else f'{ratio:.2f}'}; "
          f"oracle speedup {result['oracle_speedup']:.2f}; goals {result['goals']}")


if __name__ == "__main__":
    main()
