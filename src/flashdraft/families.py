"""Drafter families: `drafter.family` names one, this registry says where its code lives and what it
needs stored per token. No torch here: the config check and the CPU jobs (the data plan, the planner)
read it. A family's module (flashdraft.dflash, flashdraft.dspark) holds its `FAMILY`: the drafter, its
training loss, export and loader, and its evaluation proposer. Adding one: a module and a line below
(docs/architecture.md, "Adding a drafter family")."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyInfo:
    module: str  # the module whose FAMILY implements it
    # the target's last hidden state (after its final norm, what its LM head reads) stored per token beside
    # the K layers' features: the teacher distribution a distribution-matching loss needs
    last_hidden: bool


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
