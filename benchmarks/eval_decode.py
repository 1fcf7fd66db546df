"""Decode tokens/s: target-only greedy decoding vs each drafter family's speculative decoding, side by side.

Every mode runs evaluation's own loops (flashdraft.speculative: `target_decode`, `speculative_decode`, and
each family's proposer as evaluation builds it, `families.family(name).proposer`) on a random-weight
target built in-process (no download, no tokenizer: prompts are random token ids, and no token ends a
sequence), over each of the target's engines in one run: `static` (flashdraft.session: static KV cache,
compiled one-token step and block verify captured as CUDA graphs on a GPU; `modes`) and `hf` (the
model's own forward over a DynamicCache, the eager loop evaluation ran before; `modes_hf`). Each family
in `--families` (default dflash alone; dspark beside it) gets a random drafter of the preset's shapes at
one block size B (`--block-size`, default the preset's), and three modes: its cached proposer (`<family>`;
on the static engine its drafter's cache is static and its steps CUDA graphs too), its uncached one
(`<family>_nocache`, recomputing the context every step) and an oracle (`oracle`; `<family>_oracle` when
several families run). A family's verify step scores its verify width: B tokens for DFlash (B-1 drafts),
B+1 for DSpark (its anchor's slot drafts too: B drafts, each picked with its Markov bias).

Random weights make a drafter's acceptance meaningless (tau ~ 1), so the oracle mode runs too: the real
drafter drafts (its cost is paid, DSpark's Markov picks included) but the proposal is the target's greedy
continuation as the verify path itself computes it (each draft position fixed by a verify whose earlier
positions already hold it; a position's output depends only on the positions before it), so every draft
is accepted whatever the rounding: tau is the verify width (short of it only where the cap cuts the last
block). Its time per draft step and per verify step give tokens/s at any acceptance length:
tokens_per_s(tau) = tau / (t_draft + t_verify), a verify step always scoring a full block. tau is the
tokens emitted per verify step (evaluate.py's count), pooled over the prompts.

Against the shapes: `target_only_over_bound` is target-only tokens/s over the memory-bandwidth bound of
a one-token step at batch 1 (every weight but the input embedding, plus the KV cache at the mean
context, read once per token at the GPU's HBM bandwidth); `oracle_speedup` is the oracle's tokens/s over
target-only's, both on the main (first) engine, for the main (first) family. With any family but DFlash
alone the JSON adds `families` (per family, main engine: draft and verify ms per step, projected tokens/s
at the TAUS acceptance lengths, oracle speedup), `<family>_over_dflash` (ratios at the same block size:
draft ms per step, verify ms per step, and tokens/s at equal tau, which is DFlash's t_draft + t_verify
over the family's). Every JSON carries the envelope (benchmarks/harness.py): the commit, the command line,
the machine.

Usage: python benchmarks/eval_decode.py --preset tiny|qwen3-8b [--prompts 8] [--prompt-len 512]
           [--new-tokens 128] [--engines static hf] [--families dflash [dspark]] [--block-size B]
           [--out benchmarks/results/eval_decode_<preset>.json; eval_decode_<preset>_dspark_vs_dflash.json
           with both families]
"""

import argparse
import dataclasses
import time
from pathlib import Path

import torch
from harness import time_it, write_result
from shapes import PRESETS, hbm_bytes_per_s
from transformers import Qwen3Config, Qwen3ForCausalLM

from flashdraft.config import DrafterConfig
from flashdraft.families import FAMILIES, family, family_info
from flashdraft.hf_config import kv_bytes_per_token
from flashdraft.speculative import make_session, speculative_decode, target_decode

TAUS = (1.0, 3.5, 6.5)
REFERENCE = "dflash"  # the family the others are compared with (`<family>_over_dflash`)


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
        t = time_it(lambda: self.inner.propose(*args), warmup=0, repeats=1, device=self.dev)
        self.seconds += t.median_s
        return t.out


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


def build_target(preset: dict, seed: int = 0):
    """Random target, created on the device in the preset's dtype (the random stream seeded for the
    drafters built after it)."""
    dev, dtype = torch.device(preset["device"]), getattr(torch, preset["dtype"])
    config = Qwen3Config(**preset["target"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def build_drafter(model, preset: dict, name: str, block_size: int | None):
    """A random drafter of family `name` for the target, in the preset's shapes (block `block_size`, or the
    preset's), built through the family registry as evaluation loads one."""
    kind = family(name)
    cfg = DrafterConfig(**preset["drafter"])
    cfg = dataclasses.replace(cfg, family=name, block_size=block_size or cfg.block_size)
    with torch.device(model.device):
        spec = kind.spec.from_target(model.config, preset["mask_token_id"], cfg)
        drafter = kind.drafter(spec).to(model.dtype).eval().requires_grad_(False)
    return drafter, spec


def run_mode(session, prompts, new_tokens, proposer=None):
    """Decode every prompt; totals of tokens (after the prefill's first), decode and draft seconds, steps."""
    tokens = seconds = steps = 0
    outputs = []
    if proposer is not None:
        proposer.seconds = 0.0
    for ids in prompts:
        if proposer is None:
            d = target_decode(session, ids, new_tokens, eos=set())
        else:
            d = speculative_decode(session, proposer, ids, new_tokens, eos=set())
        outputs.append(d.tokens)
        tokens += len(d.tokens) - 1
        seconds += d.seconds
        steps += len(d.emitted)
    r = {
        "tokens_per_s": tokens / seconds,
        "decode_s": round(seconds, 3),
        "tokens": tokens,
        "steps": steps,
        "tau": tokens / steps,
    }  # the tokens after the prefill's first are the ones the steps emitted
    if proposer is not None:
        t_draft, t_verify = proposer.seconds / steps, (seconds - proposer.seconds) / steps
        r |= {"draft_ms_per_step": 1e3 * t_draft, "verify_ms_per_step": 1e3 * t_verify}
    else:
        r["ms_per_token"] = 1e3 * seconds / tokens
    return r, outputs


def verify_path_continuation(session, prompt, new_tokens, block) -> list[int]:
    """The greedy continuation as the verify path computes it, block by block as speculative_decode
    verifies them (the same block sizes, `block` the verify width): draft j is the verify's pick at
    position j-1 with drafts 1..j-1 already in place, so a proposal of these drafts is accepted whole."""
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


def oracle_mode(families: list[str], name: str) -> str:
    """The oracle mode's name: `oracle` where one family runs (the key the single-family JSON has)."""
    return "oracle" if len(families) == 1 else f"{name}_oracle"


class Bench:
    """One engine of the target: its sessions, and the modes it has timed so far."""

    def __init__(self, engine, model, drafters, prompts, args):
        self.engine, self.model, self.prompts, self.args = engine, model, prompts, args
        self.max_len = args.prompt_len + args.new_tokens
        main_width = next(iter(drafters.values()))[1].verify_width
        self.plain = make_session(model, engine, self.max_len, (), main_width)
        # one featured session per family: each verifies blocks of its own width
        self.featured = {
            name: make_session(model, engine, self.max_len, list(spec.target_layer_ids), spec.verify_width)
            for name, (_, spec) in drafters.items()
        }
        t0 = time.perf_counter()
        for s in (self.plain, *self.featured.values()):  # compile and capture (static, on a GPU), untimed
            getattr(s, "prepare", lambda: None)()
        self.setup_s = time.perf_counter() - t0
        self.modes, self.refs = {}, None
        # a warm-up decode's tokens (every family has the same block size)
        self.warm = min(args.new_tokens, 2 * next(iter(drafters.values()))[1].block_size)

    def timed_mode(self, name, session, proposer=None):
        t0 = time.perf_counter()
        self.modes[name], outputs = run_mode(session, self.prompts, self.args.new_tokens, proposer)
        if proposer is not None:  # greedy speculation gives target-only's output, bar bf16 near-ties
            self.modes[name]["outputs_equal_target_only"] = count_equal(outputs, self.refs)
        m = self.modes[name]
        print(
            f"{self.engine} {name}: {m['tokens_per_s']:.1f} tokens/s, tau {m['tau']:.2f} "
            f"({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
        return outputs

    def target_only(self):
        run_mode(self.plain, self.prompts[:1], self.warm)  # warm up (kernels, allocator, lazy inits)
        self.refs = self.timed_mode("target_only", self.plain)

    def run_family(self, name, drafter, spec, oracle_name):
        """The family's modes: its cached proposer, its uncached one and its oracle (sharing the cached
        proposer's drafter session), each warmed up once first."""
        session, dev = self.featured[name], self.model.device
        embed = self.model.get_input_embeddings().weight
        head = self.model.get_output_embeddings().weight

        def proposer(cached=True):  # on the static engine the drafter's cache is static too
            p = family(name).proposer(drafter, embed, head, cached=cached)
            return p.static(self.max_len) if session.static else p

        width, drafts = spec.verify_width, family_info(name).drafts(spec.block_size)
        new = self.args.new_tokens
        oracle_refs = [verify_path_continuation(session, p, new, width) for p in self.prompts]
        cached, uncached = Timed(proposer(), dev), Timed(proposer(cached=False), dev)

        def oracle(n):  # over the first n prompts
            return Timed(Oracle(cached.inner, self.prompts[:n], oracle_refs[:n], drafts), dev)

        for prop in (cached, uncached, oracle(1)):
            run_mode(session, self.prompts[:1], self.warm, prop)
        self.timed_mode(name, session, cached)
        self.timed_mode(f"{name}_nocache", session, uncached)
        outputs = self.timed_mode(oracle_name, session, oracle(len(self.prompts)))
        self.modes[oracle_name]["outputs_equal_verify_path"] = count_equal(outputs, oracle_refs)

    def result(self) -> dict:
        base = self.modes["target_only"]["tokens_per_s"]
        for m in self.modes.values():
            m["speedup"] = m["tokens_per_s"] / base
        return {"modes": self.modes, "setup_s": self.setup_s}


def count_equal(outputs, refs) -> int:
    return sum(a == b for a, b in zip(outputs, refs, strict=True))


def bench_engine(engine, model, drafters: dict, prompts, args) -> dict:
    """Every mode on one engine of the target, and the one-off compile and capture time (setup_s)."""
    bench = Bench(engine, model, drafters, prompts, args)
    bench.target_only()
    for name, (drafter, spec) in drafters.items():
        bench.run_family(name, drafter, spec, oracle_mode(args.families, name))
    return bench.result()


def step_costs(oracle: dict, base: float) -> dict:
    """Per verify step at full acceptance (the oracle's), and the tokens/s they give at the TAUS."""
    draft, verify = oracle["draft_ms_per_step"], oracle["verify_ms_per_step"]
    t_step = (draft + verify) / 1e3
    return {
        "draft_ms_per_step": draft,
        "verify_ms_per_step": verify,
        "projected": {str(t): {"tokens_per_s": t / t_step, "speedup": t / t_step / base} for t in TAUS},
    }


def family_records(modes: dict, drafters: dict, families: list[str]) -> dict:
    """Per family, on the main engine: its block, its step costs and projection, its oracle's speedup."""
    base, out = modes["target_only"]["tokens_per_s"], {}
    for name, (_, spec) in drafters.items():
        oracle = modes[oracle_mode(families, name)]
        drafts = family_info(name).drafts(spec.block_size)
        out[name] = {
            "block_size": spec.block_size,
            "drafts_per_block": drafts,
            "verify_width": spec.verify_width,
            **step_costs(oracle, base),
            "oracle_speedup": oracle["tokens_per_s"] / base,
        }
    return out


def over_reference(records: dict) -> dict:
    """`<family>_over_dflash` for each other family, where DFlash ran: at the same block size, the ratios of
    draft and of verify ms per step, and of tokens/s at equal tau (tau / (t_draft + t_verify))."""
    if REFERENCE not in records:
        return {}
    ref, out = records[REFERENCE], {}
    for name, r in records.items():
        if name != REFERENCE:
            step, ref_step = (x["draft_ms_per_step"] + x["verify_ms_per_step"] for x in (r, ref))
            out[f"{name}_over_{REFERENCE}"] = {
                "block_size": r["block_size"],
                "draft_ms_per_step": r["draft_ms_per_step"] / ref["draft_ms_per_step"],
                "verify_ms_per_step": r["verify_ms_per_step"] / ref["verify_ms_per_step"],
                "tokens_per_s_at_equal_tau": ref_step / step,
            }
    return out


def default_out(args) -> Path:
    """eval_decode_<preset>.json for DFlash alone; else named by the families, DFlash last
    (eval_decode_<preset>_dspark_vs_dflash.json)."""
    names = sorted(args.families, key=lambda f: f == REFERENCE)
    tail = "" if names == [REFERENCE] else "_" + "_vs_".join(names)
    return Path(f"benchmarks/results/eval_decode_{args.preset}{tail}.json")


def bandwidth_bound(model, args) -> float | None:
    """Tokens/s of a one-token step at batch 1 that reads every weight but the input embedding and the KV
    cache at the mean context once, at the GPU's HBM bandwidth (None where it is not known)."""
    dev = model.device
    weights = sum(
        t.numel() * t.element_size() for n, t in model.named_parameters() if "embed_tokens" not in n
    )
    context = args.prompt_len + args.new_tokens / 2
    hbm = args.hbm_bytes_per_s or (
        hbm_bytes_per_s(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else None
    )
    kv = kv_bytes_per_token(model.config, model.dtype.itemsize)
    return hbm / (weights + context * kv) if hbm else None


def summarize(args, preset, model, drafters, runs, t_start) -> dict:
    main_engine, main_family = args.engines[0], args.families[0]
    spec = drafters[main_family][1]
    modes = runs[main_engine]["modes"]
    base, o = modes["target_only"]["tokens_per_s"], modes[oracle_mode(args.families, main_family)]
    costs = step_costs(o, base)
    machinery = {
        "formula": "tokens_per_s(tau) = tau / (t_draft + t_verify), t_draft and t_verify per verify step, "
        "measured in the oracle mode (every verify step scores a full block of its verify "
        "width, B tokens or B+1 where the anchor's slot drafts too, and, all drafts accepted, "
        "never crops the KV cache; the cached and uncached modes' steps include the crop)",
        "draft_ms_per_step": costs["draft_ms_per_step"],
        "verify_ms_per_step": costs["verify_ms_per_step"],
        "target_only_ms_per_token": modes["target_only"]["ms_per_token"],
        "projected": costs["projected"],
    }
    bound = bandwidth_bound(model, args)
    result = {
        "what": f"decode tokens/s (after the prefill), target-only greedy vs {' and '.join(args.families)} "
        "speculative decoding, random weights, evaluate.py code paths",
        "preset": args.preset,
        "shapes": {
            "target": preset["target"],
            "dtype": preset["dtype"],
            "drafter_layers": spec.num_layers,
            "block_size": spec.block_size,
            "target_layer_ids": list(spec.target_layer_ids),
        },
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "engine": main_engine,
        "modes": modes,
        **{f"modes_{e}": r["modes"] for e, r in runs.items() if e != main_engine},
        "setup_s": {e: r["setup_s"] for e, r in runs.items()},
        "bound_tokens_per_s": bound,
        "bound": "batch 1: HBM bytes/s over (every weight but the input embedding + the KV cache at the mean "
        "context, prompt_len + new_tokens/2) per token",
        "target_only_over_bound": base / bound if bound else None,
        "oracle_speedup": o["tokens_per_s"] / base,
        "goals": {
            "target_only_over_bound>=0.4": base / bound >= 0.4 if bound else None,
            "oracle_speedup>=8": o["tokens_per_s"] / base >= 8,
        },
        "machinery": machinery,
    }
    if args.families != [REFERENCE]:  # the DFlash-only JSON keeps the keys its readers know
        records = family_records(modes, drafters, args.families)
        result |= {"families": records, **over_reference(records)}
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    return result


def report(result: dict, runs: dict, out: Path):
    """The table: every mode of every engine, the main family's projection, the others' records."""
    print(
        f"\n{result['preset']} on {result['machine']['device']}, {result['prompts']} prompts x "
        f"{result['prompt_len']} tokens, {result['new_tokens']} new, {result['wall_s']} s -> {out}"
    )
    print(f"{'mode':<24}{'tau':>7}{'tok/s':>10}{'speedup':>9}{'draft ms':>10}{'verify ms':>11}")
    for name, m in [(f"{e} {n}", m) for e, r in runs.items() for n, m in r["modes"].items()]:
        if "draft_ms_per_step" in m:
            steps = f"{m['draft_ms_per_step']:>10.2f}{m['verify_ms_per_step']:>11.2f}"
        else:  # target-only: one forward per token
            steps = f"{'-':>10}{m['ms_per_token']:>11.2f}"
        print(f"{name:<24}{m['tau']:>7.2f}{m['tokens_per_s']:>10.1f}{m['speedup']:>9.2f}{steps}")
    records = result.get("families", {"": result["machinery"]})  # DFlash alone: its machinery
    for name, r in records.items():
        for tau, v in r["projected"].items():
            print(
                f"{(name + ' projected').strip():<24}{float(tau):>7.2f}{v['tokens_per_s']:>10.1f}"
                f"{v['speedup']:>9.2f}"
            )
    for key, v in result.items():
        if key.endswith(f"_over_{REFERENCE}"):
            print(
                f"{key} at block {v['block_size']}: draft ms per step {v['draft_ms_per_step']:.2f}x, "
                f"verify ms per step {v['verify_ms_per_step']:.2f}x, "
                f"tokens/s at equal tau {v['tokens_per_s_at_equal_tau']:.2f}x"
            )
    ratio = result["target_only_over_bound"]
    print(
        f"target-only over its bound: {'-' if ratio is None else f'{ratio:.2f}'}; "
        f"oracle speedup {result['oracle_speedup']:.2f}; goals {result['goals']}"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument(
        "--engines",
        nargs="+",
        default=["static", "hf"],
        choices=["static", "hf"],
        help="the first is the main one (modes, goals); the others are reported beside it",
    )
    p.add_argument(
        "--families",
        nargs="+",
        default=[REFERENCE],
        choices=list(FAMILIES),
        help="drafter families, each on the same target and prompts; the first is the main one "
        "(oracle_speedup, goals, machinery)",
    )
    p.add_argument(
        "--block-size", type=int, default=None, help="every family's block size (default: the preset's)"
    )
    p.add_argument("--hbm-bytes-per-s", type=float, default=None, help="for GPUs not in the table")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.families = list(dict.fromkeys(args.families))
    preset = PRESETS[args.preset]
    if preset["device"] == "cpu":
        torch.set_num_threads(1)  # a tiny model is thousands of small ops: more threads only add contention
    out = Path(args.out) if args.out else default_out(args)

    t_start = time.perf_counter()
    model = build_target(preset)
    drafters = {name: build_drafter(model, preset, name, args.block_size) for name in args.families}
    spec = drafters[args.families[0]][1]
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, spec.mask_token_id, (args.prompts, args.prompt_len), generator=gen).tolist()
    print(
        f"built {args.preset} in {time.perf_counter() - t_start:.1f} s; {', '.join(args.families)}: "
        f"drafter layers {spec.num_layers}, block {spec.block_size}, target layers "
        f"{list(spec.target_layer_ids)}",
        flush=True,
    )

    runs = {engine: bench_engine(engine, model, drafters, prompts, args) for engine in args.engines}
    result = summarize(args, preset, model, drafters, runs, t_start)
    report(write_result(out, result, params=vars(args), device=model.device), runs, out)


if __name__ == "__main__":
    main()
