"""What a training job trains on: the data seam between the hidden states on disk and the loop.

A `TrainData` (a protocol every mode implements whole) says which samples the run numbers and their
lengths, the samples this job reads (its `store`) and the validation subset, what the run key depends on,
where the job starts and stops within the run, when the run has passed its end, what a finished job prunes,
and what it exports. The loop in train.py asks these questions and never which mode it runs in:

- `StoreData` (hidden.mode: store): every sample of the hidden shards, from the run's latest checkpoint to
  its end, then the export; the validation split (train.val_samples) comes out of the shards' samples.
- `ChunkData` (hidden.mode: stream, a train_chunk job): one chunk of the data plan, from the checkpoint
  where the previous chunk ended to the chunk's end; a chunk whose end the run has passed is trained.
- `PlanData` (hidden.mode: stream, the train job): the run every chunk trained, nothing left to train:
  the job exports the run's last checkpoint.

`TrainResult` is what a training job returns, whatever its mode. `Plan` is stream mode's data plan as
training reads it (stream.py writes it: the data_plan job).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Protocol, TypeVar

from .batches import micro_per_step
from .checkpoint import checkpoint_dirs, checkpoint_step, run_key
from .config import PLAN_TRAIN_KEYS, DrafterConfig, TrainConfig, needs_last_hidden
from .errors import UserError
from .hidden import HiddenStore, StoreView, require_last_hidden
from .holdout import split_record, val_split

FORMAT = "flashdraft.plan/1"
T = TypeVar("T")


class TrainData(Protocol):
    """What a training job trains on, asked the same questions in every mode."""

    shards: list[str]  # the run key's hidden shards (none in stream mode: the plan's fingerprint stands)
    protect: frozenset[int]  # checkpoint steps the job never prunes

    @property
    def name(self) -> str:
        """What the job trains, for its log lines."""

    @property
    def fingerprint(self) -> str | None:
        """The run key's data (None: the shards' manifests)."""

    @property
    def tokenizer_length(self) -> int | None:
        """len(tokenizer) of the target (None: the job loads the tokenizer)."""

    @property
    def store(self):
        """The samples this job trains on, by the run's sample numbers."""

    @property
    def val_store(self):
        """The validation samples (None: no validation)."""

    @property
    def lengths(self) -> list[int]:
        """The run's samples' lengths, by their numbers."""

    def check(self, cfg: TrainConfig, world: int) -> None:
        """One line when the data was made for another training than this one."""

    def trained(self, run_dir: Path) -> Path | None:
        """The checkpoint at or past the job's end, when the run has passed it (nothing to train)."""

    def begin(self, run_dir: Path) -> None:
        """(Main rank, before the latest checkpoint is read.) A checkpoint to start from exists."""

    def stop(self, total: int) -> int:
        """The step the job stops at, of a run of `total` steps."""

    def where(self) -> str:
        """Where in the run the job trains, for the log (a clause after a comma, or nothing)."""

    def finish(self, run_dir: Path, keep: int) -> None:
        """(Main rank, once the job's steps are trained.) Prunes what the job no longer needs."""

    def export(self, write: Callable[[], T]) -> T | None:
        """The trained run's export: `write`'s result, or None where the job exports nothing."""

    def summary(self) -> dict:
        """What the job's result says of its data (TrainResult's fields)."""

    def val_split(self) -> dict | None:
        """The validation split, for a user to inspect (val_split.json)."""


@dataclass
class TrainResult:
    """What a training job returns, whatever its mode. `to_json` is the JSON line it prints: a chunk's
    summary (train_chunk's --done file), else the last logged row and the compile caches' counters."""

    step: int  # the run's step the job ended at
    run_dir: str
    rows: list[dict]  # the logged rows (none for a chunk trained already)
    stopped: bool = False  # by a signal or --stop-at, with a checkpoint: not finished
    signal: int = 0  # the signal that stopped it (0: --stop-at or not stopped)
    compile_cache: dict = field(default_factory=dict)
    peak_gpu_bytes: int | None = None
    chunk: dict | None = None  # the stream chunk it trained
    first_step_done_s: float | None = None  # the process's age when its first step ended
    first_step_done_at: float | None = None  # and the time
    seconds: float | None = None  # the process's age at the end
    trained_already: str | None = None  # the checkpoint past the job's end it found, having trained nothing

    def to_json(self) -> dict:
        if self.chunk is not None:
            keys = (
                "chunk",
                "step",
                "first_step_done_s",
                "first_step_done_at",
                "seconds",
                "compile_cache",
                "trained_already",
            )
            return {k: getattr(self, k) for k in keys}
        return {**(self.rows[-1] if self.rows else {}), "compile_cache": self.compile_cache}


def split_store(store, cfg: TrainConfig):
    """Store mode: (the training samples, the validation samples or None) of the shards' store."""
    if not cfg.val_samples:
        return store, None
    ids = store.ids()
    val = set(val_split(ids, cfg.val_samples, cfg.seed))
    train = [i for i, sid in enumerate(ids) if sid not in val]
    return StoreView(store, train), StoreView(store, [i for i, sid in enumerate(ids) if sid in val])


def check_stores(data, spec, drafter_cfg: DrafterConfig) -> None:
    """The job's shards hold what the drafter reads: the target's layers it was built for and, where the
    family's loss reads it, the target's last hidden state."""
    stores = [s for s in (data.store, data.val_store) if s is not None]
    if needs_last_hidden(drafter_cfg):
        for s in stores:
            require_last_hidden(s, drafter_cfg.family)
    for s in stores[:1]:
        if (s.layer_ids, s.hidden_size) != (spec.target_layer_ids, spec.hidden_size):
            raise ValueError(
                f"hidden shards hold layers {s.layer_ids} (H={s.hidden_size}) but the drafter wants "
                f"{spec.target_layer_ids} (H={spec.hidden_size}); recompute the hidden states"
            )


class StoreData:
    """Store mode: the hidden shards' samples; the job trains from the run's latest checkpoint to its end
    and exports."""

    name = "the run"
    fingerprint = None  # the run key reads the shards' manifests
    tokenizer_length = None  # the training job loads the tokenizer
    protect: frozenset[int] = frozenset()

    def __init__(self, shards: list[str], cfg: TrainConfig):
        self.shards, self.cfg = [str(s) for s in shards], cfg

    @cached_property
    def _split(self):
        return split_store(HiddenStore(self.shards), self.cfg)

    @property
    def store(self):
        return self._split[0]

    @property
    def val_store(self):
        return self._split[1]

    @cached_property
    def lengths(self) -> list[int]:
        return [self.store.num_tokens(i) for i in range(len(self.store))]

    def check(self, cfg: TrainConfig, world: int) -> None:
        pass

    def trained(self, run_dir: Path) -> Path | None:
        return None  # a finished run's rerun resumes at its end and exports again

    def begin(self, run_dir: Path) -> None:
        pass

    def stop(self, total: int) -> int:
        return total

    def where(self) -> str:
        return ""

    def finish(self, run_dir: Path, keep: int) -> None:
        pass

    def export(self, write: Callable[[], T]) -> T | None:
        return write()

    def summary(self) -> dict:
        return {}

    def val_split(self) -> dict | None:
        """The validation split, for a user to inspect (val_split.json)."""
        return None if self.val_store is None else split_record(self.val_store.ids(), self.cfg.seed)


class _Planned:
    """Stream mode's data: what the plan says of the run (its key's data, the tokenizer, the training it was
    made for)."""

    plan: Plan

    @property
    def fingerprint(self) -> str:
        return self.plan.fingerprint

    @property
    def tokenizer_length(self) -> int | None:
        return self.plan.tokenizer_length

    def check(self, cfg: TrainConfig, world: int) -> None:
        self.plan.check(cfg, world)


class ChunkData(_Planned):
    """Stream mode, one chunk of the plan: its shards hold the chunk's samples; the job trains the chunk's
    steps from the checkpoint where the previous chunk ended (or an attempt of this one stopped), keeps
    the chunk's end and no checkpoint inside it, and exports nothing."""

    def __init__(self, plan: Plan, chunk: Chunk, shards: list[str], val_shards, cfg: TrainConfig):
        self.plan, self.chunk, self.shards, self.val_shards, self.cfg = plan, chunk, shards, val_shards, cfg
        self.protect = frozenset(c.end_step for c in plan.chunks)  # where later chunks start

    @property
    def name(self) -> str:
        return self.chunk.name

    @property
    def steps(self) -> tuple[int, int]:
        """The run's steps [start, end) the chunk trains."""
        return self.chunk.start_step, self.chunk.end_step

    @cached_property
    def store(self):
        return planned_store(self.plan, self.chunk, self.shards)

    @cached_property
    def val_store(self):
        return self.plan.val_store(self.val_shards) if self.cfg.val_samples else None

    @property
    def lengths(self) -> list[int]:
        return self.plan.lengths

    def trained(self, run_dir: Path) -> Path | None:
        """The first checkpoint at or past the chunk's end: the chunk is trained (chunk_trained)."""
        return chunk_trained(run_dir, self.chunk.end_step)

    def begin(self, run_dir: Path) -> None:
        """(Main rank, before the latest checkpoint is read.) A checkpoint to start from exists."""
        chunk_resume_point(run_dir, self.chunk.start_step, self.chunk.end_step, self.plan.chunks)

    def stop(self, total: int) -> int:
        return min(total, self.chunk.end_step)

    def where(self) -> str:
        return f", {self.name} (steps {self.steps[0]}..{self.steps[1]})"

    def finish(self, run_dir: Path, keep: int) -> None:
        """(Main rank, once the chunk has trained.) Its end stays, the checkpoints inside it go."""
        prune_chunk(run_dir, self.chunk.start_step, self.chunk.end_step, keep)

    def export(self, write: Callable[[], T]) -> T | None:
        return None  # the train job exports the run every chunk trained (PlanData)

    def summary(self) -> dict:
        """What the job's summary (train_chunk's JSON) says of its data."""
        return {"chunk": asdict(self.chunk)}

    def val_split(self) -> dict | None:
        return None


class PlanData(_Planned):
    """Stream mode's train job: the run that every chunk of the plan trained, nothing left to train: the
    job exports its last checkpoint, reading no samples and building no optimizer or step."""

    name = "the run"
    protect: frozenset[int] = frozenset()
    store = val_store = None  # no sample is read

    @property
    def lengths(self) -> list[int]:
        return []

    def __init__(self, plan: Plan, cfg: TrainConfig):
        self.plan, self.cfg, self.shards = plan, cfg, []

    @property
    def total(self) -> int:
        return self.plan.meta["total_steps"]

    def trained(self, run_dir: Path) -> Path | None:
        """The run's last checkpoint, once it holds the plan's last step; one line before."""
        found = checkpoint_dirs(run_dir)
        step = checkpoint_step(found[-1]) if found else 0
        if step < self.total:
            raise UserError(
                f"the run is trained to step {step} of {self.total}: train every chunk of the "
                f"plan {self.plan.dir} first (the train_chunk jobs)"
            )
        return found[-1]

    def begin(self, run_dir: Path) -> None:
        pass

    def stop(self, total: int) -> int:
        return total

    def where(self) -> str:
        return ""

    def finish(self, run_dir: Path, keep: int) -> None:
        pass  # every chunk pruned its own

    def export(self, write: Callable[[], T]) -> T | None:
        return write()

    def summary(self) -> dict:
        return {}

    def val_split(self) -> dict | None:
        return self.plan.val_split() if self.cfg.val_samples else None


def train_data(
    cfg: TrainConfig,
    shards: list[str],
    plan: str | None = None,
    chunk: str | None = None,
    val_shards: list[str] | None = None,
) -> TrainData:
    """The data of a training job from its command line: hidden shards (store mode), or a data plan's
    directory and one of its chunks (the chunk's shards, `val_shards` holding the validation samples), or
    the plan alone (its export)."""
    if plan is None:
        return StoreData(shards, cfg)
    p = Plan(plan)
    return ChunkData(p, p.named(chunk), shards, val_shards, cfg) if chunk else PlanData(p, cfg)


def run_dir(checkpoints, cfg: TrainConfig, drafter_cfg: DrafterConfig, data: TrainData) -> Path:
    """The run's directory under `checkpoints`, named by its configs and data (checkpoint.run_key)."""
    return Path(checkpoints) / run_key(cfg, drafter_cfg, data.shards, data.fingerprint)


# ----------------------------------------------------------------------------------- stream mode's plan


def chunk_name(epoch: int, chunk: int) -> str:
    return f"epoch-{epoch:03d}/chunk-{chunk:05d}"


@dataclass
class Chunk:
    epoch: int
    chunk: int  # within its epoch
    index: int  # in the run, over all epochs
    start_step: int  # optimizer steps of the run: [start_step, end_step)
    end_step: int
    samples: int
    tokens: int  # hidden-state tokens the chunk's shards hold
    bytes: int  # their shards' size on disk at most (tokens x bytes per token + an allowance per row)

    @property
    def name(self) -> str:
        return chunk_name(self.epoch, self.chunk)


class Plan:
    """plan.json and the samples' numbering, as a training job reads them."""

    def __init__(self, plan_dir):
        self.dir = Path(plan_dir)
        path = self.dir / "plan.json"
        try:
            self.meta = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: not a readable data plan ({e}); rerun the data_plan rule") from e
        if self.meta.get("format") != FORMAT:
            raise UserError(f"{path}: not a {FORMAT} plan; rerun the data_plan rule")
        self.chunks = [Chunk(**c) for c in self.meta["chunks"]]
        self._samples = None

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    @property
    def tokenizer_length(self) -> int | None:
        """len(tokenizer) of the target (None in a plan written before it was kept)."""
        return self.meta.get("tokenizer_length")

    def _load_samples(self):
        if self._samples is None:
            import pyarrow.parquet as pq

            t = pq.read_table(self.dir / "samples.parquet", columns=["id", "num_tokens"])
            self._samples = t.column("id").to_pylist(), t.column("num_tokens").to_pylist()
        return self._samples

    @property
    def lengths(self) -> list[int]:
        return self._load_samples()[1]

    def index_of(self) -> dict[str, int]:
        return {sid: i for i, sid in enumerate(self._load_samples()[0])}

    def tokens_rows(self, samples: list[int]) -> list[int]:
        """The rows in the tokens files of the run's samples `samples` (the validation split renumbers)."""
        import pyarrow.parquet as pq

        rows = pq.read_table(self.dir / "samples.parquet", columns=["row"]).column("row").to_pylist()
        return [rows[i] for i in samples]

    def val_samples(self) -> tuple[list[str], list[int], list[int]]:
        """The validation split (train.val_samples): ids, their tokens rows and lengths."""
        import pyarrow.parquet as pq

        path = self.dir / "val.parquet"
        if not path.exists():
            raise UserError(
                f"the data plan {self.dir} has no validation split (train.val_samples was 0 when "
                "it was made); rerun the plan (snakemake --forcerun data_plan)"
            )
        t = pq.read_table(path, columns=["id", "row", "num_tokens"])
        return (t.column("id").to_pylist(), t.column("row").to_pylist(), t.column("num_tokens").to_pylist())

    def val_split(self) -> dict:
        return split_record(self.val_samples()[0], self.meta["train"]["seed"])

    def val_store(self, shards):
        """The validation shard(s), checked to hold exactly the plan's validation samples."""
        if not shards:
            raise UserError("train.val_samples is set but no validation shard was given (--val)")
        store = HiddenStore(shards)
        ids, _, lengths = self.val_samples()
        got = dict(zip(store.ids(), (store.num_tokens(i) for i in range(len(store))), strict=True))
        if got != dict(zip(ids, lengths, strict=True)):
            raise UserError(
                f"the validation shard {shards[0]} does not hold the validation samples of the "
                f"data plan {self.dir}; rerun it (snakemake --forcerun hidden_val)"
            )
        return store

    def named(self, name: str) -> Chunk:
        for c in self.chunks:
            if c.name == name:
                return c
        raise UserError(
            f"{self.dir}/plan.json has no chunk {name} (it has {self.chunks[0].name}..{self.chunks[-1].name})"
        )

    def find(self, epoch: int, chunk: int) -> Chunk:
        return self.named(chunk_name(epoch, chunk))

    def chunk_samples(self, c: Chunk) -> list[int]:
        """The run's sample indices the chunk trains on, in plan order (an epoch sees a sample once)."""
        import pyarrow.parquet as pq

        return pq.read_table(self.dir / f"{c.name}.parquet", columns=["sample"]).column("sample").to_pylist()

    def check(self, cfg: TrainConfig, world: int) -> None:
        """One line naming the key when the plan was made for another training than this one."""
        planned = self.meta["train"]
        for k in PLAN_TRAIN_KEYS:
            if planned.get(k, 0) != getattr(cfg, k):  # a plan made before a key existed had its default
                raise UserError(
                    f"config key train.{k}: {getattr(cfg, k)!r}, but the data plan {self.dir}/plan.json was "
                    f"made for {planned.get(k, 0)!r}; rerun the plan (snakemake --forcerun data_plan): "
                    "nothing trained is lost"
                )
        if micro_per_step(cfg, world) != self.meta["micro_per_step"]:  # one micro-batch per process
            raise UserError(
                f"the data plan {self.dir}/plan.json was made for {self.meta['world']} training "
                f"process(es), this run has {world}: rerun the plan "
                "(snakemake --forcerun data_plan)"
            )


def planned_store(plan: Plan, c: Chunk, shards):
    """The chunk's shards under the run's sample numbers (what the epoch plan holds, for the loader), checked
    to hold exactly the chunk's samples at the planned lengths."""
    if not shards:
        raise UserError(f"no hidden shards given for {c.name}")
    store = HiddenStore(shards)
    index = plan.index_of()
    local, unknown = {}, []
    for j, sid in enumerate(store.ids()):
        i = index.get(sid)
        if i is None or plan.lengths[i] != store.num_tokens(j):
            unknown.append(sid)
        else:
            local[i] = j
    missing = set(plan.chunk_samples(c)) - set(local)
    if unknown or missing:
        raise UserError(
            f"the hidden shards of {c.name} ({shards[0]}, ...) do not match the data plan {plan.dir}: "
            f"{len(unknown)} sample(s) not in the plan or of another length, {len(missing)} of the chunk's "
            "missing; rerun the chunk's hidden_chunk jobs (after a data change: snakemake --forcerun "
            "data_plan)"
        )
    return StoreView(store, local)


# ------------------------------------------------------------------------- chunk checkpoints


def chunk_trained(run_dir: Path, end: int) -> Path | None:
    """The first checkpoint at or past a chunk's end, if any: the run got past the chunk, whose steps
    are then trained (the run dir's key holds the configs and the plan, and a resumed run replays exactly
    what an uninterrupted one would have)."""
    return next((p for p in checkpoint_dirs(run_dir) if checkpoint_step(p) >= end), None)


def chunk_resume_point(run_dir: Path, start: int, end: int, chunks=()) -> Path | None:
    """Where the training of a chunk of steps [start, end) begins, for a chunk not trained yet (nothing at
    or past its end, chunk_trained): the latest checkpoint inside it (an attempt that was stopped or
    killed), else the one at `start` (None at step 0). Removes nothing. Without either, one line names
    the chunk to rerun from: of `chunks` (the plan's), the one holding the latest checkpoint kept."""
    found = checkpoint_dirs(run_dir)
    inside = [p for p in found if start < checkpoint_step(p) < end]
    at = inside[-1] if inside else next((p for p in found if checkpoint_step(p) == start), None)
    if at is None and start > 0:
        kept = [checkpoint_step(p) for p in found]
        last = max([s for s in kept if s < start], default=0)
        c = next((c for c in chunks if c.start_step <= last < c.end_step), None)
        frm = (
            f"the chunk that holds step {last}"
            if c is None
            else f"chunk {c.name}, which {'starts' if c.start_step == last else 'resumes'} at step {last}"
        )
        raise UserError(
            f"no checkpoint at step {start} in {run_dir} (kept: "
            f"{', '.join(map(str, kept)) or 'none'}) to train steps {start}..{end} from: the "
            f"previous chunk did not finish, or its checkpoint was removed; rerun from {frm} "
            "(snakemake --forcerun on its train_chunk output)"
        )
    return at


def prune_chunk(run_dir: Path, start: int, end: int, keep: int = 0) -> None:
    """A finished chunk keeps its end only: the next chunk starts there, and chunk_resume_point reads a
    checkpoint inside a chunk as an attempt of that chunk that did not finish. Of the chunks' ends, the
    last `keep` stay (0: all): a rerun can start from any of them."""
    for p in checkpoint_dirs(run_dir):
        if start < checkpoint_step(p) < end:
            shutil.rmtree(p, ignore_errors=True)
    for old in checkpoint_dirs(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
