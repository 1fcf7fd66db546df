"""Held-out validation during training (`train.val_samples`, `train.val_every`) and the best checkpoint
(`train.export: best`).

- The split: the `val_samples` sample ids whose hash with train.seed is smallest. It depends on the ids
  alone, not on their order or the shard count, so store mode (which splits the shards' samples when
  training starts, leaving the hidden shards independent of train.seed) and stream mode (whose data plan
  splits, and whose validation shard lives through every chunk) keep the same samples out of training.
- The evaluation: the drafter in eval mode, without gradients and uncompiled (no inference graphs to
  compile), on fixed anchors: each sample's come from a seed of its id alone, so numbers compare across
  steps, runs and seeds. Loss, per-position acceptance and sim_tau are the training metrics'
  (`loss.dflash_loss` stats, `loss.summarize`). Ranks share the batches; each batch's stats land in
  their own row, summed in batch order, so any world size gives the same numbers.
- The best checkpoint: the weights of the best validation sim_tau so far in run_dir/best/step-NNNNNNNN
  (beside the checkpoints, which their pruning never touches); state.json carries which step it is.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from .batches import Collate, bucket_for, rows_per_batch
from .checkpoint import read_safetensors, write_safetensors
from .config import TrainConfig
from .distributed import Dist, all_sum, barrier
from .errors import UserError
from .holdout import anchor_seed
from .io import atomic_path
from .train_step import anchors_for, batch_tensors, row_slices

VAL_PREFIX = "val_"


def val_every(cfg: TrainConfig) -> int:
    return cfg.val_every or cfg.checkpoint_every


def due(cfg: TrainConfig, step: int, total: int) -> bool:
    """Whether the validation runs after optimizer step `step` (every val_every steps and at the end)."""
    return bool(cfg.val_samples) and (step % val_every(cfg) == 0 or step == total)


class Validator:
    """The validation samples in fixed micro-batches (id order, by length bucket) and their evaluation."""

    def __init__(self, store, cfg: TrainConfig, d: Dist, hidden_dtype):
        self.store, self.d, self.cfg = store, d, cfg
        self.ids = store.ids()
        order = sorted(range(len(store)), key=lambda i: self.ids[i])
        by_bucket: dict[int, list[int]] = {}
        for i in order:
            by_bucket.setdefault(bucket_for(store.num_tokens(i), cfg.buckets), []).append(i)
        self.batches = [
            rows[j : j + rows_per_batch(b, cfg.batch_tokens)]
            for b, rows in sorted(by_bucket.items())
            for j in range(0, len(rows), rows_per_batch(b, cfg.batch_tokens))
        ]
        self.collate = Collate(cfg.buckets, cfg.batch_tokens, hidden_dtype)

    def evaluate(self, step_fn, drafter, sharded: bool) -> dict:
        """val_loss, val_acc, val_acc_pos_k and val_sim_tau of `drafter` (a collective: every rank calls)."""
        d, n = self.d, len(self.batches)
        mine = list(range(d.rank, n, d.world))
        if sharded:  # every rank runs as many forwards (FSDP gathers weights in each); extras count nothing
            mine += [None] * (-(-n // d.world) - len(mine))
        per = None
        # SDPA: flex_attention outside a compiled graph computes every score densely (20 GiB for one
        # micro-batch at the production shape); SDPA's kernels take the dense mask
        view = replace(step_fn, model=drafter, attention="sdpa", compile_loss=False)
        drafter.eval()
        amp = step_fn.amp_dtype
        try:
            with (
                torch.no_grad(),
                torch.compiler.set_stance("force_eager"),
                torch.autocast(d.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None),
            ):
                for k in mine:
                    rows = self.batches[0 if k is None else k]
                    batch = self.collate([self.store[i] for i in rows])
                    # the training's anchor sampling, with fixed seeds
                    pad = len(batch["loss_mask"]) - len(rows)
                    seeds = [anchor_seed(self.ids[i]) for i in rows] + [None] * pad
                    anchors, valid = anchors_for(step_fn, batch["loss_mask"], seeds=seeds)
                    stats = sum(
                        view.family.loss(view, batch_tensors(view, part), a, v)[1]
                        for part, a, v in row_slices(view, batch, anchors, valid)
                    )
                    if per is None:
                        per = torch.zeros(n, len(stats), dtype=torch.float64, device=d.device)
                    if k is not None:
                        per[k] = stats.double()
        finally:
            drafter.train()
        if per is None:  # this rank had no batch: its rows are zeros
            size = view.family.stats_size(step_fn.spec.block_size)
            per = torch.zeros(n, size, dtype=torch.float64, device=d.device)
        total = all_sum(per, d).cpu()  # each row comes from one rank; the rest add exact zeros
        summed = torch.zeros(total.shape[1], dtype=torch.float64)
        for row in total:  # in batch order: the same sum on any number of ranks
            summed += row
        return {VAL_PREFIX + k: v for k, v in view.family.summarize(summed, step_fn.spec.block_size).items()}


def best_dirs(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "best").glob("step-*") if (p / "val.json").exists())


class Best:
    """The best validation sim_tau so far and its weights (run_dir/best/step-NNNNNNNN/model.safetensors,
    in the export's dtype). `state`: state.json's "best" on a resume; a best written after that
    checkpoint belongs to steps being trained again and is removed (they write it again)."""

    def __init__(self, run_dir: Path, d: Dist, state: dict | None, dtype: torch.dtype | None):
        self.dir, self.d, self.dtype = run_dir / "best", d, dtype
        self.step = state["step"] if state else None
        self.sim_tau = state["sim_tau"] if state else -math.inf
        self.kept = self.step  # the best the last checkpoint names: kept until a later one names another
        if d.main:
            for p in best_dirs(run_dir):
                if int(p.name.split("-")[1]) != self.step:
                    shutil.rmtree(p, ignore_errors=True)

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps (by the name `best`): the best so far, which that checkpoint then keeps;
        the constructor's `state` takes it back."""
        self.kept = self.step
        return None if self.step is None else {"step": self.step, "sim_tau": self.sim_tau}

    def update(self, step: int, row: dict, model_state) -> bool:
        """Keep the weights (`model_state()`: a collective under FSDP) when `row` beats the best so far."""
        tau = row[VAL_PREFIX + "sim_tau"]
        if not tau > self.sim_tau:  # NaN never wins
            return False
        model = model_state()
        if self.d.main:
            path = self.dir / f"step-{step:08d}"
            with atomic_path(path) as tmp:
                tmp.mkdir(parents=True)
                write_safetensors(
                    tmp / "model.safetensors",
                    {k: v.detach().to("cpu", self.dtype or v.dtype).contiguous() for k, v in model.items()},
                )
                (tmp / "val.json").write_text(json.dumps({"step": step, **row}))
            for p in best_dirs(self.dir.parent):
                if int(p.name.split("-")[1]) not in (step, self.kept):
                    shutil.rmtree(p, ignore_errors=True)
        barrier(self.d)
        self.step, self.sim_tau = step, tau
        return True

    def weights(self) -> dict[str, torch.Tensor]:
        path = self.dir / f"step-{self.step:08d}" / "model.safetensors"
        if not path.exists():
            raise UserError(
                f"{path}: the best checkpoint is missing; rerun training with train.export: "
                "last, or remove the run's checkpoints to train again"
            )
        return read_safetensors(path)


def export_choice(cfg: TrainConfig, best: Best | None, last_step: int) -> dict:
    """Which step the export takes, and why (export.json, the report)."""
    out = {
        "export": cfg.export,
        "last_step": last_step,
        "best_step": best.step if best else None,
        "best_val_sim_tau": best.sim_tau if best and best.step is not None else None,
    }
    if cfg.export == "best" and best is not None and best.step is not None:
        why = (
            f"train.export: best: step {best.step} had the best validation sim_tau ({best.sim_tau:.4f}) "
            f"of the run's validations"
        )
        return {**out, "step": best.step, "why": why}
    if cfg.export == "best":
        why = "train.export: best, but no validation gave a number: the last step is exported"
    else:
        why = "train.export: last: the weights after the run's last step"
    return {**out, "step": last_step, "why": why}
