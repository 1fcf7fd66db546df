"""A drafter's export directory (config.json + model.safetensors, the family's format): writing it
(`export_drafter`), loading it back as a drafter of the family its config names (`load_drafter`), and
reading one as the weights a run starts from (`init_weights`, drafter.init_from)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import init_files
from .errors import UserError
from .io import atomic_path
from .model import DFlashDrafter, DrafterSpec, meta_drafter


def export_drafter(
    drafter: DFlashDrafter | None,
    spec: DrafterSpec,
    out_dir,
    dtype: torch.dtype | None = None,
    state: dict | None = None,
):
    """config.json + model.safetensors in the DFlash format, written as one directory atomically.
    state: the drafter's full state dict, where the module holds only shards of it (FSDP)."""
    state = drafter.state_dict() if state is None else state
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in state.items()}
    bad = [k for k in state if "embed_tokens" in k or "lm_head" in k]
    assert not bad, f"the drafter must not carry the target's embedding or head: {bad}"
    saved = str(next(iter(state.values())).dtype).removeprefix("torch.")
    with atomic_path(out_dir) as tmp:
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(spec.to_config_dict(saved), indent=2) + "\n")
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})


# what a drafter to start from must share with the one being trained: its field, and the key that sets it
# here (None: the target's config.json sets it, so only a drafter of another target differs)
INIT_KEYS = {
    "block_size": "drafter.block_size",
    "num_layers": "drafter.num_layers",
    "target_layer_ids": "drafter.target_layer_ids",
    "mask_token_id": "drafter.mask_token_id",
    "sliding_window": "drafter.sliding_window",
    "hidden_size": None,
    "intermediate_size": None,
    "num_heads": None,
    "num_kv_heads": None,
    "head_dim": None,
    "vocab_size": None,
}


def init_weights(
    path, spec: DrafterSpec, cls: type[DFlashDrafter] = DFlashDrafter, keys: dict[str, str | None] = INIT_KEYS
) -> dict[str, torch.Tensor]:
    """drafter.init_from: the fp32 weights of the export at `path` for a drafter of `spec`, or a UserError
    naming what differs (a key and both values) or what is missing. `cls`: the family's drafter class (its
    spec class reads the config; its foreign keys are dropped), `keys`: the fields that must agree."""
    path, key = Path(path), "config key drafter.init_from"
    files = init_files(path)
    family = cls.__name__.removesuffix("Drafter")
    try:
        theirs = cls.spec_class.from_config_dict(json.loads(files[0].read_text()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(
            f"{key}: {files[0]} is not a {family} drafter's config ({type(e).__name__}: {e})"
        ) from e
    for field, setting in keys.items():
        mine, other = getattr(spec, field), getattr(theirs, field)
        if mine != other:
            fix = (
                f"set {setting}: {other}"
                if setting
                else f"use a drafter of this target (its {field} is {mine})"
            )
            raise UserError(
                f"{key}: {path} has {field} {other}, this drafter {mine}; {fix}, or start from "
                "another drafter"
            )
    try:
        state = load_file(files[1])
    except Exception as e:  # safetensors raises its own error types for a corrupt file
        raise UserError(f"{key}: {files[1]} cannot be read ({type(e).__name__}: {e})") from e
    state = {k: v for k, v in state.items() if k not in cls.foreign_keys}
    want = {k: v.shape for k, v in meta_drafter(spec, cls).state_dict().items()}
    missing, extra = sorted(want.keys() - state.keys()), sorted(state.keys() - want.keys())
    wrong = [
        f"{k} {tuple(state[k].shape)} (want {tuple(want[k])})"
        for k in sorted(want.keys() & state.keys())
        if state[k].shape != want[k]
    ]
    for what, names in (("lacks", missing), ("has tensors this drafter has not", extra), ("has", wrong)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise UserError(f"{key}: {files[1]} {what}: {', '.join(names[:3])}{more}")
    state = {k: v.float() for k, v in state.items()}
    if bad := [k for k, v in sorted(state.items()) if not v.isfinite().all()]:
        raise UserError(
            f"{key}: {files[1]} holds NaN or infinite values in {', '.join(bad[:3])}"
            f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}; start from another drafter"
        )
    return state


def load_drafter(path, device="cpu") -> tuple[DFlashDrafter, DrafterSpec]:
    """The drafter of an export directory (of the family its config.json names), in the dtype it was
    saved in."""
    from .families import family_of_export

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    kind = family_of_export(config)
    spec = kind.spec.from_config_dict(config)
    state = load_file(path / "model.safetensors", device=str(device))
    state = {k: v for k, v in state.items() if k not in kind.drafter.foreign_keys}
    drafter = kind.drafter(spec).to(device=device, dtype=next(iter(state.values())).dtype)
    drafter.load_state_dict(state, strict=True)
    return drafter, spec
