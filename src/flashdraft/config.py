"""Typed configuration: one dataclass per section of config/config.yaml.

The dataclass defaults are the single place where defaults live (the DFlash recipe for training, with
D-PACE's loss weights);
workflow/schemas/config.schema.yaml checks types and documents every key. Each stage script takes its
section as JSON (`--cfg '{...}'`), so Snakemake reruns a stage only when its own section changes.
The checks across sections made before any job runs are config_check.py's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserError
from .families import FAMILIES, family_info
from .families import DSparkConfig as DSparkConfig  # drafter.dspark's section, for its users
from .io import parse_bytes


@dataclass
class TargetConfig:
    path: str = "{results}/toy/target"  # HF model directory (or the toy target built by the workflow)
    build_toy: bool = False  # build the toy target at `path` (embedded default)
    dtype: str = "bfloat16"  # dtype the target runs in: float32 | bfloat16 | float16


@dataclass
class ToyConfig:
    seed: int = 0
    num_docs: int = 3000  # synthetic training documents for the toy target
    vocab_size: int = 512  # BPE vocabulary (embedding keeps free rows above it, one is MASK)
    hidden_size: int = 128
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 300
    lr: float = 3e-3
    source_rows: int = 200  # rows in each synthetic prompt source file


@dataclass
class SourceConfig:
    name: str
    path: str  # local file or HF dataset id
    format: str = "auto"  # auto | jsonl | json | parquet | arrow | hf
    shape: str = "auto"  # auto | sharegpt | messages | alpaca | prompt
    split: str = "train"
    weight: float = 1.0
    fields: dict[str, str] = field(default_factory=dict)  # rename source fields to canonical ones


@dataclass
class PromptsConfig:
    total: int = 1000  # prompts in the training mix
    eval_count: int = 32  # held-out prompts for evaluation
    min_chars: int = 1
    max_chars: int = 32000
    seed: int = 0
    sources: list[SourceConfig] = field(default_factory=list)
    near_dup: bool = True  # drop MinHash-LSH near-duplicates after exact dedup
    near_dup_threshold: float = 0.85  # estimated Jaccard similarity of word n-gram shingles
    near_dup_num_perm: int = 64
    near_dup_ngram: int = 5  # words per shingle
    # templates ("{prompt}" is the last user turn) that fill the gap when the unique pool is too small
    augment: list[str] = field(
        default_factory=lambda: [
            "{prompt} Answer briefly.",
            "{prompt} Explain step by step.",
            "{prompt} Respond in French.",
            "Think carefully, then answer.\n\n{prompt}",
        ]
    )


@dataclass
class RegenerateConfig:
    enabled: bool = True
    backend: str = "hf"  # hf (in-process generate) | openai (any OpenAI-compatible server) | server (own)
    engine: str = "auto"  # hf backend: auto | static (flashdraft.decode) | hf or generate (HF generate)
    shards: int = 0  # jobs the stage is split into, one GPU each; 0: hidden.shards
    max_new_tokens: int = 1024
    batch_size: int = 0  # sequences decoded at once; 0: static engine from free GPU memory, else 16
    temperature: float = 0.0
    # above temperature 0, sampling keeps the top_k likeliest tokens (0: all), then the fewest whose
    # probabilities add up to top_p (1.0: all); DeepSpec's data scripts: temperature 0.7, top_p 0.8, top_k 20
    top_p: float = 1.0
    top_k: int = 0
    thinking: bool = False
    part_rows: int = 256  # rows per atomically committed parquet part
    max_error_fraction: float = 0.05  # fail the stage when more rows than this fail
    # a rerun answers again the rows that failed for the server's reason (an error, a malformed answer);
    # true: every failed row, also those that failed for their own (a prompt the template cannot render)
    retry_failed: bool = False
    # backend openai: the server, and how hard to try it
    base_url: str = ""  # e.g. http://127.0.0.1:8000/v1
    model: str | None = None  # model name sent in requests; None: the target path
    api_key_env: str = "OPENAI_API_KEY"  # env var holding the API key (unset: no key sent)
    concurrency: int = 32  # requests in flight
    max_retries: int = 5  # per request, on connection errors, timeouts, 429 and 5xx
    timeout_s: float = 600.0  # per request
    backoff_s: float = 1.0  # first retry delay; doubled per retry (capped at 60 s), with jitter
    # backend server: the job starts this server on its own leased GPUs, sends it requests as the openai
    # backend does (base_url is the server's), and stops it at the end
    # the job reaches it at 127.0.0.1; --host keeps vLLM off the node's other interfaces
    server_cmd: str = "vllm serve {target} --host 127.0.0.1 --port {port} --tensor-parallel-size {gpus}"
    server_gpus: int = 1  # GPUs the job leases for the server; {gpus} in server_cmd (tensor parallelism)
    server_port: int = 0  # 0: a free port
    server_timeout_s: float = 1800.0  # until the server answers: vLLM loads the weights and compiles first

    def __post_init__(self):
        # `hf` is the word eval.engine uses for the model's own transformers code; regeneration's jobs keep
        # `generate` as they always had it, so a run that wrote either spelling reruns nothing
        if self.engine == "hf":
            self.engine = "generate"


@dataclass
class HiddenConfig:
    shards: int = 2
    max_length: int = 3072
    dtype: str = "bfloat16"  # hidden-state storage: bfloat16 | float32 | float8_e4m3 (per-token scale)
    batch_tokens: int = 16384  # token budget of one forward batch
    disk_margin: float = 0.1  # preflight: free space must exceed the estimated bytes by this fraction
    mode: str = "store"  # store: every epoch's hidden states on disk | stream: a ring of 2 chunks
    disk_budget: int = 0  # bytes of hidden states on disk at once (stream); "2TB" etc. accepted; 0: unset
    chunk_tokens: int = 0  # hidden-state tokens per chunk (stream); 0: from disk_budget

    def __post_init__(self):
        self.disk_budget = parse_bytes(self.disk_budget, "config key hidden.disk_budget")


@dataclass
class DrafterKeys:
    """The drafter section's keys every family reads; DrafterConfig adds each family's own section."""

    family: str = "dflash"  # a key of families.FAMILIES: dflash | dspark
    num_layers: int = 5  # K: draft layers, also the number of target layers fused
    block_size: int = 16
    target_layer_ids: list[int] | None = None  # None: round(1 + i*(N-4)/(K-1))
    mask_token_id: int | None = None  # None: len(tokenizer), the first unused embedding row
    sliding_window: int | None = None  # W >= block_size: a block query sees the W positions up to its own
    init_from: str | None = None  # a drafter export (ours or a released one) that training starts from


def drafter_config_class(families: dict) -> type:
    """The drafter section's dataclass: DrafterKeys and a field per family with keys of its own, named as
    the family and holding its section (families.FamilyInfo.section: drafter.dspark a DSparkConfig)."""
    cls = dataclasses.make_dataclass(
        "DrafterConfig",
        [(name, i.section, field(default_factory=i.section)) for name, i in families.items() if i.section],
        bases=(DrafterKeys,),
    )
    cls.__module__, cls.__doc__ = __name__, "The drafter section: DrafterKeys and each family's own section."
    return cls


DrafterConfig = drafter_config_class(FAMILIES)


@dataclass
class TrainConfig:
    epochs: int = 6
    max_steps: int = 0  # stop after this many optimizer steps (0: run all epochs)
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    max_anchors: int = 512
    # anchors one forward+backward holds, all rows of a micro-batch together (rows x the bucket's anchor
    # slots): a micro-batch with more runs as row slices whose gradients add up to the same step, so the
    # draft positions a GPU holds at once are bounded by construction (memory.py predicts the peak;
    # docs/training.md, "Memory"); 0: no bound (one forward+backward per micro-batch)
    batch_anchors: int = 0
    # dpace: D-PACE's position weights from the drafter's own confidence (beat decay on every seed of the
    # toy ablation, benchmarks/results/recipe_ablation_toy.json) | decay: the paper's exp(-(k-1)/gamma);
    # a key of objectives.OBJECTIVES
    loss: str = "dpace"
    gamma: float | None = None  # loss decay; None: 7 for B=16, 5 for B=10, 4 for B=8
    dpace_alpha: float = 0.5  # D-PACE confidence smoothing, q~ = (1 - alpha) q + alpha, in [0, 1]
    batch_tokens: int = 16384  # token budget of one micro-batch per process
    # tokens of one optimizer step over all processes, a multiple of batch_tokens (micro-batches accumulated);
    # 0: one micro-batch per process (the global batch then grows with the process count)
    global_batch_tokens: int = 0
    buckets: list[int] = field(default_factory=lambda: [1024, 2048, 3072])  # padded lengths
    compile: bool = True
    # what one compiled graph covers: model (the whole drafter) | layer (one decoder layer's graph, traced
    # once and run by every layer, and the context projection: the first step traces a fifth as much)
    compile_scope: str = "model"
    # the LM head's chunked cross-entropy compiled too (its softmax and gradient fused); off until measured
    compile_loss: bool = False
    # tensorwise | rowwise: the drafter's linear layers in float8 (torchao's float8 training, the scales
    # per tensor or per row) on a GPU with FP8 matmuls; the frozen LM head stays in train.dtype. None: off
    fp8: str | None = None
    attention: str = "auto"  # auto (flex on GPU, sdpa on CPU) | flex | sdpa
    parallel: str = "auto"  # auto | ddp | fsdp (auto: fsdp when a full copy per GPU would not fit)
    dtype: str = "bfloat16"  # autocast dtype on GPU; CPU trains in float32
    seed: int = 0
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    log_every: int = 10
    # held-out validation: this many training samples (chosen by train.seed) are kept out of training and
    # evaluated with fixed anchors every val_every steps and at the end; 0: no validation.
    # config/config.yaml sets 0 (docs/performance.md's toy figures are of runs without a split)
    val_samples: int = 64
    val_every: int = 0  # optimizer steps between validations; 0: every checkpoint_every steps
    # the weights exported (and evaluated): last | best (the best validation sim_tau). last: on the toy
    # best never gave a higher evaluation tau than last (benchmarks/results/val_vs_eval_toy.json)
    export: str = "last"

    def loss_gamma(self, block_size: int) -> float:
        if self.gamma is not None:
            return self.gamma
        return {16: 7.0, 10: 5.0, 8: 4.0, 7: 4.0}.get(block_size, max(1.0, block_size / 2.3))


# The train fields the compiled step depends on (compile_cache.cache_key holds them), and what else the
# compile warmup reads: the seed (its drafter's initialization) and the parallel mode (FSDP: nothing to
# compile). The workflow reruns the warmup when one of WARMUP_TRAIN_KEYS changes, not on lr etc. They
# live here, not in compile_cache.py, so the workflow reads them without importing torch.
COMPILED_TRAIN_KEYS = (
    "max_anchors",
    "batch_anchors",
    "batch_tokens",
    "buckets",
    "compile",
    "compile_scope",
    "compile_loss",
    "fp8",
    "attention",
    "dtype",
)
WARMUP_TRAIN_KEYS = (*COMPILED_TRAIN_KEYS, "seed", "parallel")

# Keys added after runs existed, left out of a stage's params (its rerun trigger) while at the value that
# changes nothing: a run made before a key existed has nothing to redo (run_config does the same).
LATER_KEYS = {"train": {"batch_anchors": 0}, "regenerate": {"top_p": 1.0, "top_k": 0}}


def stage_params(section: str, values: dict) -> dict:
    """A config section's `values` as a stage's params: LATER_KEYS at their unset value left out."""
    later = LATER_KEYS.get(section, {})
    return {k: v for k, v in values.items() if k not in later or later[k] != v}


# The train keys stream mode's data plan depends on (flashdraft.stream): a change in one needs a new plan.
PLAN_TRAIN_KEYS = (
    "seed",
    "epochs",
    "max_steps",
    "batch_tokens",
    "global_batch_tokens",
    "buckets",
    "val_samples",
)
EXPORTS = ("last", "best")
FP8_RECIPES = ("tensorwise", "rowwise")
COMPILE_SCOPES = ("model", "layer")


@dataclass
class EvalConfig:
    num_prompts: int = 64
    max_new_tokens: int = 256
    # every prompt is decoded at each: 0 greedy (lossless checked token for token), above 0 sampled (the
    # paper's T=1); the first gives summary.json's headline numbers, each its own under by_temperature
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    temperature: float | None = None  # one temperature only: the same as temperatures: [temperature]
    seed: int = 0  # prompt i samples from seed + i; the untrained baseline's weights come from it too
    shards: int = 0  # jobs the prompts are split into, one GPU each; 0: gpus.target (at least 1)
    engine: str = "auto"  # the target's cache: auto | static (flashdraft.session) | hf (DynamicCache)

    def __post_init__(self):
        # `temperature` is the key of configs written before `temperatures`: one temperature, as they had it
        if self.temperature is not None:
            self.temperatures, self.temperature = [self.temperature], None
        if (
            not self.temperatures
            or len(set(self.temperatures)) != len(self.temperatures)
            or any(t < 0 for t in self.temperatures)
        ):
            raise UserError(
                f"config key eval.temperatures: {self.temperatures}; give one or more distinct "
                "temperatures >= 0, e.g. [0, 1]"
            )


@dataclass
class GpusConfig:
    target: int = 0  # GPUs for target stages; precompute runs one shard job per GPU (0: CPU)
    drafter: int = 0  # GPUs for training, one torchrun process each (0: one CPU process); per node
    drafter_nodes: int = 1  # nodes for training; > 1 starts torchrun on every node through srun (SLURM)
    rdzv_port: int = 29400  # port of the torchrun rendezvous on the first training node (drafter_nodes > 1)
    lock_dir: str | None = None  # one lock file per GPU, shared by the jobs on a node; None: this user's own
    check_visible: bool = True  # refuse to start when more GPUs are asked for than are visible
    memory_gib: float = 0  # GiB of memory of one GPU where the jobs run, for the memory check and the
    # planner (0: the visible GPU's; set it when the jobs run on other nodes)


@dataclass
class Config:
    results: str = "results"  # the run's directory: every output, log, checkpoint and the report
    target: TargetConfig = field(default_factory=TargetConfig)
    toy: ToyConfig = field(default_factory=ToyConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    hidden: HiddenConfig = field(default_factory=HiddenConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    gpus: GpusConfig = field(default_factory=GpusConfig)


def from_dict(cls, data: dict[str, Any] | None, where: str = "config"):
    """Build dataclass `cls` from a dict, recursing into nested dataclasses; unknown keys are errors."""
    data = dict(data or {})
    known = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    kwargs = {}
    for name in sorted(known):
        if name not in data:
            continue
        value, sub = data[name], f"{where}.{name}"
        inner = _dataclass_type(hints[name])
        if inner is not None and isinstance(value, dict):
            value = from_dict(inner, value, sub)
        elif inner is not None and isinstance(value, list):
            value = [from_dict(inner, v, f"{sub}[{i}]") for i, v in enumerate(value)]
        kwargs[name] = value
    return cls(**kwargs)


def _dataclass_type(tp) -> type | None:
    """The dataclass held by a field typed `X` or `list[X]`, else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def init_files(path) -> list[Path]:
    """drafter.init_from's two files (config.json, model.safetensors), or a UserError naming what is
    missing (torch-free: the workflow checks it before any job)."""
    path = Path(path)
    files = [path / "config.json", path / "model.safetensors"]
    if not all(f.is_file() for f in files):
        missing = ", ".join(f.name for f in files if not f.is_file())
        raise UserError(
            f"config key drafter.init_from: {path} is not a drafter export (it needs config.json "
            f"and model.safetensors; missing: {missing})"
        )
    return files


def check_validation(t: TrainConfig, samples: int | None = None, steps: int | None = None) -> None:
    """The validation keys against each other and, where known, the data's `samples` and the run's
    optimizer `steps`: one line naming the key."""
    if t.export not in EXPORTS:
        raise UserError(f"config key train.export: {t.export!r}; use one of {', '.join(EXPORTS)}")
    if t.val_samples < 0 or t.val_every < 0:
        raise UserError("config keys train.val_samples and train.val_every must be >= 0")
    if t.export == "best" and not t.val_samples:
        raise UserError(
            "config key train.export: best needs a validation split; set train.val_samples > 0 "
            "or train.export: last"
        )
    if samples is not None and t.val_samples and t.val_samples >= samples:
        raise UserError(
            f"config key train.val_samples ({t.val_samples}) leaves none of the {samples} "
            f"samples for training; use fewer (a few percent), or 0 for no validation"
        )
    steps = steps if steps is not None else t.max_steps or None
    if steps is not None and t.val_samples and t.val_every > steps:
        raise UserError(
            f"config key train.val_every ({t.val_every}) is larger than the run ({steps} "
            f"optimizer steps): use at most {steps}, or 0 (every train.checkpoint_every steps)"
        )


def train_world(gpus: GpusConfig, drafter: int | None = None) -> int:
    """Training processes: one per GPU (or one on the CPU) on each of gpus.drafter_nodes nodes (`drafter`:
    GPUs per node other than gpus.drafter, the planner's splits)."""
    return max(1, gpus.drafter if drafter is None else drafter) * gpus.drafter_nodes


# The step's arithmetic, torch-free for the config check; flashdraft.batches makes the batches from it.
def micro_per_step(cfg: TrainConfig, world: int) -> int:
    """Micro-batches in one optimizer step, over all ranks: global_batch_tokens // batch_tokens, or one
    per rank when global_batch_tokens is 0 (then the global batch grows with the process count)."""
    if not cfg.global_batch_tokens:
        return world
    g, rem = divmod(cfg.global_batch_tokens, cfg.batch_tokens)
    if rem or g < world:
        raise ValueError(
            f"train.global_batch_tokens ({cfg.global_batch_tokens}) must be a multiple of train.batch_tokens "
            f"({cfg.batch_tokens}) and hold at least one micro-batch per process ({world}): "
            f"use {cfg.batch_tokens * max(world, g or 1)} or lower train.batch_tokens"
        )
    return g


def rows_per_batch(bucket: int, batch_tokens: int) -> int:
    return max(1, batch_tokens // bucket)


FLEX_MULTIPLE = 128  # flex_attention kernels need Q and KV lengths padded to its block size


def num_anchor_slots(seq_len: int, max_anchors: int, block_size: int) -> int:
    """Anchors per sample for a padded length: at most max_anchors and seq_len-1, rounded up so the
    block queries (slots * B) are a multiple of 128, which flex_attention needs. Fixed per length bucket,
    so every step of a bucket has one shape (no recompiles)."""
    a = max(1, min(max_anchors, seq_len - 1))
    step = FLEX_MULTIPLE // math.gcd(FLEX_MULTIPLE, block_size)
    return -(-a // step) * step


def slice_rows(bucket: int, cfg: TrainConfig, block_size: int) -> int:
    """Rows of one forward+backward in `bucket`: the micro-batch's rows, or, under train.batch_anchors, the
    fewest equal slices whose anchor slots stay within it (the last slice padded with empty rows). One
    number per bucket, so every forward of a bucket has one shape."""
    return slice_size(
        rows_per_batch(bucket, cfg.batch_tokens),
        num_anchor_slots(bucket, cfg.max_anchors, block_size),
        cfg.batch_anchors,
    )


def slice_size(rows: int, slots: int, batch_anchors: int) -> int:
    """Rows per slice of a micro-batch of `rows` rows with `slots` anchor slots each under train.batch_anchors
    (0: the whole micro-batch): the fewest slices within the bound, as equal as can be."""
    if not batch_anchors:
        return rows
    slices = -(-rows // max(1, batch_anchors // slots))
    return -(-rows // slices)


# Stream mode keeps this many chunks' hidden states on disk at once: one trains while the next is written.
STREAM_RING = 2


def stream_chunk_tokens(hidden: HiddenConfig, per_token: int) -> int:
    """Hidden-state tokens per chunk in stream mode: hidden.chunk_tokens, else what half of
    hidden.disk_budget holds (two chunks are on disk at once: one trains while the next is written).
    `per_token`: the bytes one token takes in a shard (io.bytes_per_token)."""
    if hidden.chunk_tokens:
        return hidden.chunk_tokens
    if not hidden.disk_budget:
        raise UserError(
            "config key hidden.disk_budget: stream mode needs the bytes of hidden states allowed "
            "on disk at once (e.g. 2TB), or hidden.chunk_tokens"
        )
    tokens = hidden.disk_budget // (STREAM_RING * per_token)
    if tokens < 1:
        raise UserError(
            f"config key hidden.disk_budget: {hidden.disk_budget} bytes do not hold two tokens "
            f"of hidden states ({per_token} bytes each); give at least {STREAM_RING * per_token}"
        )
    return tokens


# Bytes a shard row takes beyond its tokens' (Arrow offsets, the id, record-batch metadata), counted
# generously so that chunks sized from hidden.disk_budget stay within it on disk.
STREAM_ROW_BYTES = 1024


def stream_least(step_bytes: int, per_token: int, kept: int = 0) -> tuple[int, int]:
    """The smallest hidden.chunk_tokens and hidden.disk_budget whose chunks hold an optimizer step of
    `step_bytes` bytes of hidden states (`per_token` bytes a token): the step's tokens (rounded up), and
    STREAM_RING chunks of them plus `kept` bytes that stay on disk beside the ring (the validation shard).
    The one place this is computed: the data plan gives it its largest step, the check before any job and
    the planner the config's bound of one (check_stream)."""
    tokens = -(-step_bytes // per_token)
    return tokens, STREAM_RING * tokens * per_token + kept


def load_section(cls, text: str | None, where: str):
    """Parse a config section's JSON (a stage's `--cfg`, `--drafter-cfg`, `--target-cfg`...) into its
    dataclass."""
    try:
        data = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: the section is not JSON ({e}); pass it as a JSON object") from e
    return from_dict(cls, data, where)


# A path that starts with RUN_DIR/ is inside the run's directory (`results`): the toy's target and sources
# of config/config.yaml, so that `results: runs/NAME` keeps everything of its run there.
RUN_DIR = "{results}"


def in_run_dir(obj, results: str):
    """`obj` (a config dataclass, list or value) with every string starting with RUN_DIR/ made a path under
    `results`, in place; returns it."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, in_run_dir(getattr(obj, f.name), results))
    elif isinstance(obj, list):
        obj[:] = [in_run_dir(x, results) for x in obj]
    elif isinstance(obj, str) and obj.startswith(RUN_DIR + "/"):
        return results.rstrip("/") + obj[len(RUN_DIR) :]
    return obj


def config_from(data: dict | None) -> Config:
    """The run's Config from its YAML's data: the dataclasses' defaults for what it leaves out, RUN_DIR
    paths placed in its `results`."""
    cfg = from_dict(Config, data, "config")
    return in_run_dir(cfg, cfg.results)


def to_json(obj) -> str:
    return json.dumps(dataclasses.asdict(obj), sort_keys=True)


def run_config(cfg: TrainConfig, drafter_cfg: DrafterConfig) -> str:
    """What of the train and drafter sections makes a run: checkpoint.run_key hashes it with the data, and
    stream mode's train_chunk jobs rerun when it changes (run_config_digest), not on the other keys."""
    # DDP and FSDP resume each other; the export's choice is made after training; without validation its
    # keys change nothing (and runs keep the keys they had before those keys existed: so does a dflash run
    # its drafter key, from before drafter.family)
    skip = {"parallel", "export"} | ({"val_samples", "val_every"} if not cfg.val_samples else set())
    same_run = stage_params("train", {k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip})
    # a family's own section (drafter.<family>) counts in its runs only, so that adding a family changes no
    # run's key; a DFlash run keeps the key it had before drafter families existed (no `family` either)
    drafter = {
        k: v
        for k, v in dataclasses.asdict(drafter_cfg).items()
        if k not in FAMILIES or k == drafter_cfg.family
    }
    if drafter_cfg.family == "dflash":
        drafter.pop("family")
    return json.dumps(same_run, sort_keys=True) + json.dumps(drafter, sort_keys=True)


def run_config_digest(cfg: TrainConfig, drafter_cfg: DrafterConfig) -> str:
    """A short digest of run_config (for the workflow, which does not import torch)."""
    return hashlib.sha256(run_config(cfg, drafter_cfg).encode()).hexdigest()[:12]


def needs_last_hidden(drafter: DrafterConfig) -> bool:
    """Whether drafter.family trains on the target's last hidden state, which its hidden shards then hold
    per token beside the K layers' features (the `last_hidden` column; families.FamilyInfo.last_hidden):
    a family that has one, where a term reading it has a weight (FamilyInfo.teacher_weights)."""
    return family_info(drafter.family).needs_last_hidden(drafter)


def feature_layers(num_target_layers: int, drafter: DrafterConfig) -> list[int]:
    """0-indexed decoder layers whose outputs feed the drafter: drafter.target_layer_ids or the formula."""
    n = num_target_layers
    ids = drafter.target_layer_ids or target_layer_ids(n, drafter.num_layers)
    bad = layers_out_of_range(ids, n)
    if bad and not drafter.target_layer_ids:
        raise UserError(
            f"config key drafter.target_layer_ids: the default ids round(1 + i*(N-4)/(K-1)) are {ids} for a "
            f"target with {n} layers and {drafter.num_layers} drafter layers, {bad} out of range; set "
            f"drafter.target_layer_ids to {drafter.num_layers} ids in 0..{n - 1}"
        )
    if bad:
        raise UserError(
            f"config key drafter.target_layer_ids: {bad} out of range for a target with {n} layers; "
            f"use ids in 0..{n - 1}"
        )
    return list(ids)


def target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash feature layers: round(1 + i*(N-4)/(K-1)), 0-indexed decoder layers. Python's round (half
    to even), as the reference `dflash.model.build_target_layer_ids`: serving engines that derive the ids
    themselves get the same ones."""
    n, k = num_target_layers, num_draft_layers
    if k == 1:
        return [n // 2]
    return [round(1 + i * (n - 4) / (k - 1)) for i in range(k)]


def layers_out_of_range(layer_ids, num_target_layers: int) -> list[int]:
    """The layer ids a target of `num_target_layers` decoder layers does not have (0-indexed)."""
    return [i for i in layer_ids if not 0 <= i < num_target_layers]
