"""Checkpoints: weights-only loading, a resume's optimizer state, the run key (checkpoint.py)."""

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from flashdraft.checkpoint import (
    Checkpointer,
    load_checkpoint,
    read_checkpoint,
    run_key,
    save_checkpoint,
    start_reading,
)
from flashdraft.config import DrafterConfig, TrainConfig, run_config, to_json
from flashdraft.distributed import Dist
from flashdraft.hidden import manifest_path
from flashdraft.train_setup import lr_factor


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
    path = save_checkpoint(
        tmp_path / "a",
        model.state_dict(),
        optimizer.state_dict(),
        scheduler.state_dict(),
        {"step": 2},
        keep=1,
    )
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
    ckpt = Checkpointer(
        tmp_path / "a", Dist(device=torch.device("cuda")), model, optimizer, scheduler, sharded=False, keep=1
    )
    ckpt.save({"step": 1}, wait=True)
    path = tmp_path / "a" / "step-00000001"
    reading = start_reading(path, torch.device("cuda"))
    moments = reading.result().optim_tensors()
    assert all(t.device.type == "cuda" for t in moments.values())
    ckpt = Checkpointer(
        tmp_path / "b", Dist(device=torch.device("cuda")), model, optimizer, scheduler, sharded=False, keep=1
    )
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


def test_run_key_changes_with_config_and_data(train_shards, tmp_path):
    _, shards = train_shards
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


def test_adding_a_drafter_family_changes_no_existing_run_s_config(monkeypatch):
    """A new family brings its own section (drafter.<family>): the run config of every existing family's
    run, which its run key and stream mode's rerun trigger hash, stays what it was."""
    import dataclasses

    from flashdraft import config, families

    @dataclasses.dataclass
    class NewFamilySection:
        weight: float = 1.0

    @dataclasses.dataclass
    class WithNewFamily(DrafterConfig):
        newfam: NewFamilySection = dataclasses.field(default_factory=NewFamilySection)

    runs = [
        (TrainConfig(), DrafterConfig(family=f, block_size=b)) for f, b in (("dflash", 16), ("dspark", 7))
    ]
    before = [run_config(t, d) for t, d in runs]
    monkeypatch.setitem(families.FAMILIES, "newfam", families.FAMILIES["dflash"])
    assert config.FAMILIES is families.FAMILIES
    after = [
        run_config(t, WithNewFamily(**{f.name: getattr(d, f.name) for f in dataclasses.fields(d)}))
        for t, d in runs
    ]
    assert after == before
    assert '"newfam": {"weight": 1.0}' in run_config(TrainConfig(), WithNewFamily(family="newfam"))


def test_the_schema_s_families_are_the_registry_s():
    import yaml

    from flashdraft.families import FAMILIES

    schema_file = Path(__file__).parents[1] / "workflow" / "schemas" / "config.schema.yaml"
    schema = yaml.safe_load(schema_file.read_text())
    family = schema["properties"]["drafter"]["properties"]["family"]
    assert family["enum"] == list(FAMILIES)
    assert {k for k in FAMILIES if k != "dflash"} <= set(schema["properties"]["drafter"]["properties"])
