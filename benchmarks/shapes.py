"""Target shapes the benchmarks build with random weights (Qwen3Config keyword arguments): the library's
presets (flashdraft.shapes), which the planner reads too; the benchmarks' presets on them; and the
GPUs' spec-sheet peaks the benchmarks hold their rates against."""

from flashdraft.shapes import QWEN3_8B, TOY

# A benchmark preset: a target's shapes, the drafter trained on it, one micro-batch of training (`rows`
# samples of `seq_len` tokens, up to `max_anchors` blocks each) and where and how it runs. A script adds
# its own run sizes (steps, samples, timeouts) to these.
PRESETS = {
    # the toy target's shapes (flashdraft.toy) with the embedded default drafter (K=2, B=8), CPU
    "tiny": dict(
        target=TOY,
        mask_token_id=512,
        drafter=dict(num_layers=2, block_size=8),
        seq_len=256,
        rows=4,
        max_anchors=32,
        device="cpu",
        dtype="float32",
        attention="sdpa",
    ),
    # Qwen3-8B's shapes with the DFlash recipe drafter (K=5, B=16, 512 anchors), bf16, flex attention
    "qwen3-8b": dict(
        target=QWEN3_8B,
        mask_token_id=151669,
        drafter=dict(num_layers=5, block_size=16),
        seq_len=3072,
        rows=4,
        max_anchors=512,
        device="cuda",
        dtype="bfloat16",
        attention="flex",
    ),
}

# per GPU, spec sheet (SXM), by a substring of torch.cuda.get_device_name()
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12}  # dense bf16 tensor-core FLOP/s
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}  # memory bandwidth


def peak_bf16_flops(device_name: str) -> float | None:
    """The device's dense bf16 FLOP/s (None for a GPU not in the table, or the CPU)."""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)


def hbm_bytes_per_s(device_name: str) -> float | None:
    """The device's memory bandwidth in bytes/s (None for a GPU not in the table, or the CPU)."""
    return next((v for k, v in HBM_BYTES_PER_S.items() if k in device_name), None)


__all__ = [
    "QWEN3_8B",
    "TOY",
    "PRESETS",
    "PEAK_BF16_FLOPS",
    "HBM_BYTES_PER_S",
    "peak_bf16_flops",
    "hbm_bytes_per_s",
]
