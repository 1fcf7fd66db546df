"""The one way a config is read into a Config, for the workflow, the planner and the tests.

`load` reads what a command line names: the YAML files merged in order (each on top of the one before, as
Snakemake reads `--configfile a.yaml b.yaml`; the embedded default only where none is given, as the
Snakefile), then `--config`-style overrides on top. `read` takes the data from there (or the workflow's
`config`, which Snakemake has merged the same way) to the Config: the schema's lines, `config.config_from`
(the dataclasses' defaults, `{results}/` paths placed in the run's directory), then
`config_check.config_problems`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .config import Config, config_from
from .config_check import Problems, config_problems, schema_problems, schema_valid_part, target_problem
from .errors import UserError

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "config" / "config.yaml"  # the Snakefile's `configfile:`
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"


@dataclass
class Read:
    """A config's data read (`read`): the Config (None where the schema's mistakes leave none to check),
    the schema's lines (and config_from's), the checks' problems and their warnings."""

    cfg: Config | None
    schema: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def lines(self) -> list[str]:
        return self.schema + self.problems


def load(configfiles=(), overrides: Mapping | None = None, target: dict | None = None, base=DEFAULT_CONFIG):
    """The config as the workflow sees it, or a UserError naming every problem, one line each
    (`configfiles`: one file or several, each on top of the one before; `base`, the embedded default, only
    where none is given; `overrides`: `--config` values on top, a mapping of sections or of dotted keys,
    `train.lr`; `target`: the target's config.json when it is not at target.path)."""
    files = [configfiles] if isinstance(configfiles, (str, os.PathLike)) else list(configfiles)
    data = merged(files or [base], overrides)
    r = read(data, f"{' + '.join(map(str, files or [base]))}: ", target)
    Problems(r.lines).raise_all()
    return r.cfg


def merged(files, overrides: Mapping | None = None) -> dict:
    """The YAML `files` merged in order, then `overrides` (see `load`), or a UserError naming the file."""
    import yaml

    data = {}
    for f in files:
        try:
            loaded = yaml.safe_load(Path(f).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise UserError(f"{f}: cannot read the config ({str(e).splitlines()[0]})") from e
        if not isinstance(loaded, dict):
            raise UserError(f"{f}: the config must be a mapping of sections")
        merge_into(data, loaded)
    for key, value in (overrides or {}).items():
        *sections, name = str(key).split(".")
        nested = {name: value}
        for s in reversed(sections):
            nested = {s: nested}
        merge_into(data, nested)
    return data


def merge_into(base: dict, update: Mapping) -> None:
    """Snakemake's merge of a --configfile (or --config) over the config before it: nested mappings key by
    key, anything else replaced."""
    for k, v in update.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            merge_into(base[k], v)
        else:
            base[k] = dict(v) if isinstance(v, Mapping) else v


def read(data: dict, where: str = "", target: dict | None = None, absent_target_ok: bool = False) -> Read:
    """Merged config data to a Config, with every problem found on the way (`where`: the files, before each
    schema line; `target`: the target's config.json when it is not at target.path; `absent_target_ok`: a
    target.path without a config.json is another check's line (config_check.file_problems, the workflow's),
    the checks here take the target as unknown)."""
    r = Read(None, schema_problems(data, SCHEMA, where) if SCHEMA.exists() else [])
    part = schema_valid_part(data, SCHEMA) if r.schema else data
    if part is None:
        return r
    try:
        r.cfg = config_from(part)
    except ValueError as e:
        r.schema.append(f"{where}{e}")
        return r
    if target is None and absent_target_ok and target_problem(r.cfg):
        target = {}
    r.problems, r.warnings = config_problems(r.cfg, target)
    return r
