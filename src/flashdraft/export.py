"""The export of a trained run: the drafter's weights (the last step's, or with train.export: best the
best validation's) in its family's format, the final metrics CSV, export.json (which step of which run,
and why) and, with validation, val_split.json (its samples) beside the metrics.

Store mode exports at the end of its training job (train.py); stream mode's train job exports the run
that every chunk trained (`export_checkpoint`), from its last checkpoint, building no optimizer or step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoint import checkpoint_step, read_model, read_state
from .distributed import Dist, log
from .drafter_io import export_drafter
from .io import code_version, write_json
from .metrics import metric_fields, write_metrics
from .model import DrafterSpec
from .train_step import load_spec, resolve
from .validate import Best, export_choice


def export_run(
    d: Dist,
    job,
    spec: DrafterSpec,
    run: Path,
    model: dict,
    best: Best | None,
    step: int,
    rows: list[dict],
    dtype: torch.dtype | None,
    drafter=None,
) -> None:
    """Write the export of `job` (a train.TrainJob) from its run dir `run` trained to `step`: `model` is the
    last step's full state dict, `best` the validation's best so far (every rank calls: they read it)."""
    chosen = export_choice(job.cfg, best, step)
    if chosen["step"] != step:
        model = best.weights()
    if d.main:
        export_drafter(drafter, spec, job.out, dtype=dtype, state=model)
        fields = metric_fields(spec.block_size, bool(job.cfg.val_samples), spec.family)
        write_metrics(job.metrics, rows, fields)
        info = Path(job.metrics).parent
        write_json(info / "export.json", {**chosen, "run": run.name, **code_version()})  # checkpoints/<run>
        if (split := job.data.val_split()) is not None:
            write_json(info / "val_split.json", split)
        log(
            d,
            f"exported {job.out}: step {chosen['step']} of {step} ({chosen['why']}); metrics in "
            f"{job.metrics}",
        )


def export_checkpoint(d: Dist, job, run: Path, last: Path) -> list[dict]:
    """Stream mode's train job (job.data: a train_data.PlanData): export the run that every chunk of the
    plan trained from its last checkpoint `last`, building no optimizer or step; returns its logged rows."""
    cfg, data = job.cfg, job.data
    step = checkpoint_step(last)
    spec = load_spec(job.target, job.drafter, data.tokenizer_length)
    dtype = resolve(cfg, d.device).amp_dtype
    state = read_state(json.loads((last / "state.json").read_text()))
    log(d, f"resumed from {last}: step {step}, the run's last, saved by {state['position'].world} rank(s)")
    best = Best(run, d, state["best"], dtype) if cfg.val_samples else None
    rows = state["metrics"]["rows"]
    model = read_model(last) if d.main else {}  # rank 0 writes the export
    export_run(d, job, spec, run, model, best, step, rows, dtype)
    return rows
