"""The export of a trained run (export.py): the drafter's weights (the last step's, or the best
validation's) in the DFlash format, the metrics CSV, export.json and val_split.json; stream mode's train
job (train_data.PlanData), which exports the run's last checkpoint."""

import csv
import json
from types import SimpleNamespace

import pytest
import torch
from model_helpers import B, tiny_spec
from safetensors import safe_open

from flashdraft import export
from flashdraft.checkpoint import write_safetensors
from flashdraft.config import DrafterConfig, TrainConfig
from flashdraft.distributed import Dist
from flashdraft.drafter_io import load_drafter
from flashdraft.errors import UserError
from flashdraft.metrics import metric_fields
from flashdraft.model import DFlashDrafter
from flashdraft.train import train
from flashdraft.train_data import PlanData, run_dir
from flashdraft.validate import Best

VERSION = {"commit": "abc1234", "dirty": False}
SPLIT = {"samples": 2, "seed": 0, "ids": ["a", "b"]}
ROWS = [{"step": 1, "epoch": 0, "loss": 3.5}, {"step": 2, "epoch": 0, "loss": 3.0}]


@pytest.fixture(autouse=True)
def version(monkeypatch):
    """export.json's code version, fixed: the checkout's own is no business of these tests."""
    monkeypatch.setattr(export, "code_version", lambda: VERSION)


def drafter(seed: int) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(tiny_spec())


def job(tmp_path, cfg: TrainConfig, split=None, **kw):
    data = SimpleNamespace(val_split=lambda: split, **kw.pop("data", {}))
    return SimpleNamespace(
        cfg=cfg, data=data, out=tmp_path / "drafter", metrics=tmp_path / "train" / "metrics.csv", **kw
    )


def tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def read_csv(path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_the_last_step_s_weights_in_the_dflash_format(tmp_path):
    d = drafter(0)
    state = d.state_dict()
    j = job(tmp_path, TrainConfig(val_samples=0))
    export.export_run(
        Dist(), j, d.spec, tmp_path / "checkpoints" / "run1", state, None, 7, ROWS, torch.bfloat16, d
    )
    config = json.loads((j.out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dtype"] == "bfloat16"
    assert config["block_size"] == B and config["num_hidden_layers"] == 2 and config["num_target_layers"] == 6
    assert config["dflash_config"] == {"mask_token_id": 99, "target_layer_ids": [1, 3]}
    saved = tensors(j.out)
    assert saved.keys() == state.keys()
    assert not [k for k in saved if "embed_tokens" in k or "lm_head" in k]
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, state[k].bfloat16()) for k, v in saved.items())
    loaded, spec = load_drafter(j.out)
    assert spec == d.spec and type(loaded) is DFlashDrafter

    fields, rows = read_csv(j.metrics)
    assert fields == metric_fields(B, False, "dflash") and "val_loss" not in fields
    assert [(r["step"], r["loss"]) for r in rows] == [("1", "3.5"), ("2", "3.0")]
    info = json.loads((tmp_path / "train" / "export.json").read_text())
    assert info["step"] == info["last_step"] == 7 and info["export"] == "last" and info["run"] == "run1"
    assert info["best_step"] is None and "train.export: last" in info["why"]
    assert {k: info[k] for k in VERSION} == VERSION
    assert not (tmp_path / "train" / "val_split.json").exists()


def test_best_exports_the_best_validation_s_weights_and_names_its_step(tmp_path):
    best_weights, last = drafter(1).state_dict(), drafter(2)
    run = tmp_path / "checkpoints" / "run2"
    best = Best(run, Dist(), None, None)
    assert best.update(3, {"val_sim_tau": 1.5}, lambda: best_weights)
    assert not best.update(5, {"val_sim_tau": 1.2}, lambda: last.state_dict())  # worse: not kept
    j = job(tmp_path, TrainConfig(val_samples=2, export="best"), SPLIT)
    export.export_run(Dist(), j, last.spec, run, last.state_dict(), best, 6, ROWS, None, last)
    saved = tensors(j.out)
    assert all(torch.equal(v, best_weights[k]) for k, v in saved.items())
    assert not all(torch.equal(v, last.state_dict()[k]) for k, v in saved.items())
    info = json.loads((tmp_path / "train" / "export.json").read_text())
    assert (info["step"], info["best_step"], info["last_step"], info["best_val_sim_tau"]) == (3, 3, 6, 1.5)
    assert "step 3 had the best validation sim_tau" in info["why"]
    assert json.loads((tmp_path / "train" / "val_split.json").read_text()) == SPLIT
    fields, _ = read_csv(j.metrics)
    assert fields == metric_fields(B, True, "dflash") and "val_sim_tau" in fields


def test_best_without_a_validation_number_exports_the_last_step(tmp_path):
    last = drafter(2)
    run = tmp_path / "checkpoints" / "run3"
    j = job(tmp_path, TrainConfig(val_samples=2, export="best"), SPLIT)
    export.export_run(
        Dist(), j, last.spec, run, last.state_dict(), Best(run, Dist(), None, None), 4, ROWS, None, last
    )
    assert all(torch.equal(v, last.state_dict()[k]) for k, v in tensors(j.out).items())
    info = json.loads((tmp_path / "train" / "export.json").read_text())
    assert info["step"] == 4 and info["best_step"] is None and "no validation gave a number" in info["why"]


def test_only_the_first_rank_writes(tmp_path):
    d = drafter(0)
    j = job(tmp_path, TrainConfig(val_samples=2), SPLIT)
    export.export_run(
        Dist(rank=1, world=2), j, d.spec, tmp_path / "run", d.state_dict(), None, 2, ROWS, None, d
    )
    assert not j.out.exists() and not (tmp_path / "train").exists()


# ----------------------------------------------------------------------------------- stream mode's export


def stream_job(tmp_path, total: int):
    """A stream-mode train job whose plan trains `total` steps, its target the tiny drafter's (config.json
    alone: drafter.mask_token_id set, so no tokenizer)."""
    spec = tiny_spec()
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "hidden_size": spec.hidden_size,
                "intermediate_size": spec.intermediate_size,
                "num_hidden_layers": spec.num_target_layers,
                "num_attention_heads": spec.num_heads,
                "num_key_value_heads": spec.num_kv_heads,
                "head_dim": spec.head_dim,
                "rms_norm_eps": spec.rms_norm_eps,
                "rope_theta": spec.rope_theta,
                "vocab_size": spec.vocab_size,
                "max_position_embeddings": spec.max_position_embeddings,
            }
        )
    )
    drafter_cfg = DrafterConfig(num_layers=2, block_size=B, target_layer_ids=[1, 3], mask_token_id=99)
    checked, cfg = [], TrainConfig(val_samples=0)
    plan = SimpleNamespace(
        dir=tmp_path / "plan",
        meta={"total_steps": total},
        fingerprint="plan-1",
        tokenizer_length=None,
        check=lambda cfg, world: checked.append(world),
    )
    j = job(tmp_path, cfg, checkpoints=tmp_path / "checkpoints", drafter=drafter_cfg, target=target)
    j.data = PlanData(plan, cfg)  # the plan's answers without its files
    return j, run_dir(j.checkpoints, j.cfg, drafter_cfg, j.data), checked


def checkpoint(run, step: int, weights: dict) -> None:
    path = run / f"step-{step:08d}"
    path.mkdir(parents=True)
    write_safetensors(path / "model.safetensors", weights)
    (path / "state.json").write_text(
        json.dumps(
            {
                "position": {"step": step, "epoch": 0, "cursor": 0, "world": 1},
                "metrics": {"rows": ROWS[:1] * step, "window": []},
                "best": None,
                "spec": None,
            }
        )
    )


def test_stream_train_job_waits_for_every_chunk_then_exports_the_last_checkpoint(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # one process
    j, run, checked = stream_job(tmp_path, total=4)
    with pytest.raises(UserError, match=r"trained to step 0 of 4: train every chunk of the plan .*plan"):
        train(j)
    assert checked == [1]
    checkpoint(run, 2, drafter(1).state_dict())
    with pytest.raises(UserError, match="trained to step 2 of 4"):
        train(j)
    last = drafter(2).state_dict()
    checkpoint(run, 4, last)
    result = train(j)
    assert result.step == 4 and result.run_dir == str(run) and not result.stopped
    assert result.rows == ROWS[:1] * 4
    assert result.to_json() == {**ROWS[0], "compile_cache": {}}  # the line the job prints
    saved = tensors(j.out)
    assert saved.keys() == last.keys() and all(torch.equal(v, last[k]) for k, v in saved.items())
    assert json.loads((j.out / "config.json").read_text()) == tiny_spec().to_config_dict("float32")
    info = json.loads((tmp_path / "train" / "export.json").read_text())
    assert (info["step"], info["run"]) == (4, run.name)
    _, rows = read_csv(j.metrics)
    assert len(rows) == 4
