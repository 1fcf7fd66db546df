"""The training objective: anchors, the training forward over blocks, the block labels and the loss
(the DFlash decay weights or D-PACE's), the fused LM-head cross-entropy and the logged stats.

Per step we sample anchors p (positions with loss_mask[p] and loss_mask[p+1]); each anchor makes one
block `[token[p], MASK x (B-1)]` at positions p..p+B-1, which sees the context strictly before its
anchor and its own block (model.dflash_mask_mod). Block position k predicts token[p+k] (same position,
no shift), k=1..B-1, with loss weight loss_mask[p+k]*exp(-(k-1)/gamma) (`train.loss: decay`) or D-PACE's
weights from the drafter's own confidence (`train.loss: dpace`): the objectives are objectives.py's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from .config import FLEX_MULTIPLE, num_anchor_slots  # noqa: F401  (the anchor slots' arithmetic, torch-free)
from .model import DrafterSpec, dense_mask, dflash_mask_mod
from .objectives import Objective


def sample_anchors(loss_mask, max_anchors: int, block_size: int, generator=None, seeds=None):
    """Random anchors per sample: positions p with loss_mask[p] and loss_mask[p+1], drawn uniformly
    without replacement, sorted. Returns anchors `[b, A]` (-1 where padded) and valid `[b, A]`, with
    A = num_anchor_slots(S, max_anchors, block_size).

    seeds: one seed per row (None for a padding row): row r's keys come from its own generator, one
    key per eligible position in order, so its anchors depend on its seed and its own loss mask only,
    not on the batch it shares, its row, or the padded length. Without seeds, one `generator` draws
    keys for the whole `[b, S-1]` batch."""
    b, s = loss_mask.shape
    a = num_anchor_slots(s, max_anchors, block_size)
    lm = loss_mask.bool().cpu()
    eligible = lm[:, :-1] & lm[:, 1:]  # [b, S-1]: p in 0..S-2
    if seeds is None:
        keys = torch.rand(eligible.shape, generator=generator)
    else:
        keys = torch.ones(eligible.shape)
        for r, seed in enumerate(seeds):
            if seed is not None:
                row = torch.Generator().manual_seed(seed)
                keys[r, eligible[r]] = torch.rand(int(eligible[r].sum()), generator=row)
    keys = torch.where(eligible, keys, torch.full_like(keys, 2.0))  # ineligible sort last
    k = min(max_anchors, s - 1)
    picked_keys, picked = keys.topk(k, dim=1, largest=False)
    valid = picked_keys < 1.0
    picked = torch.where(valid, picked, torch.full_like(picked, s)).sort(dim=1).values
    valid = picked < s
    anchors = torch.full((b, a), -1, dtype=torch.long)
    anchors[:, :k] = torch.where(valid, picked, torch.full_like(picked, -1))
    valid = anchors >= 0
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def flex_mask(anchors, valid, ctx_len: int, block_size: int, window: int | None = None):
    """The BlockMask, built eagerly: compiled, it made a cold compile slower for no faster a step
    (benchmarks/results/compile_variants_qwen3-8b.json)."""
    b, a = anchors.shape
    q_len = a * block_size
    mod = dflash_mask_mod(anchors, valid, ctx_len, block_size, window)
    return create_block_mask(mod, B=b, H=None, Q_LEN=q_len, KV_LEN=ctx_len + q_len, device=anchors.device)


def resolve_attention(name: str, device) -> str:
    """auto = flex on CUDA (fast, no dense mask), sdpa on CPU (flex has no CPU backward)."""
    if name == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    if name not in ("flex", "sdpa"):
        raise ValueError(f"attention must be auto, flex or sdpa, not {name!r}")
    return name


def block_inputs(input_ids, anchors, block_size: int, mask_token_id: int):
    """Block token ids `[b, A*B]` (`[token at anchor, MASK x (B-1)]`) and their positions (anchor+k)."""
    b, a = anchors.shape
    safe = anchors.clamp(min=0)
    ids = torch.full((b, a, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, safe)
    positions = safe[:, :, None] + torch.arange(block_size, device=anchors.device)
    return ids.view(b, -1), positions.view(b, -1)


def block_labels(input_ids, loss_mask, anchors, valid, block_size: int, gamma: float | None):
    """Labels, loss weights and label mask `[b, A, B-1]` for block positions k=1..B-1.

    Block position k predicts token[anchor+k] (the same position: no shift). Weight
    loss_mask[anchor+k] * exp(-(k-1)/gamma); 0 past the sequence end and for padded anchors. gamma None:
    the label mask as weights (an objective that makes its own, `Objective.decay`)."""
    s = input_ids.shape[1]
    k = torch.arange(1, block_size, device=anchors.device)
    idx = anchors[:, :, None] + k  # [b, A, B-1]
    inside = (idx < s) & valid[:, :, None]
    idx = idx.clamp(0, s - 1)
    labels = input_ids.gather(1, idx.flatten(1)).view_as(idx)
    label_mask = inside & (loss_mask.gather(1, idx.flatten(1)).view_as(idx) > 0)
    if gamma is None:
        return labels, label_mask.float(), label_mask
    decay = torch.exp(-(k - 1).float() / gamma)
    weights = label_mask.float() * decay
    return labels, weights, label_mask


def _spec(drafter) -> DrafterSpec:
    return drafter.module.spec if hasattr(drafter, "module") else drafter.spec  # DDP wraps the drafter


def train_forward(drafter, input_ids, hidden, anchors, valid, embed_weight, attention: str):
    """Drafter output `[b, A, B, H]` for the blocks at `anchors` over context `hidden` `[b, S, K*H]`."""
    spec = _spec(drafter)
    b, s = input_ids.shape
    a, bs = anchors.shape[1], spec.block_size
    ids, block_pos = block_inputs(input_ids, anchors, bs, spec.mask_token_id)
    if attention == "flex" and s % FLEX_MULTIPLE:
        # pad the context to flex's block size; padded positions are >= S > every anchor: never visible
        hidden = F.pad(hidden, (0, 0, 0, FLEX_MULTIPLE - s % FLEX_MULTIPLE))
        s = hidden.shape[1]
    positions = torch.cat([torch.arange(s, device=ids.device).expand(b, s), block_pos], dim=1)
    mask = (flex_mask if attention == "flex" else dense_mask)(anchors, valid, s, bs, spec.sliding_window)
    # the residual stream starts from the frozen (maybe bf16) embedding rows, kept in the weights' fp32
    embeds = F.embedding(ids, embed_weight).to(next(drafter.parameters()).dtype)
    out = drafter(hidden, embeds, positions, mask)
    return out.view(b, a, bs, -1)


def ce_chunk(h, weight, y, w, objective: Objective | None = None):
    """One chunk of LinearCrossEntropy: (sum w*CE, whether each row's argmax is its label, each row's CE,
    the gradient for h). The softmax is made in place in the logits' memory: one `[chunk, V]` float32
    buffer."""
    logits = (h.to(weight.dtype) @ weight.T).float()
    lse = logits.logsumexp(-1)
    ce = lse - logits.gather(1, y[:, None]).squeeze(1)
    if objective is not None:
        w = objective.chunk_weights(ce, w)
    correct = logits.argmax(-1) == y
    grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place: d CE / d logits = p - onehot
    grad[torch.arange(len(y), device=y.device), y] -= 1.0
    return (ce * w).sum(), correct, ce, (grad.mul_(w[:, None]).to(weight.dtype) @ weight).to(h.dtype)


class CompiledChunk:
    """A loss chunk function compiled (train.compile_loss): ce_chunk, or a family's own (DSpark's
    dspark_chunk), whose softmax, gradient and weighting fuse into a few kernels instead of a pass over the
    `[chunk, V]` logits each. Full chunks only, so one static shape.

    Its one compile comes with the first full chunk, which can be any step's (a bucket whose first
    micro-batches hold fewer blocks than a chunk), not only a bucket's first: that call runs under the
    default stance, so training's fail_on_recompile guards every later one."""

    def __init__(self, fn):
        self.fn = torch.compile(fn, dynamic=False)
        self.ran = False

    def __call__(self, *args):
        if self.ran:
            return self.fn(*args)
        with torch.compiler.set_stance("default"):
            out = self.fn(*args)
        self.ran = True
        return out


_compiled_chunks: dict = {}


def compiled_chunk(fn) -> CompiledChunk:
    """`fn` compiled, once per process."""
    if fn not in _compiled_chunks:
        _compiled_chunks[fn] = CompiledChunk(fn)
    return _compiled_chunks[fn]


def compiled_ce_chunk() -> CompiledChunk:
    return compiled_chunk(ce_chunk)


class LinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W.T, y_i) for rows h `[N, H]` of a frozen head W `[V, H]`, `chunk` rows at a
    time, with the gradient for h computed in the forward while each chunk's logits exist: no logits
    are kept for the backward and none are recomputed (W gets no gradient). Also returns, without a
    gradient, whether each row's argmax is its label and each row's CE (float32).

    objective: None (the weights `weights` are fixed), or an `Objective` whose `chunk_weights` makes each
    chunk's weights from its rows' CE and `weights` (`DPace`: rows are blocks of B-1 positions, a chunk
    holds whole blocks, `weights` is their 0/1 label mask, and each block's weights are `dpace_weights`
    of its own label probabilities, detached, computed from the chunk's logits).
    compiled: full chunks go through `compiled_ce_chunk` (the last, shorter one eager).

    The logits are h @ W.T in W's dtype (bf16 on GPU, as autocast would give), then float32 for the
    softmax; the gradient goes back through the same matmul in W's dtype."""

    @staticmethod
    def forward(
        ctx,
        h,
        weight,
        labels,
        weights,
        chunk: int,
        objective: Objective | None = None,
        compiled: bool = False,
    ):
        grad_h = torch.empty_like(h)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.empty(labels.shape, dtype=torch.bool, device=h.device)
        ce = torch.empty(labels.shape, dtype=torch.float32, device=h.device)
        fused = compiled_ce_chunk() if compiled else ce_chunk
        with torch.autocast(h.device.type, enabled=False):
            for i in range(0, h.shape[0], chunk):
                j = slice(i, i + chunk)
                run = fused if h[j].shape[0] == chunk else ce_chunk
                part, correct[j], ce[j], grad_h[j] = run(
                    h[j], weight, labels[j], weights[j].float(), objective
                )
                total += part
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(correct, ce)
        return total, correct, ce

    @staticmethod
    def backward(ctx, grad_total, _grad_correct, _grad_ce):
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_total, None, None, None, None, None, None


def dflash_loss(
    drafter,
    input_ids,
    loss_mask,
    hidden,
    anchors,
    valid,
    embed_weight,
    lm_head_weight,
    objective: Objective,
    attention: str = "sdpa",
    chunk_blocks: int = 128,
    normalizer=None,
    compile_loss: bool = False,
):
    """Weighted block CE: loss = sum(w*CE) / normalizer, w and the normalizer the objective's (`Decay`:
    w = loss_mask * exp(-(k-1)/gamma), normalizer sum(w), the DFlash recipe; `DPace`: w = `dpace_weights`,
    normalizer the number of blocks). `normalizer`: a given one (a global batch's, summed over its
    micro-batches and ranks) instead of this batch's own. The LM head + CE run `chunk_blocks` blocks
    at a time (LinearCrossEntropy), so full logits `[blocks*(B-1), V]` never exist at once, and the
    backward needs none; `compile_loss`: its chunks compiled (compiled_ce_chunk).

    Returns (loss, stats): stats is one detached float vector of sums, summable across steps and ranks
    (see `summarize`): [sum w*CE, sum normalizer, sum tau, blocks, correct_k (B-1), counted_k (B-1),
    sum expected_tau]."""
    bs = _spec(drafter).block_size
    out = train_forward(drafter, input_ids, hidden, anchors, valid, embed_weight, attention)
    labels, weights, label_mask = block_labels(input_ids, loss_mask, anchors, valid, bs, objective.decay())
    own = objective.normalizer(weights, valid)
    sel = valid.flatten()  # only real blocks go through the LM head
    h = out[:, :, 1:].flatten(0, 1)[sel]
    labels, weights, label_mask = (t.flatten(0, 1)[sel] for t in (labels, weights, label_mask))
    rows = h.flatten(0, 1)  # [blocks*(B-1), H]
    ce_sum, correct, ce = LinearCrossEntropy.apply(
        rows,
        lm_head_weight,
        labels.flatten(),
        weights.flatten(),
        chunk_blocks * (bs - 1),
        objective,
        compile_loss,
    )
    correct = correct.view_as(labels)
    loss = ce_sum / (own if normalizer is None else normalizer).clamp(min=1e-6)
    if isinstance(drafter, torch.nn.parallel.DistributedDataParallel):
        # a degenerate batch (no anchors) must still touch every parameter, or DDP's all-reduce waits
        # forever (FSDP's parameters are sharded DTensors, not to be mixed with this loss)
        loss = loss + sum(p.sum() for p in drafter.parameters()) * 0.0
    with torch.no_grad():
        hit = correct & label_mask
        tau = simulated_tau(hit)
        expected = expected_tau(torch.exp(-ce.view_as(labels)) * label_mask)
        blocks = torch.tensor(float(h.shape[0]), device=h.device)
        head = torch.stack([ce_sum.detach(), own.float(), tau.sum(), blocks])
        stats = torch.cat([head, hit.sum(0).float(), label_mask.sum(0).float(), expected.sum()[None]])
    return loss, stats


def simulated_tau(hit):
    """Acceptance length per block from hits `[blocks, B-1]`: the draft is accepted up to its first miss
    (a position without a label counts as a miss), plus the target's bonus token."""
    return hit.long().cumprod(dim=1).sum(dim=1).float() + 1.0


def expected_tau(accept):
    """Expected acceptance length per block from each position's acceptance probability `[blocks, B-1]`
    (0 where a position has no label): a draft position is reached when every one before it was
    accepted, so 1 (the bonus token) + the sum over positions of the product of the probabilities up to
    it. With the drafter sampling at T=1 and a target whose distribution is p, a position's probability
    is sum_v min(q(v), p(v)) = 1 - TV(q, p) (rejection sampling), DeepSpec's `tau_probabilistic`; where
    the data holds only the target's token y (a DFlash store), p is one-hot at y and it is q(y)."""
    return accept.float().cumprod(dim=1).sum(dim=1) + 1.0


def summarize(stats, block_size: int) -> dict:
    """Metrics from summed `dflash_loss` stats: loss, acc, acc_pos_1..B-1, sim_tau and expected_tau (per
    block, `expected_tau` of the drafter's probability of each label)."""
    stats = stats.double().cpu().tolist()
    ce, w, tau, blocks = stats[:4]
    n = block_size - 1
    correct, counted = stats[4 : 4 + n], stats[4 + n : 4 + 2 * n]
    row = {"loss": ce / w if w else float("nan"), "acc": sum(correct) / max(1.0, sum(counted))}
    for k in range(n):
        row[f"acc_pos_{k + 1}"] = correct[k] / counted[k] if counted[k] else float("nan")
    row["sim_tau"] = tau / blocks if blocks else float("nan")
    row["expected_tau"] = stats[4 + 2 * n] / blocks if blocks else float("nan")
    return row


def stats_size(block_size: int) -> int:
    return 5 + 2 * (block_size - 1)
