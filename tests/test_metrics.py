"""Training metrics: a logged row is the window's sums turned into means, the live CSV holds exactly the
rows logged since the checkpoint a run resumed from, and an open window carried through a checkpoint gives
the row an uninterrupted run logs."""

import csv
import math

import pytest
import torch

from flashdraft.distributed import Dist
from flashdraft.loss import stats_size
from flashdraft.metrics import MetricsLogger, metric_fields

B = 4  # block size: 3 draft positions


def stats(ce, w, tau, blocks, correct, counted, expected=0.0) -> torch.Tensor:
    """One micro-batch's dflash_loss stats: [sum w*CE, normalizer, sum tau, blocks, correct_k, counted_k,
    sum expected_tau]."""
    t = torch.tensor([ce, w, tau, blocks, *correct, *counted, expected], dtype=torch.float32)
    assert t.numel() == stats_size(B)
    return t


def read_csv(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def logger(tmp_path, step=0, rows=None, window=None, val=False):
    return MetricsLogger(tmp_path, Dist(), B, step, total=10, rows=rows or [], window=window, val=val)


def test_a_row_is_the_windows_sums_as_means(tmp_path):
    m = logger(tmp_path)
    m.add(stats(6.0, 2.0, 5.0, 2, [2, 1, 0], [2, 2, 1], 4.5), tokens=100)
    m.add(stats(3.0, 1.0, 2.0, 1, [1, 0, 0], [1, 1, 1], 1.5), tokens=50)
    row = m.log(step=1, epoch=0.5, lr=1e-3, grad_norm=2.0)
    m.close()
    assert row["loss"] == pytest.approx(9.0 / 3.0)  # the weighted mean over both micro-batches
    assert row["sim_tau"] == pytest.approx(7.0 / 3) and row["expected_tau"] == pytest.approx(6.0 / 3)
    assert row["acc"] == pytest.approx(4 / 8)
    assert [row[f"acc_pos_{k}"] for k in (1, 2, 3)] == pytest.approx([1.0, 1 / 3, 0.0])
    assert row["tokens_per_s"] > 0
    assert list(read_csv(tmp_path / "metrics.csv")[0]) == metric_fields(B)
    assert float(read_csv(tmp_path / "metrics.csv")[0]["loss"]) == pytest.approx(3.0)
    # the next window starts empty: a position nothing counted is nan, not a leftover
    m.add(stats(1.0, 1.0, 1.0, 1, [0, 0, 0], [1, 0, 0]), tokens=10)
    assert math.isnan(m.log(step=2, epoch=1.0, lr=1e-3, grad_norm=1.0)["acc_pos_2"])


def test_a_resumed_run_keeps_its_checkpoints_rows_and_window(tmp_path):
    """Run A logs at step 1, checkpoints at step 2 with half a window open, logs at step 3 and is killed.
    B resumes from the step-2 checkpoint: its CSV drops A's step-3 row, and its step-3 row is A's."""
    a = tmp_path
    first, second, third = (stats(2.0 * i, 1.0, 2.0, 1, [1, 0, 0], [1, 1, 1]) for i in (1, 2, 3))
    run = logger(a)
    run.add(first, 10)
    run.log(1, 0.1, 1e-3, 1.0)
    run.add(second, 10)  # step 2: checkpointed mid-window
    saved = run.state_dict()
    saved = {"rows": [dict(r) for r in saved["rows"]], "window": saved["window"]}  # as state.json holds it
    run.add(third, 10)
    logged = run.log(3, 0.3, 1e-3, 1.0)
    run.close()
    assert [r["step"] for r in read_csv(a / "metrics.csv")] == ["1", "3"]

    resumed = logger(a, step=2, **saved)
    assert [r["step"] for r in read_csv(a / "metrics.csv")] == ["1"]  # the row after the checkpoint is gone
    resumed.add(third, 10)
    again = resumed.log(3, 0.3, 1e-3, 1.0)
    resumed.close()
    for k in ("loss", "acc", "sim_tau", "acc_pos_1"):
        assert again[k] == pytest.approx(logged[k]), k
    assert [r["step"] for r in read_csv(a / "metrics.csv")] == ["1", "3"]


def test_validation_columns_are_empty_where_it_did_not_run(tmp_path):
    m = logger(tmp_path, val=True)
    m.add(stats(1.0, 1.0, 1.0, 1, [1, 0, 0], [1, 1, 1]), 10)
    m.log(1, 0.1, 1e-3, 1.0)
    m.add(stats(1.0, 1.0, 1.0, 1, [1, 0, 0], [1, 1, 1]), 10)
    m.log(2, 0.2, 1e-3, 1.0, val={"val_loss": 0.5, "val_sim_tau": 1.5})
    m.close()
    rows = read_csv(tmp_path / "metrics.csv")
    assert list(rows[0]) == metric_fields(B, val=True)
    assert rows[0]["val_loss"] == "" and float(rows[1]["val_loss"]) == 0.5


def test_a_window_checkpointed_before_a_metric_existed_resumes_with_that_metric_unknown(tmp_path):
    """A checkpoint of a version whose stats ended before expected_tau: its open window resumes, the other
    metrics of the next row as an uninterrupted run's, expected_tau NaN there only (its sums are missing)."""
    first, second = (
        stats(2.0, 1.0, 2.0, 1, [1, 0, 0], [1, 1, 1], 1.5),
        stats(4.0, 1.0, 3.0, 1, [1, 1, 0], [1, 1, 1], 2.5),
    )
    run = logger(tmp_path / "a")
    run.add(first, 10)
    run.add(second, 10)
    logged = run.log(1, 0.1, 1e-3, 1.0)
    run.close()
    old = [*first[:-1].tolist(), 10.0]  # the window as the earlier version saved it: no expected_tau
    resumed = logger(tmp_path / "b", window=old)
    resumed.add(second, 10)
    again = resumed.log(1, 0.1, 1e-3, 1.0)
    for k in ("loss", "acc", "sim_tau", "acc_pos_1", "acc_pos_2"):
        assert again[k] == pytest.approx(logged[k]), k
    assert math.isnan(again["expected_tau"])
    resumed.add(second, 10)  # the next window is whole again
    assert resumed.log(2, 0.2, 1e-3, 1.0)["expected_tau"] == pytest.approx(2.5)
    resumed.close()
