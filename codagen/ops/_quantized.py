"""An FP8 operand as the ops pass it between GEMMs: e4m3 codes and their scales (no kernels here, so that the
argument checks can name it)."""
from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

__all__ = ["GROUP", "Quantized"]

#: the scale group along K of every FP8 GEMM (and a weight block's side)
GROUP = 128


class Quantized(NamedTuple):
    """An operand already in e4m3: its codes and fp32 scales, grouped as the GEMM that reads it takes them (a
    ``QuantizedStore``'s two outputs)."""
    codes: Tensor
    scale: Tensor
