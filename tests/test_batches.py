"""Length buckets, each epoch's micro-batch plan, anchor seeds, collation (batches.py), a step's micro-batches
(config.micro_per_step) and the learning-rate schedule (train_setup.lr_factor)."""

import pytest
import torch
from conftest import toy_hidden_shards
from train_helpers import DRAFTER

from flashdraft.batches import (
    Collate,
    anchor_seeds,
    bucket_for,
    epoch_batches,
    micro_per_step,
    rows_per_batch,
    steps_left,
)
from flashdraft.config import TrainConfig
from flashdraft.hidden import HiddenStore
from flashdraft.train_setup import lr_factor


def test_buckets_and_epoch_plan():
    assert [bucket_for(n, [256, 128]) for n in (1, 128, 129, 256, 5000)] == [128, 128, 256, 256, 256]
    lengths = [50, 300, 120, 200, 90, 260, 10, 130] * 5
    cfg = TrainConfig(buckets=[128, 256], batch_tokens=512, seed=3)
    plan = epoch_batches(lengths, cfg, epoch=0)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))  # each sample once per epoch
    for b in plan:
        buckets = {bucket_for(lengths[i], cfg.buckets) for i in b}
        assert len(buckets) == 1 and len(b) <= rows_per_batch(buckets.pop(), cfg.batch_tokens)
    assert plan == epoch_batches(lengths, cfg, epoch=0)  # deterministic: every rank computes the same plan
    assert plan != epoch_batches(lengths, cfg, epoch=1)  # a new permutation every epoch


def test_anchor_seeds_follow_the_sample_not_the_batch():
    seeds = anchor_seeds(3, 1, [5, 9], rows=4)
    assert seeds[2:] == [None, None] and anchor_seeds(3, 1, [9, 2], rows=2)[0] == seeds[1]
    assert anchor_seeds(3, 2, [5], rows=1) != seeds[:1] and anchor_seeds(4, 1, [5], rows=1) != seeds[:1]


def test_collate_pads_to_bucket_and_truncates_to_the_largest(train_shards):
    _, shards = train_shards
    store = HiddenStore(shards)
    long = max(range(len(store)), key=store.num_tokens)
    short = min(range(len(store)), key=store.num_tokens)
    assert store.num_tokens(long) > 256 and store.num_tokens(short) <= 128
    collate = Collate([128, 256], 512, torch.float32)
    batch = collate([store[long], store[short]])
    assert batch["bucket"] == 256 and batch["input_ids"].shape == (2, 256)  # 512 // 256 rows
    assert batch["hidden"].shape == (2, 256, store.num_features * store.hidden_size)
    n = store.num_tokens(short)
    assert batch["tokens"] == 256 + n
    assert torch.equal(batch["input_ids"][1, :n], store[short]["input_ids"])
    assert batch["loss_mask"][1, n:].eq(0).all() and batch["hidden"][1, n:].eq(0).all()
    small = collate([store[short]])
    assert small["bucket"] == 128 and small["input_ids"].shape == (4, 128)  # padding rows keep one shape
    assert small["loss_mask"][1:].eq(0).all()


def test_collate_pads_last_hidden_like_hidden_and_only_when_the_samples_carry_it(tmp_path):
    root = tmp_path / "toy"
    root.mkdir()
    store = HiddenStore(toy_hidden_shards(root, DRAFTER, shards=1, rows=4, last_hidden=True))
    samples = [store[i] for i in range(3)]
    collate = Collate([128, 256, 512], 2048, torch.float32)
    batch = collate(samples)
    s, rows = batch["bucket"], batch["input_ids"].shape[0]
    assert batch["last_hidden"].shape == (rows, s, store.hidden_size)
    assert batch["last_hidden"].dtype == torch.float32 and batch["hidden"].shape[:2] == (rows, s)
    for r, x in enumerate(samples):
        n = min(len(x["input_ids"]), s)
        assert torch.equal(batch["last_hidden"][r, :n], x["last_hidden"][:n].float())
        assert batch["last_hidden"][r, n:].eq(0).all()
    assert batch["last_hidden"][len(samples) :].eq(0).all()
    without = collate([{k: v for k, v in x.items() if k != "last_hidden"} for x in samples])
    assert list(without) == ["input_ids", "loss_mask", "hidden", "tokens", "bucket"]
    assert all(torch.equal(without[k], batch[k]) for k in ("input_ids", "loss_mask", "hidden"))


def test_micro_per_step_refuses_a_global_batch_the_processes_cannot_share(train_shards):
    lengths = [HiddenStore(train_shards[1]).num_tokens(i) for i in range(48)]
    fixed = TrainConfig(batch_tokens=512, global_batch_tokens=1024, buckets=[128, 256])
    assert steps_left(lengths, fixed, 1) == steps_left(lengths, fixed, 2)
    legacy = TrainConfig(batch_tokens=512, buckets=[128, 256])  # one micro-batch per process and step
    half = steps_left(lengths, legacy, 2)
    assert steps_left(lengths, legacy, 1) // 2 == half == steps_left(lengths, fixed, 1) > 0
    cfg = TrainConfig(batch_tokens=512, global_batch_tokens=1536)
    assert micro_per_step(cfg, 1) == micro_per_step(cfg, 2) == micro_per_step(cfg, 3) == 3
    assert micro_per_step(TrainConfig(batch_tokens=512), 4) == 4  # 0: one per process
    with pytest.raises(ValueError, match=r"train.global_batch_tokens \(1536\) must be a multiple"):
        micro_per_step(cfg, 4)
    with pytest.raises(ValueError, match="use 1024"):
        micro_per_step(TrainConfig(batch_tokens=512, global_batch_tokens=700), 2)


def test_lr_warmup_then_cosine_to_zero():
    total, ratio = 100, 0.1
    f = [lr_factor(s, total, ratio) for s in range(total)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # linear warmup over 10 steps
    assert f[10] == pytest.approx(1.0) and f[55] == pytest.approx(0.5, abs=0.01)
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False)) and f[-1] < 1e-3
    assert lr_factor(0, 10, 0.0) == 1.0
