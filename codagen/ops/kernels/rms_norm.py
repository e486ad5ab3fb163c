"""RMSNorm statistics of the first block, whose residual stream (the embeddings) no fused GEMM produces.

One program per row: ``rstd[m] = rsqrt(sum_k x[m, k]^2 / d + eps)`` (fp32), then
``normed[m, k] = x[m, k] * norm_weight[k]`` (x's dtype), the row read twice.
"""
from __future__ import annotations

import torch

from .._checks import stats_dtype
from ._launch import dispatcher, launch_kernel, launcher, row_block, tl, triton

__all__ = ["rms_norm_stats", "rms_norm_stats_ref", "rms_norm_stats_triton"]


@triton.jit
def _rms_norm_stats_kernel(x_ptr, norm_weight_ptr, normed_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_cols
    sumsq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        sumsq += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        gamma = tl.load(norm_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(normed_ptr + row * n_cols + cols, (x * gamma).to(normed_ptr.dtype.element_ty), mask=mask)


def rms_norm_stats_ref(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``rstd = rsqrt(mean(x^2) + eps)`` (fp32; fp64 for fp64 x) and ``normed = x * norm_weight`` (x's dtype)."""
    cd = stats_dtype(x.dtype)
    xf = x.to(cd)
    rstd = torch.rsqrt(xf.square().mean(dim=-1) + eps)
    return (xf * norm_weight.to(cd)).to(x.dtype), rstd


@launcher
def rms_norm_stats_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm_stats_ref` as one kernel launch (fp16/bf16/fp32)."""
    m, n = x.shape
    normed = torch.empty_like(x)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        launch_kernel(_rms_norm_stats_kernel, (m,), x, norm_weight, normed, rstd, n, eps, BLOCK=row_block(n))
    return normed, rstd


rms_norm_stats = dispatcher(rms_norm_stats_ref, rms_norm_stats_triton)
