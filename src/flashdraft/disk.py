"""The disk a whole run takes under its results directory, checked before the first job: the hidden states
(all of them in store mode, two chunks in stream mode), the regenerated answers, the checkpoints training
keeps (and the one being written) and the export, against the free space there. Token counts are the
planner's (estimate_inputs.token_stats: what earlier stages left, else its assumptions); what is already on
disk under the results directory is not counted again."""

from __future__ import annotations

from pathlib import Path

from .config import STREAM_RING, Config, stream_chunk_tokens
from .io import FP8, free_bytes, human_bytes

ANSWER_TOKEN_BYTES = 8  # a regenerated answer's token on disk (its text and id in Parquet), generously


def run_disk(cfg: Config, shapes: dict, results) -> dict[str, int]:
    """Bytes the run writes under `results`, by part."""
    from .estimate import CHECKPOINT_BYTES_PER_PARAMETER, drafter_parameters, token_bytes
    from .estimate_inputs import token_stats

    tok = token_stats(cfg, results)
    per_token = token_bytes(cfg, shapes)
    if cfg.hidden.mode == "stream":
        hidden = STREAM_RING * stream_chunk_tokens(cfg.hidden, per_token) * per_token
    else:
        hidden = tok.total * per_token
    params = drafter_parameters(cfg, shapes)
    answers = int(tok.samples * tok.answer_tokens * ANSWER_TOKEN_BYTES) if cfg.regenerate.enabled else 0
    return {
        "hidden states": hidden,
        "regenerated answers": answers,
        "checkpoints": (cfg.train.keep_checkpoints + 1) * params * CHECKPOINT_BYTES_PER_PARAMETER,
        "export": params * 4,
    }


def floor3(n: int) -> int:
    """`n` rounded down to 3 significant digits: a size to suggest that, printed, still fits."""
    return n - n % 10 ** max(0, len(str(n)) - 3) if n > 0 else n


def on_disk(path: Path) -> int:
    """Bytes of the files under `path` (0 when it does not exist)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def disk_problem(cfg: Config, shapes: dict, results, free: int | None = None) -> str | None:
    """One line when the run's planned disk (+ hidden.disk_margin, as the precompute's preflight), less what
    it has written already, exceeds the free space under `results`, naming what would fit: stream mode's
    budget, float8 hidden states."""
    results, margin = Path(results), cfg.hidden.disk_margin
    parts = run_disk(cfg, shapes, results)
    need = int(sum(parts.values()) * (1 + margin)) - on_disk(results)
    free = free_bytes(results) if free is None else free
    if need <= free:
        return None
    said = ", ".join(f"{k} {human_bytes(v)}" for k, v in parts.items() if v)
    fixes = ["free space there"]
    others = int((sum(parts.values()) - parts["hidden states"]) * (1 + margin))
    room = floor3(int((free + on_disk(results)) / (1 + margin)) - others)
    if cfg.hidden.mode == "store" and room > 0:
        fixes.append(
            f"set hidden.mode: stream with hidden.disk_budget: {human_bytes(room)} or less (two "
            "chunks of hidden states on disk at once)"
        )
    elif cfg.hidden.mode == "stream" and room > 0:
        fixes.append(f"lower hidden.disk_budget to {human_bytes(room)} or less")
    if cfg.hidden.dtype != FP8:
        fixes.append("set hidden.dtype: float8_e4m3 (halves the hidden states)")
    return (
        f"disk: the run needs about {human_bytes(need)} more under {results}/ ({said}, +{margin:.0%}: "
        f"hidden.disk_margin) but {human_bytes(free)} are free; {'; or '.join(fixes)}"
    )
