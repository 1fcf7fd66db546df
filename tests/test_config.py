"""Config: the schema documents every key the dataclasses hold, and both shipped configs validate."""

import dataclasses
import importlib.util
import json
import re
import typing
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

from flashdraft.config import (
    Config,
    GpusConfig,
    RegenerateConfig,
    TargetConfig,
    TrainConfig,
    from_dict,
    load_section,
    target_layer_ids,
    to_json,
    train_world,
)
from flashdraft.config_check import check, check_schema
from flashdraft.config_load import load
from flashdraft.errors import UserError
from flashdraft.io import DTYPES, STORAGE_DTYPES, torch_dtype
from flashdraft.objectives import OBJECTIVES
from flashdraft.shapes import QWEN3_8B

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"


def _check(cls, node, where):
    props = node["properties"] if "properties" in node else node["items"]["properties"]
    fields = {f.name for f in dataclasses.fields(cls)}
    assert set(props) == fields, f"{where}: schema {sorted(props)} vs dataclass {sorted(fields)}"
    assert node.get("additionalProperties", node.get("items", {}).get("additionalProperties")) is False
    hints = typing.get_type_hints(cls)
    for name, prop in props.items():
        inner = hints[name]
        inner = typing.get_args(inner)[0] if typing.get_origin(inner) is list else inner
        if dataclasses.is_dataclass(inner):
            _check(inner, prop, f"{where}.{name}")
        elif name != "name":
            assert prop.get("description"), f"{where}.{name} has no description in the schema"


def test_schema_documents_every_dataclass_key():
    _check(Config, yaml.safe_load(SCHEMA.read_text()), "config")


def test_schema_dtypes_are_the_ones_torch_dtype_takes():
    props = yaml.safe_load(SCHEMA.read_text())["properties"]
    for section, names in (("target", DTYPES), ("train", DTYPES), ("hidden", STORAGE_DTYPES)):
        enum = props[section]["properties"]["dtype"]["enum"]
        assert sorted(enum) == sorted(names), f"{section}.dtype: schema {enum} vs flashdraft.io {names}"
        assert all(torch_dtype(n, names).itemsize in (1, 2, 4) for n in enum)


def test_schema_losses_are_the_registered_objectives():
    enum = yaml.safe_load(SCHEMA.read_text())["properties"]["train"]["properties"]["loss"]["enum"]
    assert sorted(enum) == sorted(OBJECTIVES), f"train.loss: schema {enum} vs objectives {list(OBJECTIVES)}"


def test_schema_backends_are_the_registered_ones():
    from flashdraft.regenerate import BACKENDS

    enum = yaml.safe_load(SCHEMA.read_text())["properties"]["regenerate"]["properties"]["backend"]["enum"]
    assert sorted(enum) == sorted(BACKENDS), f"regenerate.backend: schema {enum} vs {list(BACKENDS)}"


def test_an_unknown_loss_is_one_line_before_any_job():
    cfg = load(REPO / "config" / "config.yaml")
    for name in OBJECTIVES:
        cfg.train.loss = name
        check(cfg)
    cfg.train.loss = "mean"
    with pytest.raises(UserError, match=r"^config key train\.loss: 'mean'; use one of decay, dpace$"):
        check(cfg)


@pytest.mark.parametrize("name", ["config.yaml", "production.yaml"])
def test_shipped_configs_validate(name):
    data = yaml.safe_load((REPO / "config" / name).read_text())
    validate(data, str(SCHEMA))
    cfg = load(REPO / "config" / name, target=QWEN3_8B)  # production's target.path is not here
    assert cfg.drafter.block_size in (8, 16)


def test_unknown_key_named():
    with pytest.raises(UserError, match=r"config\.train: unknown key\(s\) \['lrr'\]"):
        from_dict(Config, {"train": {"lrr": 1}})


def test_a_schema_mistake_is_one_line_naming_the_key():
    """What the workflow checks first (and the planner): an unknown key names its section and itself, a
    wrong value its key, in one line rather than jsonschema's dump of the schema."""
    from flashdraft.config_check import check_schema

    def config(section, key, value):
        data = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
        data.setdefault(section, {})[key] = value
        return data

    with pytest.raises(UserError) as e:
        check_schema(config("train", "lrr", 1.0), SCHEMA)
    assert str(e.value) == "config key train: Additional properties are not allowed ('lrr' was unexpected)"
    with pytest.raises(UserError) as e:
        check_schema(config("trian", "lr", 1.0), SCHEMA, "my.yaml: ")
    assert str(e.value) == (
        "my.yaml: config key (top level): Additional properties are not allowed ('trian' was unexpected)"
    )
    with pytest.raises(UserError, match=r"^config key train\.epochs: 'six' is not of type 'integer'$"):
        check_schema(config("train", "epochs", "six"), SCHEMA)
    check_schema(yaml.safe_load((REPO / "config" / "production.yaml").read_text()), SCHEMA)


def test_every_problem_of_a_config_is_one_line_at_once():
    """The checks before any job gathered: three independent mistakes, three lines in one error (each in
    its own words), and the warnings still returned where nothing is wrong."""
    cfg = load(REPO / "config" / "config.yaml")
    cfg.prompts.min_chars, cfg.prompts.max_chars = 50, 10
    cfg.train.loss, cfg.drafter.sliding_window = "mean", 4
    with pytest.raises(UserError) as e:
        check(cfg)
    assert str(e.value).splitlines() == [
        "config keys prompts.min_chars (50) > prompts.max_chars (10) would reject every prompt; make "
        "min_chars <= max_chars",
        "config key drafter.sliding_window (4) < drafter.block_size (8): a window must hold a whole block; "
        "use a window of at least the block size, or null for none",
        "config key train.loss: 'mean'; use one of decay, dpace",
    ]


def test_every_schema_mistake_is_a_line_and_the_rest_of_the_config_is_still_checked():
    from flashdraft.config_check import schema_problems, schema_valid_part

    data = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    data["train"].update(lrr=1.0, epochs="six")
    data["prompts"]["sources"][1]["format"] = "csv"
    assert schema_problems(data, SCHEMA, "my.yaml: ") == [
        "my.yaml: config key prompts.sources.1.format: 'csv' is not one of ['auto', 'jsonl', 'json', "
        "'parquet', 'arrow', 'hf']",
        "my.yaml: config key train: Additional properties are not allowed ('lrr' was unexpected)",
        "my.yaml: config key train.epochs: 'six' is not of type 'integer'",
    ]
    part = schema_valid_part(data, SCHEMA)  # without the three: the defaults stand
    assert "lrr" not in part["train"] and "epochs" not in part["train"]
    assert "format" not in part["prompts"]["sources"][1] and data["train"]["lrr"] == 1.0
    del data["target"]["path"]  # a required key: no Config to check further
    assert schema_valid_part(data, SCHEMA) is None


@pytest.mark.parametrize(
    "section, key, value", [("drafter", "family", None), ("hidden", "mode", 5), ("toy", "steps", -1.5)]
)
def test_a_value_breaking_two_schema_rules_is_two_lines_not_a_crash(section, key, value):
    """A wrong type and a wrong value of one key: both lines, and the key's default stands for the rest
    of the checks (it is removed once, not twice)."""
    from flashdraft.config_check import schema_problems, schema_valid_part

    data = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    data.setdefault(section, {})[key] = value
    lines = schema_problems(data, SCHEMA)
    assert len(lines) == 2 and all(x.startswith(f"config key {section}.{key}: ") for x in lines), lines
    part = schema_valid_part(data, SCHEMA)
    assert part is not None and key not in part[section]


def test_a_family_whose_draft_weights_are_all_zero_is_refused():
    from flashdraft.config_check import config_problems

    cfg = Config()
    cfg.drafter.family = "dspark"
    cfg.drafter.dspark.ce_weight = cfg.drafter.dspark.l1_weight = 0.0
    problems, _ = config_problems(cfg, {})
    assert (
        "config keys drafter.dspark.ce_weight and drafter.dspark.l1_weight are all 0: the loss would "
        "train no draft and export an untrained drafter; give at least one a weight > 0"
    ) in problems
    cfg.drafter.dspark.l1_weight = 0.5
    assert not [x for x in config_problems(cfg, {})[0] if "weight" in x]


def test_a_target_after_configfile_is_named_as_one():
    from flashdraft.config_check import configfile_problems

    assert configfile_problems(["my.yaml", "config/a.json"], "results") == []
    assert configfile_problems(["my.yaml", "results/hidden/shard-00001.json", "x.arrow"], "results") == [
        f"--configfile {p}: not a config but a target (--configfile takes every path after it); put targets "
        f"before --configfile or after --: snakemake --cores all --configfile <config> -- {p}"
        for p in ("results/hidden/shard-00001.json", "x.arrow")
    ]


def test_section_json_fills_defaults():
    t = load_section(TrainConfig, '{"lr": 0.001}', "train")
    assert t.lr == 0.001 and t.epochs == 6 and t.max_anchors == 512
    assert t.loss_gamma(16) == 7 and t.loss_gamma(10) == 5 and t.loss_gamma(8) == 4


def test_a_stage_section_that_is_not_json_is_named():
    """A stage's section arrives as JSON (`--target-cfg` here): malformed, the error names the section."""
    with pytest.raises(UserError, match=r"^target: the section is not JSON"):
        load_section(TargetConfig, '{"path": "x",', "target")
    t = load_section(TargetConfig, '{"path": "x"}', "target")
    assert t.path == "x" and t.dtype == TargetConfig.dtype


def test_target_layer_ids_formula():
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert target_layer_ids(6, 2) == [1, 3]  # the toy target
    # 1 + 3 * 90 / 4 = 68.5: Python's round takes the even neighbour, as the reference does
    assert target_layer_ids(94, 5) == [1, 24, 46, 68, 91]


def test_a_target_too_shallow_for_the_default_feature_layers_names_the_key():
    """A 2-layer target and 2 drafter layers: the formula gives [1, -1]; one line names the key to set."""
    from flashdraft.config import DrafterConfig, feature_layers

    with pytest.raises(
        UserError,
        match=r"^config key drafter\.target_layer_ids: the default ids .* are "
        r"\[1, -1\] for a target with 2 layers .* \[-1\] out of range; set",
    ):
        feature_layers(2, DrafterConfig(num_layers=2))
    assert feature_layers(2, DrafterConfig(num_layers=2, target_layer_ids=[0, 1])) == [0, 1]


def test_default_feature_layers_that_repeat_a_layer_are_a_warning_naming_the_key():
    """A 4-layer target and 2 drafter layers: the formula gives [1, 1] (one layer fed twice); the run goes
    on with a warning naming the key; distinct or explicit ids give none."""
    from flashdraft.config_check import config_warnings

    cfg = from_dict(Config, {"drafter": {"num_layers": 2}}, "config")
    (line,) = [w for w in config_warnings(cfg, 4) if "target_layer_ids" in w]
    assert line.startswith("config key drafter.target_layer_ids: the default ids for a target of 4 layers")
    assert "[1, 1]" in line
    assert not [w for w in config_warnings(cfg, 8) if "target_layer_ids" in w]  # [1, 5]
    explicit = from_dict(Config, {"drafter": {"num_layers": 2, "target_layer_ids": [0, 3]}}, "config")
    assert not [w for w in config_warnings(explicit, 4) if "target_layer_ids" in w]


@pytest.mark.parametrize("text", ["[]", "null", "3"])
def test_a_target_config_that_is_not_an_object_is_one_line(tmp_path, text):
    from flashdraft.hf_config import read_target_config

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(UserError, match=r"^config key target\.path: .*config\.json holds \w+, not a JSON"):
        read_target_config(tmp_path)


def test_remote_code_target_refused_known_type_with_auto_map_read(tmp_path):
    from flashdraft.hf_config import read_target_config

    auto_map = {"AutoModelForCausalLM": "modeling.X"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3", "auto_map": auto_map}))
    assert read_target_config(tmp_path)["model_type"] == "phi3"  # transformers ships phi3: no remote code
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mine", "auto_map": auto_map}))
    with pytest.raises(UserError, match=r"needs remote code .*'mine'.*modeling\.X"):
        read_target_config(tmp_path)


def test_a_sliding_window_smaller_than_a_block_is_refused_before_any_job():
    cfg = load(Path(__file__).resolve().parents[1] / "config" / "config.yaml")
    cfg.drafter.sliding_window = cfg.drafter.block_size
    check(cfg)
    cfg.drafter.sliding_window = cfg.drafter.block_size - 1
    with pytest.raises(UserError, match=r"drafter\.sliding_window \(7\) < drafter\.block_size \(8\)"):
        check(cfg)


def test_a_global_batch_the_training_processes_cannot_share_is_refused_before_any_job():
    cfg = load(Path(__file__).resolve().parents[1] / "config" / "config.yaml")
    cfg.gpus.drafter = 2
    check(cfg)  # 2048 tokens: one micro-batch of 1024 on each of 2 processes
    cfg.gpus.drafter = 3
    with pytest.raises(UserError, match=r"train\.global_batch_tokens \(2048\) .* each of the 3 training"):
        check(cfg)
    cfg.gpus.drafter, cfg.train.global_batch_tokens = 1, 1500
    with pytest.raises(UserError, match=r"use a multiple of 1024 from 1024 up, or 0"):
        check(cfg)


def test_fp8_takes_a_known_recipe_and_a_gpu_with_fp8_matmuls():
    import torch

    from flashdraft.float8 import float8_linears

    cfg = load(REPO / "config" / "config.yaml")
    assert cfg.train.fp8 is None  # the embedded default trains as it always has
    assert not [w for w in check(cfg) if "torchao" in w]
    cfg.train.fp8, cfg.gpus.drafter = "rowwise", 1
    warnings = [w for w in check(cfg) if "torchao" in w]
    if importlib.util.find_spec("torchao") is None:  # said at the workflow's start, not after hours
        assert warnings == [
            "config key train.fp8 (rowwise) needs torchao, which this environment lacks: "
            "training stops at its start; pip install torchao, or set train.fp8: null"
        ]
    else:
        assert warnings == []
    cfg.train.fp8 = "e5m2"
    with pytest.raises(UserError, match=r"train\.fp8: 'e5m2'; use one of tensorwise, rowwise, or null"):
        check(cfg)
    layer = torch.nn.Linear(32, 16)
    # the trainer checks again, in the workflow's words (fp8_problem)
    on_cpu = NEED + "the drafter trains on the CPU; set train.fp8: null"
    with pytest.raises(UserError, match=f"^{re.escape(on_cpu)}$"):
        float8_linears(layer, "tensorwise", torch.device("cpu"))
    assert type(layer) is torch.nn.Linear  # left as it was


NEED = (
    "config key train.fp8 (tensorwise) needs a GPU with FP8 matmuls (compute capability 8.9 or newer), but "
)


@pytest.mark.parametrize(
    "recipe, on_gpu, gpus, torchao, expected",
    [
        (None, False, [], False, None),  # off: nothing is needed
        ("tensorwise", False, [], True, NEED + "the drafter trains on the CPU; set train.fp8: null"),
        (
            "tensorwise",
            False,
            [("0", "NVIDIA H100", (9, 0))],
            True,
            NEED + "the drafter trains on the CPU; set train.fp8: null",
        ),
        (
            "tensorwise",
            True,
            [("0", "NVIDIA A100-SXM4-80GB", (8, 0))],
            True,
            NEED + "GPU 0 (NVIDIA A100-SXM4-80GB) has compute capability 8.0; set train.fp8: null",
        ),
        (
            "tensorwise",
            True,
            [("0", "NVIDIA H100", (9, 0)), ("1", "NVIDIA A10", (8, 6))],
            True,
            NEED + "GPU 1 (NVIDIA A10) has compute capability 8.6; set train.fp8: null",
        ),
        (
            "tensorwise",
            True,
            [("0", "NVIDIA A100", (8, 0))],
            False,  # the GPU first: torchao would not help
            NEED + "GPU 0 (NVIDIA A100) has compute capability 8.0; set train.fp8: null",
        ),
        ("tensorwise", True, [("0", "NVIDIA L40S", (8, 9)), ("1", "NVIDIA H200", (9, 0))], True, None),
        ("rowwise", True, [("0", "NVIDIA B200", (10, 0))], True, None),
        (
            "tensorwise",
            True,
            [("0", "NVIDIA H100", None)],
            True,
            None,
        ),  # unknown capability: the trainer checks
        ("tensorwise", True, [], True, None),  # nothing known of the GPUs (no nvidia-smi)
        (
            "rowwise",
            True,
            [("0", "NVIDIA H200", (9, 0))],
            False,
            "config key train.fp8 (rowwise) needs torchao, which this environment lacks: pip "
            "install torchao, "
            "or set train.fp8: null",
        ),
    ],
)
def test_fp8_problem_names_what_is_missing(recipe, on_gpu, gpus, torchao, expected):
    from flashdraft.config_check import fp8_problem

    assert fp8_problem(recipe, on_gpu, gpus, torchao) == expected


def test_fp8_with_no_gpu_visible_on_the_node_is_its_own_line_beside_the_gpu_count():
    """The workflow's start where no GPU is visible (jobs run here): float8's line says what it will need,
    so the user fixes it with the GPU counts in one edit."""
    from flashdraft.config_check import fp8_problem

    line = fp8_problem("tensorwise", True, visible=False)
    assert line == NEED + "no GPU is visible here; set train.fp8: null"
    assert fp8_problem(None, True, visible=False) is None


def test_fp8_on_the_cpu_is_refused_by_the_check_before_any_job():
    """production.yaml's train.fp8 with gpus.drafter: 0: the config check the workflow (and the planner)
    runs first refuses it in one line, whatever GPUs this machine has."""
    cfg = load(REPO / "config" / "config.yaml")
    cfg.train.fp8, cfg.gpus.drafter = "tensorwise", 0
    with pytest.raises(UserError) as e:
        check(cfg)
    assert str(e.value) == NEED + "the drafter trains on the CPU; set train.fp8: null"


def test_fp8_against_this_node_s_gpus_and_torchao(monkeypatch):
    """check_fp8_gpus, which the workflow runs when gpus.check_visible: the GPUs nvidia-smi reports, and
    torchao in this environment."""
    import flashdraft.config_check as C

    cfg = load(REPO / "config" / "config.yaml")
    cfg.train.fp8, cfg.gpus.drafter = "tensorwise", 1
    with pytest.raises(UserError, match=r"but GPU 0 \(NVIDIA A100\) has compute capability 8\.0; set train"):
        C.check_fp8_gpus(cfg, [("0", "NVIDIA A100", (8, 0))])
    real = importlib.util.find_spec
    monkeypatch.setattr(C.importlib.util, "find_spec", lambda name: None if name == "torchao" else real(name))
    with pytest.raises(UserError, match=r"needs torchao, which this environment lacks"):
        C.check_fp8_gpus(cfg, [("0", "NVIDIA H200", (9, 0))])
    monkeypatch.undo()
    if importlib.util.find_spec("torchao") is not None:
        C.check_fp8_gpus(cfg, [("0", "NVIDIA H200", (9, 0))])
    cfg.gpus.drafter = 0
    with pytest.raises(UserError, match=r"the drafter trains on the CPU"):
        C.check_fp8_gpus(cfg, [("0", "NVIDIA H200", (9, 0))])
    cfg.train.fp8 = None
    C.check_fp8_gpus(cfg, [("0", "NVIDIA A100", (8, 0))])


def test_compile_scope_is_model_or_layer():
    cfg = load(REPO / "config" / "config.yaml")
    assert cfg.train.compile_scope == "model"
    cfg.train.compile_scope = "layer"
    check(cfg)
    cfg.train.compile_scope = "block"
    with pytest.raises(UserError, match=r"train\.compile_scope: 'block'; use one of model, layer"):
        check(cfg)


@pytest.mark.parametrize("spelling", ["hf", "generate"])
def test_regeneration_s_hf_engine_takes_eval_s_word_and_its_old_one_alike(spelling):
    """regenerate.engine hf is the engine eval.engine calls hf; generate, its old name, stays the same engine
    with the same section JSON (a stage's params), so a finished run that wrote it reruns nothing."""
    cfg = from_dict(Config, {"regenerate": {"engine": spelling}}, "config")
    assert cfg.regenerate.engine == "generate"
    assert to_json(cfg.regenerate) == to_json(RegenerateConfig(engine="generate"))
    data = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    data.setdefault("regenerate", {})["engine"] = spelling
    check_schema(data, SCHEMA)  # raises on a value the schema refuses


def test_a_key_added_later_is_no_rerun_trigger_while_unset():
    """train.batch_anchors (0: no bound) is left out of the stages' params, so a run made before the key
    existed has nothing to redo; set, it is one of them."""
    import dataclasses

    from flashdraft.config import LATER_KEYS, stage_params

    assert "batch_anchors" not in stage_params("train", dataclasses.asdict(TrainConfig()))
    assert stage_params("train", dataclasses.asdict(TrainConfig(batch_anchors=2560)))["batch_anchors"] == 2560
    assert all(getattr(TrainConfig(), k) == v for k, v in LATER_KEYS["train"].items())  # the defaults
    # regenerate.top_p and top_k (off: 1.0, 0): a run's regeneration from before them is not redone
    assert all(getattr(RegenerateConfig(), k) == v for k, v in LATER_KEYS["regenerate"].items())
    assert {"top_p", "top_k"}.isdisjoint(stage_params("regenerate", dataclasses.asdict(RegenerateConfig())))
    sampled = RegenerateConfig(temperature=0.7, top_p=0.8, top_k=20)
    params = stage_params("regenerate", dataclasses.asdict(sampled))
    assert (params["top_p"], params["top_k"]) == (0.8, 20)


def test_eval_temperatures_and_the_former_single_temperature():
    """eval.temperatures (default [0, 1]); eval.temperature, the key of configs from before it, is that one
    temperature alone; the schema and the dataclass refuse an empty list, a repeat and a negative one."""
    from flashdraft.config import EvalConfig

    assert EvalConfig().temperatures == [0.0, 1.0]
    legacy = from_dict(Config, {"eval": {"temperature": 0.7}}, "config").eval
    assert legacy.temperatures == [0.7] and legacy.temperature is None
    assert from_dict(Config, {"eval": {"temperatures": [1, 0]}}, "config").eval.temperatures == [1, 0]
    data = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for ok in ({"temperature": 0.0}, {"temperatures": [0, 1], "seed": 3}):
        check_schema({**data, "eval": {**data["eval"], **ok}}, SCHEMA)
    for bad in ([], [0, 0], [-1]):
        with pytest.raises(UserError, match=r"eval\.temperatures"):
            EvalConfig(temperatures=bad)
        with pytest.raises(Exception, match="temperatures"):
            check_schema({**data, "eval": {**data["eval"], "temperatures": bad}}, SCHEMA)


def test_the_training_world_is_one_process_per_gpu_or_one_on_the_cpu_per_node():
    assert train_world(GpusConfig()) == 1
    assert train_world(GpusConfig(drafter=3)) == 3
    assert train_world(GpusConfig(drafter=4, drafter_nodes=2)) == 8
    assert train_world(GpusConfig(drafter=0, drafter_nodes=2)) == 2
    assert train_world(GpusConfig(drafter=4, drafter_nodes=2), 1) == 2  # a planner's split: 1 GPU a node


@pytest.mark.parametrize("global_tokens", [1536, 1024])
def test_a_global_batch_that_is_no_whole_step_of_micro_batches_is_one_line(global_tokens):
    """train.global_batch_tokens against micro_per_step's rule (a multiple of train.batch_tokens, a
    micro-batch for each process), in the check's own words."""
    cfg = load(REPO / "config" / "config.yaml")
    cfg.gpus.drafter, cfg.train.batch_tokens = 2, 1024
    for fine in (0, 2048, 4096):
        cfg.train.global_batch_tokens = fine
        check(cfg)
    cfg.train.global_batch_tokens = global_tokens
    with pytest.raises(UserError) as e:
        check(cfg)
    assert str(e.value) == (
        f"config key train.global_batch_tokens ({global_tokens}) must be a multiple of train.batch_tokens "
        "(1024) and hold a micro-batch for each of the 2 training process(es): use a multiple of 1024 from "
        "2048 up, or 0"
    )
