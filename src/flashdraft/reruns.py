"""What a rerun says at its start about files on disk (the workflow prints these lines before any job).

Snakemake reruns a job when its outputs are missing or older than its inputs, or its code, params or
software changed; but it makes a file deleted by hand again only when a job that runs asks for it, so the
workflow's rule all asks for every shard (a deleted one then reruns with what depends on it:
`deleted_shards` names it). A stream-mode run leaves a store-mode run's shards where they are
(`store_leftovers` names them).
"""

from __future__ import annotations

import shlex
from collections import Counter
from pathlib import Path

from .io import human_bytes


def deleted_shards(shards, made_from) -> list[str]:
    """The `shards` that are gone while `made_from`, a file made from all of them, is still there: deleted
    by hand since the run that made it (a fresh run, where neither is there yet, deletes nothing)."""
    return [s for s in shards if not Path(s).exists()] if Path(made_from).exists() else []


def deleted_line(shards: list[str], command: str) -> str:
    """One line on the deleted `shards` and the plain run (`command`) that makes them again, with what
    depends on them (rule all asks for every shard)."""
    what = f"{shards[0]} and {len(shards) - 1} more" if len(shards) > 1 else shards[0]
    return (
        f"{what}: deleted since the run that used it; the plain run makes it again, with what depends on "
        f"it ({command})"
    )


def store_leftovers(hidden_dir) -> str | None:
    """A stream-mode run's line on store-mode shards in `hidden_dir` (results/hidden), which it never reads
    and leaves there; None when there are none."""
    files = sorted(Path(hidden_dir).glob("shard-*.*"))
    arrows = [f for f in files if f.suffix == ".arrow"]
    if not arrows:
        return None
    size = sum(f.stat().st_size for f in files)
    return (
        f"{hidden_dir} holds {len(arrows)} store-mode hidden shard(s) ({human_bytes(size)}) that this "
        f"stream-mode run does not read; to free the space: rm {shlex.quote(str(hidden_dir))}/shard-*"
    )


# The stages whose jobs cost GPU hours at production size: a rerun says before its first job when it makes
# their finished outputs again.
COSTLY = (
    "regenerate",
    "hidden_shard",
    "hidden_chunk",
    "hidden_val",
    "warmup",
    "train",
    "train_chunk",
    "evaluate",
)


def redo_lines(jobs) -> list[str]:
    """One line per costly rule of which this run makes finished outputs again: `jobs` holds (rule, whether
    its outputs are all on disk, Snakemake's reasons) for each job the run will run."""
    counts, reasons = Counter(), {}
    for rule, done, why in jobs:
        if rule in COSTLY and done:
            counts[rule] += 1
            reasons.setdefault(rule, {}).update(dict.fromkeys(why))  # in order, each once
    return [
        f"this run makes {n} finished {rule} output(s) again ({'; '.join(reasons[rule])}); "
        "`snakemake -n` lists each job's reason before a run"
        for rule, n in sorted(counts.items(), key=lambda kv: COSTLY.index(kv[0]))
    ]  # in the DAG's order
