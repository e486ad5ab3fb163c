"""Epilogue programs: one GEMM + a dataflow graph of epilogue primitives + declared outputs.

A program describes what happens to each fp32 accumulator tile of ``acc = op(A) @ op(B)`` *before* it
leaves the chip. It is plain, immutable data: expressions are frozen dataclasses that compare and
hash by value, so a program can key a compile cache and be printed as math.

Widths. Every tile-valued expression has a width relative to the GEMM's N: ``HALF`` (N/2 columns),
``FULL`` (N) or ``DOUBLE`` (2N). A tile of the accumulator with BN columns carries BN/2, BN or 2*BN
columns of such a value, so every value of one tile covers the same output rows and the same
column *pairs*. Adjacent-pair maps change width: SwiGLU and GeGLU take pairs (2j, 2j+1) to one column
(FULL -> HALF), their backwards take a pair plus one gradient column back to a pair (DOUBLE + FULL ->
DOUBLE), RoPE rotates each pair in place (width kept).

The primitives (each one module of :mod:`codagen.epilogue.primitives`, which holds everything about it;
:mod:`codagen.epilogue.core` holds the frame: widths, the GEMM, outputs and ``Program``):

====================  ==============================================================================
vector loads          ``RowVector`` [M] (rstd, targets, positions), ``ColVector`` [N*w] (norm weight,
                      frequencies), ``ScalarInput`` (a device tensor with one element, no host sync)
tile loads            ``TileInput`` [M, N*w] (residual, saved pre-activation)
elementwise maps      ``Unary`` (neg, exp, log, sigmoid, silu, tanh, square, rsqrt), ``Binary`` (add,
                      sub, mul, div, max, mask: a where b != 0, else 0), ``GeluTanh``, ``Constant``,
                      ``OneHot`` (column == index[row])
adjacent-pair maps    ``SwiGLU``, ``GeGLU`` (2 -> 1), ``SwiGLUBackward``, ``GeGLUBackward`` (pair + grad ->
                      pair), ``Rope`` (2 -> 2)
segmented reductions  ``SegmentSum``: per row, the sum over each aligned group of ``size`` adjacent
                      columns, broadcast back onto the group (per-head statistics: QK-norm); a
                      group never straddles a tile, so backends need tile widths that are multiples
                      of ``size``
partial reductions    ``RowPartial`` along N: one fp32 per (row, N-tile), sum or logsumexp;
                      ``ColPartial`` along M: one fp32 per (M-tile, column), sum
stores                ``Store`` main/extra outputs, each with its dtype; ``accumulate=True`` adds
                      into a caller-given tensor (gradient accumulation); ``QuantizedStore`` e4m3
                      with one fp32 scale per row and aligned group of columns (FP8 operands of a
                      GEMM with ``Gemm(k_scale_group=...)``)
====================  ==============================================================================

This module is the IR as it is imported: the frame and every registered primitive. Reductions are
tile-local partials; the library finishes them (``codagen.epilogue.finish``) with an
O(#tiles)-per-row pass, so no GEMM needs cross-tile communication and results are deterministic.
"""
from __future__ import annotations

from . import primitives
from .core import (
    PRIMITIVES,
    STORE_DTYPES,
    ColPartial,
    Expr,
    Gemm,
    Output,
    Program,
    ProgramError,
    QuantizedStore,
    RowPartial,
    Store,
    Width,
)
from .primitives.binary import BINARY_OPS
from .primitives.unary import UNARY_OPS

globals().update(PRIMITIVES)  # Accumulator, RowVector, ... and any primitive module added

__all__ = ["Width", "Gemm", "Expr", "Store", "QuantizedStore", "RowPartial", "ColPartial", "Output", "Program",
           "ProgramError",
           "UNARY_OPS", "BINARY_OPS", "STORE_DTYPES", "PRIMITIVES", *primitives.__all__]
