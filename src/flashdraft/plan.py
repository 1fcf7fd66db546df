"""The run in numbers before it starts: hours per stage on the configured GPUs, and the disk the hidden
states take in bf16 and in fp8; then both hidden-state modes (store, stream) side by side, and the mode
and gpus.target/gpus.drafter split of N GPUs with the shortest wall time whose hidden states fit a disk
budget.

    python -m flashdraft.plan --configfile my.yaml [more.yaml ...] [--gpus N] [--disk-budget 2TB]
        [--results results] [--target-config config.json] [--json plan.json]

The config is read as the workflow reads it (each --configfile on top of the one before, every key left out
taking the dataclasses' default; config/config.yaml only where no file is given; checked
against workflow/schemas/config.schema.yaml and config.check); a mistake is one line naming the key.
Token statistics come from what earlier stages left under --results (prompt counts from
prompts/stats.json, prompt tokens from prompts/train.parquet, answer tokens from regenerated/train/,
exact totals from the hidden manifests) and otherwise from the assumptions below, printed as such.

Hours are work / (per-GPU rate x GPUs), per wave of shard jobs. The rates come from the committed
benchmarks (RATES, H200, a Qwen3-8B-shaped target); for another target they are scaled by parameter
count (a forward's work and its weight reads both grow with it; the drafter's layers take the target's
shapes). Prompts, verify, warmup, report and stream mode's tokenize and data-plan jobs take minutes and
are not counted.

Store mode runs the stages one after another. Stream mode cuts every epoch into chunks of whole optimizer
steps (as many tokens as half the disk budget holds: two chunks are on disk at once); a chunk's hidden
states are precomputed on gpus.target GPUs while the previous chunk trains on gpus.drafter GPUs. Its wall
time is regeneration + the pipeline (the first chunk's precompute, then each chunk as the slower of the
two sides, the next chunk's shard jobs waiting for the training two chunks back) + evaluation. Each chunk's
training job pays the measured launch-to-first-step (every chunk after the run's first: a resumed job's,
its checkpoint read and loaded) and its last save (the drafter in fp32 and AdamW's two moments, at the
local disk's measured speed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from .config import (
    Config,
    check,
    check_schema,
    check_stream,
    feature_layers,
    from_dict,
    needs_last_hidden,
    stream_chunk_tokens,
)
from .errors import UserError, cli
from .hf_config import attention_shape, read_target_config
from .io import FP8, bytes_per_token, human_bytes, parse_bytes
from .shapes import PRESETS

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "config" / "config.yaml"  # the Snakefile's `configfile:`
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"
GOAL_HOURS = 36.0  # the whole DAG on one node, as configured
GOAL_RECOMMENDED = (19.0, 2e12)  # the recommended plan: hours of wall time, bytes of hidden states on disk
DEFAULT_DISK_BUDGET = 2 * 10**12  # hidden-state bytes allowed on disk when neither config nor --disk-budget


@dataclass(frozen=True)
class Rate:
    value: float
    file: str  # under benchmarks/results/
    key: str  # dotted path of the value in that JSON
    unit: str
    scaled: bool = True  # a per-GPU throughput, scaled by the target's size (else used as measured)


# Per-GPU rates measured on one H200 (where noted, an H100) with a Qwen3-8B-shaped target
# (tests/test_plan.py checks every value against its file and key: after rerunning a benchmark, copy its
# new value here).
RATES = {
    # at answers of up to 1,024 new tokens (1,018 on average): production's answers run to 2,048 (550 mean)
    "regenerate": Rate(12246.6, "regenerate_1024_qwen3-8b.json", "tokens_per_s_per_gpu", "new tokens/s"),
    "precompute_bfloat16": Rate(30533.3, "precompute_hidden_gpu_qwen3-8b.json", "bfloat16.tokens_per_s",
                                "tokens/s"),
    "precompute_float8_e4m3": Rate(31208.6, "precompute_hidden_gpu_qwen3-8b.json",
                                   "float8_e4m3.tokens_per_s", "tokens/s"),
    "train_1gpu": Rate(20005.5, "train_drafter_qwen3-8b.json", "throughput.1.tokens_per_s_per_gpu",
                       "tokens/s"),
    # with 2 or more processes (DDP): the per-GPU rate of the 2-GPU run, assumed to hold at any count
    "train_per_gpu": Rate(18686.2, "train_drafter_qwen3-8b_2gpu.json", "throughput.2.tokens_per_s_per_gpu",
                          "tokens/s"),
    # train.fp8 (tensorwise, with train.compile_loss) against bf16 in the same one-GPU run: the factor on
    # the training rates above, assumed to hold on any GPU count (train.compile_scope: layer, as
    # config/fp8.yaml sets it, ran 1.04x faster again: not counted); a float8 job's start, measured with
    # layer scope and the compiled loss (production.yaml's keys) beside bf16's
    "train_fp8_speedup": Rate(1.3762, "train_drafter_qwen3-8b_fp8.json", "comparison.speedup_vs_baseline",
                              "x", scaled=False),
    # drafter.family dspark against dflash, the same block (7) and data, one process, bf16 (measured on
    # one H100): the factor on the training rates above (its heads and the target's distribution cost more)
    "train_dspark_factor": Rate(0.6543, "train_drafter_qwen3-8b_dspark_vs_dflash.json",
                                "comparison.speedup_vs_baseline", "x", scaled=False),
    "train_launch_fp8": Rate(10.44, "train_drafter_qwen3-8b_fp8_vs_bf16_layer.json",
                             "first_step.warm.launch_to_first_step_s", "s", scaled=False),
    "train_launch_resumed_fp8": Rate(11.58, "train_drafter_qwen3-8b_fp8_vs_bf16_layer.json",
                                     "first_step.resumed.launch_to_first_step_s", "s", scaled=False),
    "eval_target_only": Rate(160.41, "eval_decode_qwen3-8b.json", "modes.target_only.tokens_per_s",
                             "new tokens/s"),
    # each speculative decoder (dflash, dflash_untrained, ngram), as measured at tau 1 (random weights)
    "eval_speculative": Rate(117.85, "eval_decode_qwen3-8b.json", "modes.dflash.tokens_per_s",
                             "new tokens/s"),
    # a training job's start-up, warm compile cache, production drafter shape, one process: imports, data
    # open, cache load, drafter built, first step (stream mode pays it once per chunk; several processes
    # start through torchrun, which adds its own start). A resumed job (every chunk after a run's first)
    # also reads and loads the previous chunk's checkpoint, in part while it starts: measured as a whole.
    "train_launch": Rate(9.98, "train_drafter_qwen3-8b.json", "first_step.warm.launch_to_first_step_s",
                         "s", scaled=False),
    "train_launch_resumed": Rate(11.42, "train_drafter_qwen3-8b.json",
                                 "first_step.resumed.launch_to_first_step_s", "s", scaled=False),
    # checkpoints (flashdraft.checkpoint): a save holds training up for its copy into the host buffers, then
    # writes in the background; a job's last save is waited for
    "checkpoint_stage": Rate(54.553, "checkpoint_io_qwen3-8b.json", "stage_gb_per_s", "GB/s", scaled=False),
    "checkpoint_write": Rate(1.4315, "checkpoint_io_qwen3-8b.json", "write_gb_per_s", "GB/s", scaled=False),
    "checkpoint_read": Rate(1.9076, "checkpoint_io_qwen3-8b.json", "read_gb_per_s", "GB/s", scaled=False),
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
CHECKPOINT_BYTES_PER_PARAMETER = 12  # fp32 weights + AdamW's two fp32 moments (checkpoint.save_checkpoint)


def load(configfile, base=DEFAULT_CONFIG, target: dict | None = None) -> Config:
    """The config as the workflow sees it, or a UserError naming the file or key (`configfile`: one file or
    several, each on top of the one before, as Snakemake reads `--configfile a.yaml b.yaml`; `base`, the
    embedded default, only where none is given, as the Snakefile; `target`: the
    target's config.json when it is not at target.path)."""
    import yaml

    files = [configfile] if isinstance(configfile, (str, os.PathLike)) else list(configfile)
    configfile = " + ".join(map(str, files))  # what the errors name
    data = {}
    for f in files or [base]:  # the embedded default only where no file is given, as the Snakefile
        try:
            loaded = yaml.safe_load(Path(f).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise UserError(f"{f}: cannot read the config ({str(e).splitlines()[0]})") from e
        if not isinstance(loaded, dict):
            raise UserError(f"{f}: the config must be a mapping of sections")
        merge_into(data, loaded)
    if SCHEMA.exists():
        check_schema(data, SCHEMA, f"{configfile}: ")
    try:
        cfg = from_dict(Config, data)
    except ValueError as e:
        raise UserError(f"{configfile}: {e}") from e
    check(cfg, target)
    return cfg


def merge_into(base: dict, update: dict) -> None:
    """Snakemake's merge of a --configfile over the workflow's configfile: nested mappings key by key."""
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            merge_into(base[k], v)
        else:
            base[k] = v


def read_shapes(source: str) -> dict:
    """A target's config.json from a file, or a preset of flashdraft.shapes by name (qwen3-8b, toy)."""
    if Path(source).is_file():
        try:
            shapes = json.loads(Path(source).read_text())
        except ValueError as e:
            raise UserError(f"--target-config {source}: not a config.json ({e})") from e
        return checked_shapes(shapes, source)
    if source not in PRESETS:
        raise UserError(f"--target-config {source}: no such file, nor a preset of flashdraft.shapes "
                        f"({', '.join(sorted(PRESETS))})")
    return dict(PRESETS[source])


SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def checked_shapes(shapes, source: str) -> dict:
    """A config.json dict whose shapes the cost model reads are positive integers, or a UserError naming
    the first that is not."""
    if not isinstance(shapes, dict):
        raise UserError(f"--target-config {source}: holds {type(shapes).__name__}, not a config.json object")
    text = shapes.get("text_config", shapes) if "hidden_size" not in shapes else shapes
    for key in SHAPE_KEYS:
        value = text.get(key) if isinstance(text, dict) else None
        if type(value) is not int or value <= 0:
            raise UserError(f"--target-config {source}: {key} is {value!r}; a target's config.json gives it "
                            "as a positive integer")
    return shapes


def target_shapes(cfg: Config, given: dict | None = None) -> dict:
    """The target's config.json (`given`, else from target.path), or the toy's shapes when the workflow
    has not built it yet."""
    if given is not None:
        return given.get("text_config", given) if "hidden_size" not in given else given
    if (Path(cfg.target.path) / "config.json").exists() or not cfg.target.build_toy:
        c = read_target_config(cfg.target.path)
        return c.get("text_config", c) if "hidden_size" not in c else c
    t = cfg.toy
    return {"hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_layers, "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
            "vocab_size": (t.vocab_size // 64 + 1) * 64, "tie_word_embeddings": False}


def layer_parameters(c: dict) -> int:
    """Parameters of one decoder layer of the target's shapes: attention, MLP, its two norms."""
    h = c["hidden_size"]
    n, kv, d = attention_shape(c)
    return 2 * h * n * d + 2 * h * kv * d + 3 * h * c["intermediate_size"] + 2 * h


def num_parameters(c: dict) -> int:
    """Parameters of a dense decoder-only LM from its config.json: attention, MLP, norms, embeddings."""
    h = c["hidden_size"]
    embeddings = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings") else 2)
    return c["num_hidden_layers"] * layer_parameters(c) + embeddings + h


def drafter_parameters(cfg: Config, shapes: dict) -> int:
    """The drafter's trained parameters (model.DFlashDrafter): its layers in the target's shapes, the fc
    over the K fused layers, two norms; the embedding and LM head are the target's, frozen, not saved."""
    h = shapes["hidden_size"]
    return cfg.drafter.num_layers * layer_parameters(shapes) + hidden_width(cfg, shapes) * h + 2 * h


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


def results_target(results: Path) -> tuple[str, Path] | None:
    """The target an earlier run under `results` used, and the file saying so: a hidden manifest's
    `target`, else a regeneration shard's meta.json (relative paths are the workflow's, beside results/)."""
    files = sorted((results / "hidden").glob("shard-*.json"))[:1]
    files += sorted((results / "regenerated" / "parts").glob("shard-*/meta.json"))[:1]
    for file in files:
        try:
            target = json.loads(file.read_text()).get("target")
        except (OSError, ValueError):
            continue
        if target:
            return target, file
    return None


def same_target(a: str, b: str, base: Path) -> bool:
    return (base / a).resolve() == (base / b).resolve()  # an absolute path stays itself


def token_stats(cfg: Config, results) -> Tokens:
    import pandas as pd

    r, notes = Path(results), []
    used = results_target(r)
    if used and not same_target(used[0], cfg.target.path, r.resolve().parent):
        notes.append(f"IGNORED {r}: it holds a run of another target ({used[0]}, in {used[1]}), not "
                     f"target.path {cfg.target.path}; its token statistics are not used")
        r = r / "(another target's)"  # nothing exists under it: every figure below is assumed
    stats_file = r / "prompts" / "stats.json"
    stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}
    requested = stats.get("requested_train", cfg.prompts.total)
    if stats and requested != cfg.prompts.total:
        notes.append(f"IGNORED {stats_file}: made for prompts.total {requested:,}, the config asks for "
                     f"{cfg.prompts.total:,}")
        stats = {}
    if stats:
        totals = stats["totals"]
        samples, evals = int(totals["sampled_train"]), int(totals["sampled_eval"])
        notes.append(f"training samples {samples:,}, eval prompts {evals:,}: {stats_file}")
    else:
        samples, evals = cfg.prompts.total, cfg.prompts.eval_count
        notes.append(f"training samples {samples:,}: prompts.total (no {stats_file} yet)")
    train = r / "prompts" / "train.parquet"
    if train.exists() and (Path(cfg.target.path) / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        from .chat import prompt_ids

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


def token_bytes(cfg: Config, shapes: dict, dtype: str | None = None) -> int:
    """Bytes one token takes in the hidden-state shards of this config, in hidden.dtype or `dtype`: its K
    fused layers of H values, and H more when drafter.family trains on the target's last hidden state
    (io.bytes_per_token, as the precompute preflight counts)."""
    k = len(feature_layers(shapes["num_hidden_layers"], cfg.drafter))
    last = needs_last_hidden(cfg.drafter)
    return bytes_per_token(dtype or cfg.hidden.dtype, k, shapes["hidden_size"], last)


def hidden_disk(cfg: Config, shapes: dict, tokens: int) -> dict[str, int]:
    """Bytes of the hidden-state shards in bf16 and in fp8: the precompute preflight's estimate."""
    return {dtype: tokens * token_bytes(cfg, shapes, dtype) for dtype in ("bfloat16", FP8)}


def rate(key: str, scale: float) -> float:
    r = RATES[key]
    return r.value * scale if r.scaled else r.value


def _waves_hours(work: float, jobs: int, gpus: int, rate: float) -> float:
    """`jobs` equal shard jobs of one GPU each, `gpus` at a time: whole waves, each one job's work."""
    return math.ceil(jobs / gpus) * (work / jobs) / rate / 3600


@dataclass(frozen=True)
class Split:
    target: int  # gpus.target
    drafter: int  # gpus.drafter (per node, on gpus.drafter_nodes nodes)


@dataclass(frozen=True)
class Run:
    """What every stage estimate reads: the config, its token counts, the target's shapes, how much slower
    than the benchmarks' target it runs (scale), and the GPUs one-GPU jobs share at once (gpus)."""
    cfg: Config
    tok: Tokens
    shapes: dict
    scale: float
    gpus: int

    @property
    def width(self) -> int:
        return hidden_width(self.cfg, self.shapes)

    @property
    def token_bytes(self) -> int:
        """Bytes a hidden-state token takes on disk, in hidden.dtype."""
        return token_bytes(self.cfg, self.shapes)

    def world(self, split: Split) -> int:
        return max(1, split.drafter) * self.cfg.gpus.drafter_nodes

    def train_key(self, split: Split) -> str:
        return "train_1gpu" if self.world(split) == 1 else "train_per_gpu"

    def train_keys(self, split: Split) -> list[str]:
        """The rates training is planned with: the per-GPU rate, and the measured factors of train.fp8 and
        of a drafter family other than dflash."""
        return [self.train_key(split)] + (["train_fp8_speedup"] if self.cfg.train.fp8 else []) + \
            (["train_dspark_factor"] if self.cfg.drafter.family == "dspark" else [])

    def train_rate(self, split: Split) -> float:
        """Training tokens/s per GPU."""
        return math.prod(rate(k, self.scale) for k in self.train_keys(split))

    def launch_s(self, resumed: bool) -> float:
        """A training job's start to its first step (warm compile cache); `resumed`: from a checkpoint."""
        key = "train_launch_resumed" if resumed else "train_launch"
        return rate(key + ("_fp8" if self.cfg.train.fp8 else ""), 1)

    def train_tokens(self, split: Split) -> float:
        t = self.cfg.train
        work = t.epochs * self.tok.total
        return min(work, t.max_steps * self.step_tokens(split)) if t.max_steps else work

    def step_tokens(self, split: Split) -> int:
        """Tokens of one optimizer step at their full budget (real steps hold padding too)."""
        t = self.cfg.train
        return t.global_batch_tokens or t.batch_tokens * self.world(split)

    def precompute_key(self) -> str:
        dtype = self.cfg.hidden.dtype if f"precompute_{self.cfg.hidden.dtype}" in RATES else "bfloat16"
        return f"precompute_{dtype}"

    def checkpoint_bytes(self) -> int:
        return drafter_parameters(self.cfg, self.shapes) * CHECKPOINT_BYTES_PER_PARAMETER

    def save_s(self) -> float:
        """What a save holds training up for: its copy into the host buffers (written in the background)."""
        return self.checkpoint_bytes() / (rate("checkpoint_stage", 1) * 1e9)

    def last_save_s(self) -> float:
        """A job's last save, which the job waits for: the copy and the write."""
        return self.save_s() + self.checkpoint_bytes() / (rate("checkpoint_write", 1) * 1e9)

    def load_s(self) -> float:
        return self.checkpoint_bytes() / (rate("checkpoint_read", 1) * 1e9)

    def eval_prompt_s(self) -> float:
        """One evaluation prompt on one GPU: target-only and every speculative decoder."""
        return self.cfg.eval.max_new_tokens * (1 / rate("eval_target_only", self.scale)
                                               + EVAL_DECODERS / rate("eval_speculative", self.scale))

    def gpu_hours(self, split: Split, precompute_tokens: float) -> float:
        """The work of regeneration, precompute, training and evaluation on one GPU (what no overlap or
        split can shorten), hidden states precomputed for `precompute_tokens` tokens."""
        rg = self.cfg.regenerate
        local = rg.enabled and rg.backend != "openai"
        new_tokens = self.tok.samples * self.tok.answer_tokens if local else 0.0
        seconds = new_tokens / rate("regenerate", self.scale)
        seconds += precompute_tokens / rate(self.precompute_key(), self.scale)
        seconds += self.train_tokens(split) / self.train_rate(split)
        seconds += self.tok.eval_prompts * self.eval_prompt_s()
        return seconds / 3600


def stage_table(run: Run, split: Split) -> dict:
    """Store mode's stages, one after another: work, per-GPU rates, GPUs and hours (None: on the CPU, or
    on a server the plan cannot see)."""
    cfg, tok, scale, g = run.cfg, run.tok, run.scale, run.gpus
    stages = {}

    def stage(name, work, unit, rate_keys, hours, gpus_used):
        stages[name] = {"work": work, "unit": unit, "rates": {k: rate(k, scale) for k in rate_keys},
                        "sources": [f"{RATES[k].file}: {RATES[k].key}" for k in rate_keys],
                        "gpus": gpus_used, "hours": hours}

    rg = cfg.regenerate
    new_tokens = tok.samples * tok.answer_tokens if rg.enabled else 0
    jobs = rg.shards or cfg.hidden.shards
    r = rate("regenerate", scale)
    if not rg.enabled:
        hours, used = 0.0, 0
    elif rg.backend == "openai":
        hours, used = None, 0  # answered by a server elsewhere
    elif rg.backend == "server":
        per_job = rg.server_gpus
        used = max(g // per_job, 0) * per_job
        hours = _waves_hours(new_tokens, jobs, g // per_job, r * per_job) if g >= per_job else None
    else:
        hours, used = (_waves_hours(new_tokens, jobs, g, r) if g else None), g
    stage("regeneration", new_tokens, "new tokens", ["regenerate"], hours, used)

    key = run.precompute_key()
    hours = _waves_hours(tok.total, cfg.hidden.shards, g, rate(key, scale)) if g else None
    stage("precompute", tok.total, "tokens", [key], hours, g)

    world = run.world(split)
    work = run.train_tokens(split)
    hours = work / (run.train_rate(split) * world) / 3600 if split.drafter else None
    stage("training", work, "tokens", run.train_keys(split), hours, split.drafter * cfg.gpus.drafter_nodes)

    saves = int(work / run.step_tokens(split)) // cfg.train.checkpoint_every
    hours = (saves * run.save_s() + run.last_save_s()) / 3600 if split.drafter else None
    stage("checkpoints", (saves + 1) * run.checkpoint_bytes(), "bytes",
          ["checkpoint_stage", "checkpoint_write"], hours, split.drafter * cfg.gpus.drafter_nodes)

    e = cfg.eval
    jobs = e.shards or max(1, split.target)
    work = tok.eval_prompts * e.max_new_tokens * (1 + EVAL_DECODERS)
    hours = _waves_hours(tok.eval_prompts * run.eval_prompt_s(), jobs, g, 1.0) if g else None
    stage("evaluation", work, "new tokens", ["eval_target_only", "eval_speculative"], hours, min(g, jobs))
    return stages


@dataclass
class ModePlan:
    """One hidden-state mode on one split: busy hours per stage, wall time, peak hidden-state disk."""
    mode: str  # store | stream
    split: Split
    hours: dict[str, float | None]  # stream: precompute and training overlap, the pipeline row holds both
    gpus: dict[str, int]
    wall_hours: float | None
    peak_disk: int  # bytes of hidden states on disk at once
    gpu_hours: float  # regeneration, precompute, training and evaluation work on one GPU
    chunks: Chunks | None = None


def _wall(hours: list[float | None]) -> float | None:
    return None if any(h is None for h in hours) else sum(hours)


def store_mode(run: Run, split: Split) -> ModePlan:
    table = stage_table(run, split)
    hours = {k: v["hours"] for k, v in table.items()}
    peak = run.tok.total * run.token_bytes
    gpus = {k: v["gpus"] for k, v in table.items()}
    return ModePlan("store", split, hours, gpus, _wall(list(hours.values())), peak,
                    run.gpu_hours(split, run.tok.total))


@dataclass(frozen=True)
class Chunks:
    """Stream mode's chunks: every epoch cut into whole optimizer steps of at most `cap` tokens."""
    cap: int  # hidden-state tokens a chunk may hold
    source: str  # where the cap comes from
    step_tokens: int
    per_epoch: int
    sizes: tuple[int, ...]  # hidden-state tokens of every chunk of the run, in order
    precompute_s: float  # the first (a full) chunk's, on gpus.target GPUs
    train_s: float  # its training on gpus.drafter GPUs
    startup_s: float  # its job's launch to first step, checkpoint load and save


def chunk_sizes(run: Run, split: Split, budget: int) -> tuple[int, str, tuple[int, ...]]:
    """The chunk cap, where it comes from, and every chunk's tokens: each epoch's hidden-state tokens in
    whole optimizer steps (counted at their full budget, so a chunk holds at least this many steps)."""
    h = run.cfg.hidden
    hidden = h if h.chunk_tokens else replace(h, disk_budget=budget)
    per_token = run.token_bytes
    cap = stream_chunk_tokens(hidden, per_token)
    step = run.step_tokens(split)
    check_stream(hidden, run.cfg.train, step // run.cfg.train.batch_tokens, per_token)  # the workflow's check
    source = (f"hidden.chunk_tokens {cap:,}" if h.chunk_tokens else
              f"hidden.disk_budget {human_bytes(budget)} / 2 chunks / {per_token:,} bytes per token")
    full = max(cap // step, 1) * step  # the check's bound of a step may fall below its token budget
    epoch = [full] * (run.tok.total // full) + ([run.tok.total % full] if run.tok.total % full else [])
    sizes, left = [], run.train_tokens(split)
    while left > 0 and epoch:
        for size in epoch:
            sizes.append(int(min(size, left)))
            left -= sizes[-1]
            if left <= 0:
                break
    return cap, source, tuple(sizes)


def pipeline_seconds(precompute: list[float], train: list[float]) -> float:
    """Chunk c's shard jobs start once chunk c-1's are written and chunk c-2 has trained (two chunks on
    disk at once); its training once its shards are written and chunk c-1 has trained."""
    pre_end, train_end = [], []
    for c, (p, t) in enumerate(zip(precompute, train, strict=True)):
        start = max(pre_end[c - 1] if c else 0.0, train_end[c - 2] if c >= 2 else 0.0)
        pre_end.append(start + p)
        train_end.append(max(pre_end[c], train_end[c - 1] if c else 0.0) + t)
    return train_end[-1] if train_end else 0.0


def stream_mode(run: Run, split: Split, budget: int) -> ModePlan:
    """Regeneration, then the chunk pipeline, then evaluation; a UserError when a chunk cannot hold one
    optimizer step."""
    cfg = run.cfg
    table = stage_table(run, split)
    cap, source, sizes = chunk_sizes(run, split, budget)
    on_gpus = split.target > 0 and split.drafter > 0 and run.gpus > 0
    pre_rate = rate(run.precompute_key(), run.scale) * max(1, split.target)
    train_rate = run.train_rate(split) * run.world(split)
    step, every = run.step_tokens(split), cfg.train.checkpoint_every
    pre = [n / pre_rate for n in sizes]
    train = [n / train_rate for n in sizes]
    startup = [run.launch_s(resumed=c > 0) + run.last_save_s()
               + run.save_s() * (n / step / every) for c, n in enumerate(sizes)]  # + the saves within it
    chunk_train = [t + s for t, s in zip(train, startup, strict=True)]
    pipeline = pipeline_seconds(pre, chunk_train) / 3600 if on_gpus else None
    busy = (lambda xs: sum(xs) / 3600) if on_gpus else (lambda xs: None)
    hours = {"regeneration": table["regeneration"]["hours"], "precompute": busy(pre), "training": busy(train),
             "start-up and checkpoints": busy(startup), "pipeline": pipeline,
             "evaluation": table["evaluation"]["hours"]}
    gpus = {"regeneration": table["regeneration"]["gpus"], "precompute": max(1, split.target),
            "training": run.world(split), "start-up and checkpoints": run.world(split),
            "pipeline": max(1, split.target) + run.world(split), "evaluation": table["evaluation"]["gpus"]}
    chunks = Chunks(cap, source, step, len(sizes) and math.ceil(len(sizes) / cfg.train.epochs), sizes,
                    pre[0], train[0], startup[0])
    peak = 2 * max(sizes, default=0) * run.token_bytes
    wall = _wall([hours["regeneration"], pipeline, hours["evaluation"]])
    return ModePlan("stream", split, hours, gpus, wall, peak, run.gpu_hours(split, sum(sizes)), chunks)


@dataclass
class Recommendation:
    gpus: int
    budget: int
    budget_source: str
    candidates: list[ModePlan]
    refused: dict[str, str]  # mode and split -> why it cannot run
    best: ModePlan | None

    @property
    def floor_hours(self) -> float | None:
        """All the recommended plan's GPU-hours spread over every GPU: what no schedule can beat."""
        return self.best.gpu_hours / self.gpus if self.best else None


def recommend(run: Run, budget: int, budget_source: str) -> Recommendation:
    """Every split of the `run.gpus` GPUs in both modes; the shortest wall time whose hidden states fit
    `budget`. Store mode runs its stages one after another, so each may take all N GPUs; stream mode runs
    precompute and training at once, on gpus.target + gpus.drafter = N."""
    n = run.gpus
    candidates, refused = [store_mode(run, Split(n, n))], {}
    for t in range(1, n):
        try:
            candidates.append(stream_mode(run, Split(t, n - t), budget))
        except UserError as e:
            refused[f"stream {t}+{n - t}"] = str(e)
    fits = [c for c in candidates if c.wall_hours is not None and c.peak_disk <= budget]
    best = min(fits, key=lambda c: c.wall_hours, default=None)
    if best is None and n and all(c.wall_hours is not None for c in candidates):
        stream = next(iter(refused.values()), "").removeprefix("config key hidden.disk_budget: ")
        raise UserError(f"config key hidden.disk_budget: {human_bytes(budget)} ({budget_source}) fits no "
                        f"plan on {n} GPUs: store mode keeps {human_bytes(candidates[0].peak_disk)} of "
                        f"hidden states" + (f"; in stream mode {stream}" if stream else ""))
    return Recommendation(n, budget, budget_source, candidates, refused, best)


def plan(cfg: Config, results="results", gpus: int | None = None, budget: int | None = None,
         target: dict | None = None) -> dict:
    """Hours per stage (None: on the CPU, or on a server the plan cannot see) and hidden-state bytes, for
    the config's split in both modes, and the recommended mode and split of `gpus` GPUs (default
    gpus.target) under the disk budget (default hidden.disk_budget, else DEFAULT_DISK_BUDGET)."""
    shapes = target_shapes(cfg, target)
    params, ref = num_parameters(shapes), num_parameters(REFERENCE_TARGET)
    scale = ref / params  # rates per GPU fall as the model grows
    g = cfg.gpus.target if gpus is None else gpus  # one-GPU jobs at a time (the profile's gpu resource)
    run = Run(cfg, token_stats(cfg, results), shapes, scale, g)
    if budget is not None:
        source = "--disk-budget"
    elif cfg.hidden.disk_budget:
        budget, source = cfg.hidden.disk_budget, "hidden.disk_budget"
    else:
        budget, source = DEFAULT_DISK_BUDGET, "the planner's default; set hidden.disk_budget or --disk-budget"
    split = Split(cfg.gpus.target, cfg.gpus.drafter)
    stages = stage_table(run, split)
    known = [s["hours"] for s in stages.values() if s["hours"] is not None]
    total = sum(known) if len(known) == len(stages) else None
    slowest = max(stages, key=lambda k: stages[k]["hours"] or 0)
    modes = {"store": store_mode(run, split)}
    try:
        modes["stream"] = stream_mode(run, split, budget)
    except UserError as e:
        modes["stream"] = str(e)
    rec = recommend(run, budget, source) if g and total is not None else None
    return {"parameters": params, "reference_parameters": ref, "scale": scale, "gpus": g, "tokens": run.tok,
            "stages": stages, "total_hours": total, "slowest": slowest, "hidden_width": run.width,
            "hidden_bytes": hidden_disk(cfg, shapes, run.tok.total), "hidden_dtype": cfg.hidden.dtype,
            "hidden_token_bytes": {d: token_bytes(cfg, shapes, d) for d in ("bfloat16", FP8)},
            "last_hidden": needs_last_hidden(cfg.drafter),
            "drafter_parameters": drafter_parameters(cfg, shapes), "checkpoint_bytes": run.checkpoint_bytes(),
            "save_s": run.save_s(), "last_save_s": run.last_save_s(), "load_s": run.load_s(),
            "disk_budget": budget, "budget_source": source,
            "modes": modes, "recommendation": rec}


def summary(p: dict) -> dict:
    """benchmarks/results/plan_production.json's figures: both modes on the config's split, the
    recommendation, the floor (every GPU-hour spread over the GPUs) and the share of it reached."""
    def figures(m):
        ok = isinstance(m, ModePlan)
        return {"wall_hours": _round(m.wall_hours, 2) if ok else None,
                "peak_disk_tb": round(m.peak_disk / 1e12, 3) if ok else None}

    rec = p["recommendation"]
    best = rec.best if rec else None
    floor = rec.floor_hours if rec else None
    return {"store": figures(p["modes"]["store"]), "stream": figures(p["modes"]["stream"]),
            "recommended": best and {"mode": best.mode, "gpus": {"target": best.split.target,
                                                                 "drafter": best.split.drafter},
                                     **figures(best)},
            "floor_hours": _round(floor, 2),
            "floor_fraction": _round(floor / best.wall_hours, 3) if best else None}


def _round(x, digits):
    return None if x is None else round(x, digits)


def _num(x: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def _hours(h) -> str:
    return "-" if h is None else f"{h:.1f}"


def render(p: dict, configfile) -> str:
    n, ref = _num(p["parameters"]), _num(p["reference_parameters"])
    lines = [f"plan for {configfile}: a target of {n} parameters; the benchmarks' rates (one H200, a "
             f"Qwen3-8B shape of {ref}) scaled by {ref} / {n} = {p['scale']:.3g}", "", "token statistics:"]
    lines += [f"  {note}" for note in p["tokens"].notes]
    lines += ["", f"store mode, stage after stage (gpus.target and --gpus {p['gpus']} for the one-GPU jobs, "
              "gpus.drafter for training):",
              "| stage | work | per-GPU rate | GPUs | hours |", "| --- | --- | --- | --- | --- |"]
    sources = []
    for name, s in p["stages"].items():
        rates = " + ".join(f"{r:,.4g}" if s["unit"] == "bytes" else f"{r:,.1f}"
                           for k, r in s["rates"].items() if RATES[k].unit != "x")
        rates += "".join(f" x {r:.3g}" for k, r in s["rates"].items() if RATES[k].unit == "x")  # factors
        unit = "GB" if s["unit"] == "bytes" else s["unit"]
        work = human_bytes(s["work"]) if s["unit"] == "bytes" else f"{_num(s['work'])} {s['unit']}"
        lines.append(f"| {name} | {work} | {rates} {unit}/s | {s['gpus']} | {_hours(s['hours'])} |")
        sources.append(f"  {name}: {', '.join(s['sources'])}")
    total = p["total_hours"]
    lines.append(f"| total | | | | {_hours(total)} |")
    lines += ["", "rates (per second, before scaling) from benchmarks/results/:", *sources]
    if any(s["hours"] is None for s in p["stages"].values()):
        lines.append("  -: the stage runs on the CPU (gpus.* 0) or on a server elsewhere: no measured rate")
    b, w, per_token = p["hidden_bytes"], p["hidden_width"], p["hidden_token_bytes"]
    disk = ", ".join(f"{b[d] / 1e12:,.2f} TB in {d} ({per_token[d]:,} bytes/token)" for d in b)
    last = " + the target's last hidden state (drafter.family)" if p["last_hidden"] else ""
    lines += ["", f"hidden states ({p['tokens'].total:,} tokens x {w:,} values{last}): {disk}; "
              f"configured hidden.dtype: {p['hidden_dtype']}",
              f"checkpoints: {human_bytes(p['checkpoint_bytes'])} (the drafter's "
              f"{_num(p['drafter_parameters'])} parameters in fp32 + AdamW's two moments), "
              f"a save holds training up {p['save_s']:.1f} s (then writes in the background), a job's last "
              f"save {p['last_save_s']:.1f} s, a resume {p['load_s']:.1f} s to read (while the job starts: "
              "a resumed job's measured start-up holds it)"]
    if total is None:
        lines.append("goal (whole DAG <= 36 h): not planned, some stages run without a GPU rate")
    else:
        slow = p["slowest"]
        verdict = "met" if total <= GOAL_HOURS else "NOT met"
        what = "the longest stage" if total <= GOAL_HOURS else "held back by"
        lines.append(f"goal (whole DAG <= {GOAL_HOURS:.0f} h): {verdict}, {total:.1f} h; {what}: {slow} "
                     f"({p['stages'][slow]['hours']:.1f} h)")
    lines += render_modes(p)
    if p["recommendation"]:
        lines += render_recommendation(p["recommendation"])
    return "\n".join(lines)


MODE_ROWS = [  # label, store mode's stage, stream mode's
    ("regeneration", "regeneration", "regeneration"),
    ("precompute", "precompute", "precompute"),
    ("training", "training", "training"),
    ("checkpoints (stream: and each chunk job's start-up)", "checkpoints", "start-up and checkpoints"),
    ("pipeline: precompute and training at once", None, "pipeline"),
    ("evaluation", "evaluation", "evaluation"),
]


def _cells(m, key, overlapped=False) -> list[str]:
    """A mode's GPUs and hours for one stage (blank where the mode has no such stage)."""
    if not isinstance(m, ModePlan) or key is None:
        return ["", ""]
    mark = "*" if overlapped and m.hours[key] is not None else ""
    return [str(m.gpus[key]), f"{_hours(m.hours[key])}{mark}"]


def render_modes(p: dict) -> list[str]:
    store, stream = p["modes"]["store"], p["modes"]["stream"]
    lines = ["", f"both hidden-state modes as configured (gpus.target {store.split.target}, gpus.drafter "
             f"{store.split.drafter}), hidden states on disk <= {human_bytes(p['disk_budget'])} "
             f"({p['budget_source']}):",
             "| stage | store: GPUs | store: hours | stream: GPUs | stream: hours |",
             "| --- | --- | --- | --- | --- |"]
    for label, a, b in MODE_ROWS:
        over = b in ("precompute", "training", "start-up and checkpoints")
        lines.append("| " + " | ".join([label, *_cells(store, a), *_cells(stream, b, over)]) + " |")
    wall = [f"{_hours(m.wall_hours) if isinstance(m, ModePlan) else '-'}" for m in (store, stream)]
    disk = [f"{m.peak_disk / 1e12:.2f}" if isinstance(m, ModePlan) else "-" for m in (store, stream)]
    lines += [f"| wall | | {wall[0]} | | {wall[1]} |",
              f"| peak hidden-state disk, TB | | {disk[0]} | | {disk[1]} |"]
    if isinstance(stream, ModePlan):
        lines += ["* busy hours of those GPUs, at the same time as the other side's (the pipeline row)",
                  f"stream: {describe_chunks(stream)}"]
    else:
        lines.append(f"stream: not planned: {stream}")
    return lines


def describe_chunks(m: ModePlan) -> str:
    c = m.chunks
    slower = "training" if c.train_s + c.startup_s >= c.precompute_s else "precompute"
    return (f"chunks of <= {c.cap:,} hidden-state tokens ({c.source}), {c.cap // c.step_tokens:,} optimizer "
            f"steps of {c.step_tokens:,} tokens; {c.per_epoch} per epoch, {len(c.sizes)} in all. A full "
            f"chunk: precompute {c.precompute_s:,.0f} s on {max(1, m.split.target)} GPU(s), training "
            f"{c.train_s:,.0f} s on {m.gpus['training']} GPU(s) + {c.startup_s:.0f} s for its job's launch "
            f"to first step, checkpoint load and saves; the slower side: {slower}")


def render_recommendation(r: Recommendation) -> list[str]:
    lines = ["", f"every split of {r.gpus} GPUs, hidden states <= {human_bytes(r.budget)}:",
             "| mode | gpus.target | gpus.drafter | wall hours | peak hidden-state disk, TB | fits |",
             "| --- | --- | --- | --- | --- | --- |"]
    for m in r.candidates:
        fits = "yes" if m.peak_disk <= r.budget else "no"
        lines.append(f"| {m.mode} | {m.split.target} | {m.split.drafter} | {_hours(m.wall_hours)} | "
                     f"{m.peak_disk / 1e12:.2f} | {fits} |")
    lines += [f"  not planned, {k}: {why}" for k, why in r.refused.items()]
    b = r.best
    if b is None:
        return [*lines, "recommended: none (some stages run without a GPU rate)"]
    floor = r.floor_hours
    lines += [f"recommended: hidden.mode {b.mode}, gpus.target {b.split.target}, gpus.drafter "
              f"{b.split.drafter}: {b.wall_hours:.1f} h wall, {human_bytes(b.peak_disk)} of hidden states "
              "on disk",
              f"floor: {b.gpu_hours:,.1f} GPU-hours of regeneration, precompute, training and evaluation "
              f"over {r.gpus} GPUs = {floor:.1f} h; the recommendation reaches {floor / b.wall_hours:.2f} of "
              "it"]
    hours, disk = GOAL_RECOMMENDED
    verdict = "met" if b.wall_hours <= hours and b.peak_disk <= disk else "NOT met"
    lines.append(f"goal (recommended <= {hours:.0f} h wall and <= {human_bytes(disk)} of hidden states): "
                 f"{verdict}, {b.wall_hours:.1f} h and {human_bytes(b.peak_disk)}")
    return lines


@cli
def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flashdraft.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configfile", required=True, nargs="+",
                    help="the config the workflow will run with (several: each on top of the one before)")
    ap.add_argument("--results", default=None,
                    help="results of stages already run (token statistics); default: the config's `results`")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs the one-GPU jobs (regeneration, precompute, evaluation) share at once, "
                         "e.g. the node's (the profile's gpu resource), and the GPUs the recommendation "
                         "splits; default: gpus.target")
    ap.add_argument("--disk-budget", default=None,
                    help="bytes of hidden states allowed on disk at once, e.g. 2TB; default: "
                         f"hidden.disk_budget, else {human_bytes(DEFAULT_DISK_BUDGET)}")
    ap.add_argument("--target-config", default=None,
                    help="the target's config.json when target.path does not hold it yet, or a preset of "
                         "flashdraft.shapes (qwen3-8b, toy)")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="also write both modes, the recommendation and the floor as JSON to PATH "
                         "(-: print only that)")
    a = ap.parse_args(argv)
    if a.gpus is not None and a.gpus < 0:
        raise UserError(f"--gpus {a.gpus}: give a GPU count >= 0")
    try:
        budget = None if a.disk_budget is None else parse_bytes(a.disk_budget, "--disk-budget")
    except ValueError as e:
        raise UserError(str(e)) from e
    if a.json not in (None, "-") and not Path(a.json).resolve().parent.is_dir():
        raise UserError(f"--json {a.json}: no folder {Path(a.json).resolve().parent}; create it first")
    target = read_shapes(a.target_config) if a.target_config else None
    cfg = load(a.configfile, target=target)
    p = plan(cfg, a.results or cfg.results, a.gpus, budget, target)
    if a.json == "-":
        print(json.dumps(summary(p), indent=2))
        return
    print(render(p, " + ".join(a.configfile)))
    if a.json:
        Path(a.json).write_text(json.dumps(summary(p), indent=2) + "\n")


if __name__ == "__main__":
    main()
