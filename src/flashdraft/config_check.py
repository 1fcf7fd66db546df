"""The checks of a config made before any job runs, across its sections: `check` (what needs only the config
and the target's config.json; it raises a UserError naming the key and returns warnings), `check_schema`
(the config against workflow/schemas/config.schema.yaml, one line per mistake), train.fp8 against the GPUs
and torchao (`fp8_problem`, `check_fp8_gpus`), and stream mode's chunks against one optimizer step
(`check_stream`). Torch-free, like config.py: the workflow runs them at its start.
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
)
from .errors import UserError
from .hf_config import read_target_config, target_hidden_size, target_max_positions, target_num_layers
from .io import bytes_per_token, human_bytes
from .objectives import OBJECTIVES


def check_schema(data: dict, schema_path, where: str = "") -> None:
    """`data` against workflow/schemas/config.schema.yaml (`schema_path`), as the workflow and the planner
    read a config: the first mistake as one line naming the key (an unknown one: its section, and the key
    "was unexpected"), `where` (the file) before it, instead of jsonschema's dump of the whole schema."""
    import jsonschema
    import yaml

    try:
        jsonschema.validate(data, yaml.safe_load(Path(schema_path).read_text()))
    except jsonschema.ValidationError as e:
        key = ".".join(str(p) for p in e.absolute_path) or "(top level)"
        raise UserError(f"{where}config key {key}: {e.message}") from None


def check(cfg: Config, target: dict | None = None) -> list[str]:
    """What needs only the config and the target's config.json (`target`: that file's contents, when it
    is not at target.path yet), checked before any job runs: raises a UserError naming the key; returns
    warnings."""
    from .managed_server import server_argv
    from .toy import TOY_MAX_POSITIONS

    if cfg.drafter.init_from:
        init_files(cfg.drafter.init_from)
    p = cfg.prompts
    if p.min_chars > p.max_chars:
        raise UserError(
            f"config keys prompts.min_chars ({p.min_chars}) > prompts.max_chars ({p.max_chars}) would reject "
            "every prompt; make min_chars <= max_chars"
        )
    # the toy target is built later, from toy.num_layers
    if cfg.target.build_toy:
        target = None
    elif target is None:
        target = read_target_config(cfg.target.path)
    n = cfg.toy.num_layers if target is None else target_num_layers(target)
    if n:
        feature_layers(n, cfg.drafter)
    limit = TOY_MAX_POSITIONS if target is None else target_max_positions(target)
    if limit:  # an answer needs one prompt token at least
        lengths = {"hidden.max_length": (cfg.hidden.max_length, limit),
                   "eval.max_new_tokens": (cfg.eval.max_new_tokens, limit - 1)}
        if cfg.regenerate.enabled:
            lengths["regenerate.max_new_tokens"] = (cfg.regenerate.max_new_tokens, limit - 1)
        for key, (value, most) in lengths.items():
            if value > most:
                raise UserError(
                    f"config key {key} ({value}) does not fit the target's max_position_embeddings "
                    f"({limit}); use at most {most}"
                )
    r = cfg.regenerate
    if r.enabled and r.backend == "server":
        server_argv(r.server_cmd, "target", 1, r.server_gpus)  # the template's mistakes, before any job
    t, world = cfg.train, max(1, cfg.gpus.drafter) * cfg.gpus.drafter_nodes
    g = t.global_batch_tokens
    if g and (g % t.batch_tokens or g < world * t.batch_tokens):
        raise UserError(
            f"config key train.global_batch_tokens ({g}) must be a multiple of train.batch_tokens "
            f"({t.batch_tokens}) and hold a micro-batch for each of the {world} training process(es): "
            f"use a multiple of {t.batch_tokens} from {world * t.batch_tokens} up, or 0"
        )
    w, bs = cfg.drafter.sliding_window, cfg.drafter.block_size
    if w is not None and w < bs:
        raise UserError(
            f"config key drafter.sliding_window ({w}) < drafter.block_size ({bs}): a window must hold a "
            "whole block; use a window of at least the block size, or null for none"
        )
    if cfg.drafter.family == "dspark" and w is not None:
        raise UserError("config key drafter.sliding_window: drafter.family dspark has no sliding window; set "
                        "null")
    if t.loss not in OBJECTIVES:
        raise UserError(f"config key train.loss: {t.loss!r}; use one of {', '.join(OBJECTIVES)}")
    if t.compile_scope not in COMPILE_SCOPES:
        raise UserError(f"config key train.compile_scope: {t.compile_scope!r}; use one of "
                        f"{', '.join(COMPILE_SCOPES)}")
    if t.fp8 is not None and t.fp8 not in FP8_RECIPES:
        raise UserError(f"config key train.fp8: {t.fp8!r}; use one of {', '.join(FP8_RECIPES)}, or null")
    problem = fp8_problem(t.fp8, cfg.gpus.drafter > 0)  # the GPUs themselves: check_fp8_gpus, where they run
    if problem:
        raise UserError(problem)
    check_validation(t, p.total)
    if cfg.hidden.mode == "stream":  # the data plan's sizing, before the hours of regeneration it follows
        h = cfg.toy.hidden_size if target is None else target_hidden_size(target)
        if n and h:
            per_token = bytes_per_token(cfg.hidden.dtype, len(feature_layers(n, cfg.drafter)), h,
                                        needs_last_hidden(cfg.drafter))
            check_stream(cfg.hidden, t, micro_per_step(t, world), per_token)
    warnings = []
    if t.fp8 is not None and importlib.util.find_spec("torchao") is None:
        warnings.append(f"config key train.fp8 ({t.fp8}) needs torchao, which this environment lacks: "
                        "training stops at its start; pip install torchao, or set train.fp8: null")
    if cfg.hidden.shards > p.total:
        warnings.append(
            f"config key hidden.shards: {cfg.hidden.shards} shards for at most {p.total} training prompts "
            "(prompts.total): some shards will be empty; lower hidden.shards"
        )
    if cfg.train.val_samples * VAL_WARN_RATIO > p.total:  # all of them raised above
        warnings.append(
            f"config key train.val_samples: {cfg.train.val_samples} of at most {p.total} training prompts "
            f"(prompts.total) are held out of training; use a few percent, or 0 for no validation"
        )
    return warnings


# train.fp8's float8 matmuls need this compute capability (Ada, Hopper and newer).
FP8_CAPABILITY = (8, 9)


def fp8_problem(recipe: str | None, on_gpu: bool, gpus=(), torchao: bool = True) -> str | None:
    """Why train.fp8 (`recipe`) cannot train here, as the one line to print, or None: `on_gpu` whether the
    drafter trains on GPUs, `gpus` (index, name, (major, minor) or None when unknown) those it may use,
    `torchao` whether torchao can be imported. The workflow's start and the trainer share the wording."""
    if recipe is None:
        return None
    need = (f"config key train.fp8 ({recipe}) needs a GPU with FP8 matmuls (compute capability "
            f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer)")
    fix = "; set train.fp8: null"
    if not on_gpu:
        return f"{need}, but the drafter trains on the CPU{fix}"
    for index, name, cap in gpus:
        if cap is not None and tuple(cap) < FP8_CAPABILITY:
            return f"{need}, but GPU {index} ({name}) has compute capability {cap[0]}.{cap[1]}{fix}"
    if not torchao:
        return (f"config key train.fp8 ({recipe}) needs torchao, which this environment lacks: "
                "pip install torchao, or set train.fp8: null")
    return None


def check_fp8_gpus(cfg: Config, gpus) -> None:
    """train.fp8 against the GPUs the drafter may use on this node (`gpus`: flashdraft.gpu.gpu_capabilities;
    a lease may give it any of them, and none is checked when nothing is known) and this environment's
    torchao, before any job runs: a UserError names what is missing."""
    problem = fp8_problem(cfg.train.fp8, cfg.gpus.drafter > 0, gpus,
                          importlib.util.find_spec("torchao") is not None)
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
    most = max(rows_per_batch(b, train.batch_tokens)
               * ((max_length if b == top else min(b, max_length)) * per_token + STREAM_ROW_BYTES)
               for b in train.buckets)
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
    step_is = (f"one optimizer step (up to {tokens:,} tokens' worth of hidden states: {micro} "
               f"micro-batch(es) of train.batch_tokens {train.batch_tokens} in train.buckets "
               f"{train.buckets}, samples of up to hidden.max_length {hidden.max_length} tokens)")
    if hidden.chunk_tokens and cap < tokens:
        raise UserError(f"config key hidden.chunk_tokens ({cap}): a stream-mode chunk does not hold "
                        f"{step_is}; set hidden.chunk_tokens >= {tokens}")
    if not hidden.chunk_tokens and hidden.disk_budget < budget:
        raise UserError(
            f"config key hidden.disk_budget: {human_bytes(hidden.disk_budget)} does not hold {STREAM_RING} "
            f"stream-mode chunks of {step_is}"
            + (f" and a validation shard of train.val_samples {train.val_samples}" if kept else "")
            + f"; set hidden.disk_budget >= {human_bytes(budget)} ({budget} bytes)")
