"""drafter.init_from: fine-tuning starts from an exported drafter; one that does not fit is one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import toy_hidden_shards
from safetensors.torch import load_file, save_file

from flashdraft.config import DrafterConfig
from flashdraft.config_check import check
from flashdraft.config_load import load
from flashdraft.drafter_io import export_drafter, init_weights
from flashdraft.errors import UserError
from flashdraft.model import DFlashDrafter
from flashdraft.train_step import load_spec

REPO = Path(__file__).resolve().parents[1]
DRAFTER = {"num_layers": 2, "block_size": 8}
TRAIN = {
    "lr": 1e-2,
    "max_anchors": 64,
    "batch_tokens": 512,
    "buckets": [128, 256],
    "compile": False,
    "checkpoint_every": 1000,
    "log_every": 1,
    "warmup_ratio": 0.0,
    "loss": "decay",
    "val_samples": 0,
}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A toy target, shards of one token pattern and a shifted mix of it (other samples and starts)."""
    root = tmp_path_factory.mktemp("finetune")
    base = toy_hidden_shards(root, DRAFTER)
    shifted = toy_hidden_shards(root, DRAFTER, seed=1, name="shifted")
    return root, base, shifted


def train(root, shards, out, steps, drafter=DRAFTER, check=True, **keys):
    """scripts/train.py for `steps` steps (0: train.epochs), `keys` over TRAIN."""
    cfg = {**TRAIN, "max_steps": steps, **keys}
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "train.py"),
        "--cfg",
        json.dumps(cfg),
        "--drafter-cfg",
        json.dumps(drafter),
        "--target",
        str(root / "target"),
        "--checkpoints",
        str(out / "checkpoints"),
        "--metrics",
        str(out / "metrics.csv"),
        "--out",
        str(out / "drafter"),
        *shards,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def first_losses(out, n=4):
    import pandas as pd

    return pd.read_csv(out / "metrics.csv")["loss"].head(n).mean()


def test_a_fine_tune_starts_from_the_drafter_s_loss_not_from_scratch(toy, tmp_path):
    root, base, shifted = toy
    trained = tmp_path / "trained"
    train(root, base, trained, steps=60)
    import pandas as pd

    trained_end = pd.read_csv(trained / "metrics.csv")["loss"].tail(4).mean()
    # the same shifted data, from the trained drafter and from scratch
    tuned, scratch = tmp_path / "tuned", tmp_path / "scratch"
    train(root, shifted, tuned, steps=4, drafter={**DRAFTER, "init_from": str(trained / "drafter")})
    train(root, shifted, scratch, steps=4)
    start, fresh = first_losses(tuned), first_losses(scratch)
    print(f"trained {trained_end:.3f}, fine-tune's start {start:.3f}, from scratch {fresh:.3f}")
    assert trained_end < fresh and start < fresh
    assert abs(start - trained_end) < abs(fresh - trained_end)  # nearer the drafter's loss than a new one's
    # the fine-tune's export is a drafter of the same shape, in the export format
    a, b = (load_file(d / "drafter" / "model.safetensors") for d in (trained, tuned))
    assert a.keys() == b.keys() and any(not a[k].equal(b[k]) for k in a)


def spec_of(root, **drafter):
    return load_spec(root / "target", DrafterConfig(**{**DRAFTER, **drafter}))


def export(root, out, **drafter):
    spec = spec_of(root, **drafter)
    export_drafter(DFlashDrafter(spec), spec, out)
    return out


@pytest.mark.parametrize(
    "key, value",
    [
        ("block_size", 4),
        ("num_layers", 3),
        ("target_layer_ids", [0, 2]),
        ("mask_token_id", 3),
        ("sliding_window", 64),
    ],
)
def test_a_drafter_of_another_shape_is_one_line_naming_the_key_and_both_values(toy, tmp_path, key, value):
    root = toy[0]
    other = export(root, tmp_path / "other", **{key: value})
    mine = spec_of(root)
    with pytest.raises(UserError) as e:
        init_weights(other, mine)
    msg = str(e.value)
    assert msg.startswith("config key drafter.init_from: ") and "\n" not in msg
    assert f"has {key} {value}, this drafter {getattr(mine, key)}; set drafter.{key}: {value}" in msg


def test_a_drafter_of_another_target_is_refused(toy, tmp_path):
    root = toy[0]
    out = export(root, tmp_path / "other")
    config = json.loads((out / "config.json").read_text())
    config["hidden_size"] *= 2
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"has hidden_size \d+, this drafter \d+; use a drafter of this"):
        init_weights(out, spec_of(root))


def test_missing_or_broken_files_are_one_line_each(toy, tmp_path):
    root = toy[0]
    spec = spec_of(root)
    with pytest.raises(UserError, match="is not a drafter export .*missing: config.json, model.safetensors"):
        init_weights(tmp_path / "nowhere", spec)
    out = export(root, tmp_path / "d")
    state = load_file(out / "model.safetensors")
    name = sorted(state)[0]
    save_file({k: v for k, v in state.items() if k != name}, out / "model.safetensors")
    with pytest.raises(UserError, match=f"lacks: {name}"):
        init_weights(out, spec)
    save_file({**state, name: torch.zeros(3, 3)}, out / "model.safetensors")
    with pytest.raises(UserError, match=rf"has: {name} \(3, 3\) \(want"):
        init_weights(out, spec)
    (out / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="model.safetensors cannot be read"):
        init_weights(out, spec)
    for text in ("{}", "[]", "null"):
        (out / "config.json").write_text(text)
        with pytest.raises(UserError, match="config.json is not a DFlash drafter's config"):
            init_weights(out, spec)


def test_a_missing_init_from_is_one_line_before_any_job(tmp_path):
    cfg = load(REPO / "config" / "config.yaml")
    cfg.drafter.init_from = str(tmp_path / "nowhere")
    with pytest.raises(
        UserError,
        match=r"^config key drafter\.init_from: .*nowhere is not a drafter export "
        r"\(.*missing: config\.json, model\.safetensors\)$",
    ):
        check(cfg)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    cfg.drafter.init_from = str(tmp_path / "half")
    with pytest.raises(UserError, match=r"half is not a drafter export .*missing: model\.safetensors\)$"):
        check(cfg)


def test_training_refuses_a_drafter_that_does_not_fit_before_it_trains(toy, tmp_path):
    root, base, _ = toy
    other = export(root, tmp_path / "other", block_size=4)
    out = tmp_path / "run"
    proc = train(root, base, out, steps=2, drafter={**DRAFTER, "init_from": str(other)}, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("train: error: config key drafter.init_from: ")
    assert "Traceback" not in proc.stderr and not (out / "checkpoints").exists()


def test_init_from_weights_that_are_not_finite_are_one_line(toy, tmp_path):
    root = toy[0]
    out = export(root, tmp_path / "d")
    state = load_file(out / "model.safetensors")
    name = sorted(state)[0]
    state[name] = state[name].clone()
    state[name].view(-1)[0] = float("nan")
    save_file(state, out / "model.safetensors")
    with pytest.raises(UserError, match=rf"holds NaN or infinite values in {name}; start from another"):
        init_weights(out, spec_of(root))


def test_a_diverged_run_stops_at_the_first_logged_step_and_exports_nothing(toy, tmp_path):
    """lr 1e9: the loss turns non-finite within a few steps; the run stops there with one line naming the
    step and train.lr instead of training to the end and exporting NaN weights."""
    root, base, _ = toy
    out = tmp_path / "run"
    proc = train(root, base, out, steps=20, check=False, lr=1e9)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("train: error: the loss is ")
    assert "training diverged; lower train.lr (1000000000.0)" in line
    step = int(line.split(" at step ")[1].split(":")[0])
    assert 1 <= step < 20 and not (out / "drafter").exists()


def test_zero_optimizer_steps_is_one_line_before_training(toy, tmp_path):
    """A global batch larger than the epoch: nothing would train, and the export would be the random init."""
    root, base, _ = toy
    out = tmp_path / "run"
    proc = train(root, base, out, steps=0, check=False, epochs=1, global_batch_tokens=512 * 1024)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "training would take 0 optimizer steps" in proc.stderr.strip().splitlines()[-1]
    assert not (out / "drafter").exists()
