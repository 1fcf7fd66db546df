"""The run in numbers before it starts: hours per stage on the configured GPUs, and the disk the hidden
states take in bf16 and in fp8.

    python -m flashdraft.plan --configfile my.yaml [--gpus N] [--results results]

The config is read as the workflow reads it (config/config.yaml, then the --configfile on top, checked
against workflow/schemas/config.schema.yaml and config.check); a mistake is one line naming the key.
Token statistics come from what earlier stages left under --results (prompt counts from
prompts/stats.json, prompt tokens from prompts/train.parquet, answer tokens from regenerated/train/,
exact totals from the hidden manifests) and otherwise from the assumptions below, printed as such.

Hours are work / (per-GPU rate x GPUs), per wave of shard jobs. The rates come from the committed
benchmarks (RATES, H200, a Qwen3-8B-shaped target); for another target they are scaled by parameter
count (a forward's work and its weight reads both grow with it; the drafter's layers take the target's
shapes). Prompts, verify, warmup and report take minutes and are not counted.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from .config import Config, check, feature_layers, from_dict
from .errors import UserError, cli

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "config" / "config.yaml"  # the Snakefile's `configfile:`
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"
GOAL_HOURS = 36.0  # the whole DAG on one node


@dataclass(frozen=True)
class Rate:
    value: float
    file: str  # under benchmarks/results/
    key: str  # dotted path of the value in that JSON
    unit: str


# Per-GPU rates measured on one H200 with a Qwen3-8B-shaped target (tests/test_plan.py checks every value
# against its file and key: after rerunning a benchmark, copy its new value here).
RATES = {
    "regenerate": Rate(10701.4, "regenerate_qwen3-8b.json", "tokens_per_s_per_gpu", "new tokens/s"),
    "precompute_bfloat16": Rate(30533.3, "precompute_hidden_gpu_qwen3-8b.json", "bfloat16.tokens_per_s",
                                "tokens/s"),
    "precompute_float8_e4m3": Rate(31208.6, "precompute_hidden_gpu_qwen3-8b.json",
                                   "float8_e4m3.tokens_per_s", "tokens/s"),
    "train_1gpu": Rate(19863.2, "train_drafter_qwen3-8b.json", "throughput.1.tokens_per_s_per_gpu",
                       "tokens/s"),
    # with 2 or more processes (DDP): the per-GPU rate of the 2-GPU run, assumed to hold at any count
    "train_per_gpu": Rate(18686.2, "train_drafter_qwen3-8b.json", "throughput.2.tokens_per_s_per_gpu",
                          "tokens/s"),
    "eval_target_only": Rate(23.27, "eval_decode_qwen3-8b.json", "modes.target_only.tokens_per_s",
                             "new tokens/s"),
    # each speculative decoder (dflash, dflash_untrained, ngram), as measured at tau 1 (random weights)
    "eval_speculative": Rate(15.23, "eval_decode_qwen3-8b.json", "modes.dflash.tokens_per_s", "new tokens/s"),
}
# The target those benchmarks ran (`shapes.target` of eval_decode_qwen3-8b.json): rates scale from it.
REFERENCE_TARGET = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "vocab_size": 151936}
EVAL_DECODERS = 3  # speculative decoders per prompt, beside target-only (evaluate.run_rows)

# Where no earlier stage has run: chat prompts and answers of ShareGPT/UltraChat-like mixes.
ASSUMED_PROMPT_TOKENS = 250
ASSUMED_ANSWER_TOKENS = 550
PROMPT_SAMPLE = 1000  # prompts tokenized to measure the mean prompt length


def load(configfile, base=DEFAULT_CONFIG) -> Config:
    """The config as the workflow sees it, or a UserError naming the file or key."""
    import yaml

    data = {}
    for f in ([base] if base else []) + [configfile]:
        try:
            loaded = yaml.safe_load(Path(f).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise UserError(f"{f}: cannot read the config ({str(e).splitlines()[0]})") from e
        if not isinstance(loaded, dict):
            raise UserError(f"{f}: the config must be a mapping of sections")
        merge_into(data, loaded)
    if SCHEMA.exists():
        import jsonschema

        try:
            jsonschema.validate(data, yaml.safe_load(SCHEMA.read_text()))
        except jsonschema.ValidationError as e:
            key = ".".join(str(p) for p in e.absolute_path) or "(top level)"
            raise UserError(f"{configfile}: config key {key}: {e.message}") from e
    cfg = from_dict(Config, data)
    check(cfg)
    return cfg


def merge_into(base: dict, update: dict) -> None:
    """Snakemake's merge of a --configfile over the workflow's configfile: nested mappings key by key."""
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            merge_into(base[k], v)
        else:
            base[k] = v


def target_shapes(cfg: Config) -> dict:
    """The target's config.json, or the toy's shapes when the workflow has not built it yet."""
    from .target import read_target_config

    if (Path(cfg.target.path) / "config.json").exists() or not cfg.target.build_toy:
        c = read_target_config(cfg.target.path)
        return c.get("text_config", c) if "hidden_size" not in c else c
    t = cfg.toy
    return {"hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_layers, "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
            "vocab_size": (t.vocab_size // 64 + 1) * 64, "tie_word_embeddings": False}


def num_parameters(c: dict) -> int:
    """Parameters of a dense decoder-only LM from its config.json: attention, MLP, norms, embeddings."""
    h, n, layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    kv, d = c.get("num_key_value_heads") or n, c.get("head_dim") or h // n
    per_layer = 2 * h * n * d + 2 * h * kv * d + 3 * h * c["intermediate_size"] + 2 * h
    embeddings = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + h


def hidden_width(cfg: Config, shapes: dict) -> int:
    """Values stored per token: K fused target layers x the hidden size."""
    return len(feature_layers(shapes["num_hidden_layers"], cfg.drafter)) * shapes["hidden_size"]


@dataclass
class Tokens:
    samples: int  # training samples
    prompt_tokens: float  # mean per sample
    answer_tokens: float
    total: int  # tokens in the hidden states (each sample cut at hidden.max_length)
    eval_prompts: int
    notes: list[str]  # where each figure came from


def token_stats(cfg: Config, results) -> Tokens:
    import pandas as pd

    r, notes = Path(results), []
    stats_file = r / "prompts" / "stats.json"
    if stats_file.exists():
        totals = json.loads(stats_file.read_text())["totals"]
        samples, evals = int(totals["sampled_train"]), int(totals["sampled_eval"])
        notes.append(f"training samples {samples:,}, eval prompts {evals:,}: {stats_file}")
    else:
        samples, evals = cfg.prompts.total, cfg.prompts.eval_count
        notes.append(f"training samples {samples:,}: prompts.total (no {stats_file} yet)")
    train = r / "prompts" / "train.parquet"
    if train.exists() and (Path(cfg.target.path) / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        from .evaluate import prompt_ids

        tok = AutoTokenizer.from_pretrained(cfg.target.path)
        rows = pd.read_parquet(train, columns=["messages"]).head(PROMPT_SAMPLE)["messages"]
        prompt = sum(len(prompt_ids(tok, list(m))) for m in rows) / max(len(rows), 1)
        notes.append(f"prompt tokens {prompt:,.0f} per sample: the first {len(rows)} of {train}")
    else:
        prompt = ASSUMED_PROMPT_TOKENS
        notes.append(f"prompt tokens {prompt} per sample: ASSUMED (no {train} and target tokenizer yet)")
    answers = sorted((r / "regenerated" / "train").glob("shard-*.parquet"))
    if cfg.regenerate.enabled and answers:
        lengths = pd.concat([pd.read_parquet(f, columns=["response_tokens"]) for f in answers])
        answer = float(lengths["response_tokens"].mean())
        notes.append(f"answer tokens {answer:,.0f} per sample: {len(answers)} file(s) in {answers[0].parent}")
    else:
        answer = min(ASSUMED_ANSWER_TOKENS, cfg.regenerate.max_new_tokens)
        notes.append(f"answer tokens {answer} per sample: ASSUMED (no regenerated answers yet; "
                     f"regenerate.max_new_tokens {cfg.regenerate.max_new_tokens})")
    manifests = [r / "hidden" / f"shard-{i:05d}.json" for i in range(cfg.hidden.shards)]
    if all(m.exists() for m in manifests):
        total = sum(json.loads(m.read_text())["tokens"] for m in manifests)
        notes.append(f"hidden-state tokens {total:,}: the {len(manifests)} manifests in "
                     f"{manifests[0].parent}")
    else:
        total = int(samples * min(prompt + answer, cfg.hidden.max_length))
        notes.append(f"hidden-state tokens {total:,}: samples x min(prompt + answer, hidden.max_length "
                     f"{cfg.hidden.max_length})")
    return Tokens(samples, prompt, answer, total, min(cfg.eval.num_prompts, evals), notes)


def hidden_disk(tokens: int, width: int) -> dict[str, int]:
    """Bytes of the hidden-state shards in bf16 and in fp8: the precompute preflight's estimate."""
    from .hidden import FP8, hidden_bytes

    return {dtype: hidden_bytes(tokens, dtype, width) for dtype in ("bfloat16", FP8)}


def _waves_hours(work: float, jobs: int, gpus: int, rate: float) -> float:
    """`jobs` equal shard jobs of one GPU each, `gpus` at a time: whole waves, each one job's work."""
    return math.ceil(jobs / gpus) * (work / jobs) / rate / 3600


def plan(cfg: Config, results="results", gpus: int | None = None) -> dict:
    """Hours per stage (None: on the CPU, or on a server the plan cannot see) and hidden-state bytes."""
    shapes = target_shapes(cfg)
    params, ref = num_parameters(shapes), num_parameters(REFERENCE_TARGET)
    scale = ref / params  # rates per GPU fall as the model grows
    tok = token_stats(cfg, results)
    g = cfg.gpus.target if gpus is None else gpus  # one-GPU jobs at a time (the profile's gpu resource)
    stages = {}

    def stage(name, work, unit, rate_keys, hours, gpus_used):
        stages[name] = {"work": work, "unit": unit, "rates": {k: RATES[k].value * scale for k in rate_keys},
                        "sources": [f"{RATES[k].file}: {RATES[k].key}" for k in rate_keys],
                        "gpus": gpus_used, "hours": hours}

    rg = cfg.regenerate
    new_tokens = tok.samples * tok.answer_tokens if rg.enabled else 0
    jobs = rg.shards or cfg.hidden.shards
    rate = RATES["regenerate"].value * scale
    if not rg.enabled:
        hours, used = 0.0, 0
    elif rg.backend == "openai":
        hours, used = None, 0  # answered by a server elsewhere
    elif rg.backend == "server":
        per_job = rg.server_gpus
        used = max(g // per_job, 0) * per_job
        hours = _waves_hours(new_tokens, jobs, g // per_job, rate * per_job) if g >= per_job else None
    else:
        hours, used = (_waves_hours(new_tokens, jobs, g, rate) if g else None), g
    stage("regeneration", new_tokens, "new tokens", ["regenerate"], hours, used)

    dtype = cfg.hidden.dtype if f"precompute_{cfg.hidden.dtype}" in RATES else "bfloat16"
    key = f"precompute_{dtype}"
    hours = _waves_hours(tok.total, cfg.hidden.shards, g, RATES[key].value * scale) if g else None
    stage("precompute", tok.total, "tokens", [key], hours, g)

    t = cfg.train
    world = max(1, cfg.gpus.drafter) * cfg.gpus.drafter_nodes
    key = "train_1gpu" if world == 1 else "train_per_gpu"
    work = t.epochs * tok.total
    if t.max_steps:
        work = min(work, t.max_steps * t.batch_tokens * world)
    hours = work / (RATES[key].value * scale * world) / 3600 if cfg.gpus.drafter else None
    stage("training", work, "tokens", [key], hours, cfg.gpus.drafter * cfg.gpus.drafter_nodes)

    e = cfg.eval
    jobs = e.shards or max(1, cfg.gpus.target)
    per_prompt_s = e.max_new_tokens * (1 / RATES["eval_target_only"].value
                                       + EVAL_DECODERS / RATES["eval_speculative"].value) / scale
    work = tok.eval_prompts * e.max_new_tokens * (1 + EVAL_DECODERS)
    hours = _waves_hours(tok.eval_prompts * per_prompt_s, jobs, g, 1.0) if g else None
    stage("evaluation", work, "new tokens", ["eval_target_only", "eval_speculative"], hours, min(g, jobs))

    known = [s["hours"] for s in stages.values() if s["hours"] is not None]
    total = sum(known) if len(known) == len(stages) else None
    slowest = max(stages, key=lambda k: stages[k]["hours"] or 0)
    width = hidden_width(cfg, shapes)
    return {"parameters": params, "reference_parameters": ref, "scale": scale, "gpus": g, "tokens": tok,
            "stages": stages, "total_hours": total, "slowest": slowest, "hidden_width": width,
            "hidden_bytes": hidden_disk(tok.total, width), "hidden_dtype": cfg.hidden.dtype}


def _num(x: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def _hours(h) -> str:
    return "-" if h is None else f"{h:.1f}"


def render(p: dict, configfile) -> str:
    from .hidden import bytes_per_token

    n, ref = _num(p["parameters"]), _num(p["reference_parameters"])
    lines = [f"plan for {configfile}: a target of {n} parameters; the benchmarks' rates (one H200, a "
             f"Qwen3-8B shape of {ref}) scaled by {ref} / {n} = {p['scale']:.3g}", "", "token statistics:"]
    lines += [f"  {note}" for note in p["tokens"].notes]
    lines += ["", "| stage | work | per-GPU rate | GPUs | hours |", "| --- | --- | --- | --- | --- |"]
    sources = []
    for name, s in p["stages"].items():
        rates = " + ".join(f"{r:,.1f}" for r in s["rates"].values()) + f" {s['unit']}/s"
        work = f"{_num(s['work'])} {s['unit']}"
        lines.append(f"| {name} | {work} | {rates} | {s['gpus']} | {_hours(s['hours'])} |")
        sources.append(f"  {name}: {', '.join(s['sources'])}")
    total = p["total_hours"]
    lines.append(f"| total | | | | {_hours(total)} |")
    lines += ["", "rates (per second, before scaling) from benchmarks/results/:", *sources]
    if any(s["hours"] is None for s in p["stages"].values()):
        lines.append("  -: the stage runs on the CPU (gpus.* 0) or on a server elsewhere: no measured rate")
    b, w = p["hidden_bytes"], p["hidden_width"]
    disk = ", ".join(f"{b[d] / 1e12:,.2f} TB in {d} ({bytes_per_token(d, w):,} bytes/token)" for d in b)
    lines += ["", f"hidden states ({p['tokens'].total:,} tokens x {w:,} values): {disk}; "
              f"configured hidden.dtype: {p['hidden_dtype']}"]
    if total is None:
        lines.append("goal (whole DAG <= 36 h): not planned, some stages run without a GPU rate")
    else:
        slow = p["slowest"]
        verdict = "met" if total <= GOAL_HOURS else "NOT met"
        what = "the longest stage" if total <= GOAL_HOURS else "held back by"
        lines.append(f"goal (whole DAG <= {GOAL_HOURS:.0f} h): {verdict}, {total:.1f} h; {what}: {slow} "
                     f"({p['stages'][slow]['hours']:.1f} h)")
    return "\n".join(lines)


@cli
def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flashdraft.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configfile", required=True, help="the config the workflow will run with")
    ap.add_argument("--results", default="results", help="results of stages already run (token statistics)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs the one-GPU jobs (regeneration, precompute, evaluation) share at once, "
                         "e.g. the node's (the profile's gpu resource); default: gpus.target")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    a = ap.parse_args(argv)
    if a.gpus is not None and a.gpus < 0:
        raise UserError(f"--gpus {a.gpus}: give a GPU count >= 0")
    p = plan(load(a.configfile), a.results, a.gpus)
    if a.json:
        print(json.dumps(p, default=lambda o: o.__dict__, indent=2))
    else:
        print(render(p, a.configfile))


if __name__ == "__main__":
    main()
