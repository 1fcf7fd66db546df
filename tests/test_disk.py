"""The whole run's disk, planned before the first job (flashdraft.disk)."""

import re
from dataclasses import replace
from pathlib import Path

from flashdraft.config_load import load
from flashdraft.disk import disk_problem, run_disk
from flashdraft.io import parse_bytes
from flashdraft.shapes import QWEN3_8B

REPO = Path(__file__).resolve().parents[1]
PRODUCTION = REPO / "config" / "production.yaml"


def test_a_store_run_too_large_for_the_disk_names_the_stream_budget_that_fits(tmp_path):
    cfg = load([str(PRODUCTION)], target=QWEN3_8B)
    parts = run_disk(cfg, QWEN3_8B, tmp_path / "results")
    assert parts["hidden states"] > 10**13 and all(v > 0 for v in parts.values())  # 1.1M prompts, fp8
    free = 200 * 10**9
    line = disk_problem(cfg, QWEN3_8B, tmp_path / "results", free=free)
    assert line.startswith("disk: the run needs about ") and f"under {tmp_path / 'results'}/" in line
    assert "float8" not in line  # production is on float8 already
    budget = re.search(r"hidden\.mode: stream with hidden\.disk_budget: (\S+ \w?B) or less", line).group(1)
    budget = parse_bytes(budget, "the line's budget")
    stream = replace(cfg, hidden=replace(cfg.hidden, mode="stream", disk_budget=budget))
    assert disk_problem(stream, QWEN3_8B, tmp_path / "results", free=free) is None
    bf16 = replace(cfg, hidden=replace(cfg.hidden, dtype="bfloat16"))
    assert "set hidden.dtype: float8_e4m3" in disk_problem(bf16, QWEN3_8B, tmp_path / "results", free=free)


def test_what_the_run_has_written_already_is_not_counted_again(tmp_path):
    cfg = load([str(PRODUCTION)], target=QWEN3_8B)
    cfg = replace(cfg, prompts=replace(cfg.prompts, total=2000))
    results = tmp_path / "results"
    need = sum(run_disk(cfg, QWEN3_8B, results).values()) * (1 + cfg.hidden.disk_margin)
    assert disk_problem(cfg, QWEN3_8B, results, free=int(need * 0.9)) is not None
    (results / "hidden").mkdir(parents=True)
    with open(results / "hidden" / "shard-00000.arrow", "wb") as f:
        f.truncate(int(need * 0.2))  # sparse: its size counts, no disk taken
    assert disk_problem(cfg, QWEN3_8B, results, free=int(need * 0.9)) is None
