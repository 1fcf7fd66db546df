"""What the drafter and loss tests share (test_model.py, test_loss.py): the tiny drafter's spec and its
training forward over the `setup` batch (a conftest fixture)."""

import torch

from flashdraft.loss import train_forward
from flashdraft.model import DrafterSpec

B = 8  # block size of the tiny drafter
V = 100
MASK = 99


def tiny_spec(**kw) -> DrafterSpec:
    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_layers=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=V,
        max_position_embeddings=512,
        block_size=B,
        mask_token_id=MASK,
        target_layer_ids=[1, 3],
        num_target_layers=6,
    )
    return DrafterSpec(**{**base, **kw})


def block_out(setup, hidden=None, ids=None, attention="sdpa"):
    drafter, ids0, _, hidden0, embed, _, anchors, valid = setup
    with torch.no_grad():
        return train_forward(
            drafter,
            ids0 if ids is None else ids,
            hidden0 if hidden is None else hidden,
            anchors,
            valid,
            embed,
            attention,
        )
