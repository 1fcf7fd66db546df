"""Drafter families: `drafter.family` names one, this registry says where its code lives and what it
needs stored per token. No torch here: the config check and the CPU jobs (the data plan, the planner)
read it. A family's module (flashdraft.dflash, flashdraft.dspark) holds its `FAMILY`: the drafter, its
training loss, export and loader, and its evaluation proposer. Its line below holds what needs no torch:
its config section (drafter.<family>), what it stores, how it is exported and served, its config checks,
its parameters beside the backbone and its measured factors on the planner's rates, so that the config,
the config check, the planner and the memory estimate ask the registry and never name a family. Adding
one: a module and a line below (docs/architecture.md, "Adding a drafter family")."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


def _no_problems(drafter_cfg) -> list[str]:
    return []


def _no_parameters(drafter_cfg, shapes: dict) -> int:
    return 0


@dataclass(frozen=True)
class FamilyRate:
    """A factor on DFlash's measured rate at one stage of the plan, measured against DFlash by a benchmark
    (the planner's estimate.RATES[name], used as measured): `file` under benchmarks/results/, `key` the
    dotted path of the value in it; `applies(drafter_cfg)`: whether a run of the family pays it."""

    name: str
    stage: str  # train | eval
    file: str
    key: str
    applies: Callable = lambda drafter_cfg: True


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
    # the dataclass of its own keys, drafter.<family> (config.DrafterConfig holds one per family that has
    # one, and only the run's family's enters its run key, config.run_config); None: no keys of its own
    section: type | None = None
    # (drafter_cfg) -> the config's problems that only this family has, one line each naming the key
    # (config_check.config_problems reports them with the rest)
    check: Callable = _no_problems
    # (drafter_cfg, shapes) -> its trained parameters beside DFlash's backbone (its heads), from the
    # target's config.json shapes: the memory estimate's weights, gradients and moments
    head_parameters: Callable = _no_parameters
    # the planner's factors on DFlash's rates at training and evaluation (none: DFlash's rates)
    rates: tuple[FamilyRate, ...] = ()

    def drafts(self, block_size: int) -> int:
        """Draft tokens per block: what a serving engine's speculative token count is set to."""
        return block_size if self.anchor_drafts else block_size - 1

    def needs_last_hidden(self, drafter_cfg) -> bool:
        """Whether a run of the family trains on the target's last hidden state (`last_hidden`): where a
        term reading it has a weight in its section (`teacher_weights`), else always."""
        section = getattr(drafter_cfg, drafter_cfg.family, None)
        if not self.last_hidden or not self.teacher_weights or section is None:
            return self.last_hidden
        return any(getattr(section, k) for k in self.teacher_weights)

    def rate_keys(self, drafter_cfg, stage: str) -> list[str]:
        """The planner's factors (estimate.RATES keys) a run of the family pays at `stage`."""
        return [r.name for r in self.rates if r.stage == stage and r.applies(drafter_cfg)]


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


# DSpark's section, checks, parameters and rates


@dataclass
class DSparkConfig:
    """drafter.dspark (drafter.family dspark): its heads and its loss's weights (DeepSpec's Qwen3 recipe)."""

    markov_rank: int = 256  # r of the vanilla Markov head (markov_w1 [V, r], markov_w2 [r, V]); 0: none
    ce_weight: float = 0.1  # the block CE's weight in the loss
    l1_weight: float = 0.9  # the L1 distance to the target's distribution
    confidence_weight: float = 1.0  # the confidence head's BCE; 0: no confidence head
    confidence_with_markov: bool = True  # the confidence head reads the Markov features of the previous token


def _dspark_problems(d) -> list[str]:
    """No sliding window; a confidence head that reads the Markov features needs a Markov head."""
    h, lines = d.dspark, []
    if d.sliding_window is not None:
        lines.append(
            "config key drafter.sliding_window: drafter.family dspark has no sliding window; set null"
        )
    if not h.markov_rank and h.confidence_weight and h.confidence_with_markov:
        lines.append(
            "config key drafter.dspark.confidence_with_markov: true reads the Markov head's "
            "features, and drafter.dspark.markov_rank 0 builds none; set it false (the "
            "confidence head reads the slot's hidden state alone), or "
            "drafter.dspark.confidence_weight: 0 (no confidence head)"
        )
    return lines


def _dspark_parameters(d, shapes: dict) -> int:
    """The Markov head, markov_w1 [V, r] and markov_w2 [r, V], and the confidence head over [h; W1[x]]."""
    h, v, hidden = d.dspark, shapes["vocab_size"], shapes["hidden_size"]
    conf = (hidden + (h.markov_rank if h.confidence_with_markov else 0) + 1) if h.confidence_weight else 0
    return 2 * v * h.markov_rank + conf


# A DSpark run pays the measured factors for its Markov head, and in training for a term reading the
# target's distribution (the L1 and confidence terms); a heads-off one (markov_rank 0, CE only: the
# DSpark paper's DFlash baseline) runs at DFlash's rates: the backbone and one CE over the vocabulary
# per slot, one argmax over the block (not measured apart).
_DSPARK_RATES = (
    # against dflash, the same block (7) and data, one process, bf16 (one H100): its heads and the
    # target's distribution cost more
    FamilyRate(
        "train_dspark_factor",
        "train",
        "train_drafter_qwen3-8b_dspark_vs_dflash.json",
        "comparison.speedup_vs_baseline",
        lambda d: bool(d.dspark.markov_rank) or FAMILIES["dspark"].needs_last_hidden(d),
    ),
    # decoding against dflash's at the same block (7) and acceptance, the static engine at batch 1 (its
    # drafting step with the Markov picks one after another, and a verify one token wider; one H100)
    FamilyRate(
        "eval_dspark_factor",
        "eval",
        "eval_decode_qwen3-8b_dspark_vs_dflash.json",
        "dspark_over_dflash.tokens_per_s_at_equal_tau",
        lambda d: bool(d.dspark.markov_rank),
    ),
)


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
        section=DSparkConfig,
        check=_dspark_problems,
        head_parameters=_dspark_parameters,
        rates=_DSPARK_RATES,
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
