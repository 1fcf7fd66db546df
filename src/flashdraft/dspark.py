"""The DSpark drafter family (DeepSeek's DeepSpec): DFlash's backbone plus a Markov head and a confidence
head, its distribution-matching loss, its proposer and its export. docs/dspark.md lists the facts this
follows, with their sources.

The block `[token at anchor, MASK x (B-1)]` sits at positions anchor..anchor+B-1 and sees the context
strictly before its anchor (model.py's backbone and mask, unchanged), but here **slot k predicts the token
at anchor+k+1**: B inputs give B drafts. Slot k's logits are `h_k @ W.T + markov_w2(markov_w1[prev_k])`,
W the target's frozen LM head and prev_k the token before slot k's: the anchor token for k=0, then the
true token at anchor+k in training and the token picked for slot k-1 when drafting. The confidence head
reads `[h_k ; markov_w1[prev_k]]` and predicts the acceptance rate 1 - L1/2 of its slot.

Either head can be off, as in DeepSpec: markov_rank 0 builds no Markov head (slot k's logits are its base
logits, each slot picked on its own), confidence weight 0 no confidence head. Both off and the loss
weights 1 CE + 0 L1 make the DSpark paper's DFlash baseline (config/dflash_paper.yaml); then nothing reads
the target's last hidden state, and the shards need not hold it (config.needs_last_hidden).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from . import drafter_io
from .config import DrafterConfig, DSparkConfig, needs_last_hidden
from .families import FAMILIES, Family
from .loss import compiled_chunk, simulated_tau, train_forward
from .model import DFlashDrafter, DrafterSpec

NUM_ANCHORS = 512  # DeepSpec's loader requires config.num_anchors (its training sampler's): its recipe's


@dataclass
class DSparkSpec(DrafterSpec):
    family: ClassVar[str] = "dspark"
    markov_rank: int = 256  # r: markov_w1 [V, r], markov_w2 [r -> V]; 0: no Markov head
    confidence_head: bool = True
    confidence_with_markov: bool = True  # the confidence head reads markov_w1[prev] beside h

    def __post_init__(self):
        if self.sliding_window is not None:
            raise ValueError("a DSpark drafter has no sliding window")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank {self.markov_rank}: 0 (no Markov head) or more")
        if not self.markov_rank:
            if self.confidence_head and self.confidence_with_markov:
                raise ValueError(
                    "a confidence head reads the Markov features only with a Markov head "
                    "(markov_rank > 0); set confidence_head_with_markov false"
                )
            self.confidence_with_markov = False  # without either head there are none to read

    @property
    def verify_width(self) -> int:
        """The anchor is the first prediction slot: B drafts, B+1 tokens per verify step."""
        return self.block_size + 1

    @classmethod
    def from_target(
        cls, target_config, tokenizer, drafter_cfg: DrafterConfig, dspark_cfg: DSparkConfig | None = None
    ) -> DSparkSpec:
        """DrafterSpec.from_target plus the heads of `dspark_cfg` (default drafter_cfg.dspark); the
        confidence head exists where its loss weight is not 0, the Markov head where its rank is."""
        d = drafter_cfg.dspark if dspark_cfg is None else dspark_cfg
        return dataclasses.replace(
            super().from_target(target_config, tokenizer, drafter_cfg),
            markov_rank=d.markov_rank,
            confidence_head=d.confidence_weight > 0,
            confidence_with_markov=d.confidence_with_markov,
        )

    def to_config_dict(self, dtype: str = "bfloat16") -> dict:
        """config.json in DeepSpec's layout (what SGLang and vLLM load): the Qwen3 fields, with the DSpark
        keys at the top level instead of DFlash's dflash_config; markov_head_type only with a Markov head
        (DeepSpec's build_draft_config writes it only then)."""
        d = super().to_config_dict(dtype)
        del d["dflash_config"]
        kind = {"markov_head_type": "vanilla"} if self.markov_rank else {}
        d.update(
            architectures=[FAMILIES["dspark"].architecture],
            mask_token_id=self.mask_token_id,
            target_layer_ids=list(self.target_layer_ids),
            num_anchors=NUM_ANCHORS,
            markov_rank=self.markov_rank,
            **kind,
            enable_confidence_head=self.confidence_head,
            confidence_head_with_markov=self.confidence_with_markov,
        )
        return d

    @classmethod
    def from_config_dict(cls, d: dict) -> DSparkSpec:
        """The spec of a DSpark export's config.json (ours or DeepSpec's, which leaves
        confidence_head_with_markov out where it has no confidence head, and markov_head_type where it
        has no Markov head); only the vanilla Markov head, or none (markov_rank 0)."""
        rank, kind = int(d["markov_rank"]), d.get("markov_head_type")
        if rank < 0 or (rank and kind != "vanilla"):
            raise ValueError(
                f"markov_rank {rank}, markov_head_type {kind!r}: only DSpark's vanilla Markov "
                "head (markov_rank > 0, markov_head_type 'vanilla') or none (markov_rank 0) is "
                "supported"
            )
        confidence = bool(d.get("enable_confidence_head", False))
        with_markov = bool(d.get("confidence_head_with_markov", rank > 0))
        return dataclasses.replace(
            super().from_config_dict(d),
            markov_rank=rank,
            confidence_head=confidence,
            confidence_with_markov=with_markov,
        )


# what an init_from checkpoint must share beyond the backbone's fields (a confidence head present in one
# and not the other shows as missing or extra tensors)
INIT_KEYS = {
    **drafter_io.INIT_KEYS,
    "markov_rank": "drafter.dspark.markov_rank",
    "confidence_with_markov": "drafter.dspark.confidence_with_markov",
}


# ---------------------------------------------------------------------------------------------------------
# the network


class MarkovHead(nn.Module):
    """The vanilla Markov head: the logit bias markov_w2(markov_w1[previous token])."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        # an uninitialized table (DSparkDrafter initializes it): the meta device's random init imports Dynamo
        self.markov_w1 = nn.Embedding(vocab_size, rank, _weight=torch.empty(vocab_size, rank))
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1)


class DSparkDrafter(DFlashDrafter):
    """DFlashDrafter (its block_hidden / block_hidden_cached give the slots' hidden states) with the Markov
    and confidence heads (each None where the spec has none). Initialized as DeepSpec's (HF's
    _init_weights): every Linear weight and the embedding normal(0, 0.02), the confidence bias 0, norms 1."""

    spec_class = DSparkSpec
    foreign_keys = ("embed_tokens.weight", "lm_head.weight")  # DeepSpec's checkpoints carry the target's

    def __init__(self, spec: DSparkSpec, init: bool = True):
        super().__init__(spec, init)
        self.markov_head = MarkovHead(spec.vocab_size, spec.markov_rank) if spec.markov_rank else None
        dim = spec.hidden_size + spec.markov_rank * spec.confidence_with_markov
        self.confidence_head = ConfidenceHead(dim) if spec.confidence_head else None
        if init:
            if self.markov_head is not None:
                nn.init.normal_(self.markov_head.markov_w1.weight, std=0.02)
                nn.init.normal_(self.markov_head.markov_w2.weight, std=0.02)
            if self.confidence_head is not None:
                nn.init.normal_(self.confidence_head.proj.weight, std=0.02)
                nn.init.zeros_(self.confidence_head.proj.bias)

    def markov_bias(self, prev):
        """The logit bias `[.., V]` of the previous tokens `prev` `[..]`."""
        return self.markov_head.markov_w2(self.markov_head.markov_w1(prev))

    def prev_embeds(self, prev):
        """markov_w1 of the previous tokens `prev` `[..]` (None without a Markov head)."""
        return None if self.markov_head is None else self.markov_head.markov_w1(prev)

    def confidence(self, h, prev_embeds):
        """Confidence logits `[..]` of slot hidden states `[.., H]` and markov_w1 of their previous tokens
        (`prev_embeds`, read only with confidence_with_markov)."""
        x = torch.cat([h, prev_embeds.to(h.dtype)], -1) if self.spec.confidence_with_markov else h
        return self.confidence_head.proj(x).squeeze(-1)

    @torch.no_grad()
    def pick_block(self, h, last_token: int, lm_head_weight, temperature: float = 0.0, generator=None):
        """Drafts for the slots' hidden states h `[n, H]`, left to right: slot k's logits are its base
        logits plus the Markov bias of the token before it (`last_token`, the anchor, for slot 0, then each
        pick); without a Markov head the base logits, every slot at once. T=0: argmax; T>0: a sample of
        softmax(logits/T). Returns (draft tensor `[n]`, distributions `[n, V]` at T>0 else None, the logits
        `[n, V]` float32)."""
        base = (h @ lm_head_weight.to(h.dtype).T).float()
        if self.markov_head is None:
            if temperature == 0:
                return base.argmax(-1), None, base
            q = torch.softmax(base / temperature, -1)
            return torch.multinomial(q, 1, generator=generator)[:, 0], q, base
        prev = torch.tensor([last_token], device=h.device)

        def choose(k, logits):
            if temperature == 0:
                return logits.argmax(-1, keepdim=True), None
            q = torch.softmax(logits / temperature, -1)
            return torch.multinomial(q, 1, generator=generator), q

        return (*self.markov_picks(base, prev, choose), base)

    def markov_picks(self, base, prev, choose):
        """The Markov picks of pick_block (and of dspark_decode.GraphPicks): slot by slot, the base logits
        `base` `[n, V]` float32 biased in place by the Markov bias of the token before (`prev` `[1]` for
        slot 0, then each pick), then `choose(k, logits) -> (pick [1], distribution [V] or None)`. Returns
        (picks `[n]`, the distributions `[n, V]` or None)."""
        picks, qs = [], []
        for k in range(base.shape[0]):
            base[k] += self.markov_bias(prev)[0].float()
            prev, q = choose(k, base[k])
            picks.append(prev)
            qs += [] if q is None else [q]
        return torch.cat(picks), torch.stack(qs) if qs else None


# ---------------------------------------------------------------------------------------------------------
# the training objective


def dspark_labels(input_ids, loss_mask, anchors, valid, block_size: int, gamma: float):
    """Per block slot k=0..B-1, each `[b, A, B]`: the label token[anchor+k+1]; the previous token
    token[anchor+k] (the Markov head's input: the anchor token at k=0), at position anchor+k, where the
    target's last hidden state gives the teacher distribution; the eval mask, the contiguous prefix of slots
    whose label is inside the sequence and in the loss mask (none for a padded block); and the weights
    eval_mask * exp(-k/gamma). Returns (labels, prev, pos, weights, eval_mask)."""
    s = input_ids.shape[1]
    k = torch.arange(block_size, device=anchors.device)
    pos = anchors.clamp(min=0)[:, :, None] + k
    idx = pos + 1

    def at(t, i):
        return t.gather(1, i.clamp(max=s - 1).flatten(1)).view_as(i)

    labels, prev = at(input_ids, idx), at(input_ids, pos)
    inside = (idx < s) & valid[:, :, None] & (at(loss_mask, idx) > 0)
    eval_mask = inside.int().cumprod(-1).bool()
    weights = eval_mask.float() * torch.exp(-k.float() / gamma)
    return labels, prev, pos.clamp(max=s - 1), weights, eval_mask


def dspark_normalizer(input_ids, loss_mask, anchors, valid, block_size: int, gamma: float):
    """This micro-batch's sum of loss weights (the loss's own normalizer), known before its forward."""
    return dspark_labels(input_ids, loss_mask, anchors, valid, block_size, gamma)[3].sum()


def dspark_chunk(h, e, w2, head, teacher, y, w, ce_weight: float, l1_weight: float):
    """One chunk of MarkovLinearLoss: (sum of w*(ce_weight*CE + l1_weight*L1), CE, L1, argmax == label, and
    the gradients for h, e and w2). Softmaxes and the gradient are made in place: the `[chunk, V]` float32
    buffers are the draft softmax p, and the teacher's q turned into p - q, its sign, then the gradient.
    e and w2 None: no Markov head (no bias, no gradients for them); teacher None: no L1 term (L1 NaN)."""
    dt = head.dtype
    z = (h.to(dt) @ head.T).float()
    if e is not None:
        z += e.to(dt) @ w2.T
    lse = z.logsumexp(-1)
    ce = lse - z.gather(1, y[:, None]).squeeze(1)
    correct = z.argmax(-1) == y
    p = z.sub_(lse[:, None]).exp_()
    if teacher is None:
        l1, rows = torch.full_like(ce, math.nan), ce_weight * ce
        grad = p.mul_(ce_weight)  # d CE / d z = p - onehot(y)
    else:
        q = (teacher.to(dt) @ head.T).float()
        d = q.sub_(q.logsumexp(-1, keepdim=True)).exp_().sub_(p).neg_()  # p - q
        l1 = torch.linalg.vector_norm(d, 1, -1)
        rows = ce_weight * ce + l1_weight * l1
        s = d.sign_()
        # d L1 / d z = p * (sign(p - q) - <p, sign(p - q)>);  d CE / d z = p - onehot(y)
        grad = s.sub_(torch.linalg.vecdot(p, s)[:, None]).mul_(p).mul_(l1_weight).add_(p, alpha=ce_weight)
    grad[torch.arange(len(y), device=y.device), y] -= ce_weight
    g = grad.mul_(w[:, None]).to(dt)
    total = (w * rows).sum()
    if e is None:
        return total, ce, l1, correct, (g @ head).to(h.dtype), None, None
    return total, ce, l1, correct, (g @ head).to(h.dtype), (g @ w2).to(e.dtype), (g.T @ e.to(dt)).float()


class MarkovLinearLoss(torch.autograd.Function):
    """sum_i w_i * (ce_weight * CE(z_i, y_i) + l1_weight * |softmax(z_i) - softmax(t_i @ W.T)|_1) over rows
    z_i = h_i @ W.T + e_i @ W2.T (e_i = markov_w1[prev_i], W2 = markov_w2's weight), W the frozen head
    `[V, H]`, t_i the target's last hidden state at the row's position: `chunk` rows at a time, with the
    gradients for h, e and W2 made in the forward while each chunk's logits exist (as LinearCrossEntropy;
    W and t get none). Also returns, without gradient, each row's CE, L1 and whether its argmax is its
    label. Matmuls in W's dtype, softmaxes in float32. e and W2 None: no Markov head; teacher None: no L1
    term (dspark_chunk). compiled: full chunks go through dspark_chunk compiled (train.compile_loss), the
    last, shorter one eager."""

    @staticmethod
    def forward(
        ctx,
        h,
        e,
        w2,
        head,
        teacher,
        labels,
        weights,
        ce_weight: float,
        l1_weight: float,
        chunk: int,
        compiled: bool = False,
    ):
        n, dev, markov = h.shape[0], h.device, e is not None
        fused = compiled_chunk(dspark_chunk) if compiled else dspark_chunk
        grad_h = torch.empty_like(h)
        grad_e = torch.empty_like(e) if markov else None
        grad_w2 = torch.zeros(w2.shape, dtype=torch.float32, device=dev) if markov else None
        total = torch.zeros((), dtype=torch.float32, device=dev)
        ce, l1 = torch.empty(n, device=dev), torch.empty(n, device=dev)
        correct = torch.empty(n, dtype=torch.bool, device=dev)
        with torch.autocast(dev.type, enabled=False):
            w2h = w2.to(head.dtype) if markov else None
            for i in range(0, n, chunk):
                j = slice(i, i + chunk)
                run = fused if h[j].shape[0] == chunk else dspark_chunk
                out = run(
                    h[j],
                    e[j] if markov else None,
                    w2h,
                    head,
                    None if teacher is None else teacher[j],
                    labels[j],
                    weights[j].float(),
                    ce_weight,
                    l1_weight,
                )
                total += out[0]
                ce[j], l1[j], correct[j], grad_h[j] = out[1:5]
                if markov:
                    grad_e[j] = out[5]
                    grad_w2 += out[6]
        ctx.save_for_backward(grad_h, grad_e, grad_w2.to(w2.dtype) if markov else None)
        ctx.mark_non_differentiable(ce, l1, correct)
        return total, ce, l1, correct

    @staticmethod
    def backward(ctx, grad_total, *_):
        grads = [None if g is None else g * grad_total for g in ctx.saved_tensors]
        return *grads, *[None] * 8


def dspark_loss(
    model,
    input_ids,
    loss_mask,
    hidden,
    last_hidden,
    anchors,
    valid,
    embed_weight,
    lm_head_weight,
    *,
    gamma: float,
    ce_weight: float,
    l1_weight: float,
    confidence_weight: float,
    attention: str = "sdpa",
    chunk_blocks: int = 128,
    normalizer=None,
    compile_loss: bool = False,
):
    """DeepSpec's DSpark loss: (ce_weight * sum w*CE + l1_weight * sum w*L1 + confidence_weight * sum w*BCE)
    / normalizer, per slot k with w = eval_mask * exp(-k/gamma) (`dspark_labels`); CE of the Markov-corrected
    logits against token[anchor+k+1]; L1 = |p_draft - p_target|_1, p_target the target's softmax over its
    last hidden state `last_hidden` `[b, S, H]` at anchor+k; BCE of the confidence logit against 1 - L1/2
    (detached). normalizer: a given one (a global batch's) instead of this batch's sum(w). The vocabulary
    side runs `chunk_blocks` blocks at a time (MarkovLinearLoss; `compile_loss`: its full chunks compiled).
    `model`: a DSparkDrafter, maybe in DDP.
    Without a Markov head the logits are the base ones; `last_hidden` None (no L1 weight, no confidence
    head): no teacher, and the L1 and expected_tau stats are NaN.

    Returns (loss, stats): stats a detached float vector of sums, summable across steps and ranks
    (`dspark_summarize`): [loss numerator, sum w*CE, sum w*L1, sum w*BCE, sum w, sum sim_tau,
    sum expected_tau, blocks, correct_k (B), counted_k (B)]."""
    drafter = model.module if hasattr(model, "module") else model
    if last_hidden is None and (l1_weight or drafter.confidence_head is not None):
        raise ValueError(
            "the L1 term and the confidence head read the target's last hidden state: "
            "dspark_loss needs last_hidden"
        )
    bs = drafter.spec.block_size
    out = train_forward(model, input_ids, hidden, anchors, valid, embed_weight, attention)
    labels, prev, pos, weights, eval_mask = dspark_labels(input_ids, loss_mask, anchors, valid, bs, gamma)
    own = weights.sum()
    sel = valid.flatten()  # only real blocks go through the heads
    h = out.flatten(0, 1)[sel]  # [n, B, H]
    labels, prev, pos, weights, eval_mask = (
        t.flatten(0, 1)[sel] for t in (labels, prev, pos, weights, eval_mask)
    )
    rows, w, y = h.flatten(0, 1), weights.flatten(), labels.flatten()
    teacher = None
    if last_hidden is not None:
        rows_of = torch.arange(anchors.shape[0], device=anchors.device)[:, None].expand_as(anchors).flatten()
        teacher = last_hidden[rows_of[sel][:, None], pos].flatten(0, 1)  # [n * B, H]
    e = drafter.prev_embeds(prev.flatten())
    w2 = None if drafter.markov_head is None else drafter.markov_head.markov_w2.weight
    total, ce, l1, correct = MarkovLinearLoss.apply(
        rows, e, w2, lm_head_weight, teacher, y, w, ce_weight, l1_weight, chunk_blocks * bs, compile_loss
    )
    accept = (1.0 - l1 / 2).clamp(0.0, 1.0)  # the acceptance rate of rejection sampling, per slot
    bce_sum = torch.zeros((), device=rows.device)
    if drafter.confidence_head is not None:
        conf = drafter.confidence(rows, e).float()
        bce_sum = (w * F.binary_cross_entropy_with_logits(conf, accept, reduction="none")).sum()
        total = total + confidence_weight * bce_sum
    loss = total / (own if normalizer is None else normalizer).clamp(min=1e-6)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        # a degenerate batch (no anchors) must still touch every parameter, or DDP's all-reduce waits forever
        loss = loss + sum(p.sum() for p in model.parameters()) * 0.0
    with torch.no_grad():
        hit = correct.view_as(labels) & eval_mask
        expected = (accept.view_as(labels) * eval_mask).cumprod(1).sum(1) + 1.0
        blocks = torch.tensor(float(h.shape[0]), device=h.device)
        head = torch.stack(
            [
                total.detach(),
                (w * ce).sum(),
                (w * l1).sum(),
                bce_sum.detach(),
                own,
                simulated_tau(hit).sum(),
                expected.sum(),
                blocks,
            ]
        )
        stats = torch.cat([head, hit.sum(0).float(), eval_mask.sum(0).float()])
    return loss, stats


def dspark_stats_size(block_size: int) -> int:
    return 8 + 2 * block_size


def dspark_summarize(stats, block_size: int) -> dict:
    """Metrics from summed `dspark_loss` stats: loss and its terms ce, l1, confidence (each per unit of
    weight; confidence 0 without a head), acc, acc_pos_1..B (acc_pos_j: the token at anchor+j, slot j-1),
    sim_tau (greedy: drafts up to the first miss + the bonus) and expected_tau (DeepSpec's
    tau_probabilistic: sum of the cumulative products of 1 - L1/2, + the bonus), per block; l1 and
    expected_tau NaN where the loss had no teacher."""
    s = stats.double().cpu().tolist()
    total, ce, l1, bce, w, tau, expected, blocks = s[:8]
    correct, counted = s[8 : 8 + block_size], s[8 + block_size : 8 + 2 * block_size]

    def per(x, n):
        return x / n if n else math.nan

    row = {
        "loss": per(total, w),
        "ce": per(ce, w),
        "l1": per(l1, w),
        "confidence": per(bce, w),
        "acc": sum(correct) / max(1.0, sum(counted)),
    }
    for k in range(block_size):
        row[f"acc_pos_{k + 1}"] = per(correct[k], counted[k])
    row["sim_tau"], row["expected_tau"] = per(tau, blocks), per(expected, blocks)
    return row


# ---------------------------------------------------------------------------------------------------------
# the family: the trainer's calls (train_step.Step carries the run's loss options) and init_from


@dataclass(frozen=True)
class DSparkLoss:
    """The run's loss options: drafter.dspark's weights, train.gamma's decay, and whether a term reads the
    target's last hidden state (config.needs_last_hidden)."""

    gamma: float
    ce_weight: float
    l1_weight: float
    confidence_weight: float
    teacher: bool = True


def loss_options(train_cfg, drafter_cfg: DrafterConfig, spec: DSparkSpec) -> DSparkLoss:
    d = drafter_cfg.dspark
    return DSparkLoss(
        train_cfg.loss_gamma(spec.block_size),
        d.ce_weight,
        d.l1_weight,
        d.confidence_weight,
        needs_last_hidden(drafter_cfg),
    )


def loss(step, t: dict, anchors, valid, normalizer=None):
    """dspark_loss of one micro-batch; a store's last hidden state is not read where no term needs it."""
    o = step.options
    if o.teacher and "last_hidden" not in t:
        raise ValueError("a DSpark drafter trains on hidden shards holding the target's last hidden state")
    last = t["last_hidden"] if o.teacher else None
    return dspark_loss(
        step.model,
        t["input_ids"],
        t["loss_mask"],
        t["hidden"],
        last,
        anchors,
        valid,
        step.embed,
        step.head,
        gamma=o.gamma,
        ce_weight=o.ce_weight,
        l1_weight=o.l1_weight,
        confidence_weight=o.confidence_weight,
        attention=step.attention,
        normalizer=normalizer,
        compile_loss=step.compile_loss,
    )


def normalizer(step, t: dict, anchors, valid):
    return dspark_normalizer(
        t["input_ids"], t["loss_mask"], anchors, valid, step.spec.block_size, step.options.gamma
    )


def proposer(drafter, embed_weight, lm_head_weight, cached: bool = True, **kw):
    """The evaluation's DSparkProposer (dspark_decode.py, imported here only: it brings the engines)."""
    from .dspark_decode import DSparkProposer

    return DSparkProposer(drafter, embed_weight, lm_head_weight, cached, **kw)


def metric_names(block_size: int) -> list[str]:
    return [
        "loss",
        "ce",
        "l1",
        "confidence",
        "acc",
        *(f"acc_pos_{k}" for k in range(1, block_size + 1)),
        "sim_tau",
        "expected_tau",
    ]


def init_weights(path, spec: DSparkSpec) -> dict[str, torch.Tensor]:
    """drafter.init_from for a DSpark drafter: drafter_io.init_weights with DSpark's config and keys; a
    DeepSpec checkpoint's embed_tokens.weight and lm_head.weight (the target's) are ignored."""
    return drafter_io.init_weights(path, spec, DSparkDrafter, INIT_KEYS)


FAMILY = Family(
    name="dspark",
    spec=DSparkSpec,
    drafter=DSparkDrafter,
    loss=loss,
    normalizer=normalizer,
    summarize=dspark_summarize,
    metric_names=metric_names,
    stats_size=dspark_stats_size,
    proposer=proposer,
    init_weights=init_weights,
    loss_options=loss_options,
)
