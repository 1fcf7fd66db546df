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
    architecture: str  # config.json's `architectures[0]` in its export: how an export names its family
    # how the serving engines name it: vLLM's speculative_config `method`, SGLang's --speculative-algorithm
    vllm_method: str
    sglang_algorithm: str
    anchor_drafts: bool  # the anchor's slot predicts too: a block of B gives B drafts (else B - 1)
    # its section's loss weights (drafter.<family>.<key>) that train the drafts: not all may be 0, which
    # would train nothing and export an untrained drafter
    draft_weights: tuple[str, ...] = ()
    # its section's loss weights whose terms read the target's last hidden state (`last_hidden`): with all
    # of them 0 the shards need not hold it (empty: a family with `last_hidden` always needs it)
    teacher_weights: tuple[str, ...] = ()

    def drafts(self, block_size: int) -> int:
        """Draft tokens per block: what a serving engine's speculative token count is set to."""
        return block_size if self.anchor_drafts else block_size - 1


@dataclass(frozen=True)
class Family:
    """What the trainer, the validation, the export and the evaluation ask of a drafter family."""

    name: str
    spec: type  # its shapes: .from_target(target_config, tokenizer, drafter_cfg), .from_config_dict(d)
    drafter: type  # the nn.Module: drafter(spec, init=True); its state dict is the export's tensors
    # (step, tensors, anchors, valid, normalizer=None) -> (loss, stats): one micro-batch's training loss;
    # tensors: the batch's input_ids, loss_mask, hidden (and last_hidden) on the step's device
    loss: Callable
    # (step, tensors, anchors, valid) -> this micro-batch's share of what the loss is divided by
    normalizer: Callable
    summarize: Callable  # (summed stats, block_size) -> {metric: value}, in metric_names' order
    metric_names: Callable  # block_size -> the metrics summarize gives (the CSV's columns)
    stats_size: Callable  # block_size -> the length of one stats vector
    proposer: Callable  # (drafter, embed, head, cached=True) -> the evaluation's speculative.Proposer
    init_weights: Callable  # (drafter.init_from, spec) -> the fp32 weights to start from (drafter_io)
    # (train_cfg, drafter_cfg, spec) -> what the loss reads besides train.loss's objective (Step.options)
    loss_options: Callable = lambda train_cfg, drafter_cfg, spec: None


FAMILIES: dict[str, FamilyInfo] = {
    "dflash": FamilyInfo(
        "flashdraft.dflash",
        last_hidden=False,
        architecture="DFlashDraftModel",
        vllm_method="dflash",
        sglang_algorithm="DFLASH",
        anchor_drafts=False,
    ),
    "dspark": FamilyInfo(
        "flashdraft.dspark",
        last_hidden=True,
        architecture="Qwen3DSparkModel",
        vllm_method="dspark",
        sglang_algorithm="DSPARK",
        anchor_drafts=True,
        draft_weights=("ce_weight", "l1_weight"),
        teacher_weights=("l1_weight", "confidence_weight"),
    ),
}


def family_info(name: str) -> FamilyInfo:
    if name not in FAMILIES:
        raise ValueError(f"drafter.family must be one of {tuple(FAMILIES)}, not {name!r}")
    return FAMILIES[name]


def family(name: str) -> Family:
    """The family's implementation (its module's FAMILY): imports torch."""
    return importlib.import_module(family_info(name).module).FAMILY


def family_name_of_export(config: dict) -> str:
    """The family of an export's config.json, by its `architectures` (DFlash's when it names none)."""
    arch = (config.get("architectures") or [FAMILIES["dflash"].architecture])[0]
    for name, info in FAMILIES.items():
        if info.architecture == arch:
            return name
    raise ValueError(
        f"architectures {arch!r} is no drafter family of this version "
        f"({', '.join(info.architecture for info in FAMILIES.values())})"
    )


def family_of_export(config: dict) -> Family:
    """The family implementation of an export's config.json (family_name_of_export)."""
    return family(family_name_of_export(config))
