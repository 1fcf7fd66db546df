"""Stream mode: the data plan, chunked training as a chain of jobs, and the real DAG against store mode."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import REPO, SMALL, copy_toy, job_counts, shared_pycache, snakemake, write_config
from safetensors.torch import load_file

from flashdraft.batches import epoch_batches, micro_per_step
from flashdraft.config import DrafterConfig, HiddenConfig, TrainConfig
from flashdraft.errors import UserError
from flashdraft.stream import ROW_BYTES, cut_chunks, data_plan, write_tokens
from flashdraft.timeline import DiskWatch, job_times, latest_log, overlap_s
from flashdraft.train_data import Chunk, Plan

DRAFT = DrafterConfig(num_layers=2)

# ---- the plan ----


def test_cut_chunks_takes_whole_steps_within_the_budget():
    assert cut_chunks([3, 3, 3, 3, 3], 7) == [(0, 2), (2, 4), (4, 5)]
    assert cut_chunks([5, 1, 1, 5], 7) == [(0, 3), (3, 4)]
    assert cut_chunks([4], 4) == [(0, 1)]


def _tokens(tmp_path, lengths_per_shard, seed=0):
    import random

    rng, files = random.Random(seed), []
    for s, lengths in enumerate(lengths_per_shard):
        samples = [
            (f"s{s}-{i}", [rng.randrange(3, 500) for _ in range(n)], [0] * (n // 2) + [1] * (n - n // 2))
            for i, n in enumerate(lengths)
        ]
        files.append(tmp_path / f"tokens-{s}.parquet")
        write_tokens(samples, files[-1], {"shard": s})
    return [str(f) for f in files]


def _target(tmp_path, layers=6, hidden=128):
    d = tmp_path / "target"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "num_hidden_layers": layers, "hidden_size": hidden})
    )
    return d


def test_plan_chunks_every_epoch_into_whole_steps_in_store_order(tmp_path):
    lengths = [[30 + (7 * i) % 90 for i in range(40)], [25 + (11 * i) % 100 for i in range(33)]]
    files = _tokens(tmp_path, lengths)
    train = TrainConfig(
        epochs=3, batch_tokens=256, global_batch_tokens=512, buckets=[64, 128], seed=3, val_samples=0
    )
    hidden = HiddenConfig(mode="stream", chunk_tokens=1600)
    plan = data_plan(_target(tmp_path), files, hidden, DRAFT, train, 1, tmp_path / "plan")
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
            want = [i for b in batches[first : first + (c["end_step"] - c["start_step"]) * g] for i in b]
            assert table["sample"].tolist() == want  # the epoch's micro-batches, in order
            assert c["tokens"] == sum(flat[i] for i in want)
            assert c["bytes"] == c["tokens"] * plan["bytes_per_token"] + len(want) * ROW_BYTES
            assert c["bytes"] <= hidden.chunk_tokens * plan["bytes_per_token"]
            assert table["id"].tolist() == [ids[i] for i in want]
    assert plan["total_steps"] == steps
    assert plan["peak_bytes"] <= 2 * hidden.chunk_tokens * plan["bytes_per_token"]


@pytest.mark.parametrize(
    "hidden, key",
    [
        (HiddenConfig(mode="stream", chunk_tokens=100), "hidden.chunk_tokens"),
        (HiddenConfig(mode="stream", disk_budget="300kB"), "hidden.disk_budget"),
        (HiddenConfig(mode="stream"), "hidden.disk_budget"),
    ],
    ids=["chunk-below-one-step", "budget-below-one-step", "no-budget"],
)
def test_a_chunk_smaller_than_one_step_is_one_line_naming_the_key(tmp_path, hidden, key):
    files = _tokens(tmp_path, [[100] * 20])
    train = TrainConfig(epochs=1, batch_tokens=256, global_batch_tokens=512, buckets=[128], val_samples=0)
    with pytest.raises(UserError, match=re.escape(f"config key {key}")) as e:
        data_plan(_target(tmp_path), files, hidden, DRAFT, train, 1, tmp_path / "plan")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["hidden.disk_budget", "hidden.chunk_tokens"])
def test_a_chunk_too_small_for_one_step_fails_before_any_job_with_the_data_plan_s_least(tmp_path, key):
    """config_check.check (before any job), the planner and the data plan size a step's chunk with one
    function (config.stream_least): the check from the config's bound of a step, the data plan from its real
    steps. Samples as long as the bucket and hidden.max_length fill every step to that bound, so all three
    name the same smallest value, in one line; that value passes the check and makes a plan, one less
    fails."""
    from flashdraft.config import Config, from_dict
    from flashdraft.config_check import check
    from flashdraft.io import human_bytes
    from flashdraft.plan import plan

    files = _tokens(tmp_path, [[128] * 20])
    target = {
        "model_type": "qwen3",
        "num_hidden_layers": 6,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 576,
        "max_position_embeddings": 4096,
    }
    train = {"epochs": 1, "batch_tokens": 256, "global_batch_tokens": 512, "buckets": [128], "val_samples": 0}

    def config(value):
        return from_dict(
            Config,
            {
                "hidden": {"mode": "stream", "max_length": 128, key.split(".")[1]: value},
                "drafter": {"num_layers": 2},
                "train": train,
                "prompts": {"total": 20},
            },
        )

    per_token = 2 * 128 * 2 + 5  # 2 fused layers of 128 in bf16, the id and the mask
    step = 2 * 2 * (128 * per_token + ROW_BYTES)  # 2 micro-batches of 2 rows of 128 tokens
    tokens = -(-step // per_token)
    least = tokens if key == "hidden.chunk_tokens" else 2 * tokens * per_token
    want = f">= {least}" if key == "hidden.chunk_tokens" else f">= {human_bytes(least)} ({least} bytes"
    small = config(least - 1)
    with pytest.raises(UserError, match=re.escape(f"config key {key}")) as before_any_job:
        check(small, target)
    line = str(before_any_job.value)
    assert "\n" not in line and want in line and "one optimizer step" in line
    assert plan(small, tmp_path / "no-results", 2, None, target)["modes"]["stream"] == line  # the planner's
    with pytest.raises(UserError, match=re.escape(f"config key {key}")) as in_the_job:
        data_plan(_target(tmp_path), files, small.hidden, DRAFT, small.train, 1, tmp_path / "small")
    assert want in str(in_the_job.value)
    check(config(least), target)
    made = data_plan(_target(tmp_path), files, config(least).hidden, DRAFT, small.train, 1, tmp_path / "plan")
    assert made["peak_bytes"] <= (least if key == "hidden.disk_budget" else least * per_token * 2)


def test_a_plan_made_for_another_training_names_the_key(tmp_path):
    files = _tokens(tmp_path, [[60] * 30])
    train = TrainConfig(epochs=2, batch_tokens=256, global_batch_tokens=512, buckets=[64], val_samples=0)
    data_plan(
        _target(tmp_path),
        files,
        HiddenConfig(mode="stream", chunk_tokens=800),
        DRAFT,
        train,
        1,
        tmp_path / "plan",
    )
    plan = Plan(tmp_path / "plan")
    plan.check(train, 1)
    for change, key in (
        ({"epochs": 3}, "train.epochs"),
        ({"seed": 1}, "train.seed"),
        ({"batch_tokens": 128}, "train.batch_tokens"),
    ):
        with pytest.raises(UserError, match=re.escape(f"config key {key}")):
            plan.check(TrainConfig(**{**train.__dict__, **change}), 1)
    one_each = TrainConfig(**{**train.__dict__, "global_batch_tokens": 0})  # a micro-batch per process
    data_plan(
        _target(tmp_path),
        files,
        HiddenConfig(mode="stream", chunk_tokens=800),
        DRAFT,
        one_each,
        1,
        tmp_path / "plan1",
    )
    Plan(tmp_path / "plan1").check(one_each, 1)
    with pytest.raises(UserError, match="made for 1 training process"):
        Plan(tmp_path / "plan1").check(one_each, 2)


def test_a_chunk_store_reads_the_run_s_sample_numbers_and_pickles_for_loader_workers(tmp_path):
    import pickle

    from conftest import toy_hidden_shards

    from flashdraft.hidden import HiddenStore, StoreView

    shards = toy_hidden_shards(tmp_path, {"num_layers": 2, "block_size": 8}, shards=2, rows=6)
    store = HiddenStore(shards)
    local = {100 + j: j for j in range(len(store))[::-1]}  # run numbers -> rows of these shards
    chunk = pickle.loads(pickle.dumps(StoreView(store, local)))  # as a DataLoader worker gets it
    assert len(chunk) == len(store) and chunk.layer_ids == store.layer_ids
    for i, j in local.items():
        assert chunk[i]["id"] == store[j]["id"] and chunk[i]["hidden"].equal(store[j]["hidden"])
    assert store.ids() == [store[j]["id"] for j in range(len(store))]


def test_stream_shards_hold_the_last_hidden_state_when_the_family_needs_it(tmp_path):
    """The plan counts the last hidden state's bytes; a chunk part and the validation shard (hidden_chunk,
    hidden_val, through their scripts' --last-hidden) hold it, and the chunk's store gives it per sample."""
    import runpy

    from flashdraft.config import TargetConfig, ToyConfig, to_json
    from flashdraft.hidden import HiddenStore, manifest_path
    from flashdraft.toy import build_toy_target
    from flashdraft.train_data import planned_store

    target = tmp_path / "toy"
    build_toy_target(ToyConfig(steps=0, num_docs=200), str(target))  # H=128, 6 layers
    files = _tokens(tmp_path, [[40 + (13 * i) % 60 for i in range(24)]])
    train = TrainConfig(epochs=1, batch_tokens=256, global_batch_tokens=512, buckets=[128], val_samples=3)
    hidden = HiddenConfig(mode="stream", disk_budget="2MB")
    plans = {
        last: data_plan(target, files, hidden, DRAFT, train, 1, tmp_path / f"plan-{last}", last_hidden=last)
        for last in (False, True)
    }
    assert plans[True]["bytes_per_token"] == plans[False]["bytes_per_token"] + 2 * 128  # bf16, H more
    assert plans[True]["last_hidden"] and plans[True]["chunk_tokens"] < plans[False]["chunk_tokens"]

    plan_dir = tmp_path / "plan-True"
    args = [
        "--cfg",
        to_json(hidden),
        "--drafter-cfg",
        to_json(DRAFT),
        "--last-hidden",
        "--target-cfg",
        to_json(TargetConfig(path=str(target), dtype="float32")),
        "--plan",
        str(plan_dir),
    ]
    part, val = tmp_path / "chunk" / "part-00000.arrow", tmp_path / "val.arrow"
    runpy.run_path(str(REPO / "scripts" / "hidden_chunk.py"))["main"](
        [*args, "--epoch", "0", "--chunk", "0", "--part", "0", "--parts", "1", "--out", str(part)]
    )
    runpy.run_path(str(REPO / "scripts" / "hidden_val.py"))["main"]([*args, "--out", str(val)])
    for shard in (part, val):
        assert json.loads(manifest_path(shard).read_text())["last_hidden"] is True
    plan = Plan(plan_dir)
    chunk = planned_store(plan, plan.find(0, 0), [str(part)])
    for i in plan.chunk_samples(plan.find(0, 0))[:3]:
        item = chunk[i]
        assert item["last_hidden"].shape == (len(item["input_ids"]), 128) and item["hidden"].shape[1] == 256
    assert plan.val_store([str(val)]).last_hidden and "last_hidden" in HiddenStore([val])[0]


def _checkpoints(run_dir, steps):
    for step in steps:
        (run_dir / f"step-{step:08d}").mkdir(parents=True)
        (run_dir / f"step-{step:08d}" / "state.json").write_text(json.dumps({"step": step}))


def _steps(run_dir):
    from flashdraft.checkpoint import checkpoint_dirs, checkpoint_step

    return [checkpoint_step(p) for p in checkpoint_dirs(run_dir)]


def test_a_chunk_resumes_a_killed_attempt_or_starts_where_the_previous_chunk_ended(tmp_path):
    from flashdraft.train_data import chunk_resume_point, chunk_trained, prune_chunk

    run = tmp_path / "killed"
    _checkpoints(run, [10, 12, 14])  # chunk [10, 20) was killed after step 14
    assert chunk_resume_point(run, 10, 20).name == "step-00000014" and _steps(run) == [10, 12, 14]
    _checkpoints(run, [20])
    prune_chunk(run, 10, 20)  # once it has finished, a chunk keeps its start and its end only
    assert _steps(run) == [10, 20]
    _checkpoints(tmp_path / "ends", [0, 5, 10, 15, 20])
    prune_chunk(tmp_path / "ends", 15, 20, keep=3)  # of the chunks' ends, the last train.keep_checkpoints
    assert _steps(tmp_path / "ends") == [10, 15, 20]

    assert chunk_resume_point(tmp_path / "fresh", 0, 10) is None  # the first chunk starts from scratch

    run = tmp_path / "redone"
    _checkpoints(run, [20, 25, 30])  # chunks to step 30 done, [20, 30) asked again: the run got past it
    assert chunk_trained(run, 30).name == "step-00000030" and chunk_trained(run, 20).name == "step-00000020"
    assert chunk_trained(run, 31) is None and _steps(run) == [20, 25, 30]

    # the checkpoint a chunk starts from is gone, and none at or past its end (removed by hand, say): one
    # line names the chunk to rerun from, the one holding the latest checkpoint kept, and nothing is removed
    chunks = [Chunk(0, i, i, 10 * i, 10 * i + 10, 1, 1, 1) for i in range(4)]
    run = tmp_path / "removed"
    _checkpoints(run, [10, 14])  # chunk-00001 was killed after step 14, then steps 20 on were removed
    with pytest.raises(
        UserError,
        match=r"no checkpoint at step 30 .*\(kept: 10, 14\).* rerun from chunk "
        r"epoch-000/chunk-00001, which resumes at step 14 \(snakemake --forcerun",
    ):
        chunk_resume_point(run, 30, 40, chunks)
    with pytest.raises(UserError, match="kept: none.* chunk epoch-000/chunk-00000, which starts at step 0"):
        chunk_resume_point(tmp_path / "gone", 20, 30, chunks)
    assert _steps(run) == [10, 14]


def _trained_plan(tmp_path):
    """A data plan of four chunks (no hidden states: the tests below find them trained already), its training
    config and its run directory."""
    from flashdraft.checkpoint import run_key

    files = _tokens(tmp_path, [[60] * 30])
    train = TrainConfig(
        epochs=2,
        batch_tokens=256,
        global_batch_tokens=512,
        buckets=[64],
        val_samples=0,
        compile=False,
        checkpoint_every=1,
    )
    data_plan(
        _target(tmp_path),
        files,
        HiddenConfig(mode="stream", chunk_tokens=1000),
        DRAFT,
        train,
        1,
        tmp_path / "plan",
    )
    plan = Plan(tmp_path / "plan")
    assert len(plan.chunks) == 4 and all(c.end_step - c.start_step >= 2 for c in plan.chunks)
    return train, plan, tmp_path / "checkpoints" / run_key(train, DRAFT, [], plan.fingerprint)


def _train_chunk(tmp_path, train, plan, chunk, capsys) -> tuple[dict, str]:
    """scripts/train.py on one chunk of the plan, in this process: its --done summary and its log."""
    import importlib.util
    from dataclasses import asdict

    from flashdraft.config import to_json

    spec = importlib.util.spec_from_file_location("train_script", REPO / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    done = tmp_path / "done" / f"{chunk.name}.json"
    capsys.readouterr()
    script.main(
        [
            "--cfg",
            json.dumps(asdict(train)),
            "--drafter-cfg",
            to_json(DRAFT),
            "--target",
            str(tmp_path / "target"),
            "--checkpoints",
            str(tmp_path / "checkpoints"),
            "--plan",
            str(plan.dir),
            "--chunk",
            chunk.name,
            "--done",
            str(done),
            str(tmp_path / "never-read.arrow"),
        ]
    )
    return json.loads(done.read_text()), capsys.readouterr().err


def test_a_chunk_of_a_finished_run_is_done_without_training_or_deleting(tmp_path, capsys):
    """A rerun of a chunk of a finished run (a changed train key the chunks do not need, an earlier seed's
    plan made again, --forcerun): its run directory holds checkpoints past the chunk's end, so it is done."""
    train, plan, run = _trained_plan(tmp_path)
    ends = [c.end_step for c in plan.chunks]
    _checkpoints(run, ends[-3:])  # train.keep_checkpoints: 3 left the last three chunks' ends
    for chunk in plan.chunks:  # the first (its start: step 0), one whose start was pruned, the last
        done, log = _train_chunk(tmp_path, train, plan, chunk, capsys)
        assert done["chunk"] == {**done["chunk"], "start_step": chunk.start_step, "end_step": chunk.end_step}
        assert done["step"] == chunk.end_step
        assert f"{chunk.name} is trained already" in log and "new run" not in log
        assert _steps(run) == ends[-3:]  # nothing removed


def test_a_chunk_stopped_at_its_last_step_is_done_on_the_rerun(tmp_path, capsys):
    """SIGTERM at a chunk's last step saves that step's checkpoint and exits 143 before the chunk's
    checkpoints are pruned: the rerun keeps the end, removes the checkpoints inside the chunk (the finished
    job's pruning) and trains nothing."""
    train, plan, run = _trained_plan(tmp_path)
    first, second = plan.chunks[:2]
    _checkpoints(run, range(first.end_step, second.end_step + 1))  # saved every step, the end last
    done, log = _train_chunk(tmp_path, train, plan, second, capsys)
    assert done["step"] == second.end_step and f"{second.name} is trained already" in log
    assert _steps(run) == [first.end_step, second.end_step]


def test_disk_watch_keeps_the_peak_while_files_and_folders_come_and_go(tmp_path):
    watch = DiskWatch(tmp_path / "hidden", every_s=0.001)
    (tmp_path / "hidden" / "a").mkdir(parents=True)
    (tmp_path / "hidden" / "a" / "x.arrow").write_bytes(b"0" * 5000)

    def sampled_thrice():
        start = watch.samples
        for _ in range(10_000):
            if watch.samples >= start + 3:
                return True
            time.sleep(0.001)
        return False

    assert sampled_thrice()  # with the file there
    shutil.rmtree(tmp_path / "hidden")
    assert sampled_thrice()  # and after its folder is gone: the sampler lives on
    assert watch.close() == 5000


# ---- the real DAG: stream mode against store mode, restarts, the disk bound and the overlap ----

# One sample per forward (hidden.batch_tokens: 1) in both modes: a forward's batch composition changes its
# float reductions, so only then are the two modes' hidden states the same bits (see docs/stream.md).
# One training thread in both (set below), so that a chunk's hidden parts can run beside its training.
# 2 validation samples: their shard, kept through the run, fits the disk budget beside the ring of chunks.
# Both modes fine-tune the drafter in init/ (a new one of another seed, exported into the work dir).
# hidden.max_length 64 (the toy's samples run to 65 tokens): the check before any job counts a step at
# samples of up to that length, so a 1.2 MB budget (three chunks per epoch) holds its bound of one step.
# Eager steps in both modes (train.compile: false): what is compared is which samples and steps the chunks
# train, bit for bit, not the compiled step (its warmup cache and hits: test_workflow's small_run); a
# compile in each of the three runs below (store, stream, killed and rerun) took 30-40 s for nothing asserted.
STREAM_SMALL = {
    **SMALL,
    "train.epochs": 2,
    "hidden.batch_tokens": 1,
    "train.checkpoint_every": 1,
    "train.val_samples": 2,
    "train.val_every": 2,
    "drafter.init_from": "init",
    "hidden.max_length": 64,
    "train.compile": False,
}
THREADS = ["--set-threads", "train=1", "train_chunk=1", "warmup=1"]
DRAFTER = "results/drafter/config.json"
INIT_LINE = "drafter: starting from drafter.init_from init"


def _stream_config(work, **hidden):
    cfg = write_config(work / "config.yaml", STREAM_SMALL)
    data = yaml.safe_load(cfg.read_text())
    data["hidden"].update({"mode": "stream", **hidden})
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    return cfg


def _fresh_copy(src, dst):
    """A copy of a store-mode run up to its regenerated answers (same toy target, prompts, answers)."""
    shutil.copytree(src, dst, symlinks=True)
    for d in ("drafter", "train", "checkpoints", "hidden", "compile_cache", "eval"):
        shutil.rmtree(dst / "results" / d, ignore_errors=True)
    return dst


def _init_drafter(work, toy):
    """The toy target (the small config's: small_toy), then a new drafter for it (seed 1, not the runs'
    train.seed) exported into init/."""
    import torch

    from flashdraft.drafter_io import export_drafter
    from flashdraft.model import DFlashDrafter
    from flashdraft.train_step import load_spec

    copy_toy(toy, work)
    spec = load_spec(work / "results" / "toy" / "target", DrafterConfig(num_layers=2, block_size=8))
    torch.manual_seed(1)
    export_drafter(DFlashDrafter(spec), spec, work / "init")


@pytest.fixture(scope="module")
def store_run(tmp_path_factory, small_toy):
    work = tmp_path_factory.mktemp("store")
    _init_drafter(work, small_toy)
    config = write_config(work / "config.yaml", STREAM_SMALL)
    snakemake(work, "--cores", "2", DRAFTER, *THREADS, config=config)
    return work


@pytest.fixture(scope="module")
def stream_run(store_run, tmp_path_factory):
    work = _fresh_copy(store_run, tmp_path_factory.mktemp("stream") / "run")
    config = _stream_config(work, disk_budget="1.2MB")
    watch = DiskWatch(work / "results" / "hidden")
    proc = snakemake(work, "--cores", "2", DRAFTER, *THREADS, config=config)
    return work, config, proc, watch.close()


def _weights(work):
    return load_file(work / "results" / "drafter" / "model.safetensors")


def _metrics(work):
    return pd.read_csv(work / "results" / "train" / "metrics.csv").drop(columns=["tokens_per_s"])


@pytest.mark.slow
def test_stream_mode_trains_the_same_samples_steps_and_weights_as_store_mode(store_run, stream_run):
    work = stream_run[0]
    plan = json.loads((work / "results" / "plan" / "plan.json").read_text())
    assert plan["chunk_tokens_from"] == "hidden.disk_budget"
    assert all(sum(c["epoch"] == e for c in plan["chunks"]) >= 3 for e in range(2))  # 3+ chunks per epoch
    pd.testing.assert_frame_equal(_metrics(work), _metrics(store_run))  # every logged step, bit for bit
    a, b = _weights(work), _weights(store_run)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    # the chunks' hidden states are gone once trained; the plan, the checkpoints and the validation shard stay
    assert [p.name for p in (work / "results" / "hidden").rglob("*.arrow")] == ["val.arrow"]
    assert len(list((work / "results" / "train" / "chunks").rglob("*.json"))) == len(plan["chunks"])


@pytest.mark.slow
def test_stream_mode_starts_from_init_from_once_and_validates_as_store_mode(store_run, stream_run):
    """drafter.init_from starts the first chunk; every later chunk resumes from its checkpoint. With the
    metrics (the first loss too) and weights equal to store mode's above, the chain is store mode's
    fine-tune; the validation rows come every train.val_every steps and at the end, as in store mode."""
    work = stream_run[0]
    plan = json.loads((work / "results" / "plan" / "plan.json").read_text())
    names = [f"epoch-{c['epoch']:03d}/chunk-{c['chunk']:05d}" for c in plan["chunks"]]
    logs = [(work / "results" / "logs" / "train_chunk" / f"{n}.log").read_text() for n in names]
    assert INIT_LINE in logs[0] and "resumed from" not in logs[0]
    assert all(INIT_LINE not in t and "resumed from" in t for t in logs[1:])
    assert INIT_LINE in (store_run / "results" / "logs" / "train.log").read_text()
    assert INIT_LINE not in (work / "results" / "logs" / "train.log").read_text()  # the export job
    metrics = pd.read_csv(work / "results" / "train" / "metrics.csv")
    last = plan["total_steps"]
    val = metrics.dropna(subset=["val_sim_tau"])
    assert val["step"].tolist() == sorted({*range(2, last + 1, 2), last})
    assert val[["val_loss", "val_acc", "val_sim_tau"]].notna().all().all()
    split = [json.loads((w / "results" / "train" / "val_split.json").read_text()) for w in (work, store_run)]
    assert split[0] == split[1] and split[0]["val_samples"] == 2
    assert json.loads((work / "results" / "hidden" / "val-verify.json").read_text())["ok"] is True


@pytest.mark.slow
def test_a_corrupt_validation_shard_stops_the_run_before_a_chunk_trains_on_it(stream_run, tmp_path):
    work = tmp_path / "run"
    shutil.copytree(stream_run[0], work, symlinks=True)
    val = work / "results" / "hidden" / "val.arrow"
    data = bytearray(val.read_bytes())
    data[len(data) // 2] ^= 0xFF
    val.write_bytes(bytes(data))
    proc = snakemake(work, "--cores", "2", DRAFTER, *THREADS, config=stream_run[1], check=False)
    assert proc.returncode != 0
    log = (work / "results" / "logs" / "hidden_val_verify.log").read_text()
    assert "1 of 1 hidden shard(s) failed verification" in log and "val.arrow" in log
    assert not val.exists() and len(list((work / "results" / "hidden" / "bad").glob("val.*.arrow"))) == 1
    assert "train_chunk" not in {j.rule for j in job_times(latest_log(work))}


@pytest.mark.slow
def test_the_plan_keeps_the_tokenizer_s_length_so_training_never_imports_transformers(stream_run):
    work = stream_run[0]
    target = work / "results" / "toy" / "target"
    plan = Plan(work / "results" / "plan")
    check = (
        "import sys, json; from flashdraft.config import DrafterConfig;"
        "from flashdraft.train_step import load_spec;"
        f"spec = load_spec({str(target)!r}, DrafterConfig(num_layers=2), {plan.tokenizer_length});"
        "print(json.dumps([spec.mask_token_id, 'transformers' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout
    from transformers import AutoTokenizer

    assert plan.tokenizer_length == len(AutoTokenizer.from_pretrained(target))
    assert json.loads(out) == [plan.tokenizer_length, False]  # MASK where the tokenizer puts it, no import


@pytest.mark.slow
def test_stream_mode_writes_the_next_chunk_while_one_trains_within_the_disk_budget(stream_run):
    work, _, _, peak = stream_run
    plan = json.loads((work / "results" / "plan" / "plan.json").read_text())
    assert 0 < peak <= plan["disk_budget"] == 1_200_000
    assert plan["peak_bytes"] <= plan["disk_budget"]
    jobs = {
        (j.rule, j.wildcards.get("chunk")): j
        for j in job_times(latest_log(work))
        if j.wildcards.get("part", "00000") == "00000"
    }
    names = [f"epoch-{c['epoch']:03d}/chunk-{c['chunk']:05d}" for c in plan["chunks"]]
    # the next chunk's shard job ran while this one trained
    overlapped = sum(
        overlap_s(jobs["train_chunk", cur], jobs["hidden_chunk", nxt]) > 0
        for cur, nxt in zip(names, names[1:], strict=False)
    )
    assert overlapped >= len(names) // 2


def _wait_for(pattern, proc, timeout=900):
    """The pid of a process whose command line matches `pattern`, once one runs."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, "the run ended before the process to kill started"
        for d in Path("/proc").iterdir():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, ValueError):
                continue
            launcher = re.search(r"flashdraft\.gpu|torch\.distributed\.run|torchrun", cmd)
            if re.search(pattern, cmd) and not launcher:
                return int(d.name)
        time.sleep(0.05)
    raise AssertionError(f"no process matched {pattern}")


def _background(work, config, *args):
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "workflow" / "Snakefile"),
        "-d",
        str(work),
        "--configfile",
        str(config),
        "--cores",
        "2",
        DRAFTER,
        *args,
        *THREADS,
    ]
    env = shared_pycache({k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"})
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.mark.slow
def test_killed_shard_and_training_jobs_rerun_to_the_same_weights(store_run, stream_run, tmp_path):
    work = _fresh_copy(store_run, tmp_path / "run")
    config = _stream_config(work, disk_budget="1.2MB")
    plan_names = [
        f"epoch-{c['epoch']:03d}/chunk-{c['chunk']:05d}"
        for c in json.loads((stream_run[0] / "results" / "plan" / "plan.json").read_text())["chunks"]
    ]
    # kill -9 a shard job of the fourth chunk while it writes
    proc = _background(work, config)
    epoch, chunk = int(plan_names[3][6:9]), int(plan_names[3][-5:])
    os.kill(_wait_for(rf"hidden_chunk\.py .*--epoch {epoch} --chunk {chunk} ", proc), signal.SIGKILL)
    assert proc.wait() != 0
    # kill -9 the training of the fifth chunk once it has saved a checkpoint inside the chunk
    proc = _background(work, config)
    pid = _wait_for(rf"train\.py .*--chunk {plan_names[4]}", proc)
    ckpts = work / "results" / "checkpoints"
    start = json.loads((work / "results" / "plan" / "plan.json").read_text())["chunks"][4]["start_step"]
    while not any(int(p.name[5:]) > start for p in ckpts.glob("*/step-*") if (p / "state.json").exists()):
        assert proc.poll() is None
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    assert proc.wait() != 0
    snakemake(work, "--cores", "2", DRAFTER, *THREADS, config=config)
    assert "resumed from" in (work / "results" / "logs" / "train_chunk" / f"{plan_names[4]}.log").read_text()
    ran = [j.wildcards["chunk"] for j in job_times(latest_log(work)) if j.rule == "train_chunk"]
    assert ran == plan_names[4:]  # the killed chunk onward
    a, b = _weights(work), _weights(stream_run[0])
    assert all(a[k].equal(b[k]) for k in a)
    pd.testing.assert_frame_equal(_metrics(work), _metrics(stream_run[0]))


@pytest.mark.slow
def test_forcerun_of_a_finished_run_s_chunk_recomputes_its_shards_and_trains_nothing(stream_run, tmp_path):
    work = tmp_path / "run"
    shutil.copytree(stream_run[0], work, symlinks=True)
    plan = json.loads((work / "results" / "plan" / "plan.json").read_text())
    names = [f"epoch-{c['epoch']:03d}/chunk-{c['chunk']:05d}" for c in plan["chunks"]]
    again = len(names) - 2
    forced = f"results/train/chunks/{names[again]}.json"
    proc = snakemake(work, "--cores", "2", DRAFTER, "--forcerun", forced, *THREADS, config=stream_run[1])
    ran = [(j.rule, j.wildcards.get("chunk")) for j in job_times(latest_log(work))]
    assert sorted(c for r, c in ran if r == "train_chunk") == names[again:]
    assert sorted(c for r, c in ran if r == "hidden_chunk") == names[again:]  # deleted shards, recomputed
    assert not {"data_plan", "hidden_tokens", "regenerate", "warmup"} & {r for r, _ in ran}
    assert "Job stats" in proc.stdout + proc.stderr
    for name in names[again:]:  # the run got past them: trained already, nothing removed
        log = (work / "results" / "logs" / "train_chunk" / f"{name}.log").read_text()
        assert f"{name} is trained already" in log
    steps = [
        sorted(p.name for p in (w / "results" / "checkpoints").glob("*/step-*"))
        for w in (work, stream_run[0])
    ]
    assert steps[0] == steps[1]
    a, b = _weights(work), _weights(stream_run[0])
    assert all(a[k].equal(b[k]) for k in a)


@pytest.mark.slow
def test_a_changed_plan_key_replans_and_keeps_what_was_trained(stream_run, tmp_path):
    work = tmp_path / "run"
    shutil.copytree(stream_run[0], work, symlinks=True)
    before = sorted(p.name for p in (work / "results" / "checkpoints").iterdir())
    config = _stream_config(work, disk_budget="1.2MB")
    data = yaml.safe_load(config.read_text())
    data["train"]["seed"] = 1
    config.write_text(yaml.safe_dump(data))
    dry = snakemake(work, "-n", "--cores", "2", DRAFTER, config=config).stdout
    assert "data_plan" in job_counts(dry)
    after = sorted(p.name for p in (work / "results" / "checkpoints").iterdir())
    assert after == before  # the old run's checkpoints stay, under their own run key


@pytest.mark.slow
def test_a_changed_export_key_exports_again_without_a_chunk_job_or_a_lost_checkpoint(stream_run, tmp_path):
    """train_chunk's params hold what the run key hashes of the configs, not the whole train section: a
    key the run key leaves out (train.export) reruns the export alone, from the finished run."""
    work = tmp_path / "run"
    shutil.copytree(stream_run[0], work, symlinks=True)
    ckpts = work / "results" / "checkpoints"
    before = sorted(str(p.relative_to(ckpts)) for p in ckpts.glob("*/step-*"))
    config = work / "config.yaml"
    data = yaml.safe_load(config.read_text())
    data["train"]["export"] = "best"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    dry = snakemake(work, "-n", "--cores", "2", DRAFTER, *THREADS, config=config).stdout
    assert job_counts(dry) == {"train": 1}, dry
    snakemake(work, "--cores", "2", DRAFTER, *THREADS, config=config)
    assert [j.rule for j in job_times(latest_log(work))] == ["train"]
    assert sorted(str(p.relative_to(ckpts)) for p in ckpts.glob("*/step-*")) == before
    assert json.loads((work / "results" / "train" / "export.json").read_text())["export"] == "best"


@pytest.mark.slow
def test_a_dspark_drafter_trains_in_stream_mode(store_run, tmp_path):
    """drafter.family dspark in stream mode: every chunk and the validation shard carry the target's last
    hidden state, the chunks train one run to a DSpark export, and the chunks' hidden states are gone."""
    from flashdraft.drafter_io import load_drafter
    from flashdraft.hidden import HiddenStore

    work = _fresh_copy(store_run, tmp_path / "run")
    dspark = {k: v for k, v in STREAM_SMALL.items() if k != "drafter.init_from"}
    dspark.update(
        {
            "drafter.family": "dspark",
            "drafter.block_size": 7,
            "drafter.dspark": {"markov_rank": 64},
            "train.gamma": 4.0,
            "train.epochs": 1,
            "train.compile": False,
        }
    )  # compiled: test_workflow
    config = write_config(work / "config.yaml", dspark)
    data = yaml.safe_load(config.read_text())
    data["hidden"].update({"mode": "stream", "disk_budget": "2MB"})
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    snakemake(work, "--cores", "2", DRAFTER, *THREADS, config=config)
    plan = json.loads((work / "results" / "plan" / "plan.json").read_text())
    assert len(plan["chunks"]) >= 2  # one epoch in several chunks: a boundary inside it
    val = HiddenStore([work / "results" / "hidden" / "val.arrow"])
    assert val[0]["last_hidden"].shape[0] == len(val[0]["input_ids"])
    assert [p.name for p in (work / "results" / "hidden").rglob("*.arrow")] == ["val.arrow"]
    drafter, spec = load_drafter(work / "results" / "drafter")
    assert spec.family == "dspark" and spec.block_size == 7
    metrics = _metrics(work)
    assert metrics["step"].iloc[-1] == plan["chunks"][-1]["end_step"]
    assert metrics[["loss", "l1", "val_expected_tau"]].iloc[-1].notna().all()
