"""Target shapes the benchmarks build with random weights (Qwen3Config keyword arguments): the library's
presets (flashdraft.shapes), which the planner reads too."""

from flashdraft.shapes import QWEN3_8B, TOY

__all__ = ["QWEN3_8B", "TOY"]
