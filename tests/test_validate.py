"""Held-out validation during training (train.val_samples, train.val_every) and the best checkpoint
(train.export): the split, the rows and their determinism, the export, resume, stream mode's plan."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import toy_hidden_shards
from safetensors.torch import load_file

from flashdraft.config import HiddenConfig, TrainConfig
from flashdraft.config_check import check
from flashdraft.config_load import load
from flashdraft.errors import UserError
from flashdraft.hidden import HiddenStore
from flashdraft.holdout import val_split
from flashdraft.stream import data_plan, write_tokens
from flashdraft.train_data import Plan, split_store

REPO = Path(__file__).resolve().parents[1]
DRAFTER = {"num_layers": 2, "block_size": 8}
TRAIN = {
    "max_steps": 6,
    "lr": 3e-3,
    "max_anchors": 16,
    "batch_tokens": 512,
    "buckets": [128, 256],
    "compile": False,
    "checkpoint_every": 4,
    "keep_checkpoints": 1,
    "log_every": 1,
    "val_samples": 8,
    "val_every": 2,
    "export": "best",
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate")
    return root, toy_hidden_shards(root, DRAFTER)


def train(root, shards, out, cfg=TRAIN, extra=(), check=True):
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "train.py"),
        "--cfg",
        json.dumps(cfg),
        "--drafter-cfg",
        json.dumps(DRAFTER),
        "--target",
        str(root / "target"),
        "--checkpoints",
        str(out / "checkpoints"),
        "--metrics",
        str(out / "metrics.csv"),
        "--out",
        str(out / "drafter"),
        *extra,
        *shards,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def val_rows(out):
    df = pd.read_csv(out / "metrics.csv")
    cols = [c for c in df.columns if c == "step" or c.startswith("val_")]
    return df, df.dropna(subset=["val_sim_tau"])[cols]


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """An uninterrupted run with validation every 2 steps, exporting the best."""
    root, shards = data
    out = tmp_path_factory.mktemp("reference")
    proc = train(root, shards, out)
    return out, proc


def test_the_split_is_seeded_by_the_ids_alone_and_refuses_to_take_every_sample():
    ids = [f"s{i}" for i in range(50)]
    a = val_split(ids, 5, seed=0)
    assert len(a) == 5 and a == sorted(a)
    assert val_split(list(reversed(ids)), 5, seed=0) == a  # not the order, nor the shard count
    assert val_split(ids, 5, seed=1) != a
    assert set(val_split(ids + ["x", "y"], 5, seed=0)) <= set(a) | {"x", "y"}  # more data: mostly the same
    with pytest.raises(UserError, match=r"config key train\.val_samples \(50\) leaves none of the 50"):
        val_split(ids, 50, seed=0)


def test_store_mode_keeps_the_validation_samples_out_of_training(data):
    root, shards = data
    store = HiddenStore(shards)
    train_store, val = split_store(store, TrainConfig(val_samples=8, seed=0))
    assert len(val) == 8 and len(train_store) == len(store) - 8
    assert not set(val.ids()) & set(train_store.ids())
    assert sorted(val.ids()) == val_split(store.ids(), 8, 0)
    assert train_store[0]["input_ids"].equal(store[train_store.index[0]]["input_ids"])
    assert split_store(store, TrainConfig(val_samples=0))[1] is None  # every sample trains


def test_the_default_split_and_the_warning_for_a_large_one():
    assert TrainConfig().val_samples == 64
    cfg = load(REPO / "config" / "config.yaml")
    assert cfg.train.val_samples == 0 and check(cfg) == []  # the embedded default (docs/performance.md)
    cfg.train.val_samples = 36
    assert check(cfg) == []  # a tenth of the 360 prompts
    cfg.train.val_samples = 37
    assert check(cfg) == [
        "config key train.val_samples: 37 of at most 360 training prompts (prompts.total) "
        "are held out of training; use a few percent, or 0 for no validation"
    ]


def test_bad_validation_keys_are_one_line_before_any_job():
    cfg = load(REPO / "config" / "config.yaml")
    check(cfg)
    cfg.train.val_samples = cfg.prompts.total
    with pytest.raises(UserError, match=r"config key train\.val_samples \(360\) leaves none of the 360"):
        check(cfg)
    cfg.train.val_samples, cfg.train.export = 0, "best"
    with pytest.raises(UserError, match=r"config key train\.export: best needs a validation split"):
        check(cfg)
    cfg.train.val_samples, cfg.train.max_steps, cfg.train.val_every = 4, 10, 11
    with pytest.raises(UserError, match=r"config key train\.val_every \(11\) is larger than the run \(10"):
        check(cfg)


def test_validation_rows_the_best_export_and_their_determinism(data, reference, tmp_path):
    root, shards = data
    out, proc = reference
    df, val = val_rows(out)
    assert "train: 40 samples" in proc.stderr  # 48 in the shards, 8 held out
    assert val["step"].tolist() == [2, 4, 6]  # every val_every steps and at the end
    assert df.loc[~df["step"].isin([2, 4, 6]), "val_sim_tau"].isna().all()  # empty where not evaluated
    assert set(df.columns) >= {"val_loss", "val_acc", "val_acc_pos_1", "val_acc_pos_7", "val_sim_tau"}
    # the export is the best validation step's, kept beside the last checkpoint (keep_checkpoints: 1)
    exported = json.loads((out / "export.json").read_text())
    best = int(val.loc[val["val_sim_tau"].idxmax(), "step"])
    assert exported["step"] == best and exported["last_step"] == 6 and "best validation" in exported["why"]
    run_dir = next((out / "checkpoints").iterdir())
    assert [p.name for p in (run_dir / "best").iterdir()] == [f"step-{best:08d}"]
    weights, kept = (
        load_file(out / "drafter" / "model.safetensors"),
        load_file(run_dir / "best" / f"step-{best:08d}" / "model.safetensors"),
    )
    assert all(weights[k].equal(kept[k].to(weights[k].dtype)) for k in weights)
    split = json.loads((out / "val_split.json").read_text())
    assert split["val_samples"] == 8 and split["ids"] == val_split(HiddenStore(shards).ids(), 8, 0)
    # the same run again: the same numbers; stopped after step 3 and resumed: the same rows and export
    again = tmp_path / "again"
    train(root, shards, again, extra=["--stop-at", "3"])
    train(root, shards, again)
    pd.testing.assert_frame_equal(val_rows(again)[1], val)
    pd.testing.assert_frame_equal(
        val_rows(again)[0].drop(columns="tokens_per_s"), df.drop(columns="tokens_per_s")
    )
    assert json.loads((again / "export.json").read_text()) == exported
    # train.export: last on the finished run exports the last step without training again (Snakemake
    # removes the outputs of a job before it runs)
    shutil.rmtree(again / "drafter")
    last = train(root, shards, again, cfg={**TRAIN, "export": "last"})
    assert "resumed from" in last.stderr and json.loads((again / "export.json").read_text())["step"] == 6
    step6 = load_file(again / "checkpoints" / run_dir.name / "step-00000006" / "model.safetensors")
    assert all(load_file(again / "drafter" / "model.safetensors")[k].equal(step6[k]) for k in step6)


def test_validation_does_not_change_what_trains(data, tmp_path):
    """The training rows of a run with validation are those of a run on the same 40 samples without."""
    root, shards = data
    store = HiddenStore(shards)
    held = set(val_split(store.ids(), 8, 0))
    from flashdraft.hidden import ShardMeta, manifest_path
    from flashdraft.hidden_write import open_shard, write_manifest

    path = tmp_path / "train-only.arrow"
    meta = ShardMeta(
        target="toy", target_layer_ids=store.layer_ids, hidden_size=store.hidden_size, dtype="bfloat16"
    )
    with open_shard(path, meta) as w:
        for i, sid in enumerate(store.ids()):
            if sid not in held:
                x = store[i]
                w.write(sid, x["input_ids"].tolist(), x["loss_mask"].tolist(), x["hidden"])
    write_manifest(manifest_path(path), w)
    with_val, without = tmp_path / "with", tmp_path / "without"
    train(root, shards, with_val, cfg={**TRAIN, "export": "last"})
    train(root, [str(path)], without, cfg={**TRAIN, "val_samples": 0, "val_every": 0, "export": "last"})
    a, b = (pd.read_csv(o / "metrics.csv") for o in (with_val, without))
    cols = ["step", "loss", "acc", "sim_tau", "grad_norm"]
    pd.testing.assert_frame_equal(a[cols], b[cols])
    assert list(b.columns) == [c for c in a.columns if not c.startswith("val_")]  # no validation columns
    wa, wb = (load_file(o / "drafter" / "model.safetensors") for o in (with_val, without))
    assert all(wa[k].equal(wb[k]) for k in wa)


def test_val_every_larger_than_the_run_is_one_line_before_training(data, tmp_path):
    root, shards = data
    proc = train(root, shards, tmp_path, cfg={**TRAIN, "val_every": 7}, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "config key train.val_every (7) is larger than the run (6" in proc.stderr.strip().splitlines()[-1]
    assert not list((tmp_path / "checkpoints").rglob("step-*"))


@pytest.mark.parametrize("val_samples", [48, None], ids=["set", "default"])
def test_a_split_of_every_sample_is_one_line_before_training(data, tmp_path, val_samples):
    """48 samples in the shards: a split of 48, or the default (64, the key unset), leaves none to train."""
    root, shards = data
    cfg = {k: v for k, v in TRAIN.items() if k != "val_samples"}
    if val_samples is not None:
        cfg["val_samples"] = val_samples
    proc = train(root, shards, tmp_path, cfg=cfg, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    n = val_samples or 64
    assert (
        f"config key train.val_samples ({n}) leaves none of the 48 samples for training"
        in proc.stderr.strip().splitlines()[-1]
    )
    assert not list((tmp_path / "checkpoints").rglob("step-*"))


def test_stream_plan_holds_the_validation_samples_out_and_reads_them_back(tmp_path):
    import random

    rng, files = random.Random(0), []
    for s, n in enumerate([30, 25]):
        samples = [
            (f"s{s}-{i}", [rng.randrange(3, 500) for _ in range(40 + i)], [0] * 20 + [1] * (20 + i))
            for i in range(n)
        ]
        files.append(tmp_path / f"tokens-{s}.parquet")
        write_tokens(samples, files[-1], {"shard": s})
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "num_hidden_layers": 6, "hidden_size": 128})
    )
    cfg = TrainConfig(epochs=2, batch_tokens=256, buckets=[64, 128], val_samples=6, seed=3)
    from flashdraft.config import DrafterConfig

    plan = data_plan(
        target,
        [str(f) for f in files],
        HiddenConfig(mode="stream", chunk_tokens=2000),
        DrafterConfig(num_layers=2),
        cfg,
        1,
        tmp_path / "plan",
    )
    ids = [f"s{s}-{i}" for s, n in enumerate([30, 25]) for i in range(n)]
    held = val_split(ids, 6, 3)
    p = Plan(tmp_path / "plan")
    assert plan["samples"] == 49 and p.val_split()["ids"] == held
    samples = pd.read_parquet(tmp_path / "plan" / "samples.parquet")
    assert samples["id"].tolist() == [i for i in ids if i not in held]  # store order, without the split
    assert [ids[r] for r in samples["row"]] == samples["id"].tolist()  # each one's row in the tokens files
    val_ids, rows, lengths = p.val_samples()
    assert [ids[r] for r in rows] == val_ids and lengths == [40 + int(i.split("-")[1]) for i in val_ids]
    trained = {i for c in p.chunks for i in p.chunk_samples(c)}
    assert max(trained) < 49  # the run's numbering has no validation sample
    with pytest.raises(UserError, match=r"config key train\.val_samples"):
        p.check(TrainConfig(epochs=2, batch_tokens=256, buckets=[64, 128], val_samples=0, seed=3), 1)


def test_the_report_shows_the_validation_curve_and_the_exported_step(reference):
    from flashdraft.report import training_section

    out, _ = reference
    html = training_section(out / "metrics.csv")
    exported = json.loads((out / "export.json").read_text())
    assert 'id="train-val-tau"' in html and "<h3>Validation</h3>" in html
    assert f"Exported step {exported['step']} of 6" in html and "best validation sim_tau" in html


@pytest.mark.slow
def test_two_processes_validate_to_the_same_numbers_as_one(data, tmp_path):
    from flashdraft.launch import torchrun_argv

    root, shards = data
    cfg = {**TRAIN, "global_batch_tokens": 1024}  # the same global batch on 1 and 2 processes
    one, two = tmp_path / "one", tmp_path / "two"
    train(root, shards, one, cfg=cfg)
    script = str(REPO / "scripts" / "train.py")
    cmd = torchrun_argv(sys.executable, script, 2) + [
        "--cfg",
        json.dumps(cfg),
        "--drafter-cfg",
        json.dumps(DRAFTER),
        "--target",
        str(root / "target"),
        "--checkpoints",
        str(two / "checkpoints"),
        "--metrics",
        str(two / "metrics.csv"),
        "--out",
        str(two / "drafter"),
        *shards,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    pd.testing.assert_frame_equal(val_rows(one)[1], val_rows(two)[1])
    assert json.loads((one / "export.json").read_text()) == json.loads((two / "export.json").read_text())


def test_validation_never_computes_every_attention_score_densely(data):
    """Validation runs eagerly; flex attention there would hold all b*h*Q*K scores at once (20 GiB per
    micro-batch at the production shape): the largest allocation stays below that, with the same metrics
    as training's attention gives."""
    import dataclasses

    import torch
    from torch.profiler import ProfilerActivity, profile

    from flashdraft.config import DrafterConfig
    from flashdraft.distributed import setup_dist
    from flashdraft.loss import num_anchor_slots
    from flashdraft.train_step import build_step, load_spec
    from flashdraft.validate import Validator

    root, shards = data
    cfg = TrainConfig(**{**TRAIN, "attention": "flex"})
    spec = load_spec(root / "target", DrafterConfig(**DRAFTER))
    d = setup_dist()
    val = Validator(HiddenStore(shards[:1]), cfg, d, torch.float32)
    got = {}
    for attention in ("flex", "sdpa"):
        step = build_step(dataclasses.replace(cfg, attention=attention), spec, root / "target", d.device)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            got[attention] = val.evaluate(step, step.model, False)
        largest = max(e.cpu_memory_usage for e in prof.events())
        scores = 0  # float32 scores of the largest micro-batch: rows * heads * block queries * keys
        for rows in val.batches:
            ids = val.collate([val.store[i] for i in rows])["input_ids"]
            q = num_anchor_slots(ids.shape[1], cfg.max_anchors, DRAFTER["block_size"]) * DRAFTER["block_size"]
            scores = max(scores, ids.shape[0] * spec.num_heads * q * (ids.shape[1] + q) * 4)
        assert 0 < largest < 0.75 * scores, (attention, largest, scores)
    assert got["flex"] == pytest.approx(got["sdpa"], rel=1e-5)
