"""A drafter family is its module plus one registry line (docs/architecture.md, "Adding a drafter family"):
a family made here, a module holding its FAMILY and a line of families.FAMILIES, is what the family
look-ups, the config (its own section), the config check, the memory estimate and the planner use, with no
other edit; adding it changes no existing run's key, rates or plan. DFlash's entries are the identity."""

import dataclasses
import sys
import types
from pathlib import Path

import pytest
import yaml

from flashdraft import config
from flashdraft.config import DrafterConfig, config_from, run_config
from flashdraft.config_check import config_problems
from flashdraft.estimate import RATES, Run, Split
from flashdraft.families import (
    FAMILIES,
    FamilyInfo,
    FamilyRate,
    family,
    family_info,
    family_name_of_export,
)
from flashdraft.memory import drafter_parameters
from flashdraft.results import figure
from flashdraft.shapes import QWEN3_8B

NAME = "toyfam"
MODULE = "toyfam_module"
# any committed benchmark figure serves as the toy family's measured factors
TRAIN_FACTOR = ("train_drafter_qwen3-8b_dspark_vs_dflash.json", "comparison.speedup_vs_baseline")
EVAL_FACTOR = ("eval_decode_qwen3-8b_dspark_vs_dflash.json", "dspark_over_dflash.tokens_per_s_at_equal_tau")
TOO_LONG = f"config key drafter.block_size: drafter.family {NAME} drafts blocks of at most 8"
SPLIT = Split(target=1, drafter=1)


@dataclasses.dataclass
class ToySection:
    """drafter.toyfam: the family's own keys."""

    heads: int = 2


def toy_check(d) -> list[str]:
    return [TOO_LONG] if d.block_size > 8 else []


def toy_parameters(d, shapes: dict) -> int:
    return shapes["hidden_size"] * d.toyfam.heads  # heads of H values, say


INFO = FamilyInfo(
    MODULE,
    last_hidden=False,
    architecture="ToyFamModel",
    vllm_method="toyfam",
    sglang_algorithm="TOYFAM",
    anchor_drafts=False,
    section=ToySection,
    check=toy_check,
    head_parameters=toy_parameters,
    rates=(
        FamilyRate("train_toyfam_factor", "train", *TRAIN_FACTOR),
        FamilyRate("eval_toyfam_factor", "eval", *EVAL_FACTOR, applies=lambda d: d.num_layers > 1),
    ),
)


def register(monkeypatch):
    """The family's module (DFlash's pieces under its own name) and its registry line: nothing else (the
    drafter section's dataclass made from the registry as config.py makes it at import)."""
    from flashdraft import dflash

    module = types.ModuleType(MODULE)
    module.FAMILY = dataclasses.replace(dflash.FAMILY, name=NAME)
    monkeypatch.setitem(sys.modules, MODULE, module)
    monkeypatch.setitem(FAMILIES, NAME, INFO)
    monkeypatch.setattr(config, "DrafterConfig", config.drafter_config_class(FAMILIES))
    return module


def base_config(**drafter):
    """The embedded default config (config/config.yaml) with these drafter keys."""
    data = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "config.yaml").read_text())
    data.setdefault("drafter", {}).update(drafter)
    return config_from(data)


def existing_runs():
    """Every existing family's run as the default config makes it, and DSpark's paper baseline."""
    return [
        base_config(family="dflash"),
        base_config(family="dspark", block_size=7),
        base_config(family="dspark", block_size=7, dspark={"markov_rank": 0, "l1_weight": 0.0}),
    ]


def what_a_run_is(cfg) -> tuple:
    """What adding a family may not change of an existing run: its run key's config, its config
    problems, its parameters and its planned rates."""
    run = Run(cfg, None, QWEN3_8B, 1.0, 1)
    return (
        run_config(cfg.train, cfg.drafter),
        config_problems(cfg),
        drafter_parameters(cfg, QWEN3_8B),
        run.train_keys(SPLIT),
        run.eval_keys(),
        run.train_rate(SPLIT),
        run.eval_prompt_s(),
    )


def test_the_registry_line_finds_the_family_s_module(monkeypatch):
    module = register(monkeypatch)
    assert family(NAME) is module.FAMILY and family_info(NAME) is INFO
    assert family_name_of_export({"architectures": ["ToyFamModel"]}) == NAME
    assert INFO.drafts(8) == 7 and not INFO.needs_last_hidden(config.DrafterConfig(family=NAME))


def test_the_family_s_section_is_read_and_enters_its_runs_key_only(monkeypatch):
    register(monkeypatch)
    toy = base_config(family=NAME, toyfam={"heads": 3})
    assert toy.drafter.toyfam == ToySection(heads=3)
    assert '"toyfam": {"heads": 3}' in run_config(toy.train, toy.drafter)
    plain = base_config(family="dflash", toyfam={"heads": 3})
    assert "toyfam" not in run_config(plain.train, plain.drafter)


def test_the_family_s_checks_are_the_config_check_s(monkeypatch):
    register(monkeypatch)
    problems, _ = config_problems(base_config(family=NAME, block_size=16))
    assert TOO_LONG in problems
    assert TOO_LONG not in config_problems(base_config(family=NAME, block_size=8))[0]
    assert TOO_LONG not in config_problems(base_config(family="dflash", block_size=16))[0]


def test_the_family_s_heads_count_in_the_memory_estimate(monkeypatch):
    register(monkeypatch)
    toy, plain = base_config(family=NAME, toyfam={"heads": 3}), base_config(family="dflash")
    heads = QWEN3_8B["hidden_size"] * 3
    assert drafter_parameters(toy, QWEN3_8B) == drafter_parameters(plain, QWEN3_8B) + heads


def test_the_family_s_rates_are_the_planner_s(monkeypatch):
    register(monkeypatch)
    train, evaluate = figure(*TRAIN_FACTOR), figure(*EVAL_FACTOR)
    assert (RATES["train_toyfam_factor"].value, RATES["eval_toyfam_factor"].value) == (train, evaluate)
    toy, plain = (Run(base_config(family=f), None, QWEN3_8B, 1.0, 1) for f in (NAME, "dflash"))
    assert toy.train_keys(SPLIT) == [*plain.train_keys(SPLIT), "train_toyfam_factor"]
    assert toy.train_rate(SPLIT) == pytest.approx(plain.train_rate(SPLIT) * train)
    assert toy.eval_keys() == [*plain.eval_keys(), "eval_toyfam_factor"]
    assert toy.eval_prompt_s() > plain.eval_prompt_s()
    one_layer = Run(base_config(family=NAME, num_layers=1), None, QWEN3_8B, 1.0, 1)  # `applies`: not paid
    assert one_layer.eval_keys() == plain.eval_keys()


def test_adding_a_family_changes_no_existing_run(monkeypatch):
    """Its key's config, its problems, its parameters and its plan's rates stay as they were, and so do
    the planner's rates."""
    before = [what_a_run_is(cfg) for cfg in existing_runs()]
    rates = {k: (r.file, r.key, r.unit, r.scaled) for k, r in RATES.items()}
    register(monkeypatch)
    assert [what_a_run_is(cfg) for cfg in existing_runs()] == before
    after = {k: (r.file, r.key, r.unit, r.scaled) for k, r in RATES.items()}
    assert {k: v for k, v in after.items() if "toyfam" not in k} == rates


def test_dflash_s_entries_are_the_identity():
    info, d = FAMILIES["dflash"], DrafterConfig()
    assert (info.check(d), info.head_parameters(d, QWEN3_8B), info.rates) == ([], 0, ())
    assert info.rate_keys(d, "train") == info.rate_keys(d, "eval") == []


def test_dspark_s_checks_rates_and_heads_come_from_its_registry_line():
    info = FAMILIES["dspark"]
    d = DrafterConfig(family="dspark", block_size=7, sliding_window=8)
    assert info.check(d) == [
        "config key drafter.sliding_window: drafter.family dspark has no sliding window; set null"
    ]
    assert info.rate_keys(d, "train") == ["train_dspark_factor"]
    assert info.rate_keys(d, "eval") == ["eval_dspark_factor"]
    assert info.head_parameters(d, QWEN3_8B) > 0
    assert {r.name for r in info.rates} <= set(RATES)
