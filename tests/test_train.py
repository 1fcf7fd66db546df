"""Training end to end: scripts/train.py in real processes (torchrun, gloo on the CPU), DDP and FSDP, resumes
on other process counts, signals, and compiled and float8 training on GPUs. Its parts have their own files:
test_batches, test_checkpoint, test_distributed, test_compile_cache."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import cache_misses, toy_hidden_shards
from train_helpers import (
    COMPILE_ERROR,
    DRAFTER,
    TRAIN,
    assert_no_autotuning,
    fp8_ready,
    losses,
    read_rows,
    run,
    tensorboard_losses,
    train_cmd,
    warmup_cmd,
)

from flashdraft.config import DrafterConfig
from flashdraft.drafter_io import load_drafter
from flashdraft.train_step import load_spec


@pytest.fixture(scope="module")
def reference(train_shards, tmp_path_factory):
    """An uninterrupted 2-process run."""
    root, shards = train_shards
    out = tmp_path_factory.mktemp("reference")
    proc = run(train_cmd(root, shards, out))
    (out / "stderr.txt").write_text(proc.stderr)
    return out


# ---------------------------------------------------------------------------------------------------------
# real runs


@pytest.mark.slow
def test_torchrun_two_processes_train_and_export(train_shards, reference):
    root, _ = train_shards
    rows = read_rows(reference / "metrics.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert {"acc", "acc_pos_1", "acc_pos_7", "sim_tau", "lr", "tokens_per_s"} <= set(rows[0])
    loss = losses(rows)
    assert all(math.isfinite(x) for x in loss) and loss[-1] < loss[0]
    assert all(1.0 <= float(r["sim_tau"]) <= 8.0 for r in rows)
    drafter, spec = load_drafter(reference / "drafter")
    assert spec == load_spec(root / "target", DrafterConfig(**DRAFTER))
    assert all(torch.isfinite(p).all() for p in drafter.parameters())
    run_dirs = list((reference / "checkpoints").iterdir())
    assert len(run_dirs) == 1  # one run key
    assert [p.name for p in sorted(run_dirs[0].glob("step-*"))] == ["step-00000004", "step-00000006"]
    tb = tensorboard_losses(run_dirs[0])  # the same numbers as the CSV, for TensorBoard
    assert sorted(tb) == list(range(1, 7)) and list(tb.values()) == pytest.approx(loss, rel=1e-6)
    # every rank logs when its first step of a bucket began, so a late rank shows in the log
    log = (reference / "stderr.txt").read_text()
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: bucket \d+: step began at [\d.]+ s, took [\d.]+ s", log), log[-3000:]


@pytest.mark.parametrize("block", [8, 16])
def test_block_size_presets_train_export_and_load_in_the_reference(train_shards, tmp_path, block):
    """Blocks of 8 (Model-Optimizer's) and 16 (the paper's): training, export, and the export's round
    trip through config.json and safetensors, into our loader and the reference's."""
    root, shards = train_shards
    drafter = {**DRAFTER, "block_size": block}
    run(train_cmd(root, shards, tmp_path, {**TRAIN, "max_steps": 2}, nproc=1, drafter=drafter))
    rows = read_rows(tmp_path / "metrics.csv")
    assert f"acc_pos_{block - 1}" in rows[0] and f"acc_pos_{block}" not in rows[0]
    assert all(1.0 <= float(r["sim_tau"]) <= block for r in rows)
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["block_size"] == block
    ours, spec = load_drafter(tmp_path / "drafter")
    assert spec == load_spec(root / "target", DrafterConfig(**drafter))
    reference = pytest.importorskip("dflash.model", reason="the pinned reference; `make install` installs it")
    ref, info = reference.DFlashDraftModel.from_pretrained(
        tmp_path / "drafter", dtype=ours.fc.weight.dtype, output_loading_info=True
    )
    assert not any(info.values()), info
    assert ref.block_size == block and ref.mask_token_id == spec.mask_token_id
    state = ours.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in ref.state_dict().items())


@pytest.mark.slow
def test_fsdp_trains_as_ddp_does_and_each_resumes_the_other(train_shards, reference, tmp_path):
    """FSDP2 over 2 gloo processes (weights, gradients and AdamW state sharded) follows DDP's loss curve,
    and the checkpoints hold the same full state dicts: a stopped FSDP run resumes under FSDP and under
    DDP, a stopped DDP run under FSDP, each to DDP's curve and export."""
    root, shards = train_shards
    ref = losses(read_rows(reference / "metrics.csv"))
    fsdp, ddp = {**TRAIN, "parallel": "fsdp"}, {**TRAIN, "parallel": "ddp"}
    a, b, c = tmp_path / "fsdp-fsdp", tmp_path / "fsdp-ddp", tmp_path / "ddp-fsdp"
    proc = run(train_cmd(root, shards, a, fsdp, extra=["--stop-at", "3"]))
    assert "parallel: fsdp (fsdp), 2 processes" in proc.stderr
    shutil.copytree(a, b)
    run(train_cmd(root, shards, c, ddp, extra=["--stop-at", "3"]))
    for out, cfg in ((a, fsdp), (b, ddp), (c, fsdp)):
        proc = run(train_cmd(root, shards, out, cfg))
        assert "resumed from" in proc.stderr and f"parallel: {cfg['parallel']}" in proc.stderr
        assert losses(read_rows(out / "metrics.csv")) == pytest.approx(ref, rel=1e-5), out.name
        want, _ = load_drafter(reference / "drafter")
        got, _ = load_drafter(out / "drafter")
        for (k, x), y in zip(want.state_dict().items(), got.state_dict().values(), strict=True):
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-6), (out.name, k)


@pytest.mark.slow
def test_a_dspark_drafter_trains_under_fsdp_as_under_ddp(tmp_path):
    """DSpark's loss reads its Markov head's weights outside the drafter's forward (the chunked vocabulary
    side): under FSDP2 they are the gathered weights and their gradients reach the shards, so the loss
    curve and the export are DDP's."""
    drafter = {**DRAFTER, "family": "dspark"}
    shards = toy_hidden_shards(tmp_path, drafter, last_hidden=True)
    cfg = {**TRAIN, "max_steps": 4}
    out = {mode: tmp_path / mode for mode in ("ddp", "fsdp")}
    for mode, where in out.items():
        proc = run(train_cmd(tmp_path, shards, where, {**cfg, "parallel": mode}, drafter=drafter))
        assert f"parallel: {mode} ({mode}), 2 processes" in proc.stderr
    ddp, fsdp = (read_rows(where / "metrics.csv") for where in out.values())
    assert losses(fsdp) == pytest.approx(losses(ddp), rel=1e-5) and losses(ddp)[-1] < losses(ddp)[0]
    want, _ = load_drafter(out["ddp"] / "drafter")
    got, _ = load_drafter(out["fsdp"] / "drafter")
    assert any("markov" in k for k in want.state_dict())
    for (k, x), y in zip(want.state_dict().items(), got.state_dict().values(), strict=True):
        # the Markov tables' rows of tokens seldom seen get gradients near 0, whose rounding AdamW's update
        # (~lr per step whatever the gradient's size) lifts: a gradient that missed the other rank's would be
        # off by ~lr (3e-3)
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-4 if "markov" in k else 1e-6), k


@pytest.mark.slow
def test_a_global_batch_in_tokens_trains_the_same_on_one_and_two_processes(train_shards, tmp_path):
    """train.global_batch_tokens: two micro-batches per step, accumulated on one process or one each on
    two, give the same steps, loss curve and weights; a resume on the other process count keeps the batch."""
    root, shards = train_shards
    cfg = {**TRAIN, "max_steps": 0, "epochs": 1, "global_batch_tokens": 2 * TRAIN["batch_tokens"]}
    one, two, moved = tmp_path / "one", tmp_path / "two", tmp_path / "moved"
    log = run(train_cmd(root, shards, one, cfg, nproc=1)).stderr
    assert "global batch: 2 micro-batches of 512 tokens, 2 or fewer per process" in log
    run(train_cmd(root, shards, two, cfg, nproc=2))
    run(train_cmd(root, shards, moved, cfg, nproc=2, extra=["--stop-at", "3"]))
    run(train_cmd(root, shards, moved, cfg, nproc=1))  # resumed on one process
    rows = read_rows(one / "metrics.csv")
    assert len(rows) >= 6 and [r["step"] for r in rows] == [r["step"] for r in read_rows(two / "metrics.csv")]
    for out in (two, moved):
        assert losses(read_rows(out / "metrics.csv")) == pytest.approx(losses(rows), rel=1e-4), out.name
        want, _ = load_drafter(one / "drafter")
        got, _ = load_drafter(out / "drafter")
        for (k, x), y in zip(want.state_dict().items(), got.state_dict().values(), strict=True):
            assert torch.allclose(x, y, rtol=1e-3, atol=1e-5), (out.name, k)


@pytest.mark.slow
def test_fsdp_accumulates_micro_batches_to_the_single_process_curve(train_shards, tmp_path):
    """Two micro-batches per process and step under FSDP2 (gradient sync only on the last) follow one
    process accumulating all four."""
    root, shards = train_shards
    cfg = {**TRAIN, "max_steps": 3, "global_batch_tokens": 4 * TRAIN["batch_tokens"]}
    run(train_cmd(root, shards, tmp_path / "one", cfg, nproc=1))
    run(train_cmd(root, shards, tmp_path / "fsdp", {**cfg, "parallel": "fsdp"}, nproc=2))
    want = losses(read_rows(tmp_path / "one" / "metrics.csv"))
    got = losses(read_rows(tmp_path / "fsdp" / "metrics.csv"))
    assert len(want) == 3 and got == pytest.approx(want, rel=1e-4)


def unnamed_states(checkpoints: Path) -> int:
    """Rewrite every checkpoint's state.json as checkpoints wrote it before the states had names (the
    position's and the metrics' keys side by side); returns how many."""
    paths = list(checkpoints.glob("*/step-*/state.json"))
    for path in paths:
        state = json.loads(path.read_text())
        best = {"best": state["best"]} if state["best"] else {}
        path.write_text(json.dumps({**state["position"], **state["metrics"], "spec": state["spec"], **best}))
    return len(paths)


@pytest.mark.slow
def test_stopped_run_resumes_to_the_same_losses_on_two_or_one_processes(train_shards, reference, tmp_path):
    """Also from a checkpoint written before the states had names (on 2 processes)."""
    root, shards = train_shards
    ref = read_rows(reference / "metrics.csv")
    stopped = tmp_path / "stopped"
    run(train_cmd(root, shards, stopped, extra=["--stop-at", "3"]))
    assert not (stopped / "drafter").exists()  # stopped: no export yet
    one = tmp_path / "one"
    shutil.copytree(stopped, one)

    assert unnamed_states(stopped / "checkpoints") > 0
    run(train_cmd(root, shards, stopped))  # resume on 2 processes
    rows = read_rows(stopped / "metrics.csv")
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    assert losses(rows) == pytest.approx(losses(ref), rel=1e-9, abs=0)  # the same curve, step for step
    assert [r["acc"] for r in rows] == [r["acc"] for r in ref]
    tb = tensorboard_losses(next((stopped / "checkpoints").iterdir()))  # one event per step after resuming
    assert sorted(tb) == list(range(1, 7)) and list(tb.values()) == pytest.approx(losses(ref), rel=1e-6)
    a, _ = load_drafter(reference / "drafter")
    b, _ = load_drafter(stopped / "drafter")
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), k

    run(train_cmd(root, shards, one, nproc=1))  # resume on 1 process: same data position, another split
    rows = read_rows(one / "metrics.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert losses(rows)[:3] == losses(ref)[:3]
    assert all(math.isfinite(x) for x in losses(rows)) and (one / "drafter" / "model.safetensors").exists()


def signal_job(pattern: str, sig) -> int:
    """`sig` to every process whose command line holds `pattern`, as SLURM signals every process of a job
    at its time limit (torchrun's ranks and their loader workers are in process groups of their own)."""
    hit = 0
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if pattern in (p / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(p.name), sig)
                hit += 1
        except (OSError, ValueError):
            continue
    return hit


def signal_then_resume(train_shards, tmp_path, sig, every_process, nproc=2, gpu=False):
    """A signal to a running run: the ranks agree on a step, save it and exit 128 + signal; the rerun
    resumes from that step and keeps the rows logged before. every_process: SLURM's way (all of them at
    once); otherwise only to the launched process, as Ctrl-C in a terminal (torchrun passes it on)."""
    root, shards = train_shards
    cfg = {**TRAIN, "max_steps": 100_000, "log_every": 2, "checkpoint_every": 100_000}
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({} if gpu else {"CUDA_VISIBLE_DEVICES": ""})}
    cmd = train_cmd(root, shards, out, cfg, nproc=nproc, gpu=gpu)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        live = out / "checkpoints"
        while proc.poll() is None and sum(len(read_rows(f)) for f in live.glob("*/metrics.csv")) < 2:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if every_process:
            assert signal_job(str(out), sig) >= nproc + 1  # torchrun and its ranks (and loader workers)
        else:
            proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            signal_job(str(out), signal.SIGKILL)
    name = signal.Signals(sig).name
    stopped = re.search(rf"stopped on {name} after step (\d+), checkpoint saved", stderr)
    assert stopped, stderr[-3000:]
    if nproc == 1:
        assert proc.returncode == 128 + sig
    else:  # torchrun fails on a signal, with a code of its own (now and then it aborts shutting down)
        assert proc.returncode != 0
    step = int(stopped.group(1))
    assert step >= 4 and step % cfg["log_every"] == 0
    run_dir = next(live.iterdir())
    assert [p.name for p in run_dir.glob("step-*")] == [f"step-{step:08d}"]
    before = read_rows(run_dir / "metrics.csv")
    assert [int(r["step"]) for r in before] == list(range(2, step + 1, 2))
    assert not (out / "drafter").exists()

    proc = run(
        train_cmd(root, shards, out, cfg, nproc=nproc, extra=["--stop-at", str(step + 2)], gpu=gpu), gpu=gpu
    )
    assert f"resumed from {run_dir / f'step-{step:08d}'}: step {step}/" in proc.stderr
    after = read_rows(run_dir / "metrics.csv")
    assert [int(r["step"]) for r in after] == list(range(2, step + 3, 2))
    assert after[: len(before)] == before  # nothing logged before the signal is lost
    return stderr


@pytest.mark.parametrize(
    "sig, every_process, nproc",
    [
        pytest.param(signal.SIGTERM, True, 2, marks=pytest.mark.slow),
        pytest.param(signal.SIGINT, False, 2, marks=pytest.mark.slow),
        (signal.SIGINT, False, 1),
    ],
    ids=["sigterm-to-every-process", "ctrl-c-to-torchrun", "ctrl-c-to-one-process"],
)
def test_a_signal_saves_a_checkpoint_at_the_next_log_step_and_the_rerun_resumes_there(
    train_shards, tmp_path, sig, every_process, nproc
):
    signal_then_resume(train_shards, tmp_path, sig, every_process, nproc)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_sigterm_reaches_loader_workers_too_and_training_still_saves(train_shards, tmp_path):
    """On GPU the loader's worker processes get the signal as well (SLURM signals them all)."""
    stderr = signal_then_resume(train_shards, tmp_path, signal.SIGTERM, every_process=True, gpu=True)
    assert "DataLoader worker" not in stderr


@pytest.mark.slow
def test_fsdp_compiled_trains_to_the_eager_ddp_losses(train_shards, reference, tmp_path):
    """FSDP2 with the compiled step on 2 gloo processes: Dynamo compiles around FSDP's hooks, every later
    step runs under fail_on_recompile, and the losses are the eager DDP run's."""
    root, shards = train_shards
    cfg, cache, out = {**TRAIN, "compile": True, "parallel": "fsdp"}, tmp_path / "cache", tmp_path / "fsdp"
    run(warmup_cmd(root, shards, cfg, cache, world=2))  # knows the ranks compile: compiles nothing
    proc = run(
        train_cmd(root, shards, out, cfg, extra=["--compile-cache", str(cache)]),
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")},
    )
    assert "the warmup compiled nothing: training shards the drafter (FSDP)" in proc.stderr
    assert "parallel: fsdp (fsdp), 2 processes" in proc.stderr and "compiled, caches" in proc.stderr
    assert not [line for line in proc.stderr.splitlines() if COMPILE_ERROR.search(line)]
    got, want = losses(read_rows(out / "metrics.csv")), losses(read_rows(reference / "metrics.csv"))
    assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_flex_training_hits_the_warmup_cache_and_never_recompiles(train_shards, tmp_path):
    """On GPU: flex attention, bf16 autocast, compiled per bucket in the warmup; training ranks (one per GPU,
    each seeing cuda:0) load the blob, hit the caches, and run every later step under fail_on_recompile
    (a recompile would end the run), while new anchors (new block masks) arrive every step."""
    root, shards = train_shards
    cfg = {**TRAIN, "compile": True, "max_steps": 8, "lr": 1e-3}
    cache = tmp_path / "cache"
    run(
        warmup_cmd(root, shards, cfg, cache),
        gpu=True,
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-warmup")},
    )
    meta = json.loads((cache / "meta.json").read_text())
    print("warmup:", json.dumps({k: meta[k] for k in ("seconds", "counters", "artifact_bytes")}))
    assert meta["key"]["attention"] == "flex" and meta["artifact_bytes"] > 0
    shutil.rmtree(meta["inductor_dir"])  # training on another node
    nproc = min(2, torch.cuda.device_count())
    out = tmp_path / "train"
    cmd = train_cmd(root, shards, out, cfg, nproc=nproc, extra=["--compile-cache", str(cache)], gpu=True)
    proc = run(cmd, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-train")}, gpu=True)
    print(proc.stderr[-2000:])
    counters = json.loads(proc.stdout.strip().splitlines()[-1])["compile_cache"]
    assert counters["fxgraph_cache_hit"] > 0 and cache_misses(counters) == 0, counters
    assert_no_autotuning(proc.stderr)
    rows = read_rows(out / "metrics.csv")
    assert len(rows) == 8 and all(math.isfinite(x) for x in losses(rows))
    drafter, _ = load_drafter(out / "drafter")
    assert next(drafter.parameters()).dtype == torch.bfloat16  # exported in the training dtype


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_ready(), reason="needs torchao and a GPU with FP8 matmuls")
def test_gpu_fp8_training_loads_its_warmup_cache_and_tracks_bf16(train_shards, tmp_path):
    """train.fp8 (with the compiled loss): the warmup compiles the float8 step, training hits its caches
    and never recompiles, the loss follows the bf16 run on the same data and seed, and the export holds
    plain weights in the training dtype (float8 lives only in the matmuls)."""
    root, shards = train_shards
    base = {**TRAIN, "compile": True, "max_steps": 8, "lr": 1e-3}
    rows = {}
    for name, lever in (("bf16", {}), ("fp8", {"fp8": "tensorwise", "compile_loss": True})):
        cfg, cache, out = {**base, **lever}, tmp_path / f"cache-{name}", tmp_path / name
        run(
            warmup_cmd(root, shards, cfg, cache),
            gpu=True,
            env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-warmup-{name}")},
        )
        shutil.rmtree(json.loads((cache / "meta.json").read_text())["inductor_dir"])  # another node
        cmd = train_cmd(root, shards, out, cfg, nproc=1, extra=["--compile-cache", str(cache)], gpu=True)
        proc = run(cmd, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{name}")}, gpu=True)
        counters = json.loads(proc.stdout.strip().splitlines()[-1])["compile_cache"]
        assert counters["fxgraph_cache_hit"] > 0 and cache_misses(counters) == 0, (name, counters)
        assert counters["autograd_cache_hit"] > 0 and counters["autograd_cache_bypass"] == 0, (name, counters)
        assert_no_autotuning(proc.stderr)
        rows[name] = losses(read_rows(out / "metrics.csv"))
    assert len(rows["fp8"]) == 8 and all(math.isfinite(x) for x in rows["fp8"])
    assert rows["fp8"] == pytest.approx(rows["bf16"], rel=0.05)
    drafter, _ = load_drafter(tmp_path / "fp8" / "drafter")
    assert all(type(m) is torch.nn.Linear for m in drafter.modules() if isinstance(m, torch.nn.Linear))
    assert next(drafter.parameters()).dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_gpu_two_process_training_from_a_cold_or_a_warm_compile_cache(train_shards, tmp_path, cache):
    """2-GPU compiled flex training from a cold cache (no warmup artifacts, an empty Inductor dir: every
    rank compiles) and from a warm one (the warmup's artifacts, an empty Inductor dir: every rank hits).
    Both train every step with finite losses and print no Dynamo/FX error; later steps of both run under
    fail_on_recompile."""
    root, shards = train_shards
    cfg = {**TRAIN, "compile": True, "max_steps": 6, "lr": 1e-3}
    extra = []
    if cache == "warm":
        run(
            warmup_cmd(root, shards, cfg, tmp_path / "cache"),
            env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-warmup")},
            gpu=True,
        )
        extra = ["--compile-cache", str(tmp_path / "cache")]
    out = tmp_path / "train"
    cmd = train_cmd(root, shards, out, cfg, nproc=2, extra=extra, gpu=True)
    proc = run(cmd, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-train")}, gpu=True)
    print(proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    assert not [line for line in proc.stderr.splitlines() if COMPILE_ERROR.search(line)]
    assert "first step" in proc.stderr and "compiled, caches" in proc.stderr
    counters = json.loads(proc.stdout.strip().splitlines()[-1])["compile_cache"]
    if cache == "warm":
        assert counters["fxgraph_cache_hit"] > 0 and counters["autograd_cache_hit"] > 0
        assert cache_misses(counters) == 0, counters
    else:  # compiled for real (the ranks share one Inductor dir, so one may hit what the other just wrote)
        assert counters["fxgraph_cache_miss"] > 0
    rows = read_rows(out / "metrics.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert all(math.isfinite(x) for x in losses(rows))
    assert (out / "drafter" / "model.safetensors").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_fsdp_compiled_flex_training_follows_ddp(train_shards, tmp_path):
    """2-GPU FSDP2 with compiled flex attention and bf16 autocast: no Dynamo/FX error, every step, and the
    losses of the same run under DDP (bf16: loose)."""
    root, shards = train_shards
    cfg = {**TRAIN, "compile": True, "max_steps": 6, "lr": 1e-3}
    curves = {}
    for mode in ("ddp", "fsdp"):
        out = tmp_path / mode
        cmd = train_cmd(root, shards, out, {**cfg, "parallel": mode}, nproc=2, gpu=True)
        proc = run(cmd, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{mode}")}, gpu=True)
        print(proc.stderr[-2000:])
        assert f"parallel: {mode} ({mode}), 2 processes" in proc.stderr and "Traceback" not in proc.stderr
        assert not [line for line in proc.stderr.splitlines() if COMPILE_ERROR.search(line)]
        curves[mode] = losses(read_rows(out / "metrics.csv"))
        assert len(curves[mode]) == 6 and all(math.isfinite(x) for x in curves[mode])
    assert curves["fsdp"] == pytest.approx(curves["ddp"], rel=2e-2)
