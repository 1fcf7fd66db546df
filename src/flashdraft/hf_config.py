"""The target's config.json as data: read without running model code, and the shapes taken from it
with their fallbacks, in one place (attention heads, KV heads, head dim, layers, positions, bytes of KV
cache per token). The functions take the file's dict or a transformers config object alike. Low in the
import graph (no torch, no transformers at import): config_check.check, the planner, the data plan, the
training step and the decode engines read it."""

from __future__ import annotations

import json
import types
from pathlib import Path

from .errors import UserError


def read_target_config(path) -> dict:
    """The target's config.json, read as JSON: no model code runs. A target whose model_type transformers
    does not ship but whose `auto_map` names the checkpoint's own code is refused, since loading it would
    execute that code (trust_remote_code), which flashdraft never does."""
    file = Path(path) / "config.json"
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(
            f"config key target.path: cannot read {file} ({e}); point it at an HF model directory"
        ) from e
    if not isinstance(cfg, dict):
        raise UserError(
            f"config key target.path: {file} holds {type(cfg).__name__}, not a JSON object; "
            "point it at an HF model directory"
        )
    model_type = cfg.get("model_type")
    if cfg.get("auto_map") and not _transformers_ships(model_type):
        raise UserError(
            f"config key target.path: {file} needs remote code (model_type {model_type!r} is not in "
            f"transformers; auto_map {cfg['auto_map']}); flashdraft does not run a checkpoint's own code: "
            "use a model transformers supports"
        )
    return cfg


def _transformers_ships(model_type) -> bool:
    """Whether transformers has a config class for `model_type` (its auto mapping; the package may have
    another name, as gemma3_text's is gemma3)."""
    try:
        from transformers.models.auto.auto_mappings import CONFIG_MAPPING_NAMES  # without torch
    except ImportError:  # releases before that module (importing torch)
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    return model_type in CONFIG_MAPPING_NAMES


# Model types whose transformers config class keeps the keys SPEC_KEYS of config.json as they are (and
# reads RoPE's base from rope_theta or rope_parameters as the spec does): with all of them in the file,
# its JSON gives the spec exactly what AutoConfig would, without importing transformers (tests/test_model.py
# compares both on these types' real configs).
PLAIN_CONFIG_TYPES = ("qwen3", "qwen2", "llama", "mistral")
SPEC_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "num_hidden_layers",
)


def plain_target_config(cfg: dict):
    """A config.json dict as an object with its keys as attributes, where it stands for the target's
    AutoConfig exactly (see PLAIN_CONFIG_TYPES); None where only AutoConfig knows the values (a missing
    key takes its config class's default, other model types may map or derive keys)."""
    rope = cfg.get("rope_parameters")
    if rope is None:  # transformers 4's file
        theta = cfg.get("rope_theta")
    elif isinstance(rope, dict) and "rope_theta" not in cfg:  # transformers 5's
        theta = rope.get("rope_theta")
    else:  # both, or one per layer type: how they combine is the config class's business
        theta = None
    if (
        cfg.get("model_type") not in PLAIN_CONFIG_TYPES
        or not isinstance(theta, (int, float))
        or any(cfg.get(k) is None for k in SPEC_KEYS)
    ):
        return None
    return types.SimpleNamespace(**cfg)


def target_num_layers(cfg: dict) -> int | None:
    """Decoder layers from a config.json dict (multimodal configs keep them in text_config)."""
    return cfg.get("num_hidden_layers") or (cfg.get("text_config") or {}).get("num_hidden_layers")


def target_hidden_size(cfg: dict) -> int | None:
    """The hidden size from a config.json dict (multimodal configs keep it in text_config)."""
    return cfg.get("hidden_size") or (cfg.get("text_config") or {}).get("hidden_size")


def target_max_positions(cfg: dict) -> int | None:
    """The longest sequence the target takes, from a config.json dict (None when it does not say)."""
    return cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")


def past_positions(prompt_tokens: int, new_tokens: int, limit: int | None) -> bool:
    """Whether a prompt of `prompt_tokens` tokens, answered with `new_tokens` more, needs positions past the
    target's `limit` (its max_position_embeddings; None or 0: it does not say, and nothing is refused).
    Past them a model gives garbage, not an error. The one test of a prompt too long for the target: the
    prompts stage asks it for one answer token, regeneration for regenerate.max_new_tokens."""
    return bool(limit) and prompt_tokens + new_tokens > limit


def _get(cfg, key: str):
    """A key of a config.json dict (a multimodal one's text_config) or of a transformers config object."""
    if isinstance(cfg, dict):
        return cfg.get(key) if key in cfg or "text_config" not in cfg else cfg["text_config"].get(key)
    return getattr(cfg, key, None)


def kv_dims(heads: int, kv_heads: int | None, head_dim: int | None, hidden: int) -> tuple[int, int]:
    """(KV heads, head dim) where a config leaves them out: one KV head per head (multi-head attention),
    head_dim = hidden_size / heads."""
    return kv_heads or heads, head_dim or hidden // heads


def attention_shape(cfg) -> tuple[int, int, int]:
    """(attention heads, KV heads, head dim) of a target's config."""
    heads = _get(cfg, "num_attention_heads")
    return heads, *kv_dims(
        heads, _get(cfg, "num_key_value_heads"), _get(cfg, "head_dim"), _get(cfg, "hidden_size")
    )


def kv_bytes_per_token(cfg, value_bytes: int) -> int:
    """Bytes of keys and values the target caches per token, every layer, at `value_bytes` per value."""
    _, kv_heads, head_dim = attention_shape(cfg)
    return 2 * _get(cfg, "num_hidden_layers") * kv_heads * head_dim * value_bytes
