"""Rowwise e4m3 quantization: the separate kernel an FP8 GEMM's operand needs before a quantizing epilogue does it.

One program per row of ``x`` [M, K] (bf16, fp16 or fp32), the row read twice::

    amax     = max(max_k |x[m, k]|, 1e-12)
    scale[m] = amax / 448,   q[m, k] = e4m3(clamp(x[m, k] * (448 / amax), -448, 448))

448 is e4m3's largest finite value, so each row's largest element lands on it (torchao's rowwise recipe);
``q * scale[:, None]`` is ``x`` dequantized, and ``scale`` is the GEMM epilogue's ``a_scale`` or ``b_scale``
(:meth:`codagen.epilogue.core.Program.with_rowwise_scales`). Both divisions are correctly rounded (``div_rn``).

The cast rounds to nearest even by bit arithmetic on the fp32 value (``device_math.e4m3_code``, shared with the
quantizing epilogue), not by Triton's fp8 conversion, which Triton 3.6's interpreter gets wrong. The few integer
operations per element are free in a kernel that reads 2 bytes and writes 1 per element. Rowwise is the one-group
case of the quantizing epilogue's groups (``codagen.epilogue.core.quantize_groups_ref``).
"""
from __future__ import annotations

import torch

from codagen.epilogue.core import AMAX_FLOOR, E4M3_MAX, quantize_groups_ref

from ._launch import dispatcher, e4m3_code, launch_kernel, launcher, row_block, tl, triton

__all__ = ["quantize_rowwise", "quantize_rowwise_ref", "quantize_rowwise_triton", "E4M3_MAX", "AMAX_FLOOR"]

# the kernel repeats E4M3_MAX and AMAX_FLOOR as literals (a Triton global must be a ``tl.constexpr``, which would
# need Triton at import)


@triton.jit
def _quantize_rowwise_kernel(x_ptr, q_ptr, scale_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * n_cols, q_ptr + row * n_cols
    lane_amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        lane_amax = tl.maximum(lane_amax, tl.abs(x))
    amax = tl.maximum(tl.max(lane_amax, axis=0), 1e-12)  # AMAX_FLOOR
    inv_scale = tl.math.div_rn(448.0, amax)  # E4M3_MAX
    tl.store(scale_ptr + row, tl.math.div_rn(amax, 448.0))
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)
        tl.store(q_row + cols, e4m3_code(v).to(tl.uint8), mask=mask)


def quantize_rowwise_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of the module docstring: ``q`` float8_e4m3fn [M, K], ``scale`` fp32 [M]; the divisions in
    float64, so both are correctly rounded to fp32 (as ``div_rn`` is)."""
    m, k = x.shape
    if k == 0:  # no columns: amax is the floor
        return torch.empty(m, 0, dtype=torch.float8_e4m3fn, device=x.device), torch.full(
            (m,), AMAX_FLOOR / E4M3_MAX, dtype=torch.float32, device=x.device)
    q, scale = quantize_groups_ref(x.float(), k)
    return q, scale[:, 0]


@launcher
def quantize_rowwise_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rowwise_ref` as one kernel launch (bf16/fp16/fp32 ``x``), bitwise."""
    m, n = x.shape
    x = x.contiguous()  # the kernel steps its rows by K
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        launch_kernel(_quantize_rowwise_kernel, (m,), x, q.view(torch.uint8), scale, n, BLOCK=row_block(n))
    return q, scale


quantize_rowwise = dispatcher(quantize_rowwise_ref, quantize_rowwise_triton)
