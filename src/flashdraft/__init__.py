"""flashdraft: train DFlash block-diffusion drafters for any Hugging Face causal LM."""

__version__ = "0.1.0"
