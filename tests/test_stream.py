"""Stream mode: the data plan, chunked training as a chain of jobs, and the real DAG against store mode."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest
from conftest import REPO, SMALL, job_counts, snakemake, write_config
from safetensors.torch import load_file

from flashdraft.batches import epoch_batches, micro_per_step
from flashdraft.config import DrafterConfig, HiddenConfig, TrainConfig
from flashdraft.errors import UserError
from flashdraft.stream import Plan, cut_chunks, data_plan, write_tokens

# ---- the plan ----


def test_cut_chunks_takes_whole_steps_within_the_budget():
    assert cut_chunks([3, 3, 3, 3, 3], 7) == [(0, 2), (2, 4), (4, 5)]
    assert cut_chunks([5, 1, 1, 5], 7) == [(0, 3), (3, 4)]
    assert cut_chunks([4], 4) == [(0, 1)]


def _tokens(tmp_path, lengths_per_shard, seed=0):
    import random

    rng, files = random.Random(seed), []
    for s, lengths in enumerate(lengths_per_shard):
        samples = [(f"s{s}-{i}", [rng.randrange(3, 500) for _ in range(n)], [0] * (n // 2) + [1] * (n - n // 2))
                   for i, n in enumerate(lengths)]
        files.append(tmp_path / f"tokens-{s}.parquet")
        write_tokens(samples, files[-1], {"shard": s})
    return [str(f) for f in files]


def _target(tmp_path, layers=6, hidden=128):
    d = tmp_path / "target"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": layers,
                                               "hidden_size": hidden}))
    return d


def test_plan_chunks_every_epoch_into_whole_steps_in_store_order(tmp_path):
    lengths = [[30 + (7 * i) % 90 for i in range(40)], [25 + (11 * i) % 100 for i in range(33)]]
    files = _tokens(tmp_path, lengths)
    train = TrainConfig(epochs=3, batch_tokens=256, global_batch_tokens=512, buckets=[64, 128], seed=3)
    hidden = HiddenConfig(mode="stream", chunk_tokens=1200)
    plan = data_plan(_target(tmp_path), files, hidden, DrafterConfig(num_layers=2), train, 1, tmp_path / "plan")
    flat = [n for shard in lengths for n in shard]
    ids = [f"s{s}-{i}" for s, shard in enumerate(lengths) for i in range(len(shard))]  # shard after shard
    g = micro_per_step(train, 1)
    steps = 0
    for e in range(3):
        batches = epoch_batches(flat, train, e)
        chunks = [c for c in plan["chunks"] if c["epoch"] == e]
        assert chunks[0]["start_step"] == steps and len(chunks) >= 2
        steps += len(batches) // g
        assert chunks[-1]["end_step"] == steps
        for c in chunks:
            table = pd.read_parquet(tmp_path / "plan" / f"epoch-{e:03d}" / f"chunk-{c['chunk']:05d}.parquet")
            first = (c["start_step"] - chunks[0]["start_step"]) * g
            want = [i for b in batches[first:first + (c["end_step"] - c["start_step"]) * g] for i in b]
            assert table["sample"].tolist() == want  # the epoch's micro-batches, in order
            assert c["tokens"] == sum(flat[i] for i in want) <= hidden.chunk_tokens
            assert table["id"].tolist() == [ids[i] for i in want]
    assert plan["total_steps"] == steps
    assert plan["peak_bytes"] <= 2 * hidden.chunk_tokens * plan["bytes_per_token"]


@pytest.mark.parametrize("hidden, key", [
    (HiddenConfig(mode="stream", chunk_tokens=100), "hidden.chunk_tokens"),
    (HiddenConfig(mode="stream", disk_budget="300kB"), "hidden.disk_budget"),
    (HiddenConfig(mode="stream"), "hidden.disk_budget"),
], ids=["chunk-below-one-step", "budget-below-one-step", "no-budget"])
def test_a_chunk_smaller_than_one_step_is_one_line_naming_the_key(tmp_path, hidden, key):
    files = _tokens(tmp_path, [[100] * 20])
    train = TrainConfig(epochs=1, batch_tokens=256, global_batch_tokens=512, buckets=[128])
    with pytest.raises(UserError, match=re.escape(f"config key {key}")) as e:
        data_plan(_target(tmp_path), files, hidden, DrafterConfig(num_layers=2), train, 1, tmp_path / "plan")
    assert "\n" not in str(e.value)


def test_a_plan_made_for_another_training_names_the_key(tmp_path):
    files = _tokens(tmp_path, [[60] * 30])
    train = TrainConfig(epochs=2, batch_tokens=256, global_batch_tokens=512, buckets=[64])
    data_plan(_target(tmp_path), files, HiddenConfig(mode="stream", chunk_tokens=800), DrafterConfig(num_layers=2),
              train, 1, tmp_path / "plan")
    plan = Plan(tmp_path / "plan")
    plan.check(train, 1)
    for change, key in (({"epochs": 3}, "train.epochs"), ({"seed": 1}, "train.seed"),
                        ({"batch_tokens": 128}, "train.batch_tokens")):
        with pytest.raises(UserError, match=re.escape(f"config key {key}")):
            plan.check(TrainConfig(**{**train.__dict__, **change}), 1)
    one_each = TrainConfig(**{**train.__dict__, "global_batch_tokens": 0})  # a micro-batch per process
    data_plan(_target(tmp_path), files, HiddenConfig(mode="stream", chunk_tokens=800), DrafterConfig(num_layers=2),
              one_each, 1, tmp_path / "plan1")
    Plan(tmp_path / "plan1").check(one_each, 1)
    with pytest.raises(UserError, match="made for 1 training process"):
        Plan(tmp_path / "plan1").check(one_each, 2)
