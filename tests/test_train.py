"""Training: the data plan, schedule, run key, real torchrun runs (gloo on CPU), resume, compile warmup."""

import csv
import importlib.util
import json
import math
import os
import pickle
import re
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
from conftest import cache_misses, run_python, toy_hidden_shards
from torch._inductor import config as inductor_config
from torch._inductor.cpu_vec_isa import VecISA

from flashdraft.batches import (
    Collate,
    anchor_seeds,
    bucket_for,
    epoch_batches,
    micro_per_step,
    rows_per_batch,
    steps_left,
)
from flashdraft.checkpoint import (
    Checkpointer,
    load_checkpoint,
    read_checkpoint,
    run_key,
    save_checkpoint,
    start_reading,
)
from flashdraft.compile_cache import set_compile_workers, warmup
from flashdraft.config import DrafterConfig, TrainConfig, run_config, to_json
from flashdraft.distributed import Dist, parallel_mode
from flashdraft.drafter_io import load_drafter
from flashdraft.hidden import HiddenStore, manifest_path
from flashdraft.launch import torchrun_argv
from flashdraft.train_setup import lr_factor
from flashdraft.train_step import load_spec

REPO = Path(__file__).resolve().parents[1]
DRAFTER = {"num_layers": 2, "block_size": 8}
TRAIN = {"max_steps": 6, "lr": 3e-3, "max_anchors": 16, "batch_tokens": 512, "buckets": [128, 256],
         "compile": False, "checkpoint_every": 4, "log_every": 1, "val_samples": 0}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A random (untrained) toy target and two real hidden-state shards of learnable token patterns."""
    root = tmp_path_factory.mktemp("train")
    return root, toy_hidden_shards(root, DRAFTER)


def train_cmd(root, shards, out, cfg=TRAIN, nproc=2, drafter=DRAFTER, extra=(), gpu=False):
    """scripts/train.py under torchrun (nproc > 1) or as a plain process. gpu: every rank sees its GPU as
    cuda:0 (--virtual-local-rank), as the workflow runs it."""
    script = str(REPO / "scripts" / "train.py")
    launcher = [sys.executable, script]
    if nproc > 1:
        launcher = torchrun_argv(sys.executable, script, nproc, virtual=gpu)
    args = ["--cfg", json.dumps(cfg), "--drafter-cfg", json.dumps(drafter),
            "--target", str(root / "target"), "--checkpoints", str(out / "checkpoints"),
            "--metrics", str(out / "metrics.csv"), "--out", str(out / "drafter"), *extra, *shards]
    return launcher + args


def run(cmd, env=None, gpu=False):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU tests stay on the CPU (gloo) even on a GPU machine
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def read_rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def losses(rows):
    return [float(r["loss"]) for r in rows]


def tensorboard_losses(run_dir) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("train/loss")}


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """An uninterrupted 2-process run."""
    root, shards = data
    out = tmp_path_factory.mktemp("reference")
    proc = run(train_cmd(root, shards, out))
    (out / "stderr.txt").write_text(proc.stderr)
    return out


# ---------------------------------------------------------------------------------------------------------
# the data plan, schedule, run key


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


def test_lr_warmup_then_cosine_to_zero():
    total, ratio = 100, 0.1
    f = [lr_factor(s, total, ratio) for s in range(total)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # linear warmup over 10 steps
    assert f[10] == pytest.approx(1.0) and f[55] == pytest.approx(0.5, abs=0.01)
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False)) and f[-1] < 1e-3
    assert lr_factor(0, 10, 0.0) == 1.0


def _training_state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, 10, 0.1))
    return model, optimizer, scheduler


class _RunsCode:
    """A pickled object that runs code when loaded without weights_only."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_checkpoints_load_weights_only(tmp_path, monkeypatch):
    # this variable turns torch.load's default to unsafe loading; an explicit weights_only=True is kept
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    model, optimizer, scheduler = _training_state(0)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = (model.state_dict(), optimizer.state_dict(), scheduler.state_dict())
    path = save_checkpoint(tmp_path, *state, {"step": 1}, keep=1)

    # a real checkpoint (AdamW and LambdaLR state included) loads under weights_only, unchanged
    model2, optimizer2, scheduler2 = _training_state(1)
    assert load_checkpoint(path, model2, optimizer2, scheduler2, "cpu", sharded=False) == {"step": 1}
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert str(optimizer2.state_dict()) == str(optimizer.state_dict())
    assert scheduler2.state_dict() == scheduler.state_dict()

    # one that holds an object that would run code is refused, and the code never runs
    marker = tmp_path / "ran"
    torch.save({"optimizer": _RunsCode(marker), "scheduler": {}}, path / "optim.pt")
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(path, model2, optimizer2, scheduler2, "cpu", sharded=False)
    assert not marker.exists()


def test_a_resume_loads_the_optimizer_state_before_the_first_step_or_the_next_save(tmp_path):
    """Checkpointer.resume loads the weights and the schedule; the optimizer's state, maybe still being read,
    waits for the first optimizer step or the next save: the step equals the uninterrupted run's, and a save
    before any step holds the whole state."""
    model, optimizer, scheduler = _training_state(0)
    x = torch.randn(2, 4)

    def step(m, o, s):
        m(x).square().sum().backward()
        o.step()
        o.zero_grad()
        s.step()

    for _ in range(2):
        step(model, optimizer, scheduler)
    path = save_checkpoint(tmp_path / "a", model.state_dict(), optimizer.state_dict(), scheduler.state_dict(),
                           {"step": 2}, keep=1)
    weights, schedule = [p.detach().clone() for p in model.parameters()], scheduler.state_dict()

    def resumed(run_dir):
        m, o, s = _training_state(1)
        ckpt = Checkpointer(run_dir, Dist(), m, o, s, sharded=False, keep=1)
        assert ckpt.resume(path, start_reading(path, "cpu")) == {"step": 2}
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), weights, strict=True))
        assert s.state_dict() == schedule and not o.state  # the moments: not yet
        return m, o, s, ckpt

    m, o, s, _ = resumed(tmp_path / "b")
    step(m, o, s)
    step(model, optimizer, scheduler)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), model.parameters(), strict=True))
    assert str(o.state_dict()) == str(optimizer.state_dict())

    *_, ckpt = resumed(tmp_path / "c")
    ckpt.save({"step": 2}, wait=True)
    saved, original = read_checkpoint(tmp_path / "c" / "step-00000002"), read_checkpoint(path)
    assert saved.optim.keys() == original.optim.keys() and len(saved.optim) == 6  # step, exp_avg, exp_avg_sq
    assert all(torch.equal(saved.optim[k], original.optim[k]) for k in saved.optim)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_resume_reads_the_moments_onto_the_gpu_and_pins_the_save_buffers_after_the_first_step(tmp_path):
    """On the GPU the reading thread puts the optimizer's tensors on the device, where the optimizer keeps
    them as loaded (no copy at the first step); the saves' pinned host buffers are allocated in the
    background after the first step, and a save from them holds the GPU's state bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    x = torch.randn(8, 64, device="cuda")

    def step():
        model(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    ckpt = Checkpointer(tmp_path / "a", Dist(device=torch.device("cuda")), model, optimizer, scheduler,
                        sharded=False, keep=1)
    ckpt.save({"step": 1}, wait=True)
    path = tmp_path / "a" / "step-00000001"
    reading = start_reading(path, torch.device("cuda"))
    moments = reading.result().optim_tensors()
    assert all(t.device.type == "cuda" for t in moments.values())
    ckpt = Checkpointer(tmp_path / "b", Dist(device=torch.device("cuda")), model, optimizer, scheduler,
                        sharded=False, keep=1)
    ckpt.resume(path, reading)
    ckpt.load_optimizer()
    state = optimizer.state[model.weight]
    assert state["exp_avg"].data_ptr() == moments["0.exp_avg"].data_ptr()  # loaded as read, not copied
    assert ckpt.reserve() is not None and ckpt.reserve() is None  # once
    step()
    ckpt.save({"step": 2}, wait=True)
    saved = read_checkpoint(tmp_path / "b" / "step-00000002")
    assert torch.equal(saved.model["weight"], model.weight.detach().cpu())
    assert torch.equal(saved.optim["0.exp_avg_sq"], state["exp_avg_sq"].cpu())


def test_a_failed_trainer_ends_its_loader_workers_so_it_can_exit():
    """DataLoader workers ignore stop signals (the trainer handles a stop), so Python's exit, which sends
    them SIGTERM and joins them, would wait for ever after a failure: train() kills them first."""
    code = (
        "import torch\n"
        "from flashdraft.distributed import end_loader_workers, ignore_stop_signals\n"
        "loader = torch.utils.data.DataLoader(list(range(64)), batch_size=2, num_workers=2,\n"
        "                                     worker_init_fn=ignore_stop_signals)\n"
        "it = iter(loader)\n"
        "next(it)\n"
        "try:\n"
        "    raise RuntimeError('broken')\n"
        "except BaseException:\n"
        "    end_loader_workers()\n"
        "    raise\n"
    )
    p = run_python(code)
    assert p.returncode == 1 and "RuntimeError: broken" in p.stderr


def test_anchor_seeds_follow_the_sample_not_the_batch():
    seeds = anchor_seeds(3, 1, [5, 9], rows=4)
    assert seeds[2:] == [None, None] and anchor_seeds(3, 1, [9, 2], rows=2)[0] == seeds[1]
    assert anchor_seeds(3, 2, [5], rows=1) != seeds[:1] and anchor_seeds(4, 1, [5], rows=1) != seeds[:1]


def test_run_key_changes_with_config_and_data(data, tmp_path):
    _, shards = data
    cfg, dcfg = TrainConfig(), DrafterConfig()
    key = run_key(cfg, dcfg, shards)
    assert key == run_key(TrainConfig(), DrafterConfig(), shards) and len(key) == 12
    assert key != run_key(TrainConfig(lr=1e-3), dcfg, shards)
    assert key != run_key(cfg, DrafterConfig(block_size=8), shards)
    assert key != run_key(cfg, DrafterConfig(family="dspark"), shards)
    # a dflash run keeps the key it had before drafter.family existed (the drafter's keys without it)
    assert '"family"' not in run_config(cfg, dcfg)
    assert '"family": "dspark"' in run_config(cfg, DrafterConfig(family="dspark"))
    copy = [str(tmp_path / Path(p).name) for p in shards]
    for src, dst in zip(shards, copy, strict=True):
        shutil.copy(src, dst)
        manifest = json.loads(manifest_path(src).read_text())
        manifest_path(dst).write_text(json.dumps({**manifest, "rows": manifest["rows"] + 1}))
    assert key != run_key(cfg, dcfg, copy)
    assert to_json(cfg) == to_json(TrainConfig())


def test_collate_pads_to_bucket_and_truncates_to_the_largest(data):
    _, shards = data
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
    assert batch["last_hidden"][len(samples):].eq(0).all()
    without = collate([{k: v for k, v in x.items() if k != "last_hidden"} for x in samples])
    assert list(without) == ["input_ids", "loss_mask", "hidden", "tokens", "bucket"]
    assert all(torch.equal(without[k], batch[k]) for k in ("input_ids", "loss_mask", "hidden"))


# ---------------------------------------------------------------------------------------------------------
# real runs


@pytest.mark.slow
def test_torchrun_two_processes_train_and_export(data, reference):
    root, _ = data
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
def test_block_size_presets_train_export_and_load_in_the_reference(data, tmp_path, block):
    """Blocks of 8 (Model-Optimizer's) and 16 (the paper's): training, export, and the export's round
    trip through config.json and safetensors, into our loader and the reference's."""
    root, shards = data
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
    ref, info = reference.DFlashDraftModel.from_pretrained(tmp_path / "drafter", dtype=ours.fc.weight.dtype,
                                                           output_loading_info=True)
    assert not any(info.values()), info
    assert ref.block_size == block and ref.mask_token_id == spec.mask_token_id
    state = ours.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in ref.state_dict().items())


@pytest.mark.slow
def test_fsdp_trains_as_ddp_does_and_each_resumes_the_other(data, reference, tmp_path):
    """FSDP2 over 2 gloo processes (weights, gradients and AdamW state sharded) follows DDP's loss curve,
    and the checkpoints hold the same full state dicts: a stopped FSDP run resumes under FSDP and under
    DDP, a stopped DDP run under FSDP, each to DDP's curve and export."""
    root, shards = data
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
def test_a_global_batch_in_tokens_trains_the_same_on_one_and_two_processes(data, tmp_path):
    """train.global_batch_tokens: two micro-batches per step, accumulated on one process or one each on
    two, give the same steps, loss curve and weights; a resume on the other process count keeps the batch."""
    root, shards = data
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
def test_fsdp_accumulates_micro_batches_to_the_single_process_curve(data, tmp_path):
    """Two micro-batches per process and step under FSDP2 (gradient sync only on the last) follow one
    process accumulating all four."""
    root, shards = data
    cfg = {**TRAIN, "max_steps": 3, "global_batch_tokens": 4 * TRAIN["batch_tokens"]}
    run(train_cmd(root, shards, tmp_path / "one", cfg, nproc=1))
    run(train_cmd(root, shards, tmp_path / "fsdp", {**cfg, "parallel": "fsdp"}, nproc=2))
    want = losses(read_rows(tmp_path / "one" / "metrics.csv"))
    got = losses(read_rows(tmp_path / "fsdp" / "metrics.csv"))
    assert len(want) == 3 and got == pytest.approx(want, rel=1e-4)


def test_micro_per_step_refuses_a_global_batch_the_processes_cannot_share(data):
    lengths = [HiddenStore(data[1]).num_tokens(i) for i in range(48)]
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


def test_parallel_mode_shards_only_what_would_not_fit():
    h200, h100 = 139 * 2**30, 79 * 2**30  # as torch reports them
    assert parallel_mode("auto", 1_050_000_000, 1, h200) == "single"  # one process: nothing to share
    assert parallel_mode("fsdp", 10, 1, None) == "single"
    for gpu in (h200, h100):  # the 8B target's drafter: 16.8 GB per copy, 47 GB at its peak
        assert parallel_mode("auto", 1_050_000_000, 8, gpu) == "ddp"
    assert parallel_mode("auto", 4_600_000_000, 8, h200) == "fsdp"  # a 70B target's (H=8192): 74 GB
    assert parallel_mode("auto", 4_600_000_000, 8, None) == "ddp"  # CPU: no GPU memory to fit
    assert parallel_mode("fsdp", 10, 2, h200) == "fsdp" and parallel_mode("ddp", 10**12, 2, h100) == "ddp"
    with pytest.raises(ValueError, match="train.parallel"):
        parallel_mode("zero3", 10, 2, None)


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
def test_stopped_run_resumes_to_the_same_losses_on_two_or_one_processes(data, reference, tmp_path):
    """Also from a checkpoint written before the states had names (on 2 processes)."""
    root, shards = data
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


def signal_then_resume(data, tmp_path, sig, every_process, nproc=2, gpu=False):
    """A signal to a running run: the ranks agree on a step, save it and exit 128 + signal; the rerun
    resumes from that step and keeps the rows logged before. every_process: SLURM's way (all of them at
    once); otherwise only to the launched process, as Ctrl-C in a terminal (torchrun passes it on)."""
    root, shards = data
    cfg = {**TRAIN, "max_steps": 100_000, "log_every": 2, "checkpoint_every": 100_000}
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({} if gpu else {"CUDA_VISIBLE_DEVICES": ""})}
    cmd = train_cmd(root, shards, out, cfg, nproc=nproc, gpu=gpu)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
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

    proc = run(train_cmd(root, shards, out, cfg, nproc=nproc, extra=["--stop-at", str(step + 2)], gpu=gpu),
               gpu=gpu)
    assert f"resumed from {run_dir / f'step-{step:08d}'}: step {step}/" in proc.stderr
    after = read_rows(run_dir / "metrics.csv")
    assert [int(r["step"]) for r in after] == list(range(2, step + 3, 2))
    assert after[: len(before)] == before  # nothing logged before the signal is lost
    return stderr


@pytest.mark.parametrize("sig, every_process, nproc",
                         [pytest.param(signal.SIGTERM, True, 2, marks=pytest.mark.slow),
                          pytest.param(signal.SIGINT, False, 2, marks=pytest.mark.slow),
                          (signal.SIGINT, False, 1)],
                         ids=["sigterm-to-every-process", "ctrl-c-to-torchrun", "ctrl-c-to-one-process"])
def test_a_signal_saves_a_checkpoint_at_the_next_log_step_and_the_rerun_resumes_there(data, tmp_path, sig,
                                                                                       every_process, nproc):
    signal_then_resume(data, tmp_path, sig, every_process, nproc)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_sigterm_reaches_loader_workers_too_and_training_still_saves(data, tmp_path):
    """On GPU the loader's worker processes get the signal as well (SLURM signals them all)."""
    stderr = signal_then_resume(data, tmp_path, signal.SIGTERM, every_process=True, gpu=True)
    assert "DataLoader worker" not in stderr


def test_warmup_without_compile_writes_meta_and_empty_artifacts(data, tmp_path):
    root, shards = data
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


def test_warmup_compiles_nothing_when_training_shards_the_drafter(data, tmp_path):
    """With FSDP over the training's processes the warmup neither builds nor runs the unsharded step (its
    graphs would not be the ranks', and one GPU may not hold it); over one process it is the plain step."""
    root, shards = data
    cfg = TrainConfig(**{**TRAIN, "compile": True, "parallel": "fsdp"})
    meta = warmup(cfg, DrafterConfig(**DRAFTER), root / "target", shards, tmp_path / "sharded", world=2)
    assert meta["fsdp"] is True and meta["seconds"] == {} and meta["artifact_bytes"] == 0
    assert (tmp_path / "sharded" / "artifacts.bin").read_bytes() == b"" and meta["inductor_files"] == 0
    assert json.loads((tmp_path / "sharded" / "meta.json").read_text())["fsdp"] is True
    one = TrainConfig(**{**TRAIN, "parallel": "fsdp"})  # compile: false, so only the eager check runs
    meta = warmup(one, DrafterConfig(**DRAFTER), root / "target", shards, tmp_path / "single", world=1)
    assert meta["fsdp"] is False and set(meta["seconds"]) == {128, 256}


def warmup_cmd(root, shards, cfg, cache, drafter=DRAFTER, world=1):
    """scripts/warmup.py: compile the step once per bucket and save the caches to `cache`."""
    return [sys.executable, str(REPO / "scripts" / "warmup.py"), "--cfg", json.dumps(cfg), "--drafter-cfg",
            json.dumps(drafter), "--target", str(root / "target"), "--out-dir", str(cache),
            "--world", str(world), *shards]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signal_stops_the_warmup_as_training_keeping_no_cache(data, tmp_path, sig):
    root, shards = data
    cfg, cache, tmp = {**TRAIN, "compile": True}, tmp_path / "cache", tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(warmup_cmd(root, shards, cfg, cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
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
def test_warmup_cache_gives_hits_in_a_fresh_training_process(data, tmp_path):
    """Compile once in the warmup, then a fresh process on a node without the warmup's Inductor dir loads
    the blob and unpacks the warmup's Inductor files at that dir's path (not into its own
    TORCHINDUCTOR_CACHE_DIR): FX-graph and AOTAutograd cache hits, no misses, no C++ kernel compiled
    again, and step 2 runs under fail_on_recompile. The losses are an eager run's: the cached code
    computes the same step."""
    root, shards = data
    drafter = {"num_layers": 1, "block_size": 8, "target_layer_ids": [1, 3]}  # the shards fuse 2 layers
    cfg = {**TRAIN, "compile": True, "buckets": [128], "batch_tokens": 256, "max_steps": 2}
    cache = tmp_path / "cache"
    run(warmup_cmd(root, shards, cfg, cache, drafter),
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-warmup")})
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
    assert losses(read_rows(out / "metrics.csv")) == pytest.approx(losses(read_rows(eager / "metrics.csv")),
                                                                   rel=1e-4)


@pytest.mark.slow
def test_fsdp_compiled_trains_to_the_eager_ddp_losses(data, reference, tmp_path):
    """FSDP2 with the compiled step on 2 gloo processes: Dynamo compiles around FSDP's hooks, every later
    step runs under fail_on_recompile, and the losses are the eager DDP run's."""
    root, shards = data
    cfg, cache, out = {**TRAIN, "compile": True, "parallel": "fsdp"}, tmp_path / "cache", tmp_path / "fsdp"
    run(warmup_cmd(root, shards, cfg, cache, world=2))  # knows the ranks compile: compiles nothing
    proc = run(train_cmd(root, shards, out, cfg, extra=["--compile-cache", str(cache)]),
               env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert "the warmup compiled nothing: training shards the drafter (FSDP)" in proc.stderr
    assert "parallel: fsdp (fsdp), 2 processes" in proc.stderr and "compiled, caches" in proc.stderr
    assert not [line for line in proc.stderr.splitlines() if COMPILE_ERROR.search(line)]
    got, want = losses(read_rows(out / "metrics.csv")), losses(read_rows(reference / "metrics.csv"))
    assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_flex_training_hits_the_warmup_cache_and_never_recompiles(data, tmp_path):
    """On GPU: flex attention, bf16 autocast, compiled per bucket in the warmup; training ranks (one per GPU,
    each seeing cuda:0) load the blob, hit the caches, and run every later step under fail_on_recompile
    (a recompile would end the run), while new anchors (new block masks) arrive every step."""
    root, shards = data
    cfg = {**TRAIN, "compile": True, "max_steps": 8, "lr": 1e-3}
    cache = tmp_path / "cache"
    run(warmup_cmd(root, shards, cfg, cache), gpu=True,
        env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-warmup")})
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


def assert_no_autotuning(stderr: str) -> None:
    """The warm rank's slowest compile phases (logged after its first step) hold no Triton autotuning: the
    warmup's autotune results reached it."""
    phases = stderr.split("compile phases:")[1].splitlines()[0]
    assert "benchmark_all_configs" not in phases, phases


def _fp8_ready(cuda: bool = True) -> bool:
    if importlib.util.find_spec("torchao") is None:
        return False
    return not cuda or torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 9)


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


@pytest.mark.skipif(not _fp8_ready(cuda=False), reason="needs torchao")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_graphs_load_from_the_aot_autograd_cache_in_a_fresh_process(tmp_path, recipe):
    """torchao's float8 step is cached whole (AOTAutograd's joint graph too, not only Inductor's kernels),
    so a warm process skips tracing it again, and computes the same loss and gradients (float8 matmuls run
    on the CPU too)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    runs = [subprocess.run([sys.executable, "-c", FLOAT8_STEP, recipe], env=env, check=True,
                           capture_output=True, text=True) for _ in range(2)]
    out = [json.loads(r.stdout.splitlines()[-1]) for r in runs]
    cold, warm = (o["counters"] for o in out)
    assert cold["autograd_cache_miss"] > 0 and cold["autograd_cache_bypass"] == 0, cold
    assert warm["autograd_cache_hit"] == cold["autograd_cache_miss"] and cache_misses(warm) == 0, warm
    assert warm["autograd_cache_bypass"] == 0, warm
    assert out[0]["loss"] == out[1]["loss"] and out[0]["grads"] == out[1]["grads"]


@pytest.mark.gpu
@pytest.mark.skipif(not _fp8_ready(), reason="needs torchao and a GPU with FP8 matmuls")
def test_gpu_fp8_training_loads_its_warmup_cache_and_tracks_bf16(data, tmp_path):
    """train.fp8 (with the compiled loss): the warmup compiles the float8 step, training hits its caches
    and never recompiles, the loss follows the bf16 run on the same data and seed, and the export holds
    plain weights in the training dtype (float8 lives only in the matmuls)."""
    root, shards = data
    base = {**TRAIN, "compile": True, "max_steps": 8, "lr": 1e-3}
    rows = {}
    for name, lever in (("bf16", {}), ("fp8", {"fp8": "tensorwise", "compile_loss": True})):
        cfg, cache, out = {**base, **lever}, tmp_path / f"cache-{name}", tmp_path / name
        run(warmup_cmd(root, shards, cfg, cache), gpu=True,
            env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-warmup-{name}")})
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


# Dynamo / FX failures as they print: "torch._dynamo.exc....Error", "FX ... error", "error ... dynamo"
_COMPILER = r"(dynamo|\bFX\b|torch\.fx)"
COMPILE_ERROR = re.compile(rf"{_COMPILER}.*(error|exception)|(error|exception).*{_COMPILER}", re.IGNORECASE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_gpu_two_process_training_from_a_cold_or_a_warm_compile_cache(data, tmp_path, cache):
    """2-GPU compiled flex training from a cold cache (no warmup artifacts, an empty Inductor dir: every
    rank compiles) and from a warm one (the warmup's artifacts, an empty Inductor dir: every rank hits).
    Both train every step with finite losses and print no Dynamo/FX error; later steps of both run under
    fail_on_recompile."""
    root, shards = data
    cfg = {**TRAIN, "compile": True, "max_steps": 6, "lr": 1e-3}
    extra = []
    if cache == "warm":
        run(warmup_cmd(root, shards, cfg, tmp_path / "cache"),
            env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-warmup")}, gpu=True)
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
def test_gpu_fsdp_compiled_flex_training_follows_ddp(data, tmp_path):
    """2-GPU FSDP2 with compiled flex attention and bf16 autocast: no Dynamo/FX error, every step, and the
    losses of the same run under DDP (bf16: loose)."""
    root, shards = data
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


def test_dtype_and_attention_are_resolved_once_for_the_step_and_the_cache_key():
    """The CPU trains in float32 with SDPA whatever train.dtype says; the compile cache's key holds what
    the step runs with, so a config that runs the same step keys the same cache."""
    from test_model import tiny_spec

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
    assert resolve(TrainConfig(**{**TRAIN, "dtype": "bfloat16", "attention": "auto"}), gpu) == \
        type(run)(torch.bfloat16, "flex")
    assert resolve(TrainConfig(**{**TRAIN, "dtype": "float32", "attention": "sdpa"}), gpu).dtype == "float32"
    with pytest.raises(ValueError, match="attention must be auto, flex or sdpa"):
        resolve(TrainConfig(**{**TRAIN, "attention": "dense"}), cpu)
