"""``(src * factor).to(dtype)`` with ``factor`` a device scalar, the product in fp32, one rounding.

The LM head's saved gradients times the loss gradient: PyTorch's ``bf16 * fp32 scalar tensor`` would
round ``factor`` to bf16 first.
"""
from __future__ import annotations

import torch

from .._checks import stats_dtype
from ._launch import cdiv, dispatcher, launch_kernel, launcher, tl, triton

__all__ = ["scale_cast", "scale_cast_ref", "scale_cast_triton"]


@triton.jit
def _scale_cast_kernel(src_ptr, factor_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    factor = tl.load(factor_ptr).to(tl.float32)
    src = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (src * factor).to(out_ptr.dtype.element_ty), mask=mask)


def scale_cast_ref(src: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(src * factor).to(dtype)``, the product in fp32 (fp64 for fp64 ``src``): ``factor`` is never rounded
    to ``src``'s dtype (PyTorch's ``bf16 * fp32 scalar tensor`` would round it to bf16 first)."""
    cd = stats_dtype(src.dtype)
    return (src.to(cd) * factor.to(cd)).to(dtype)


@launcher
def scale_cast_triton(src: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`scale_cast_ref` as one kernel launch (contiguous ``src``; fp16/bf16/fp32)."""
    src = src.contiguous()
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    if src.numel():
        block = 4096
        launch_kernel(_scale_cast_kernel, (cdiv(src.numel(), block),), src, factor, out, src.numel(), BLOCK=block)
    return out


scale_cast = dispatcher(scale_cast_ref, scale_cast_triton)
