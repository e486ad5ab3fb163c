"""A low-rank update of a fused GEMM's weight: ``W_eff = W + scale * b @ a`` (LoRA).

The fused ops take it as ``low_rank=LowRank(a, b, scale)`` with ``a`` [r, in features] and ``b``
[out features, r] (PEFT's ``lora_A.weight`` and ``lora_B.weight``). The update never forms
``b @ a``: the op computes ``u = scale * inp @ a^T`` [M, r] (a skinny GEMM) and hands ``(u, b)`` to the
fused GEMM as its low-rank operand pair, so ``inp @ W^T + u @ b^T`` accumulates in one launch and the
epilogue (RMSNorm scaling, RoPE, QK-norm, SwiGLU, residual) runs on the sum. The input-gradient GEMM
of the backward carries the pair ``(scale * grad @ b, a)`` the same way; the gradients of ``a`` and
``b`` are skinny GEMMs over the saved ``u`` and the GEMM's input.
"""
from __future__ import annotations

import dataclasses

from torch import Tensor

__all__ = ["LowRank"]


@dataclasses.dataclass(frozen=True)
class LowRank:
    """``W_eff = W + scale * b @ a``: ``a`` [r, in features], ``b`` [out features, r], ``scale`` a float."""
    a: Tensor
    b: Tensor
    scale: float = 1.0
