"""Rowwise e4m3 quantization: the separate kernel an FP8 GEMM's operand needs before a quantizing epilogue does it.

One program per row of ``x`` [M, K] (bf16, fp16 or fp32), the row read twice::

    amax     = max(max_k |x[m, k]|, 1e-12)
    scale[m] = amax / 448,   q[m, k] = e4m3(clamp(x[m, k] * (448 / amax), -448, 448))

448 is e4m3's largest finite value, so each row's largest element lands on it (torchao's rowwise recipe);
``q * scale[:, None]`` is ``x`` dequantized, and ``scale`` is the GEMM epilogue's ``a_scale`` or ``b_scale``
(:meth:`codagen.epilogue.core.Program.with_rowwise_scales`). Both divisions are correctly rounded (``div_rn``).

The cast rounds to nearest even by bit arithmetic on the fp32 value (:func:`_e4m3_code`), not by Triton's fp8
conversion: Triton 3.6's interpreter rounds some values a binade low there (``docs/notes/fp8-mainloop-compile.md``),
and the kernel must compute on CPU what it computes on the GPU. The few integer operations per element are free in a
kernel that reads 2 bytes and writes 1 per element.
"""
from __future__ import annotations

import torch

from ._launch import dispatcher, launch_kernel, launcher, row_block, tl, triton

__all__ = ["quantize_rowwise", "quantize_rowwise_ref", "quantize_rowwise_triton", "E4M3_MAX", "AMAX_FLOOR"]

#: e4m3's largest finite value, and the floor of a row's amax (an all-zero row gets a finite scale); the kernel
#: repeats both as literals (a Triton global must be a ``tl.constexpr``, which would need Triton at import)
E4M3_MAX, AMAX_FLOOR = 448.0, 1e-12


@triton.jit
def _e4m3_code(v):
    """The e4m3fn code (in an int32) of fp32 ``v`` in [-448, 448], rounded to nearest even.

    Normal results (|v| >= 2^-6): the code is ``(exponent + 7) << 3 | top 3 mantissa bits``, plus one where the 20
    dropped bits round up; a carry out of the mantissa steps the exponent, as adding 1 to the code does.
    Subnormal ones: the code is ``|v| / 2^-9`` rounded to nearest even, which adding and subtracting 2^23 does
    exactly in fp32 (``|v| * 512 < 8``), and code 8 is the smallest normal, 2^-6."""
    magnitude = tl.abs(v)
    bits = magnitude.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 127
    mantissa = bits & 0x7FFFFF
    top = mantissa >> 20
    dropped = mantissa & 0xFFFFF
    round_up = (dropped > 0x80000) | ((dropped == 0x80000) & ((top & 1) == 1))
    normal = ((exponent + 7) << 3) + top + round_up.to(tl.int32)
    subnormal = ((magnitude * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(magnitude < 0.015625, subnormal, normal)
    return tl.where(v < 0, code | 0x80, code)


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
        tl.store(q_row + cols, _e4m3_code(v).to(tl.uint8), mask=mask)


def quantize_rowwise_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of the module docstring: ``q`` float8_e4m3fn [M, K], ``scale`` fp32 [M]; the divisions in
    float64, so both are correctly rounded to fp32 (as ``div_rn`` is)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1).clamp(min=AMAX_FLOOR) if x.shape[1] else xf.new_full((x.shape[0],), AMAX_FLOOR)
    inv_scale = (E4M3_MAX / amax.double()).float()
    scale = (amax.double() / E4M3_MAX).float()
    return (xf * inv_scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


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
