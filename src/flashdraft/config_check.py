"""The checks of a config made before any job runs, across its sections, gathered (`Problems`: every
problem found, one line each, all reported at once): `check` (what needs only the config and the target's
config.json; it raises a UserError naming each key and returns warnings), `check_schema` (the config against
workflow/schemas/config.schema.yaml, one line per mistake), the files and GPUs the config names
(`file_problems`, `gpu_problems`), train.fp8 against the GPUs and torchao (`fp8_problem`, `check_fp8_gpus`),
stream mode's chunks against one optimizer step (`check_stream`), and a target read as a config file
(`configfile_problems`). Torch-free, like config.py: the workflow runs them at its start.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .config import (
    COMPILE_SCOPES,
    FP8_RECIPES,
    STREAM_RING,
    STREAM_ROW_BYTES,
    Config,
    HiddenConfig,
    TrainConfig,
    check_validation,
    feature_layers,
    init_files,
    micro_per_step,
    needs_last_hidden,
    rows_per_batch,
    stream_chunk_tokens,
    stream_least,
    target_layer_ids,
    train_world,
)
from .errors import UserError
from .hf_config import read_target_config, target_hidden_size, target_max_positions, target_num_layers
from .io import bytes_per_token, human_bytes
from .objectives import OBJECTIVES

# What a config file's name ends in (Snakemake reads YAML, and JSON as YAML).
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def configfile_problems(paths, results: str) -> list[str]:
    """--configfile takes every path after it, so a target written after it (`snakemake --configfile my.yaml
    results/hidden/shard-00001.arrow`) is read as a config. Snakemake itself stops with a traceback on a
    file it cannot read (a missing one, an arrow shard); the workflow sees those it could read: a file of
    this run's directory (`results`; a shard's .json manifest) or of another kind than CONFIG_SUFFIXES."""
    made, here = Path(results).resolve(), Path.cwd()
    bad = [
        Path(p).resolve()
        for p in paths
        if Path(p).suffix not in CONFIG_SUFFIXES or Path(p).resolve().is_relative_to(made)
    ]
    return [
        f"--configfile {p}: not a config but a target (--configfile takes every path after it); put "
        f"targets before --configfile or after --: snakemake --cores all --configfile <config> -- {p}"
        for p in (p.relative_to(here) if p.is_relative_to(here) else p for p in bad)
    ]


def overlay_problem(paths, data: dict) -> str | None:
    """Config files given without the keys every run needs (target, prompts): overlays (config/stream.yaml,
    config/dspark.yaml) read alone; the line shows the form that works."""
    missing = [k for k in ("target", "prompts") if k not in data]
    if not paths or not missing:
        return None
    given = " ".join(str(p) for p in paths)
    return (
        f"--configfile {given}: no {' or '.join(missing)} section: an overlay changes a whole config's "
        f"keys; give it after one: snakemake --cores all --configfile config/config.yaml {given}"
    )


class Problems:
    """The checks before any job, gathered: `run` calls a check and keeps the lines of the UserError it
    raises instead of stopping there, so that the user reads every problem at once (one line each, each
    once) and fixes them in one go."""

    def __init__(self, lines=()):
        self.lines = list(lines)

    def run(self, check, *args, failed=None):
        """`check(*args)`'s result, or `failed` once its UserError's lines are kept."""
        try:
            return check(*args)
        except UserError as e:
            self.lines += str(e).splitlines()
            return failed

    def unique(self) -> list[str]:
        return list(dict.fromkeys(self.lines))  # a problem two checks find (a layer id) is said once

    def raise_all(self) -> None:
        if self.lines:
            raise UserError("\n".join(self.unique()))


def _schema_errors(data: dict, schema_path) -> list:
    """Every mistake jsonschema finds in `data`, each at its most telling sub-error (as jsonschema.validate
    picks its one), in the order of their keys."""
    import jsonschema
    import yaml

    schema = yaml.safe_load(Path(schema_path).read_text())
    errors = jsonschema.validators.validator_for(schema)(schema).iter_errors(data)
    return sorted(
        (jsonschema.exceptions.best_match([e]) for e in errors),
        key=lambda e: [str(p) for p in e.absolute_path],
    )


def schema_problems(data: dict, schema_path, where: str = "") -> list[str]:
    """`data` against workflow/schemas/config.schema.yaml (`schema_path`), as the workflow and the planner
    read a config: each mistake as one line naming the key (an unknown one: its section, and the key "was
    unexpected"), `where` (the file) before it, instead of jsonschema's dump of the whole schema."""
    return [
        f"{where}config key {'.'.join(str(p) for p in e.absolute_path) or '(top level)'}: {e.message}"
        for e in _schema_errors(data, schema_path)
    ]


def check_schema(data: dict, schema_path, where: str = "") -> None:
    """schema_problems as a UserError, one line per mistake."""
    Problems(schema_problems(data, schema_path, where)).raise_all()


def schema_valid_part(data: dict, schema_path) -> dict | None:
    """A copy of `data` without what the schema refuses (an unknown key; a wrong value, whose default then
    stands), so that the checks that need a Config run beside the schema's lines; None when that is not
    enough (a required key, a config that is no mapping)."""
    import copy

    part, removed = copy.deepcopy(data), set()
    for e in reversed(_schema_errors(data, schema_path)):  # a list's later items first: indices hold
        path = list(e.absolute_path)
        if e.validator == "additionalProperties":
            holder = _at(part, path)
            for key in set(holder) - set(e.schema.get("properties", {})):
                del holder[key]
        elif not path:
            return None
        elif tuple(path) not in removed:  # a value may break several rules: removed once
            removed.add(tuple(path))
            del _at(part, path[:-1])[path[-1]]
    return None if _schema_errors(part, schema_path) else part


def _at(data, path: list):
    for key in path:
        data = data[key]
    return data


def check(cfg: Config, target: dict | None = None) -> list[str]:
    """config_problems as a UserError naming every problem, one line each; returns the warnings."""
    problems, warnings = config_problems(cfg, target)
    Problems(problems).raise_all()
    return warnings


def config_problems(cfg: Config, target: dict | None = None) -> tuple[list[str], list[str]]:
    """What needs only the config and the target's config.json (`target`: that file's contents, when it
    is not at target.path yet; {}: unknown), checked before any job runs: every problem as a line naming
    the key, and the warnings."""
    from .managed_server import server_argv

    found = Problems()
    if cfg.drafter.init_from:
        found.run(init_files, cfg.drafter.init_from)
    found.run(_check_chars, cfg.prompts)
    if cfg.target.build_toy:  # the toy target is built later, from toy.num_layers
        target = None
    elif target is None:
        target = found.run(read_target_config, cfg.target.path, failed={})
    n = cfg.toy.num_layers if target is None else target_num_layers(target)
    if n:
        found.run(feature_layers, n, cfg.drafter)
    found.run(_check_lengths, cfg, target)
    r = cfg.regenerate
    if r.enabled and r.backend == "server":
        found.run(server_argv, r.server_cmd, "target", 1, r.server_gpus)  # the template's mistakes
    t, world = cfg.train, train_world(cfg.gpus)
    found.run(_check_global_batch, t, world)
    found.run(_check_window, cfg.drafter)
    found.run(_check_draft_weights, cfg.drafter)
    found.run(_check_family, cfg.drafter)
    found.run(_one_of, "train.loss", t.loss, OBJECTIVES)
    found.run(_one_of, "train.compile_scope", t.compile_scope, COMPILE_SCOPES)
    if t.fp8 is not None and t.fp8 not in FP8_RECIPES:
        found.run(_one_of, "train.fp8", t.fp8, FP8_RECIPES, ", or null")
    else:  # the GPUs themselves: check_fp8_gpus, where they run
        found.run(_raise, fp8_problem(t.fp8, cfg.gpus.drafter > 0))
    found.run(check_validation, t, cfg.prompts.total)
    if cfg.hidden.mode == "stream":  # the data plan's sizing, before the hours of regeneration it follows
        found.run(_check_stream_config, cfg, target, n, world)
    return found.unique(), config_warnings(cfg, n)


def target_problem(cfg: Config) -> str | None:
    """target.path without a config.json (a model not downloaded there yet), as the workflow says it."""
    t = cfg.target
    if not t.build_toy and not (Path(t.path) / "config.json").exists():
        return (
            f"config key target.path: {t.path!r} is not a local Hugging Face model directory (no "
            "config.json); download the model there or set target.build_toy: true"
        )
    return None


def file_problems(cfg: Config, results: str, read_sources: bool = False) -> list[str]:
    """The target directory and the prompt source files the config names, where they should be before any
    job (`results`: the run's directory, where the toy's sources are made); `read_sources`: also each
    local source's first rows (sources.first_rows_problem), but for the toy's."""
    from .sources import first_rows_problem

    lines = [line for line in [target_problem(cfg)] if line]
    for s in cfg.prompts.sources:
        key = f"config key prompts.sources[{s.name}].path: {s.path!r}"
        if s.format == "hf":
            continue
        made_here = s.path.startswith(f"{results}/toy/")  # the toy's sources, made by a job of the run
        if not Path(s.path).exists() and not made_here:
            hub = len(Path(s.path).parts) == 2 and not Path(s.path).suffix  # an id such as org/dataset
            lines.append(
                f"{key} does not exist"
                + ("; for a Hugging Face Hub dataset id, set format: hf" if hub else "")
            )
        elif Path(s.path).is_dir():
            lines.append(
                f"{key} is a directory; point it at a file (jsonl, json, parquet, arrow), or set "
                "format: hf to read a folder of data files"
            )
        elif read_sources and not made_here and (problem := first_rows_problem(s)):  # it exists: read it
            lines.append(problem)
    return lines


def gpu_problems(cfg: Config, visible: int, srun: bool) -> list[str]:
    """The GPUs the config asks for against the `visible` ones, and several training nodes against SLURM
    (`srun`: whether srun is here); none when gpus.check_visible is false (the jobs run elsewhere)."""
    if not cfg.gpus.check_visible:
        return []
    asked = {"gpus.target": cfg.gpus.target, "gpus.drafter": cfg.gpus.drafter}
    if cfg.regenerate.backend == "server":
        asked["regenerate.server_gpus"] = cfg.regenerate.server_gpus
    lines = [
        f"config key {key}: asks for {n} GPU(s) but {visible} are visible (set gpus.check_visible: "
        "false when jobs run on other nodes)"
        for key, n in asked.items()
        if n > visible
    ]
    if cfg.gpus.drafter_nodes > 1 and not srun:
        lines.append(
            f"config key gpus.drafter_nodes: {cfg.gpus.drafter_nodes} nodes need SLURM (no srun "
            "here); run with --profile workflow/profiles/slurm (set gpus.check_visible: false to "
            "submit anyway)"
        )
    return lines


def _raise(problem: str | None) -> None:
    if problem:
        raise UserError(problem)


def _one_of(key: str, value, choices, more: str = "") -> None:
    if value not in choices:
        raise UserError(f"config key {key}: {value!r}; use one of {', '.join(choices)}{more}")


def _check_draft_weights(d) -> None:
    """drafter.family's loss weights that train the drafts (families.FamilyInfo.draft_weights): not all 0."""
    from .families import family_info

    keys = family_info(d.family).draft_weights
    section = getattr(d, d.family, None)
    if keys and section is not None and not any(getattr(section, k) for k in keys):
        names = " and ".join(f"drafter.{d.family}.{k}" for k in keys)
        raise UserError(
            f"config keys {names} are all 0: the loss would train no draft and export an "
            "untrained drafter; give at least one a weight > 0"
        )


def _check_family(d) -> None:
    """What only drafter.family has to check (families.FamilyInfo.check)."""
    from .families import family_info

    Problems(family_info(d.family).check(d)).raise_all()


def _check_chars(p) -> None:
    if p.min_chars > p.max_chars:
        raise UserError(
            f"config keys prompts.min_chars ({p.min_chars}) > prompts.max_chars ({p.max_chars}) would reject "
            "every prompt; make min_chars <= max_chars"
        )


def _check_lengths(cfg: Config, target: dict | None) -> None:
    """The lengths against the target's max_position_embeddings (an answer needs one prompt token at
    least): each key too long is a line."""
    from .toy import TOY_MAX_POSITIONS

    limit = TOY_MAX_POSITIONS if target is None else target_max_positions(target)
    if not limit:
        return
    lengths = {
        "hidden.max_length": (cfg.hidden.max_length, limit),
        "eval.max_new_tokens": (cfg.eval.max_new_tokens, limit - 1),
    }
    if cfg.regenerate.enabled:
        lengths["regenerate.max_new_tokens"] = (cfg.regenerate.max_new_tokens, limit - 1)
    Problems(
        f"config key {key} ({value}) does not fit the target's max_position_embeddings ({limit}); use "
        f"at most {most}"
        for key, (value, most) in lengths.items()
        if value > most
    ).raise_all()


def _check_global_batch(t: TrainConfig, world: int) -> None:
    try:
        micro_per_step(t, world)
    except ValueError:
        raise UserError(
            f"config key train.global_batch_tokens ({t.global_batch_tokens}) must be a multiple of "
            f"train.batch_tokens ({t.batch_tokens}) and hold a micro-batch for each of the {world} training "
            f"process(es): use a multiple of {t.batch_tokens} from {world * t.batch_tokens} up, or 0"
        ) from None


def _check_window(d) -> None:
    w, bs = d.sliding_window, d.block_size
    if w is not None and w < bs:
        raise UserError(
            f"config key drafter.sliding_window ({w}) < drafter.block_size ({bs}): a window must hold a "
            "whole block; use a window of at least the block size, or null for none"
        )


def _check_stream_config(cfg: Config, target: dict | None, n: int | None, world: int) -> None:
    h = cfg.toy.hidden_size if target is None else target_hidden_size(target)
    if n and h:
        per_token = bytes_per_token(
            cfg.hidden.dtype, len(feature_layers(n, cfg.drafter)), h, needs_last_hidden(cfg.drafter)
        )
        check_stream(cfg.hidden, cfg.train, micro_per_step(cfg.train, world), per_token)


def config_warnings(cfg: Config, num_target_layers: int | None = None) -> list[str]:
    """What may be meant but is likely a mistake: printed, and the run goes on."""
    t, p, d, n = cfg.train, cfg.prompts, cfg.drafter, num_target_layers
    warnings = []
    ids = target_layer_ids(n, d.num_layers) if n and not d.target_layer_ids else []
    if len(set(ids)) < len(ids) and min(ids) >= 0:  # a shallow target: the formula repeats layers
        warnings.append(
            f"config key drafter.target_layer_ids: the default ids for a target of {n} layers and "
            f"{d.num_layers} drafter layers are {ids}, the same layer fed more than once; set "
            f"drafter.target_layer_ids to distinct ids in 0..{n - 1}, or lower drafter.num_layers"
        )
    if t.fp8 is not None and importlib.util.find_spec("torchao") is None:
        warnings.append(
            f"config key train.fp8 ({t.fp8}) needs torchao, which this environment lacks: "
            "training stops at its start; pip install torchao, or set train.fp8: null"
        )
    if cfg.hidden.shards > p.total:
        warnings.append(
            f"config key hidden.shards: {cfg.hidden.shards} shards for at most {p.total} training prompts "
            "(prompts.total): some shards will be empty; lower hidden.shards"
        )
    if t.val_samples * VAL_WARN_RATIO > p.total:  # all of them raised above
        warnings.append(
            f"config key train.val_samples: {t.val_samples} of at most {p.total} training prompts "
            f"(prompts.total) are held out of training; use a few percent, or 0 for no validation"
        )
    return warnings


# train.fp8's float8 matmuls need this compute capability (Ada, Hopper and newer).
FP8_CAPABILITY = (8, 9)


def fp8_problem(
    recipe: str | None, on_gpu: bool, gpus=(), torchao: bool = True, visible: bool = True
) -> str | None:
    """Why train.fp8 (`recipe`) cannot train here, as the one line to print, or None: `on_gpu` whether the
    drafter trains on GPUs, `gpus` (index, name, (major, minor) or None when unknown) those it may use,
    `torchao` whether torchao can be imported, `visible` whether this node shows any GPU (the workflow's
    start, where its jobs run here). The workflow's start and the trainer share the wording."""
    if recipe is None:
        return None
    need = (
        f"config key train.fp8 ({recipe}) needs a GPU with FP8 matmuls (compute capability "
        f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer)"
    )
    fix = "; set train.fp8: null"
    if not on_gpu:
        return f"{need}, but the drafter trains on the CPU{fix}"
    if not visible:
        return f"{need}, but no GPU is visible here{fix}"
    for index, name, cap in gpus:
        if cap is not None and tuple(cap) < FP8_CAPABILITY:
            return f"{need}, but GPU {index} ({name}) has compute capability {cap[0]}.{cap[1]}{fix}"
    if not torchao:
        return (
            f"config key train.fp8 ({recipe}) needs torchao, which this environment lacks: "
            "pip install torchao, or set train.fp8: null"
        )
    return None


def check_fp8_gpus(cfg: Config, gpus) -> None:
    """train.fp8 against the GPUs the drafter may use on this node (`gpus`: flashdraft.gpu.gpu_capabilities;
    a lease may give it any of them, and none is checked when nothing is known) and this environment's
    torchao, before any job runs: a UserError names what is missing."""
    problem = fp8_problem(
        cfg.train.fp8, cfg.gpus.drafter > 0, gpus, importlib.util.find_spec("torchao") is not None
    )
    if problem:
        raise UserError(problem)


# check() warns when train.val_samples holds out more than 1 / VAL_WARN_RATIO of the training prompts
VAL_WARN_RATIO = 10


def stream_step_bound(train: TrainConfig, micro: int, max_length: int, per_token: int) -> int:
    """The most bytes of hidden states one optimizer step of `micro` micro-batches can take, from the config
    alone: the samples' lengths are known only once tokenized (the data plan checks its real steps), so each
    micro-batch is counted at the bucket whose full batch takes the most, each of its rows a sample as long as
    that bucket holds, at most hidden.max_length tokens (the largest bucket also takes the longer samples,
    kept whole on disk), with its row allowance."""
    top = max(train.buckets)
    most = max(
        rows_per_batch(b, train.batch_tokens)
        * ((max_length if b == top else min(b, max_length)) * per_token + STREAM_ROW_BYTES)
        for b in train.buckets
    )
    return micro * most


def check_stream(hidden: HiddenConfig, train: TrainConfig, micro: int, per_token: int) -> None:
    """Stream mode's chunks against one optimizer step, before any job: a UserError in one line naming the
    key and the smallest value that holds any step the config allows (stream_step_bound; the validation
    shard at train.val_samples samples of hidden.max_length tokens). The data plan makes the same check on
    the steps its data gives, which the bound covers. `micro`: micro-batches per optimizer step
    (micro_per_step); `per_token`: the bytes one token takes in a shard (io.bytes_per_token)."""
    cap = stream_chunk_tokens(hidden, per_token)  # no budget at all, or one that holds no two tokens
    step = stream_step_bound(train, micro, hidden.max_length, per_token)
    kept = train.val_samples * (hidden.max_length * per_token + STREAM_ROW_BYTES)
    tokens, budget = stream_least(step, per_token, kept)
    step_is = (
        f"one optimizer step (up to {tokens:,} tokens' worth of hidden states: {micro} "
        f"micro-batch(es) of train.batch_tokens {train.batch_tokens} in train.buckets "
        f"{train.buckets}, samples of up to hidden.max_length {hidden.max_length} tokens)"
    )
    if hidden.chunk_tokens and cap < tokens:
        raise UserError(
            f"config key hidden.chunk_tokens ({cap}): a stream-mode chunk does not hold "
            f"{step_is}; set hidden.chunk_tokens >= {tokens}"
        )
    if not hidden.chunk_tokens and hidden.disk_budget < budget:
        raise UserError(
            f"config key hidden.disk_budget: {human_bytes(hidden.disk_budget)} does not hold {STREAM_RING} "
            f"stream-mode chunks of {step_is}"
            + (f" and a validation shard of train.val_samples {train.val_samples}" if kept else "")
            + f"; set hidden.disk_budget >= {human_bytes(budget)} ({budget} bytes)"
        )
