"""The one way a config is read (flashdraft.config_load): files merged in order, overrides, the embedded
default, the schema, `{results}/` paths, the checks; the workflow, the planner and the tests get the same
Config from the same inputs."""

import json
import shlex

import pytest
import yaml
from conftest import REPO, production_sources, snakemake, write_config

from flashdraft.config import Config, config_from, stage_params
from flashdraft.config_load import DEFAULT_CONFIG, load, merged, read
from flashdraft.errors import UserError

PRODUCTION = REPO / "config" / "production.yaml"


def production(tmp_path):
    """config/production.yaml on a stand-in model dir and sources under `tmp_path` (nothing loads them)."""
    model = tmp_path / "models" / "Qwen3-8B"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 36}))
    production_sources(tmp_path)
    gpus = {"gpus": {"target": 5, "drafter": 3, "check_visible": False}}
    return write_config(tmp_path / "prod.yaml", gpus, base=PRODUCTION)


def job_sections(stdout: str) -> dict[str, dict]:
    """The config sections a dry run's jobs are given (`-p`: their shell commands), by section name."""
    scripts = {"prompts": "prompts", "regenerate": "regenerate", "hidden_shard": "hidden"}
    scripts |= {"evaluate": "eval", "train": "train"}
    found = {}
    for line in stdout.splitlines():
        if "Shell command: " not in line:
            continue
        argv = shlex.split(line.split("Shell command: ", 1)[1])
        script = next((a.rsplit("/", 1)[1][: -len(".py")] for a in argv if a.endswith(".py")), None)
        flags = {"--cfg": scripts.get(script), "--drafter-cfg": "drafter", "--target-cfg": "target"}
        for flag, name in flags.items():
            if name and flag in argv:
                found.setdefault(name, json.loads(argv[argv.index(flag) + 1]))
    return found


def section(cfg: Config, name: str) -> dict:
    """A section as the workflow passes it to a stage (common.smk's section)."""
    d = json.loads(json.dumps(getattr(cfg, name), default=lambda o: o.__dict__))
    return json.loads(json.dumps(stage_params(name, d)))


@pytest.mark.slow
def test_the_workflow_the_planner_and_the_tests_read_one_config(tmp_path, monkeypatch):
    """production.yaml with `--config results=run2 train={loss: dpace}`: the sections the workflow's jobs
    are given, the planner's Config (config_load.load), the Config of Snakemake's own merge of the same
    arguments, and of the tests' written config file (conftest.write_config) are one."""
    from snakemake.cli import parse_config
    from snakemake.common.configfile import load_configfile
    from snakemake.utils import update_config

    config = production(tmp_path)
    monkeypatch.chdir(tmp_path)  # the config's relative paths, as the workflow's work dir
    planner = load([config], {"results": "run2", "train.loss": "dpace"})
    assert planner.results == "run2" and planner.train.loss == "dpace"

    data = load_configfile(str(config))
    update_config(data, parse_config(["results=run2", "train={loss: dpace}"]))
    assert read(data, absent_target_ok=True).cfg == planner
    assert load(config, {"results": "run2", "train": {"loss": "dpace"}}) == planner
    written = write_config(tmp_path / "o.yaml", {"results": "run2", "train.loss": "dpace"}, base=config)
    assert load(written) == planner

    proc = snakemake(tmp_path, "-n", "-p", "--config", "results=run2", "train={loss: dpace}", config=config)
    given = job_sections(proc.stdout)
    assert sorted(given) == ["drafter", "eval", "hidden", "prompts", "regenerate", "target", "train"]
    for name, values in given.items():
        assert values == {k: v for k, v in section(planner, name).items() if k in values}, name
        assert len(values) > 1, name


def test_files_merge_in_order_key_by_key_then_the_overrides(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(yaml.safe_dump({"train": {"lr": 1e-3, "epochs": 2}, "results": "x"}))
    b.write_text(yaml.safe_dump({"train": {"epochs": 3}}))
    data = merged([a, b], {"train.lr": 5e-4, "drafter": {"block_size": 8}})
    assert data == {"train": {"lr": 5e-4, "epochs": 3}, "results": "x", "drafter": {"block_size": 8}}


def test_no_file_reads_the_embedded_default_and_places_run_dir_paths():
    cfg = load([], {"results": "elsewhere"})
    assert cfg == config_from({**yaml.safe_load(DEFAULT_CONFIG.read_text()), "results": "elsewhere"})
    assert cfg.target.path == "elsewhere/toy/target"


def test_every_problem_names_the_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"train": {"lrr": 1, "epochs": "six"}}))
    with pytest.raises(UserError) as e:
        load([DEFAULT_CONFIG, bad])
    assert str(e.value).splitlines() == [
        f"{DEFAULT_CONFIG} + {bad}: config key train: Additional properties are not allowed ('lrr' was "
        "unexpected)",
        f"{DEFAULT_CONFIG} + {bad}: config key train.epochs: 'six' is not of type 'integer'",
    ]
    bad.write_text("- a list\n")
    with pytest.raises(UserError, match=r"bad\.yaml: the config must be a mapping of sections$"):
        load(bad)
    with pytest.raises(UserError, match=r"missing\.yaml: cannot read the config"):
        load(tmp_path / "missing.yaml")
