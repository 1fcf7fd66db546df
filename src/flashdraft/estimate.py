"""The planner's cost model: the per-GPU rates measured by the committed benchmarks (RATES), the target's
and drafter's parameters and the bytes of a hidden-state token from the shapes, each store-mode stage's
work, rate, GPUs and hours (`stage_table`), both hidden-state modes on a split of the GPUs (`store_mode`,
`stream_mode` with its chunks and pipeline) and the recommended mode and split under a disk budget
(`recommend`). Its cost does not grow with the GPU count or the token count: the recommendation tries a
bounded number of splits, and stream mode's chunks are counted in runs of equal chunks, never listed one by
one. Of the disk it reads only the committed benchmark results its rates come from
(flashdraft.results); a `Run` holds the rest of what the estimate reads (estimate_inputs)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from .config import Config, feature_layers, needs_last_hidden, stream_chunk_tokens, train_world
from .config_check import check_stream
from .errors import UserError
from .estimate_inputs import Tokens
from .families import FAMILIES, family_info
from .hf_config import attention_shape
from .io import FP8, bytes_per_token, human_bytes
from .results import figure


@dataclass(frozen=True)
class Rate:
    file: str  # under benchmarks/results/
    key: str  # dotted path of the value in that JSON
    unit: str
    scaled: bool = True  # a per-GPU throughput, scaled by the target's size (else used as measured)

    @property
    def value(self) -> float:
        return float(figure(self.file, self.key))


# Per-GPU rates measured on one H200 (where noted, an H100) with a Qwen3-8B-shaped target, read from the
# benchmarks' committed results: a rerun benchmark's file is the planner's new rate.
MEASURED = {
    # at the benchmark's answer length (its `setup`), longer on average than production's assumed answers
    "regenerate": Rate("regenerate_1024_qwen3-8b.json", "tokens_per_s_per_gpu", "new tokens/s"),
    "precompute_bfloat16": Rate("precompute_hidden_gpu_qwen3-8b.json", "bfloat16.tokens_per_s", "tokens/s"),
    "precompute_float8_e4m3": Rate(
        "precompute_hidden_gpu_qwen3-8b.json", "float8_e4m3.tokens_per_s", "tokens/s"
    ),
    "train_1gpu": Rate("train_drafter_qwen3-8b.json", "throughput.1.tokens_per_s_per_gpu", "tokens/s"),
    # with 2 or more processes (DDP): the per-GPU rate of the 2-GPU run, assumed to hold at any count
    "train_per_gpu": Rate(
        "train_drafter_qwen3-8b_2gpu.json", "throughput.2.tokens_per_s_per_gpu", "tokens/s"
    ),
    # train.fp8 (tensorwise, with train.compile_loss) against bf16 in the same one-GPU run: the factor on
    # the training rates above, assumed to hold on any GPU count (train.compile_scope: layer, as
    # config/fp8.yaml sets it, runs faster again: not counted); a float8 job's start, measured with
    # layer scope and the compiled loss (production.yaml's keys) beside bf16's
    "train_fp8_speedup": Rate(
        "train_drafter_qwen3-8b_fp8.json", "comparison.speedup_vs_baseline", "x", scaled=False
    ),
    "train_launch_fp8": Rate(
        "train_drafter_qwen3-8b_fp8_vs_bf16_layer.json",
        "first_step.warm.launch_to_first_step_s",
        "s",
        scaled=False,
    ),
    "train_launch_resumed_fp8": Rate(
        "train_drafter_qwen3-8b_fp8_vs_bf16_layer.json",
        "first_step.resumed.launch_to_first_step_s",
        "s",
        scaled=False,
    ),
    "eval_target_only": Rate("eval_decode_qwen3-8b.json", "modes.target_only.tokens_per_s", "new tokens/s"),
    # each speculative decoder (dflash, dflash_untrained, ngram), as measured at tau 1 (random weights)
    "eval_speculative": Rate("eval_decode_qwen3-8b.json", "modes.dflash.tokens_per_s", "new tokens/s"),
    # a training job's start-up, warm compile cache, production drafter shape, one process: imports, data
    # open, cache load, drafter built, first step (stream mode pays it once per chunk; several processes
    # start through torchrun, which adds its own start). A resumed job (every chunk after a run's first)
    # also reads and loads the previous chunk's checkpoint, in part while it starts: measured as a whole.
    "train_launch": Rate(
        "train_drafter_qwen3-8b.json", "first_step.warm.launch_to_first_step_s", "s", scaled=False
    ),
    "train_launch_resumed": Rate(
        "train_drafter_qwen3-8b.json", "first_step.resumed.launch_to_first_step_s", "s", scaled=False
    ),
    # checkpoints (flashdraft.checkpoint): a save holds training up for its copy into the host buffers, then
    # writes in the background; a job's last save is waited for
    "checkpoint_stage": Rate("checkpoint_io_qwen3-8b.json", "stage_gb_per_s", "GB/s", scaled=False),
    "checkpoint_write": Rate("checkpoint_io_qwen3-8b.json", "write_gb_per_s", "GB/s", scaled=False),
    "checkpoint_read": Rate("checkpoint_io_qwen3-8b.json", "read_gb_per_s", "GB/s", scaled=False),
}


class RateTable(Mapping):
    """The planner's rates: MEASURED, and each drafter family's factors on the training and evaluation
    rates, measured against dflash (families.FamilyInfo.rates: the files, and which runs of the family pay
    them), read from the registry at each look-up."""

    def _rates(self) -> dict[str, Rate]:
        factors = {r.name: Rate(r.file, r.key, "x", scaled=False) for i in FAMILIES.values() for r in i.rates}
        return {**MEASURED, **factors}

    def __getitem__(self, key: str) -> Rate:
        return self._rates()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rates())

    def __len__(self) -> int:
        return len(self._rates())


RATES = RateTable()

# The target those benchmarks ran (`shapes.target` of eval_decode_qwen3-8b.json): rates scale from it.
REFERENCE_TARGET = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
}
EVAL_DECODERS = 3  # speculative decoders per prompt, beside target-only (evaluate.run_rows)
FAMILY_DECODERS = 2  # of them, the drafter family's (trained and untrained); the third is n-gram lookup
CHECKPOINT_BYTES_PER_PARAMETER = 12  # fp32 weights + AdamW's two fp32 moments (checkpoint.save_checkpoint)
MAX_GPUS = 100_000  # the most GPUs the planner plans for (--gpus, else gpus.target): plan.main refuses more
EXHAUSTIVE_GPUS = 256  # up to this many GPUs the recommendation tries every split; past it, `refined_split`
SPLIT_GRID = 24  # splits one level of `refined_split` tries in each window
SPLIT_KEEP = 8  # the best splits of one level whose neighbourhoods the next level refines
EXACT_CHUNKS = 4096  # up to this many chunks, stream mode's pipeline is run chunk by chunk; past it, in runs
MAX_CHUNKS = 10**15  # the most stream-mode chunks the planner counts (a run's, over every epoch)


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
        return train_world(self.cfg.gpus, split.drafter)

    def train_key(self, split: Split) -> str:
        return "train_1gpu" if self.world(split) == 1 else "train_per_gpu"

    def train_keys(self, split: Split) -> list[str]:
        """The rates training is planned with: the per-GPU rate, and the measured factors of train.fp8 and
        of the drafter family (family_rates)."""
        return (
            [self.train_key(split)]
            + (["train_fp8_speedup"] if self.cfg.train.fp8 else [])
            + self.family_rates("train")
        )

    def family_rates(self, stage: str) -> list[str]:
        """The measured factors against dflash that drafter.family pays at `stage` (train, eval):
        families.FamilyInfo.rates, none for dflash."""
        d = self.cfg.drafter
        return family_info(d.family).rate_keys(d, stage)

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

    def eval_keys(self) -> list[str]:
        """The rates evaluation is planned with: target-only, the speculative decoders, and the measured
        factors of the drafter family (family_rates)."""
        return ["eval_target_only", "eval_speculative"] + self.family_rates("eval")

    def eval_prompt_s(self) -> float:
        """One evaluation prompt on one GPU: target-only and every speculative decoder, at each of
        eval.temperatures (each at the measured rates, which are greedy decoding's)."""
        target_only, spec, *factor = (rate(k, self.scale) for k in self.eval_keys())
        family = spec * math.prod(factor)  # the family's decoders; n-gram lookup at the plain rate
        per_token = 1 / target_only + FAMILY_DECODERS / family + (EVAL_DECODERS - FAMILY_DECODERS) / spec
        return len(self.cfg.eval.temperatures) * self.cfg.eval.max_new_tokens * per_token

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
        stages[name] = {
            "work": work,
            "unit": unit,
            "rates": {k: rate(k, scale) for k in rate_keys},
            "sources": [f"{RATES[k].file}: {RATES[k].key}" for k in rate_keys],
            "gpus": gpus_used,
            "hours": hours,
        }

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
    stage(
        "checkpoints",
        (saves + 1) * run.checkpoint_bytes(),
        "bytes",
        ["checkpoint_stage", "checkpoint_write"],
        hours,
        split.drafter * cfg.gpus.drafter_nodes,
    )

    e = cfg.eval
    jobs = e.shards or max(1, split.target)
    work = tok.eval_prompts * len(e.temperatures) * e.max_new_tokens * (1 + EVAL_DECODERS)
    hours = _waves_hours(tok.eval_prompts * run.eval_prompt_s(), jobs, g, 1.0) if g else None
    stage("evaluation", work, "new tokens", run.eval_keys(), hours, min(g, jobs))
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
    return ModePlan(
        "store", split, hours, gpus, _wall(list(hours.values())), peak, run.gpu_hours(split, run.tok.total)
    )


class ChunkSizes(Sequence):
    """Every chunk's hidden-state tokens, in order, held as runs: `segments`, each a pattern of (tokens,
    chunks) runs repeated some times. Its length, sum and largest come in closed form; the chunks one by one
    only when iterated or indexed."""

    def __init__(self, segments=()):
        self.segments = tuple(
            (tuple((int(size), int(n)) for size, n in pattern if n > 0), int(times))
            for pattern, times in segments
        )
        self.segments = tuple((p, t) for p, t in self.segments if p and t > 0)

    @property
    def length(self) -> int:
        return sum(times * sum(n for _, n in pattern) for pattern, times in self.segments)

    @property
    def total(self) -> int:
        """Tokens over every chunk: sum(self)."""
        return sum(times * sum(size * n for size, n in pattern) for pattern, times in self.segments)

    @property
    def largest(self) -> int:
        """max(self, default=0)."""
        return max((size for pattern, _ in self.segments for size, _ in pattern), default=0)

    def without_first(self) -> tuple[int, ChunkSizes]:
        """The first chunk's tokens and the chunks after it (an empty sequence has no first: IndexError)."""
        if not self.segments:
            raise IndexError("no chunks")
        (pattern, times), *rest = self.segments
        (first, n), *others = pattern
        return first, ChunkSizes([(((first, n - 1), *others), 1), (pattern, times - 1), *rest])

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        for pattern, times in self.segments:
            for _ in range(times):
                for size, n in pattern:
                    for _ in range(n):
                        yield size

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self.length)))
        i = index + self.length if index < 0 else index
        if not 0 <= i < self.length:
            raise IndexError("chunk index out of range")
        for pattern, times in self.segments:
            per = sum(n for _, n in pattern)
            if i >= per * times:
                i -= per * times
                continue
            i %= per
            for size, n in pattern:
                if i < n:
                    return size
                i -= n
        raise AssertionError("unreachable")

    def __eq__(self, other) -> bool:
        if isinstance(other, ChunkSizes) and other.segments == self.segments:
            return True
        if not isinstance(other, Sequence) or isinstance(other, str) or len(other) != self.length:
            return False
        return all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash((self.length, self.total, self.largest))  # equal sequences, however held, hash alike

    def __repr__(self) -> str:
        return f"ChunkSizes({list(self.segments)!r})"


@dataclass(frozen=True)
class Chunks:
    """Stream mode's chunks: every epoch cut into whole optimizer steps of at most `cap` tokens."""

    cap: int  # hidden-state tokens a chunk may hold
    source: str  # where the cap comes from
    step_tokens: int
    per_epoch: int
    sizes: ChunkSizes  # hidden-state tokens of every chunk of the run, in order
    precompute_s: float  # the first (a full) chunk's, on gpus.target GPUs
    train_s: float  # its training on gpus.drafter GPUs
    startup_s: float  # its job's launch to first step, checkpoint load and save


def chunk_sizes(run: Run, split: Split, budget: int) -> tuple[int, str, ChunkSizes]:
    """The chunk cap, where it comes from, and every chunk's tokens: each epoch's hidden-state tokens in
    whole optimizer steps (counted at their full budget, so a chunk holds at least this many steps), the
    training tokens' epochs over them, the last one cut where training stops (train.max_steps). Counted, not
    listed: a UserError past MAX_CHUNKS chunks."""
    h = run.cfg.hidden
    hidden = h if h.chunk_tokens else replace(h, disk_budget=budget)
    per_token = run.token_bytes
    cap = stream_chunk_tokens(hidden, per_token)
    step = run.step_tokens(split)
    check_stream(hidden, run.cfg.train, step // run.cfg.train.batch_tokens, per_token)  # the workflow's check
    source = (
        f"hidden.chunk_tokens {cap:,}"
        if h.chunk_tokens
        else f"hidden.disk_budget {human_bytes(budget)} / 2 chunks / {per_token:,} bytes per token"
    )
    full = max(cap // step, 1) * step  # the check's bound of a step may fall below its token budget
    total, train = run.tok.total, int(run.train_tokens(split))
    whole, rem = divmod(total, full)
    epoch = ((full, whole), (rem, 1 if rem else 0))  # an epoch: its whole chunks, then what is left of it
    epochs, left = divmod(train, total) if total > 0 and train > 0 else (0, 0)
    cut = min(left // full, whole)  # the last, cut epoch: its whole chunks, then the tokens left
    last = ((full, cut), (left - cut * full, 1 if left > cut * full else 0))
    sizes = ChunkSizes([(epoch, epochs), (last, 1)])
    if sizes.length > MAX_CHUNKS:
        key = "hidden.chunk_tokens" if h.chunk_tokens else "hidden.disk_budget"
        raise UserError(
            f"config key {key}: chunks of {full:,} tokens ({source}) cut the run's {train:,} "
            f"training tokens into {sizes.length:,} chunks, past the planner's limit of "
            f"{MAX_CHUNKS:,}; give larger chunks or fewer tokens (prompts.total, train.epochs, "
            "train.max_steps)"
        )
    return cap, source, sizes


def pipeline_seconds(precompute: list[float], train: list[float]) -> float:
    """Chunk c's shard jobs start once chunk c-1's are written and chunk c-2 has trained (two chunks on
    disk at once); its training once its shards are written and chunk c-1 has trained."""
    pre_end, train_end = [], []
    for c, (p, t) in enumerate(zip(precompute, train, strict=True)):
        start = max(pre_end[c - 1] if c else 0.0, train_end[c - 2] if c >= 2 else 0.0)
        pre_end.append(start + p)
        train_end.append(max(pre_end[c], train_end[c - 1] if c else 0.0) + t)
    return train_end[-1] if train_end else 0.0


_NONE = -math.inf  # max-plus zero
_Matrix = tuple[tuple[float, float, float], ...]
_IDENTITY: _Matrix = ((0.0, _NONE, _NONE), (_NONE, 0.0, _NONE), (_NONE, _NONE, 0.0))


def _times(a: _Matrix, b: _Matrix) -> _Matrix:
    """Max-plus product: b's steps, then a's."""
    return tuple(tuple(max(a[i][k] + b[k][j] for k in range(3)) for j in range(3)) for i in range(3))


def _power(a: _Matrix, n: int) -> _Matrix:
    out = _IDENTITY
    while n:
        if n & 1:
            out = _times(out, a)
        a, n = _times(a, a), n >> 1
    return out


def _chunk_step(p: float, t: float) -> _Matrix:
    """pipeline_seconds' recurrence for one chunk of precompute p and training t, in max-plus algebra, on
    the state (the previous chunk's precompute end, its training end, the training end before it)."""
    return ((p, _NONE, p), (p + t, t, p + t), (_NONE, 0.0, _NONE))


def pipeline_seconds_runs(segments) -> float:
    """pipeline_seconds over runs of equal chunks without listing them: `segments`, each a pattern of
    (precompute, training, chunks) runs repeated some times; each run a matrix power (log of its chunks)."""
    state = _IDENTITY
    for pattern, times in segments:
        once = _IDENTITY
        for p, t, n in pattern:
            once = _times(_power(_chunk_step(p, t), n), once)
        state = _times(_power(once, times), state)
    if state == _IDENTITY:
        return 0.0
    return max(state[1])  # the last chunk's training end, every time starting at 0


def stream_mode(run: Run, split: Split, budget: int) -> ModePlan:
    """Regeneration, then the chunk pipeline, then evaluation; a UserError when a chunk cannot hold one
    optimizer step. Up to EXACT_CHUNKS chunks the pipeline runs chunk by chunk; past it, in closed form over
    runs of equal chunks (pipeline_seconds_runs), the same figures to rounding."""
    cfg = run.cfg
    table = stage_table(run, split)
    cap, source, sizes = chunk_sizes(run, split, budget)
    on_gpus = split.target > 0 and split.drafter > 0 and run.gpus > 0
    pre_rate = rate(run.precompute_key(), run.scale) * max(1, split.target)
    train_rate = run.train_rate(split) * run.world(split)
    step, every = run.step_tokens(split), cfg.train.checkpoint_every

    def startup_s(n: int, resumed: bool) -> float:  # the launch, the last save and the saves within the chunk
        return run.launch_s(resumed=resumed) + run.last_save_s() + run.save_s() * (n / step / every)

    count = sizes.length
    if count <= EXACT_CHUNKS:
        pre = [n / pre_rate for n in sizes]
        train = [n / train_rate for n in sizes]
        startup = [startup_s(n, c > 0) for c, n in enumerate(sizes)]
        chunk_train = [t + s for t, s in zip(train, startup, strict=True)]
        pipeline_s = pipeline_seconds(pre, chunk_train)
        busy_s = {"precompute": sum(pre), "training": sum(train), "start-up and checkpoints": sum(startup)}
    else:
        first, rest = sizes.without_first()
        runs = [(((first / pre_rate, first / train_rate + startup_s(first, False), 1),), 1)]
        runs += [
            (tuple((n / pre_rate, n / train_rate + startup_s(n, True), k) for n, k in pattern), times)
            for pattern, times in rest.segments
        ]
        pipeline_s = pipeline_seconds_runs(runs)
        total = sizes.total
        startup_total = (
            run.launch_s(resumed=False)
            + (count - 1) * run.launch_s(resumed=True)
            + count * run.last_save_s()
            + run.save_s() * (total / step / every)
        )
        busy_s = {
            "precompute": total / pre_rate,
            "training": total / train_rate,
            "start-up and checkpoints": startup_total,
        }
    first = sizes[0] if count else 0
    pipeline = pipeline_s / 3600 if on_gpus else None
    busy = {k: v / 3600 if on_gpus else None for k, v in busy_s.items()}
    hours = {
        "regeneration": table["regeneration"]["hours"],
        **busy,
        "pipeline": pipeline,
        "evaluation": table["evaluation"]["hours"],
    }
    gpus = {
        "regeneration": table["regeneration"]["gpus"],
        "precompute": max(1, split.target),
        "training": run.world(split),
        "start-up and checkpoints": run.world(split),
        "pipeline": max(1, split.target) + run.world(split),
        "evaluation": table["evaluation"]["gpus"],
    }
    chunks = Chunks(
        cap,
        source,
        step,
        count and math.ceil(count / cfg.train.epochs),
        sizes,
        first / pre_rate,
        first / train_rate,
        startup_s(first, False) if count else 0.0,
    )
    peak = 2 * sizes.largest * run.token_bytes
    wall = _wall([hours["regeneration"], pipeline, hours["evaluation"]])
    return ModePlan("stream", split, hours, gpus, wall, peak, run.gpu_hours(split, sizes.total), chunks)


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


def refined_split(lo: int, hi: int, cost) -> int:
    """The target GPUs of least `cost` from lo to hi, for a cost that mostly falls then rises with them
    (precompute speeds up, training slows down; the chunks' count may wiggle it): SPLIT_GRID points evenly
    spaced over the range, then SPLIT_GRID again over each of the SPLIT_KEEP best points' neighbourhoods (a
    spacing either side), and so on down to a spacing of one. The spacing falls by SPLIT_GRID / 2 a level:
    log(hi - lo) levels of at most SPLIT_KEEP x SPLIT_GRID points. Ties go to the fewest target GPUs, as in
    trying every split."""
    step = max(1, -(-(hi - lo) // (SPLIT_GRID - 1)))
    windows = {(lo, hi)}
    while True:
        points = sorted({min(a + k * step, b) for a, b in windows for k in range(-(-(b - a) // step) + 1)})
        ranked = sorted(points, key=lambda t: (cost(t), t))
        if step == 1:
            return ranked[0]
        windows = {(max(lo, t - step), min(hi, t + step)) for t in ranked[:SPLIT_KEEP]}
        step = max(1, -(-2 * step // (SPLIT_GRID - 1)))


def recommend(run: Run, budget: int, budget_source: str, targets=None) -> Recommendation:
    """Both modes on splits of the `run.gpus` GPUs; the shortest wall time whose hidden states fit `budget`.
    Store mode runs its stages one after another, so each may take all N GPUs; stream mode runs precompute
    and training at once, on gpus.target + gpus.drafter = N: every such split up to EXHAUSTIVE_GPUS GPUs (or
    those of `targets`' gpus.target), past it the splits `refined_split` tries on its way to the best."""
    n = run.gpus
    plans: dict[int, ModePlan | str] = {}  # gpus.target -> the stream plan, or why it cannot run

    def wall(t: int) -> float:  # stream mode's wall hours on t + (n - t); inf where it cannot run or fit
        if t not in plans:
            try:
                plans[t] = stream_mode(run, Split(t, n - t), budget)
            except UserError as e:
                plans[t] = str(e)
        m = plans[t]
        fits = isinstance(m, ModePlan) and m.wall_hours is not None and m.peak_disk <= budget
        return m.wall_hours if fits else math.inf

    if targets is None and n > EXHAUSTIVE_GPUS:
        refined_split(1, n - 1, wall)
    else:
        for t in range(1, n) if targets is None else targets:
            wall(t)
    candidates = [store_mode(run, Split(n, n))]
    candidates += [plans[t] for t in sorted(plans) if isinstance(plans[t], ModePlan)]
    refused = {f"stream {t}+{n - t}": plans[t] for t in sorted(plans) if isinstance(plans[t], str)}
    fits = [c for c in candidates if c.wall_hours is not None and c.peak_disk <= budget]
    best = min(fits, key=lambda c: c.wall_hours, default=None)
    if best is None and n and all(c.wall_hours is not None for c in candidates):
        stream = next(iter(refused.values()), "").removeprefix("config key hidden.disk_budget: ")
        raise UserError(
            f"config key hidden.disk_budget: {human_bytes(budget)} ({budget_source}) fits no "
            f"plan on {n} GPUs: store mode keeps {human_bytes(candidates[0].peak_disk)} of "
            f"hidden states" + (f"; in stream mode {stream}" if stream else "")
        )
    return Recommendation(n, budget, budget_source, candidates, refused, best)
