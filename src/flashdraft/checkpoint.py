"""Checkpoints: the run key, full state dicts whatever holds them (DDP or FSDP), save, load and resume.

Checkpoints hold the full state dicts in torch's one-process formats, so they depend on neither the
world size nor the parallel mode. The data position (epoch, cursor) is all the RNG state a resume needs:
data order and anchors are functions of (seed, epoch, index) (see batches.py), and the model has no
dropout.

Tensors go to safetensors files, written straight from host memory and read straight into it. A save
copies the GPU's state into pinned host buffers that the process keeps (allocating pinned memory is what
makes a copy from the GPU slow) and writes them from a background thread while training goes on; the
next save, the end of the job and a stop wait for it. The buffers are allocated in the background after
the first optimizer step, not at start-up: pinning host memory is slow and slows the whole process while
it runs. A resume starts reading its checkpoint in the background at the job's start, into pageable
memory, the optimizer's tensors on to the GPU from the reading thread (see start_reading).
benchmarks/checkpoint_io.py measures both against torch.save and torch.load of the GPU's tensors.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .config import DrafterConfig, TrainConfig, run_config
from .distributed import Dist, barrier
from .hidden import manifest_path
from .io import atomic_path, background, write_json


def run_key(cfg: TrainConfig, drafter_cfg: DrafterConfig, shards: list[str], plan: str | None = None) -> str:
    """Short hash of both configs (config.run_config: every key that makes another run) and the data (the
    shard manifests, or in stream mode the data plan's fingerprint): a changed config or data set never
    resumes an old run."""
    h = hashlib.sha256(run_config(cfg, drafter_cfg).encode())
    if plan is not None:
        h.update(f"plan {plan}".encode())
    for path in shards if plan is None else []:
        m = manifest_path(path)
        h.update(m.read_bytes() if m.exists() else str(Path(path).stat().st_size).encode())
    return h.hexdigest()[:12]


def record_run(
    run_dir: Path, cfg: TrainConfig, drafter_cfg: DrafterConfig, shards: list[str], plan: str | None = None
) -> None:
    """run.json in a run directory, written when the run starts: the train and drafter sections it trains
    with and its data (the shards, or stream mode's plan fingerprint), so that a directory named by a hash
    says what it holds."""
    path = run_dir / "run.json"
    if path.exists():
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    data = {"plan": plan} if plan is not None else {"shards": [str(p) for p in shards]}
    write_json(
        path, {"run": run_dir.name, "train": asdict(cfg), "drafter": asdict(drafter_cfg), "data": data}
    )


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (an interrupted save leaves only a `.tmp-*` sibling)."""
    return sorted(p for p in run_dir.glob("step-*") if (p / "state.json").exists())


def checkpoint_step(path: Path) -> int:
    return int(path.name.split("-")[1])


def full_state(drafter, optimizer, sharded: bool) -> tuple[dict, dict]:
    """Model and optimizer state dicts in torch's one-process formats, whatever holds them. Sharded
    (FSDP) they are gathered: a collective, every rank calls it and rank 0 gets them (the others get
    empty dicts). So checkpoints and exports do not depend on the world size or on DDP vs FSDP."""
    if not sharded:
        return drafter.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # FSDP's alone

    model, optim = get_state_dict(
        drafter, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    index = {name: i for i, (name, _) in enumerate(drafter.named_parameters())}  # names -> torch's ids
    return model, _rekey(optim, index) if optim else optim


def _rekey(optim: dict, key: dict) -> dict:
    """An optimizer state dict with its parameter keys mapped through `key` (names <-> torch's ids)."""
    return {
        "state": {key[k]: v for k, v in optim["state"].items()},
        "param_groups": [{**g, "params": [key[k] for k in g["params"]]} for g in optim["param_groups"]],
    }


def load_full_state(drafter, optimizer, model: dict, optim: dict, sharded: bool) -> None:
    """The inverse of full_state: every rank loads the full dicts and keeps its shards."""
    if not sharded:
        drafter.load_state_dict(model)
        optimizer.load_state_dict(optim)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = dict(enumerate(name for name, _ in drafter.named_parameters()))  # torch's ids -> names
    set_state_dict(
        drafter,
        optimizer,
        model_state_dict=model,
        optim_state_dict=_rekey(optim, names),
        options=StateDictOptions(full_state_dict=True),
    )


# ---------------------------------------------------------------------------------------------------------
# the files: model.safetensors (the model's state dict), optim.safetensors (the optimizer's tensors, named
# <param>.<key>) and optim.pt (the rest of the optimizer's state dict and the schedule), state.json

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def _bytes(t: torch.Tensor):
    """The tensor's memory as a flat uint8 numpy array (no copy; host and contiguous)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Host tensors into a safetensors file, written straight from their memory (no serialized copy)."""
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            f.write(memoryview(_bytes(t.contiguous())))


READ_THREADS = 4  # a safetensors file is read by this many threads at once, each a share of its bytes


def read_safetensors(path: Path, device=None, threads: int = READ_THREADS) -> dict[str, torch.Tensor]:
    """A safetensors file read into fresh host tensors, each copied on to `device` (a GPU) as soon as it is
    read when one is given. `threads` threads read a contiguous share of the tensors each (one reader
    alone leaves most of a disk's, or the page cache's, rate unused), copying on a CUDA stream of their own
    that is waited for before this returns."""
    with open(path, "rb", buffering=0) as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    total = sum(b - a for _, h in items for a, b in [h["data_offsets"]])
    shares = [[] for _ in range(max(1, threads))]
    for name, h in items:  # contiguous shares of about total / threads bytes
        shares[min(len(shares) - 1, h["data_offsets"][0] * len(shares) // max(1, total))].append((name, h))

    cuda = device is not None and torch.device(device).type == "cuda"

    def read(share) -> dict[str, torch.Tensor]:
        stream = torch.cuda.Stream(device) if cuda else None
        out = {}
        with open(path, "rb", buffering=0) as f, torch.cuda.stream(stream):
            for name, h in share:
                t = torch.empty(h["shape"], dtype=_FROM_NAME[h["dtype"]])
                view, a, b = memoryview(_bytes(t)), *h["data_offsets"]
                f.seek(8 + n + a)
                got = 0
                while got < b - a:
                    k = f.readinto(view[got:])
                    if not k:
                        raise ValueError(f"{path}: ends inside tensor {name}")
                    got += k
                out[name] = t if device is None else t.to(device)
        if stream is not None:
            stream.synchronize()
        return out

    with ThreadPoolExecutor(len(shares), thread_name_prefix="safetensors-reader") as pool:
        return {k: v for part in pool.map(read, [s for s in shares if s]) for k, v in part.items()}


def split_optim(optim: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """An optimizer state dict as (its skeleton: every tensor None, its tensors named <param>.<key>)."""
    tensors = {
        f"{p}.{k}": v for p, s in optim["state"].items() for k, v in s.items() if isinstance(v, torch.Tensor)
    }
    state = {
        p: {k: None if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for p, s in optim["state"].items()
    }
    return {"state": state, "param_groups": optim["param_groups"]}, tensors


def join_optim(skeleton: dict, tensors: dict[str, torch.Tensor]) -> dict:
    state = {
        p: {k: tensors[f"{p}.{k}"] if v is None else v for k, v in s.items()}
        for p, s in skeleton["state"].items()
    }
    return {"state": state, "param_groups": skeleton["param_groups"]}


@dataclass
class Snapshot:
    """A checkpoint's content in host memory."""

    model: dict[str, torch.Tensor]
    optim: dict[str, torch.Tensor] | Future  # split_optim's tensors (a Future: still being read)
    skeleton: dict  # split_optim's skeleton
    scheduler: dict
    state: str  # state.json's text

    def optim_tensors(self) -> dict[str, torch.Tensor]:
        return self.optim.result() if isinstance(self.optim, Future) else self.optim


def write_checkpoint(run_dir: Path, snap: Snapshot, keep: int, protect=frozenset()) -> Path:
    """`snap` as run_dir/step-NNNNNNNN, atomically. The last `keep` checkpoints stay, and those at the
    steps in `protect` (stream mode's chunk boundaries, which prune_chunk thins out)."""
    state = json.loads(snap.state)
    path = run_dir / f"step-{state.get('position', state)['step']:08d}"
    with atomic_path(path) as tmp:
        tmp.mkdir(parents=True)
        optim = background(write_safetensors, tmp / "optim.safetensors", snap.optim, name="optim-writer")
        write_safetensors(tmp / "model.safetensors", snap.model)
        optim.result()  # both files at once, as they are read
        torch.save({"optimizer": snap.skeleton, "scheduler": snap.scheduler}, tmp / "optim.pt")
        (tmp / "state.json").write_text(snap.state)
    unprotected = [p for p in checkpoint_dirs(run_dir) if checkpoint_step(p) not in protect]
    for old in unprotected[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path


def read_model(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights alone (the model's full state dict) in host memory, without its optimizer's
    state (twice their bytes)."""
    if (path / "model.safetensors").exists():
        return read_safetensors(path / "model.safetensors")
    return torch.load(path / "model.pt", map_location="cpu", weights_only=True)


def read_checkpoint(path: Path, optim_device=None, optim_later: bool = False) -> Snapshot:
    """A checkpoint directory into host memory (also one written by torch.save alone, model.pt).
    `optim_device`: the optimizer's tensors go on to it (a GPU) as they are read. `optim_later`: return
    once the weights are read, the optimizer's tensors (twice their bytes) as a Future, still being read."""
    # weights_only: tensors and plain Python values only, so a checkpoint cannot run code when loaded
    # (explicit: the default depends on the torch version and on TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD)
    opt = torch.load(path / "optim.pt", map_location="cpu", weights_only=True)
    # the weights alone first: a resume waits for them, and two files read at once share the disk's rate
    model = read_model(path)
    if (path / "model.safetensors").exists():
        optim = path / "optim.safetensors"
        tensors = (
            background(read_safetensors, optim, optim_device, name="optim-reader")
            if optim_later
            else read_safetensors(optim, optim_device)
        )
        skeleton = opt["optimizer"]
    else:
        skeleton, tensors = split_optim(opt["optimizer"])
    return Snapshot(model, tensors, skeleton, opt["scheduler"], (path / "state.json").read_text())


def save_checkpoint(
    run_dir: Path, model: dict, optim: dict, scheduler: dict, state: dict, keep: int, protect=frozenset()
) -> Path:
    """model/optim: full_state's dicts (on the host), scheduler: its state dict, state: state.json's."""
    skeleton, tensors = split_optim(optim)
    return write_checkpoint(
        run_dir, Snapshot(model, tensors, skeleton, scheduler, json.dumps(state)), keep, protect
    )


def apply_snapshot(snap: Snapshot, drafter, optimizer, scheduler, sharded: bool) -> dict:
    """Load a snapshot into the model, optimizer and schedule; returns its state.json."""
    load_full_state(drafter, optimizer, snap.model, join_optim(snap.skeleton, snap.optim_tensors()), sharded)
    scheduler.load_state_dict(snap.scheduler)
    return json.loads(snap.state)


def load_checkpoint(path: Path, drafter, optimizer, scheduler, device, sharded: bool) -> dict:
    """Model, optimizer and schedule from `path`; returns its state.json."""
    snap = read_checkpoint(path)
    return apply_snapshot(snap, drafter, optimizer, scheduler, sharded)


class HostBuffers:
    """Pinned host tensors by name that every save of a process copies the GPU's state into (allocating
    pinned memory is the slow part of a copy from the GPU, so it is done once); CPU tensors are cloned."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}
        self._reserving: Future | None = None

    def reserve(self, tensors: dict[str, torch.Tensor]) -> Future:
        """Allocate the buffers for these (GPU) tensors in a background thread; `stage` waits for it."""
        like = {k: (t.shape, t.dtype) for k, t in tensors.items() if t.device.type == "cuda"}
        self._reserving = background(self._allocate, like, name="host-buffers")
        return self._reserving

    def _allocate(self, like: dict) -> None:
        for name, (shape, dtype) in like.items():
            buf = self.buffers.get(name)
            if buf is None or buf.shape != shape or buf.dtype != dtype:
                self.buffers[name] = torch.empty(shape, dtype=dtype, pin_memory=True)

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._reserving is not None:
            reserving, self._reserving = self._reserving, None
            reserving.result()
        out, cuda = {}, False
        for name, t in tensors.items():
            if t.device.type == "cpu":
                out[name] = t.detach().clone()
                continue
            buf = self.buffers.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self.buffers[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out[name] = buf.copy_(t.detach(), non_blocking=True)
            cuda = True
        if cuda:
            torch.cuda.synchronize()
        return out


def _named(model: dict, optim: dict) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under one namespace (the host buffers' names)."""
    return {**{f"model.{k}": v for k, v in model.items()}, **{f"optim.{k}": v for k, v in optim.items()}}


def start_reading(path: Path | None, optim_device=None) -> Future | None:
    """Read the checkpoint at `path` in a background thread while the process goes on with its start;
    Checkpointer.resume takes the result (the weights, and the optimizer's tensors maybe still being read).
    `optim_device`: a GPU the optimizer's state stays on (not FSDP's, which shards it), copied there by
    the reading thread, so that loading it costs the first step nothing."""
    if path is None:
        return None
    return background(read_checkpoint, path, optim_device, True, name="checkpoint-reader")


@dataclass
class Position:
    """Where a run is: optimizer steps done, the data position (epoch, micro-batches into it) and the
    processes that got there (one micro-batch per process sizes the global batch)."""

    step: int = 0
    epoch: int = 0
    cursor: int = 0
    world: int = 1


def read_state(state: dict) -> dict:
    """A checkpoint's state.json (parsed) as the states saved by name: `position` (a Position), `metrics`
    (metrics.MetricsLogger's), `best` (validate.Best's, None without validation) and `spec`. A checkpoint
    written before the states had names (step, epoch, cursor, world, rows, window, best and spec side by
    side) reads the same."""
    if "position" not in state:
        state = {
            "position": {k: state[k] for k in ("step", "epoch", "cursor", "world")},
            "metrics": {"rows": state["rows"], "window": state["window"]},
            "best": state.get("best"),
            "spec": state.get("spec"),
        }
    return {**state, "position": Position(**state["position"])}


def saved_position(path: Path) -> Position:
    """A checkpoint's position (step, epoch, cursor, world), read without its tensors, so the data loader
    can start before they are loaded."""
    return read_state(json.loads((path / "state.json").read_text()))["position"]


class Checkpointer:
    """Saves and resumes one run's state under its run dir: every rank joins the gather (FSDP), rank 0
    takes a host copy and writes it in the background; `wait` ends that write (and raises its error)."""

    def __init__(
        self,
        run_dir: Path,
        d: Dist,
        drafter,
        optimizer,
        scheduler,
        sharded: bool,
        keep: int,
        protect=frozenset(),
    ):
        self.run_dir, self.d, self.keep, self.sharded, self.protect = run_dir, d, keep, sharded, protect
        self.drafter, self.optimizer, self.scheduler = drafter, optimizer, scheduler
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._host = HostBuffers()
        self._pending: Snapshot | None = None  # the optimizer's state, read but not yet loaded
        self._reserved = False
        optimizer.register_step_pre_hook(lambda *_: self.load_optimizer())
        optimizer.register_step_post_hook(lambda *_: self.reserve())

    def resume(self, path: Path, reading: Future | None = None) -> dict:
        """Load model, optimizer and schedule from `path` (`reading`: start_reading's, when it read the
        same path); returns its state.json. Unsharded, the optimizer's state (AdamW's moments: twice the
        weights' bytes) may still be read when this returns: it is loaded before the first optimizer step
        or the next save, whichever comes first, so the first forward and backward need not wait for it."""
        snap = reading.result() if reading is not None else read_checkpoint(path)
        if self.sharded:
            return apply_snapshot(snap, self.drafter, self.optimizer, self.scheduler, self.sharded)
        self.drafter.load_state_dict(snap.model)
        self.scheduler.load_state_dict(snap.scheduler)
        self._pending = Snapshot({}, snap.optim, snap.skeleton, snap.scheduler, snap.state)  # not the weights
        return json.loads(snap.state)

    def load_optimizer(self) -> None:
        """Load the optimizer's state that `resume` left pending (waiting for its read), if any."""
        if self._pending is None:
            return
        snap, self._pending = self._pending, None
        self.optimizer.load_state_dict(join_optim(snap.skeleton, snap.optim_tensors()))

    def reserve(self) -> Future | None:
        """Start allocating the saves' host buffers in the background, once: after the first optimizer step
        (then the optimizer's state exists and start-up is over). Not under FSDP, whose gathered state
        comes to the host by itself."""
        if self._reserved or not self.d.main or self.sharded:
            return None
        self._reserved = True
        model, optim = full_state(self.drafter, self.optimizer, False)
        return self._host.reserve(_named(model, split_optim(optim)[1]))

    def save(self, state: dict, wait: bool = False) -> None:
        """A checkpoint of this step: the state is copied to the host now and written in the background
        (`wait`: before returning). state.json's text is made here, so later rows cannot reach it."""
        self.wait()
        self.load_optimizer()
        model, optim = full_state(self.drafter, self.optimizer, self.sharded)
        if self.d.main:
            skeleton, tensors = split_optim(optim)
            host = self._host.stage(_named(model, tensors))
            snap = Snapshot(
                {k: host[f"model.{k}"] for k in model},
                {k: host[f"optim.{k}"] for k in tensors},
                copy.deepcopy(skeleton),
                copy.deepcopy(self.scheduler.state_dict()),
                json.dumps(state),
            )
            self._writer = threading.Thread(
                target=self._write, args=(snap,), name="checkpoint-writer", daemon=True
            )
            self._writer.start()
            if wait:
                self.wait()
        barrier(self.d)

    def _write(self, snap: Snapshot) -> None:
        try:
            write_checkpoint(self.run_dir, snap, self.keep, self.protect)
        except BaseException as e:  # raised on the main thread by wait()
            self._error = e

    def wait(self) -> None:
        """Block until the last save is on disk; its error, if any, is raised here (once)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def model_state(self) -> dict:
        """The full model state dict (a collective under FSDP; rank 0 gets it)."""
        return full_state(self.drafter, self.optimizer, self.sharded)[0]
