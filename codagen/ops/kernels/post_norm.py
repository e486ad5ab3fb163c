"""A norm after a GEMM's output and before the residual add (Gemma's and GLM-4's sandwich norms, OLMo 2's post-norms).

The block computes ``x = residual + RMSNorm(y) * post_weight`` from the GEMM output ``y``, then the next norm's
operand ``normed = x * norm_weight`` and statistic ``rstd``. ``RMSNorm(y)`` needs the whole row of ``y``, which no
GEMM tile holds, so this is a row kernel after the GEMM, one program per row::

    rstd_y = rsqrt(mean(y^2) + eps)                          (the row read once for the statistic)
    x      = residual + (y * rstd_y) * post_weight           (fp32, then stored; the row read again)
    normed = x * norm_weight,   rstd = rsqrt(mean(x^2) + eps)       (only where a norm comes next)

Backward, with ``g`` the gradient of ``x`` and ``c = y * rstd_y``: the residual's gradient is ``g`` itself, and the
post-norm's is the RMSNorm backward::

    grad_y = rstd_y * (post_weight * g - c * mean(c * post_weight * g))
    grad_post_weight = sum over rows of g * c

``ROWS`` rows per program, each row whole in registers (``d`` up to :data:`MAX_COLUMNS`); the weight gradient leaves
as per-program partials ``[cdiv(M, ROWS), d]``, summed by :func:`.finish.finish_col_sum_triton` (no atomics).
"""
from __future__ import annotations

import torch

from .._checks import stats_dtype
from ._launch import cdiv, dispatcher, launch_kernel, launcher, next_power_of_2, row_block, tl, triton
from .finish import finish_col_sum_triton

__all__ = ["post_norm_residual", "post_norm_residual_ref", "post_norm_residual_triton", "post_norm_backward",
           "post_norm_backward_ref", "post_norm_backward_triton", "backward_warps", "MAX_COLUMNS",
           "POST_NORM_BACKWARD_ROWS"]

#: the widest row the backward holds in registers (fp32: 64 KiB per program's row)
MAX_COLUMNS = 16384
#: rows per backward program: its weight-gradient partials are [cdiv(M, rows), d]
POST_NORM_BACKWARD_ROWS = 16


@triton.jit
def _post_norm_residual_kernel(y_ptr, residual_ptr, post_weight_ptr, norm_weight_ptr, x_ptr, normed_ptr, rstd_ptr,
                               rstd_y_ptr, n_cols, eps, BLOCK: tl.constexpr, NEXT_NORM: tl.constexpr):
    """One row per program; without NEXT_NORM (OLMo 2: no norm before the next GEMM) no ``normed``, no ``rstd``."""
    row = tl.program_id(0).to(tl.int64)
    at = row * n_cols
    y_sumsq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = tl.load(y_ptr + at + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        y_sumsq += y * y
    rstd_y = 1.0 / tl.sqrt(tl.sum(y_sumsq, axis=0) / n_cols + eps)
    x_sumsq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(y_ptr + at + cols, mask=mask, other=0.0).to(tl.float32)
        residual = tl.load(residual_ptr + at + cols, mask=mask, other=0.0).to(tl.float32)
        post_weight = tl.load(post_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = residual + y * rstd_y * post_weight
        tl.store(x_ptr + at + cols, x.to(x_ptr.dtype.element_ty), mask=mask)
        if NEXT_NORM:
            norm_weight = tl.load(norm_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            x_sumsq += x * x
            tl.store(normed_ptr + at + cols, (x * norm_weight).to(normed_ptr.dtype.element_ty), mask=mask)
    if NEXT_NORM:
        tl.store(rstd_ptr + row, 1.0 / tl.sqrt(tl.sum(x_sumsq, axis=0) / n_cols + eps))
    tl.store(rstd_y_ptr + row, rstd_y)


@triton.jit
def _post_norm_backward_kernel(y_ptr, rstd_y_ptr, post_weight_ptr, grad_x_ptr, grad_y_ptr, partial_ptr, n_rows,
                               n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    post_weight = tl.load(post_weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    grad_post_weight = tl.zeros([BLOCK], dtype=tl.float32)
    for r in range(ROWS):
        row = block * ROWS + r
        mask = col_ok & (row < n_rows)
        at = row.to(tl.int64) * n_cols + cols
        rstd_y = tl.load(rstd_y_ptr + row, mask=row < n_rows, other=0.0)
        c = tl.load(y_ptr + at, mask=mask, other=0.0).to(tl.float32) * rstd_y
        g = tl.load(grad_x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        mean_c_w_g = tl.sum(c * post_weight * g, axis=0) / n_cols
        tl.store(grad_y_ptr + at, (rstd_y * (post_weight * g - c * mean_c_w_g)).to(grad_y_ptr.dtype.element_ty),
                 mask=mask)
        grad_post_weight += g * c  # masked lanes and rows load 0: they add 0
    tl.store(partial_ptr + block.to(tl.int64) * n_cols + cols, grad_post_weight, mask=col_ok)


def backward_warps(block: int) -> int:
    """Warps of a backward program over rows of ``block`` columns: at most 32 columns per thread, whose row arrays
    (the weight, its gradient, ``c``, ``g``) then fit in registers without spilling (sm_90's cubin at 8192 columns
    spills 512 bytes per thread with 4 warps)."""
    return max(4, min(16, block // 1024))


def post_norm_residual_ref(y: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor,
                           norm_weight: torch.Tensor | None, eps: float):
    """``(x, normed, rstd, rstd_y)`` of the module docstring: ``x`` and ``normed`` in ``y``'s dtype, the statistics
    fp32 (fp64 for fp64 ``y``); ``normed`` and ``rstd`` None without a ``norm_weight`` (no norm next)."""
    cd = stats_dtype(y.dtype)
    yf = y.to(cd)
    rstd_y = torch.rsqrt(yf.square().mean(dim=-1) + eps)
    x = residual.to(cd) + yf * rstd_y[:, None] * post_weight.to(cd)
    if norm_weight is None:
        return x.to(y.dtype), None, None, rstd_y
    rstd = torch.rsqrt(x.square().mean(dim=-1) + eps)
    return x.to(y.dtype), (x * norm_weight.to(cd)).to(y.dtype), rstd, rstd_y


@launcher
def post_norm_residual_triton(y: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor,
                              norm_weight: torch.Tensor | None, eps: float):
    """:func:`post_norm_residual_ref` as one kernel launch (fp16/bf16/fp32)."""
    m, n = y.shape
    next_norm = norm_weight is not None
    x = torch.empty_like(y)
    normed = torch.empty_like(y) if next_norm else None
    rstd = torch.empty(m, dtype=torch.float32, device=y.device) if next_norm else None
    rstd_y = torch.empty(m, dtype=torch.float32, device=y.device)
    if m:  # without a next norm, its three pointers are stand-ins the kernel never reads or writes
        launch_kernel(_post_norm_residual_kernel, (m,), y, residual, post_weight,
                      norm_weight if next_norm else post_weight, x, normed if next_norm else x,
                      rstd if next_norm else rstd_y, rstd_y, n, eps, BLOCK=row_block(n), NEXT_NORM=next_norm)
    return x, normed, rstd, rstd_y


def post_norm_backward_ref(y: torch.Tensor, rstd_y: torch.Tensor, post_weight: torch.Tensor,
                           grad_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_y, grad_post_weight)`` of the module docstring, each in its tensor's dtype."""
    cd = stats_dtype(y.dtype)
    c = y.to(cd) * rstd_y.to(cd)[:, None]
    g, w = grad_x.to(cd), post_weight.to(cd)
    mean_c_w_g = (c * w * g).mean(dim=-1, keepdim=True)
    grad_y = rstd_y.to(cd)[:, None] * (w * g - c * mean_c_w_g)
    return grad_y.to(y.dtype), (g * c).sum(dim=0).to(post_weight.dtype)


@launcher
def post_norm_backward_triton(y: torch.Tensor, rstd_y: torch.Tensor, post_weight: torch.Tensor,
                              grad_x: torch.Tensor, rows: int = POST_NORM_BACKWARD_ROWS):
    """:func:`post_norm_backward_ref` as one launch plus the weight gradient's column sum."""
    m, n = y.shape
    if n > MAX_COLUMNS:
        raise ValueError(f"post_norm_backward: rows of {n} columns; the kernel holds a row of at most {MAX_COLUMNS}")
    grad_y = torch.empty_like(y)
    blocks = cdiv(m, rows)
    partial = torch.empty(max(blocks, 1), n, dtype=torch.float32, device=y.device)
    if m:
        block = next_power_of_2(n)
        launch_kernel(_post_norm_backward_kernel, (blocks,), y, rstd_y, post_weight, grad_x, grad_y, partial, m, n,
                      ROWS=rows, BLOCK=block, num_warps=backward_warps(block))
    else:
        partial.zero_()
    return grad_y, finish_col_sum_triton(partial, post_weight.dtype)


post_norm_residual = dispatcher(post_norm_residual_ref, post_norm_residual_triton)
post_norm_backward = dispatcher(post_norm_backward_ref, post_norm_backward_triton)
