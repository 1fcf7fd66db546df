"""Drafter families: `drafter.family` names one, this registry says where its code lives and what it
needs stored per token. No torch here: the config check and the CPU jobs (the data plan, the planner)
read it. A family's module (flashdraft.dflash, flashdraft.dspark) holds its `FAMILY`: the drafter, its
training loss, export and loader, and its evaluation proposer. Adding one: a module and a line below
(docs/architecture.md, "Adding a drafter family")."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyInfo:
    module: str  # the module whose FAMILY implements it
    # the target's last hidden state (after its final norm, what its LM head reads) stored per token beside
    # the K layers' features: the teacher distribution a distribution-matching loss needs
    last_hidden: bool


@dataclass(frozen=True)
class Family:
    """A family's implementation, its module's `FAMILY`: what the trainer, the evaluator and the export
    call. The callables keep their family's own signatures (a loss takes its family's weights)."""

    spec: type  # the DrafterSpec subclass: from_target, to_config_dict, from_config_dict
    drafter: type  # the nn.Module
    loss: Callable  # (drafter, batch tensors, anchors, ...) -> (loss, stats)
    normalizer: Callable  # a micro-batch's loss normalizer, known before its forward
    summarize: Callable  # (summed stats, block_size) -> metrics
    stats_size: Callable  # block_size -> length of the stats vector
    proposer: type  # a speculative.Proposer
    export: Callable  # (drafter, spec, out_dir, dtype=None, state=None)
    load: Callable  # (export dir, device) -> (drafter, spec)
    init_weights: Callable  # (drafter.init_from, spec) -> state dict


FAMILIES: dict[str, FamilyInfo] = {
    "dflash": FamilyInfo("flashdraft.dflash", last_hidden=False),
    "dspark": FamilyInfo("flashdraft.dspark", last_hidden=True),
}


def family_info(name: str) -> FamilyInfo:
    if name not in FAMILIES:
        raise ValueError(f"drafter.family must be one of {tuple(FAMILIES)}, not {name!r}")
    return FAMILIES[name]


def family(name: str):
    """The family's implementation (its module's FAMILY): imports torch."""
    return importlib.import_module(family_info(name).module).FAMILY
