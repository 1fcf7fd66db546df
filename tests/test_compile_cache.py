"""The compile warmup and its cache (compile_cache.py, float8.py): what it compiles, that a fresh
training process hits it, that a signal stops it keeping nothing, and whose compiled code is loaded."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import cache_misses
from torch._inductor import config as inductor_config
from torch._inductor.cpu_vec_isa import VecISA
from train_helpers import DRAFTER, TRAIN, fp8_ready, losses, read_rows, run, train_cmd, warmup_cmd

from flashdraft.compile_cache import set_compile_workers, warmup
from flashdraft.config import DrafterConfig, TrainConfig
from flashdraft.distributed import Dist


def test_compile_workers_none_when_warm_a_share_of_the_cores_when_cold(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    # restored after the test
    monkeypatch.setattr(inductor_config, "compile_threads", inductor_config.compile_threads)
    cores = len(os.sched_getaffinity(0))
    assert set_compile_workers(warm=True, local_world=8) == 1
    assert set_compile_workers(warm=False, local_world=1) == min(32, cores)
    assert set_compile_workers(warm=False, local_world=4 * cores) == 1
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    inductor_config.compile_threads = 3  # as torch reads the variable at import
    assert set_compile_workers(warm=True, local_world=2) == 3  # the user's choice stands


def test_warmup_without_compile_writes_meta_and_empty_artifacts(train_shards, tmp_path):
    root, shards = train_shards
    cfg = TrainConfig(**{**TRAIN, "compile": False})
    meta = warmup(cfg, DrafterConfig(**DRAFTER), root / "target", shards, tmp_path / "cache")
    assert (tmp_path / "cache" / "artifacts.bin").read_bytes() == b""
    with tarfile.open(tmp_path / "cache" / "inductor.tar") as tar:
        assert tar.getmembers() == [] and meta["inductor_files"] == 0  # nothing compiled
    saved = json.loads((tmp_path / "cache" / "meta.json").read_text())
    assert saved["compile"] is False and saved["key"]["buckets"] == [128, 256]
    assert saved["key"]["torch"] == torch.__version__
    assert saved["key"]["attention"] == ("flex" if torch.cuda.is_available() else "sdpa")
    assert set(meta["seconds"]) == {128, 256}


def test_warmup_compiles_nothing_when_training_shards_the_drafter(train_shards, tmp_path):
    """With FSDP over the training's processes the warmup neither builds nor runs the unsharded step (its
    graphs would not be the ranks', and one GPU may not hold it); over one process it is the plain step."""
    root, shards = train_shards
    cfg = TrainConfig(**{**TRAIN, "compile": True, "parallel": "fsdp"})
    meta = warmup(cfg, DrafterConfig(**DRAFTER), root / "target", shards, tmp_path / "sharded", world=2)
    assert meta["fsdp"] is True and meta["seconds"] == {} and meta["artifact_bytes"] == 0
    assert (tmp_path / "sharded" / "artifacts.bin").read_bytes() == b"" and meta["inductor_files"] == 0
    assert json.loads((tmp_path / "sharded" / "meta.json").read_text())["fsdp"] is True
    one = TrainConfig(**{**TRAIN, "parallel": "fsdp"})  # compile: false, so only the eager check runs
    meta = warmup(one, DrafterConfig(**DRAFTER), root / "target", shards, tmp_path / "single", world=1)
    assert meta["fsdp"] is False and set(meta["seconds"]) == {128, 256}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signal_stops_the_warmup_as_training_keeping_no_cache(train_shards, tmp_path, sig):
    root, shards = train_shards
    cfg, cache, tmp = {**TRAIN, "compile": True}, tmp_path / "cache", tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(
        warmup_cmd(root, shards, cfg, cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:  # signalled once Inductor writes its first file: compiling the first of two buckets
        while proc.poll() is None and not any(p.is_file() for p in tmp.glob("flashdraft-inductor-*/**/*")):
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert "Traceback" not in stderr
    assert not cache.exists() or not list(cache.iterdir())
    assert not list(tmp.glob("flashdraft-inductor-*"))  # its Inductor dir removed on the way out


def test_compiled_code_of_another_user_or_writable_by_others_is_never_loaded(tmp_path, monkeypatch, capsys):
    """The warmup's Inductor dir (per user, mode 0700) and the compile cache's blob hold code this process
    would run: a link, another user's or one every user can write is not used; the step compiles afresh."""
    from flashdraft.compile_cache import (
        ARTIFACTS,
        INDUCTOR_FILES,
        META,
        fresh_inductor_dir,
        load_compile_cache,
        not_ours,
        use_inductor_dir,
        warmup_inductor_dir,
    )
    from flashdraft.errors import UserError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = warmup_inductor_dir(tmp_path / "cache")
    assert mine.name.startswith(f"flashdraft-inductor-{os.getuid()}-")
    with fresh_inductor_dir(mine):
        assert not_ours(mine) is None and (mine.stat().st_mode & 0o777) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "default"))
    use_inductor_dir(str(shared), Dist())
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "default")
    said = capsys.readouterr()
    assert f"not using the warmup's Inductor dir ({shared} is writable by every user)" in said.out + said.err
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / ARTIFACTS).write_bytes(b"x")
    (cache / META).write_text("{}")
    (cache / ARTIFACTS).chmod(0o666)
    assert load_compile_cache(cache, {}, Dist()) is False  # refused before the blob is read as code
    said = capsys.readouterr()
    assert f"compile cache: not loaded ({cache / ARTIFACTS} is writable by every user)" in said.out + said.err
    # the blob this user's, the Inductor files beside it (unpacked as code) or the meta (naming the dir
    # they go to) another's or writable by all: nothing of it is loaded
    (cache / ARTIFACTS).chmod(0o600)
    for name in (INDUCTOR_FILES, META):
        (cache / INDUCTOR_FILES).write_bytes(b"")
        for f in (cache / INDUCTOR_FILES, cache / META):
            f.chmod(0o600)
        (cache / name).chmod(0o666)
        assert load_compile_cache(cache, {}, Dist()) is False
        said = capsys.readouterr()
        assert f"compile cache: not loaded ({cache / name} is writable by every user)" in said.out + said.err
        if os.getuid() == 0:
            (cache / name).chmod(0o644)
            os.chown(cache / name, 4242, 4242)
            assert load_compile_cache(cache, {}, Dist()) is False
            said = capsys.readouterr()
            assert f"not loaded ({cache / name} belongs to user id 4242)" in said.out + said.err
            os.chown(cache / name, os.getuid(), os.getgid())
    if os.getuid() == 0:  # another user's dir in the temp dir, where this user's would go
        theirs = warmup_inductor_dir(tmp_path / "other")
        theirs.mkdir()
        (theirs / "planted.so").write_text("")
        os.chown(theirs, 4242, 4242)
        assert not_ours(theirs) == f"{theirs} belongs to user id 4242"
        monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # as a user who cannot remove it
        with pytest.raises(UserError, match="exists and is not this user's"), fresh_inductor_dir(theirs):
            pass


@pytest.mark.slow
def test_warmup_cache_gives_hits_in_a_fresh_training_process(train_shards, tmp_path):
    """Compile once in the warmup, then a fresh process on a node without the warmup's Inductor dir loads
    the blob and unpacks the warmup's Inductor files at that dir's path (not into its own
    TORCHINDUCTOR_CACHE_DIR): FX-graph and AOTAutograd cache hits, no misses, no C++ kernel compiled
    again, and step 2 runs under fail_on_recompile. The losses are an eager run's: the cached code
    computes the same step."""
    root, shards = train_shards
    drafter = {"num_layers": 1, "block_size": 8, "target_layer_ids": [1, 3]}  # the shards fuse 2 layers
    cfg = {**TRAIN, "compile": True, "buckets": [128], "batch_tokens": 256, "max_steps": 2}
    cache = tmp_path / "cache"
    run(
        warmup_cmd(root, shards, cfg, cache, drafter),
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-warmup")},
    )
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["compile"] is True and meta["artifact_bytes"] > 0
    assert meta["counters"]["fxgraph_cache_miss"] > 0  # the warmup compiled for real
    with tarfile.open(cache / "inductor.tar") as tar:
        names = tar.getnames()
    assert len(names) == meta["inductor_files"] > 0 and any(n.endswith(".so") for n in names)  # CPU kernels
    warmup_dir = Path(meta["inductor_dir"])
    assert all((warmup_dir / n).is_file() for n in names)  # kept for training on this node
    shutil.rmtree(warmup_dir)  # another node
    out = tmp_path / "train"
    cmd = train_cmd(root, shards, out, cfg, nproc=1, drafter=drafter, extra=["--compile-cache", str(cache)])
    proc = run(cmd, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-train")})
    counters = json.loads(proc.stdout.strip().splitlines()[-1])["compile_cache"]
    assert counters["fxgraph_cache_hit"] > 0 and counters["autograd_cache_hit"] > 0
    assert cache_misses(counters) == 0, counters
    assert all((warmup_dir / n).is_file() for n in names)  # unpacked where the warmup compiled
    assert f" Inductor files added to {warmup_dir}\n" in proc.stderr
    assert not any(p.is_file() for p in (tmp_path / "inductor-train").rglob("*"))
    assert "compile workers per process: 1" in proc.stderr  # warm: no compile worker pool to start
    phases = proc.stderr.split("compile phases:")[1].splitlines()[0]  # the slowest, logged after step 1
    built = {p for p in warmup_dir.rglob("*.so")} - {warmup_dir / n for n in names}
    kernels = [p for p in built if p.with_suffix(".cpp").read_text() != VecISA._avx_code]  # not an ISA probe
    assert not kernels, (kernels, phases)  # no C++ kernel compiled again: the warmup's .so files were there
    eager = tmp_path / "eager"
    run(train_cmd(root, shards, eager, {**cfg, "compile": False}, nproc=1, drafter=drafter))
    assert losses(read_rows(out / "metrics.csv")) == pytest.approx(
        losses(read_rows(eager / "metrics.csv")), rel=1e-4
    )


FLOAT8_STEP = """
import json, sys, torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from flashdraft.compile_cache import cache_counters
from flashdraft.float8 import float8_graphs_cacheable
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.SiLU(), torch.nn.Linear(128, 64))
convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(sys.argv[1]))
float8_graphs_cacheable()
x = torch.randn(32, 64, requires_grad=True)
loss = torch.compile(model, dynamic=False)(x).square().mean()
loss.backward()
grads = [x.grad.tolist()] + [p.grad.tolist() for p in model.parameters()]
print(json.dumps({"counters": cache_counters(), "loss": loss.item(), "grads": grads}))
"""


@pytest.mark.skipif(not fp8_ready(cuda=False), reason="needs torchao")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_graphs_load_from_the_aot_autograd_cache_in_a_fresh_process(tmp_path, recipe):
    """torchao's float8 step is cached whole (AOTAutograd's joint graph too, not only Inductor's kernels),
    so a warm process skips tracing it again, and computes the same loss and gradients (float8 matmuls run
    on the CPU too)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    runs = [
        subprocess.run(
            [sys.executable, "-c", FLOAT8_STEP, recipe], env=env, check=True, capture_output=True, text=True
        )
        for _ in range(2)
    ]
    out = [json.loads(r.stdout.splitlines()[-1]) for r in runs]
    cold, warm = (o["counters"] for o in out)
    assert cold["autograd_cache_miss"] > 0 and cold["autograd_cache_bypass"] == 0, cold
    assert warm["autograd_cache_hit"] == cold["autograd_cache_miss"] and cache_misses(warm) == 0, warm
    assert warm["autograd_cache_bypass"] == 0, warm
    assert out[0]["loss"] == out[1]["loss"] and out[0]["grads"] == out[1]["grads"]


def test_dtype_and_attention_are_resolved_once_for_the_step_and_the_cache_key():
    """The CPU trains in float32 with SDPA whatever train.dtype says; the compile cache's key holds what
    the step runs with, so a config that runs the same step keys the same cache."""
    from model_helpers import tiny_spec

    from flashdraft.compile_cache import cache_key
    from flashdraft.train_step import resolve

    cpu = torch.device("cpu")
    for dtype in ("bfloat16", "float32"):
        cfg = TrainConfig(**{**TRAIN, "dtype": dtype, "attention": "auto"})
        run = resolve(cfg, cpu)
        assert (run.amp_dtype, run.attention, run.dtype) == (None, "sdpa", "float32")
        key = cache_key(cfg, tiny_spec(), cpu)
        assert (key["dtype"], key["attention"]) == ("float32", "sdpa")
    gpu = torch.device("cuda")  # only its type is read: no GPU needed
    assert resolve(TrainConfig(**{**TRAIN, "dtype": "bfloat16", "attention": "auto"}), gpu) == type(run)(
        torch.bfloat16, "flex"
    )
    assert resolve(TrainConfig(**{**TRAIN, "dtype": "float32", "attention": "sdpa"}), gpu).dtype == "float32"
    with pytest.raises(ValueError, match="attention must be auto, flex or sdpa"):
        resolve(TrainConfig(**{**TRAIN, "attention": "dense"}), cpu)
