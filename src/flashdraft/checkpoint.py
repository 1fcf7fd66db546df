"""Checkpoints: the run key, full state dicts whatever holds them (DDP or FSDP), save, load and resume.

Checkpoints hold the full state dicts in torch's one-process formats, so they depend on neither the
world size nor the parallel mode. The data position (epoch, cursor) is all the RNG state a resume needs:
data order and anchors are functions of (seed, epoch, index) (see batches.py), and the model has no
dropout.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from .config import DrafterConfig, TrainConfig, to_json
from .distributed import Dist, barrier
from .errors import UserError
from .hidden import manifest_path
from .io import atomic_path


def run_key(cfg: TrainConfig, drafter_cfg: DrafterConfig, shards: list[str], plan: str | None = None) -> str:
    """Short hash of both configs and the data (the shard manifests, or in stream mode the data plan's
    fingerprint): a changed config or data set never resumes an old run."""
    same_run = {k: v for k, v in asdict(cfg).items() if k != "parallel"}  # DDP and FSDP resume each other
    h = hashlib.sha256((json.dumps(same_run, sort_keys=True) + to_json(drafter_cfg)).encode())
    if plan is not None:
        h.update(f"plan {plan}".encode())
    for path in shards if plan is None else []:
        m = manifest_path(path)
        h.update(m.read_bytes() if m.exists() else str(Path(path).stat().st_size).encode())
    return h.hexdigest()[:12]


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (an interrupted save leaves only a `.tmp-*` sibling)."""
    return sorted(p for p in run_dir.glob("step-*") if (p / "state.json").exists())


def checkpoint_step(path: Path) -> int:
    return int(path.name.split("-")[1])


def chunk_resume_point(run_dir: Path, start: int, end: int) -> Path | None:
    """Where the training of a chunk of steps [start, end) begins: the latest checkpoint inside it (an
    attempt that was stopped or killed), else the one at `start` (None at step 0). Then the checkpoints
    after it are removed: they belong to a run of this chunk and later ones that is being redone (a
    completed chunk keeps only its end, see prune_chunk). Rank 0 alone calls it."""
    found = checkpoint_dirs(run_dir)
    inside = [p for p in found if start < checkpoint_step(p) < end]
    at = inside[-1] if inside else next((p for p in found if checkpoint_step(p) == start), None)
    if at is None and start > 0:
        kept = ", ".join(str(checkpoint_step(p)) for p in found) or "none"
        raise UserError(f"no checkpoint at step {start} in {run_dir} (kept: {kept}) to train steps "
                        f"{start}..{end} from: train.keep_checkpoints removed it, or the previous chunk did "
                        "not finish; rerun from an earlier chunk (snakemake --forcerun on its train_chunk "
                        "output) or raise train.keep_checkpoints")
    for p in found:
        if checkpoint_step(p) > (checkpoint_step(at) if at else 0):
            shutil.rmtree(p, ignore_errors=True)
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


def full_state(drafter, optimizer, sharded: bool) -> tuple[dict, dict]:
    """Model and optimizer state dicts in torch's one-process formats, whatever holds them. Sharded
    (FSDP) they are gathered: a collective, every rank calls it and rank 0 gets them (the others get
    empty dicts). So checkpoints and exports do not depend on the world size or on DDP vs FSDP."""
    if not sharded:
        return drafter.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # FSDP's alone

    model, optim = get_state_dict(drafter, optimizer,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    index = {name: i for i, (name, _) in enumerate(drafter.named_parameters())}  # names -> torch's ids
    return model, _rekey(optim, index) if optim else optim


def _rekey(optim: dict, key: dict) -> dict:
    """An optimizer state dict with its parameter keys mapped through `key` (names <-> torch's ids)."""
    return {"state": {key[k]: v for k, v in optim["state"].items()},
            "param_groups": [{**g, "params": [key[k] for k in g["params"]]} for g in optim["param_groups"]]}


def load_full_state(drafter, optimizer, model: dict, optim: dict, sharded: bool) -> None:
    """The inverse of full_state: every rank loads the full dicts and keeps its shards."""
    if not sharded:
        drafter.load_state_dict(model)
        optimizer.load_state_dict(optim)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = dict(enumerate(name for name, _ in drafter.named_parameters()))  # torch's ids -> names
    set_state_dict(drafter, optimizer, model_state_dict=model, optim_state_dict=_rekey(optim, names),
                   options=StateDictOptions(full_state_dict=True))


def save_checkpoint(run_dir: Path, model: dict, optim: dict, scheduler, state: dict, keep: int,
                    protect=frozenset()) -> Path:
    """model/optim: full_state's dicts. The last `keep` checkpoints stay, and those at the steps in
    `protect` (stream mode's chunk boundaries, which prune_chunk thins out)."""
    path = run_dir / f"step-{state['step']:08d}"
    with atomic_path(path) as tmp:
        tmp.mkdir(parents=True)
        torch.save(model, tmp / "model.pt")
        opt = {"optimizer": optim, "scheduler": scheduler.state_dict()}
        torch.save(opt, tmp / "optim.pt")
        (tmp / "state.json").write_text(json.dumps(state))
    unprotected = [p for p in checkpoint_dirs(run_dir) if checkpoint_step(p) not in protect]
    for old in unprotected[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(path: Path, drafter, optimizer, scheduler, device, sharded: bool) -> dict:
    # weights_only: tensors and plain Python values only, so a checkpoint cannot run code when loaded
    # (explicit: the default depends on the torch version and on TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD)
    opt = torch.load(path / "optim.pt", map_location=device, weights_only=True)
    model = torch.load(path / "model.pt", map_location=device, weights_only=True)
    load_full_state(drafter, optimizer, model, opt["optimizer"], sharded)
    scheduler.load_state_dict(opt["scheduler"])
    return json.loads((path / "state.json").read_text())


class Checkpointer:
    """Saves and resumes one run's state under its run dir: every rank joins the gather (FSDP), rank 0
    writes, all wait for it."""

    def __init__(self, run_dir: Path, d: Dist, drafter, optimizer, scheduler, sharded: bool, keep: int,
                 protect=frozenset()):
        self.run_dir, self.d, self.keep, self.sharded, self.protect = run_dir, d, keep, sharded, protect
        self.drafter, self.optimizer, self.scheduler = drafter, optimizer, scheduler

    def latest(self) -> Path | None:
        found = checkpoint_dirs(self.run_dir)
        return found[-1] if found else None

    def resume(self, path: Path) -> dict:
        """Load model, optimizer and schedule from `path`; returns its state.json."""
        return load_checkpoint(path, self.drafter, self.optimizer, self.scheduler, self.d.device,
                               self.sharded)

    def save(self, state: dict) -> None:
        model, optim = full_state(self.drafter, self.optimizer, self.sharded)
        if self.d.main:
            save_checkpoint(self.run_dir, model, optim, self.scheduler, state, self.keep, self.protect)
        barrier(self.d)

    def model_state(self) -> dict:
        """The full model state dict (a collective under FSDP; rank 0 gets it)."""
        return full_state(self.drafter, self.optimizer, self.sharded)[0]
