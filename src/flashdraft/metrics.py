"""Training metrics: the window of summed stats since the last log, the live CSV next to the checkpoints,
TensorBoard (optional), the progress bar and the final CSV. The logged loss is the weighted mean over all
ranks and steps since the last log."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import torch

from .distributed import Dist, all_sum, log
from .families import family
from .io import atomic_path, progress


def metric_fields(block_size: int, val: bool = False, kind: str = "dflash") -> list[str]:
    """The CSV's columns: the family `kind`'s metrics; `val` (train.val_samples): the validation's too,
    empty where it did not run."""
    names = family(kind).metric_names(block_size)
    fields = ["step", "epoch", *names, "lr", "grad_norm", "tokens_per_s"]
    return fields + [f"val_{k}" for k in names] if val else fields


def tensorboard(log_dir: Path, step: int, d: Dist):
    """A TensorBoard writer on rank 0 next to the checkpoints; `purge_step` drops the events a killed
    run logged after its last checkpoint, as the live CSV does."""
    if not d.main:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the tensorboard package is optional: the CSV has every number
        log(d, "tensorboard not installed; metrics go to CSV only")
        return None
    return SummaryWriter(str(log_dir), purge_step=step + 1 if step else None)  # `step` is checkpointed


def write_metrics(path, rows: list[dict], fields: list[str]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def resumed_window(window: list[float], width: int) -> list[float]:
    """A checkpoint's open window at this version's `width`: a checkpoint of a version whose stats vector
    ended earlier (stats are only ever appended) has no sums of the later ones, NaN in this window's row."""
    stats, tokens = window[:-1], window[-1]
    return [*stats, *[math.nan] * (width - 1 - len(stats)), tokens]


class MetricsLogger:
    """One run's metrics from `step` on; `rows` and `window` come from the checkpoint on a resume (a
    resumed window lives on rank 0: the ranks' sum is what counts). close() ends the bar and TensorBoard."""

    def __init__(
        self,
        run_dir: Path,
        d: Dist,
        block_size: int,
        step: int,
        total: int,
        rows: list[dict] | None = None,
        window: list[float] | None = None,
        val: bool = False,
        kind: str = "dflash",
    ):
        self.d, self.block_size, self.rows, self.family = d, block_size, rows or [], family(kind)
        self.fields = metric_fields(block_size, val, kind)
        width = self.family.stats_size(block_size) + 1  # + tokens
        self.window = torch.zeros(width, dtype=torch.float64, device=d.device)
        if window and d.main:
            self.window += torch.tensor(resumed_window(window, width), dtype=torch.float64, device=d.device)
        self.live_csv = run_dir / "metrics.csv"
        if d.main:
            # drops the rows a killed run logged after its last checkpoint
            write_metrics(self.live_csv, self.rows, self.fields)
        self.tb = tensorboard(run_dir / "tensorboard", step, d)
        self.bar = progress(total=total, initial=step, desc="train", unit="step", disable=not d.main)
        self.t_window = time.perf_counter()

    def add(self, stats: torch.Tensor, tokens: int) -> None:
        self.window[:-1] += stats.double()
        self.window[-1] += tokens

    def state_dict(self) -> dict:
        """What a checkpoint keeps (by the name `metrics`): the logged rows and the open window summed over
        ranks (a collective); the constructor's `rows` and `window` take it back."""
        return {"rows": self.rows, "window": all_sum(self.window, self.d).tolist()}

    def log(self, step: int, epoch: float, lr: float, grad_norm: float, val: dict | None = None) -> dict:
        """Close the window into a row (a collective): CSV, TensorBoard and the bar on rank 0. `val`: the
        validation's metrics at this step (val_*), in the same row."""
        summed = all_sum(self.window, self.d).cpu()
        dt, self.t_window = time.perf_counter() - self.t_window, time.perf_counter()
        row = {
            "step": step,
            "epoch": epoch,
            **self.family.summarize(summed[:-1], self.block_size),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": float(summed[-1]) / max(dt, 1e-9),
            **(val or {}),
        }
        self.rows.append(row)
        self.window.zero_()
        if self.d.main:
            with open(self.live_csv, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.fields).writerow(row)
            extra = {"val_tau": f"{val['val_sim_tau']:.2f}"} if val else {}
            self.bar.set_postfix(
                loss=f"{row['loss']:.3f}", tau=f"{row['sim_tau']:.2f}", **extra, refresh=False
            )
        if self.tb is not None:
            for k, v in row.items():
                if k != "step":  # val_x goes to val/x, beside train/x
                    self.tb.add_scalar(f"val/{k[4:]}" if k.startswith("val_") else f"train/{k}", v, step)
            self.tb.flush()
        return row

    def write(self, path) -> None:
        write_metrics(path, self.rows, self.fields)

    def close(self) -> None:
        self.bar.close()
        if self.tb is not None:
            self.tb.close()
