"""Target shapes by name (Qwen3Config keyword arguments), one place: the benchmarks build random-weight
targets of them (benchmarks/shapes.py), and the planner's `--target-config` takes their names (PRESETS)."""

# Qwen/Qwen3-8B's config.json (36 layers, H=4096, GQA 32/8, vocab 151936)
QWEN3_8B = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1e6,
)
# the embedded default's toy target (flashdraft.toy with config/config.yaml's toy section)
TOY = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=576,
    max_position_embeddings=4096,
)

PRESETS = {"qwen3-8b": QWEN3_8B, "toy": TOY}  # by the name `--target-config` takes
