"""The per-row fp8 scale rule of the dense linear layers, shared by the torch reference
(actors/layers/fp8_linear.py) and the Triton quantizer (actors/layers/kernels/fp8_quant.py).

Torch only (no triton import), so that the reference loads no Triton.
"""

from __future__ import annotations

import torch

from kvcore.kernels.fp8 import FORMATS

E4M3 = torch.float8_e4m3fn
FMAX = FORMATS[E4M3].max_value
# vLLM's floor on a dynamic scale: an all-zero row (a graph's padding row) still divides.
MIN_SCALE = 1.0 / (FMAX * 512.0)
