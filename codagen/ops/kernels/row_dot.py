"""The RMSNorm backward's row statistic of an op whose output gradient arrives as is.

``mean_z_dz[m] = sum_k z[m, k] grad_z[m, k] / width``, one program per row.
"""
from __future__ import annotations

import torch

from .._checks import stats_dtype
from ._launch import dispatcher, launch_kernel, launcher, row_block, tl, triton

__all__ = ["mean_row_dot", "mean_row_dot_ref", "mean_row_dot_triton"]


@triton.jit
def _mean_row_dot_kernel(a_ptr, b_ptr, out_ptr, n_cols, inv_width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        a = tl.load(a_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        acc += a * b
    tl.store(out_ptr + row, tl.sum(acc, axis=0) * inv_width)


def mean_row_dot_ref(z: torch.Tensor, grad_z: torch.Tensor, width: int) -> torch.Tensor:
    """``mean_z_dz[m] = sum_k z[m, k] grad_z[m, k] / width``."""
    cd = stats_dtype(z.dtype)
    return (z.to(cd) * grad_z.to(cd)).sum(dim=-1) / width


@launcher
def mean_row_dot_triton(z: torch.Tensor, grad_z: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`mean_row_dot_ref` as one kernel launch (fp16/bf16/fp32)."""
    m, n = z.shape
    out = torch.empty(m, dtype=torch.float32, device=z.device)
    if m:
        launch_kernel(_mean_row_dot_kernel, (m,), z, grad_z, out, n, 1.0 / width, BLOCK=row_block(n))
    return out


mean_row_dot = dispatcher(mean_row_dot_ref, mean_row_dot_triton)
