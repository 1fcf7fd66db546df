"""flashdraft: train DFlash block-diffusion drafters for any Hugging Face causal LM."""

__version__ = "0.1.0"

import logging

# Import-time noise in every job's log, none of it about what the job does: transformers imports torchao
# wherever it is installed (its quantizers), and torchao then reports each optional C kernel it cannot load
# on this machine and registers its enums the way torch now deprecates. No stage uses those kernels. Set
# here, before any module of ours imports transformers.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
