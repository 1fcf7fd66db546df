"""The committed benchmark results (benchmarks/results/*.json) as figures: a value by file and dotted key,
and where a file says it was measured (device, commit, command). The planner's rates and the figures the
docs quote are read here, so a re-measured file changes both at once."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from .errors import UserError

CHECKOUT_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def results_dir() -> Path:
    """benchmarks/results/ of the checkout this package runs from (an editable install, as `make install`
    makes), else of the working directory's checkout."""
    for d in (CHECKOUT_RESULTS, Path.cwd() / "benchmarks" / "results"):
        if d.is_dir():
            return d
    raise UserError(
        "benchmarks/results/ not found: the planner reads its measured rates there; run it "
        "from a flashdraft checkout"
    )


@cache
def result(file: str) -> dict:
    path = results_dir() / file
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such result file") from None


def lookup(data, dotted: str):
    """The value at a dotted key: dict keys by name, list items by index ("runs.0.loss")."""
    for part in dotted.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def figure(file: str, key: str):
    try:
        return lookup(result(file), key)
    except (KeyError, IndexError, ValueError, TypeError):
        raise UserError(f"benchmarks/results/{file}: no value at key {key}") from None


def provenance(file: str) -> dict[str, str | None]:
    """Where `file` says its figures were measured: device, commit (with "+dirty" for an uncommitted
    tree) and command, each None where the file does not record it. A benchmark's file records them in
    its envelope (benchmarks/harness.py: `machine.device`, `commit`, `dirty`, `argv`); older ones in the
    shapes read here too."""
    d = result(file)
    machine = d.get("machine")
    device = d.get("device") if isinstance(d.get("device"), str) else None
    if isinstance(machine, str):
        device = device or machine
    elif isinstance(machine, dict):
        device = device or machine.get("device")
    for section in ("setup", "env"):  # older files: the device beside the run's settings
        if not device and isinstance(d.get(section), dict):
            device = d[section].get("device")
    code = d.get("code") if isinstance(d.get("code"), dict) else {}  # older files: {"commit", "dirty"}
    commit = code.get("commit") or d.get("commit")
    if commit and (code.get("dirty") if code else d.get("dirty")):
        commit += "+dirty"
    command = d.get("command") or (" ".join(d["argv"]) if isinstance(d.get("argv"), list) else None)
    return {"device": device and str(device), "commit": commit, "command": command}
