"""Rowwise e4m3 quantization: the separate kernel an FP8 GEMM's operand needs before a quantizing epilogue does it.

One program per row of ``x`` [M, K] (bf16, fp16 or fp32), the row read twice::

    amax     = max(max_k |x[m, k]|, 1e-12)
    scale[m] = amax / 448,   q[m, k] = e4m3(clamp(x[m, k] * (448 / amax), -448, 448))

448 is e4m3's largest finite value, so each row's largest element lands on it (torchao's rowwise recipe);
``q * scale[:, None]`` is ``x`` dequantized, and ``scale`` is the GEMM epilogue's ``a_scale`` or ``b_scale``
(:meth:`codagen.epilogue.core.Program.with_rowwise_scales`). Both divisions are correctly rounded (``div_rn``).

The cast rounds to nearest even by bit arithmetic on the fp32 value (``codagen.backends.triton.e4m3``, shared with the
quantizing epilogue), not by Triton's fp8 conversion, which Triton 3.6's interpreter gets wrong. The few integer
operations per element are free in a kernel that reads 2 bytes and writes 1 per element. Rowwise is the one-group
case of the quantizing epilogue's groups (``codagen.epilogue.core.quantize_groups_ref``).

:func:`quantize_groups` is the blockwise recipe's: one scale per group of 128 columns, of 128 rows, or per 128 x 128
block (a weight), one program per tile of groups. Where a GEMM's epilogue writes the operand (``QuantizedStore``),
no such kernel runs; the first layer's input and the weights have no epilogue before them.
"""
from __future__ import annotations

import torch

from codagen.epilogue.core import AMAX_FLOOR, E4M3_MAX, is_group_size
from codagen.epilogue.core import quantize_groups_ref as quantize_in_groups

from ._launch import dispatcher, e4m3_code, launch_kernel, launcher, row_block, tl, triton

__all__ = ["quantize_rowwise", "quantize_rowwise_ref", "quantize_rowwise_triton", "quantize_groups",
           "quantize_groups_ref", "quantize_groups_triton", "GROUPINGS", "E4M3_MAX", "AMAX_FLOOR"]

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
    q, scale = quantize_in_groups(x.float(), 1, k)
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


#: the groups :func:`quantize_groups` takes: of columns in a row, of rows in a column, square blocks
GROUPINGS = ("n", "m", "blocks")


@triton.jit
def _quantize_tiles_kernel(x_ptr, q_ptr, scale_ptr, n_rows, n_cols, scale_rows_total, scale_cols,
                           ROW_GROUPS: tl.constexpr, GROUP_ROWS: tl.constexpr, COL_GROUPS: tl.constexpr,
                           GROUP_COLS: tl.constexpr):
    """One tile of ``x`` per program, ROW_GROUPS x COL_GROUPS groups of [GROUP_ROWS, GROUP_COLS] (a group is a row's
    columns, a column's rows or a square block): each group's amax over its valid elements, its scale, its codes."""
    rows = tl.program_id(0) * (ROW_GROUPS * GROUP_ROWS) + tl.arange(0, ROW_GROUPS * GROUP_ROWS)
    cols = tl.program_id(1) * (COL_GROUPS * GROUP_COLS) + tl.arange(0, COL_GROUPS * GROUP_COLS)
    ok = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    groups = tl.reshape(tl.abs(x), (ROW_GROUPS, GROUP_ROWS, COL_GROUPS, GROUP_COLS))
    amax = tl.maximum(tl.max(tl.max(groups, axis=3), axis=1), 1e-12)  # [ROW_GROUPS, COL_GROUPS]; AMAX_FLOOR
    inv_scale = tl.reshape(tl.broadcast_to(tl.math.div_rn(448.0, amax)[:, None, :, None],
                                           (ROW_GROUPS, GROUP_ROWS, COL_GROUPS, GROUP_COLS)),
                           (ROW_GROUPS * GROUP_ROWS, COL_GROUPS * GROUP_COLS))
    v = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)  # E4M3_MAX
    tl.store(q_ptr + offsets, e4m3_code(v).to(tl.uint8), mask=ok)
    scale_rows = tl.program_id(0) * ROW_GROUPS + tl.arange(0, ROW_GROUPS)
    scale_cols_here = tl.program_id(1) * COL_GROUPS + tl.arange(0, COL_GROUPS)
    scale_ok = (scale_rows < scale_rows_total)[:, None] & (scale_cols_here < scale_cols)[None, :]
    tl.store(scale_ptr + scale_rows.to(tl.int64)[:, None] * scale_cols + scale_cols_here[None, :],
             tl.math.div_rn(amax, 448.0), mask=scale_ok)


def _grouping(x: torch.Tensor, group: int, along: str) -> tuple[int, int]:
    """(rows, columns) of one group of ``along`` for ``x`` [M, K]; raises on what the quantizers do not take."""
    if along not in GROUPINGS:
        raise ValueError(f"quantize_groups: along must be one of {GROUPINGS}, got {along!r}")
    if not is_group_size(group):
        raise ValueError(f"quantize_groups: group must be a power of two >= 16, got {group!r}")
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"quantize_groups: x must be a 2-D floating-point matrix, got shape {tuple(x.shape)}, "
                         f"{x.dtype}")
    return {"n": (1, group), "m": (group, 1), "blocks": (group, group)}[along]


def quantize_groups_ref(x: torch.Tensor, group: int = 128, along: str = "n") -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``x`` [M, K] in e4m3 with one fp32 scale per group, each group's amax onto 448 (the math
    of the module docstring, per group; a last, partial group takes the elements there are):

    - ``along="n"``: groups of ``group`` columns in a row, ``scale`` [M, cdiv(K, group)] (an activation operand of
      ``Gemm(k_scale_group=group)``, as a ``QuantizedStore`` writes it);
    - ``"m"``: groups of ``group`` rows in a column, ``scale`` [cdiv(M, group), K] (a weight gradient's operand);
    - ``"blocks"``: ``group x group`` blocks, ``scale`` [cdiv(M, group), cdiv(K, group)] (a weight, for
      ``b_scale_block``: the same blocks serve ``x @ W^T`` and ``dY @ W``)."""
    return quantize_in_groups(x.float(), *_grouping(x, group, along))


@launcher
def quantize_groups_triton(x: torch.Tensor, group: int = 128, along: str = "n") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_groups_ref` as one kernel launch (bf16/fp16/fp32 ``x``), bitwise."""
    group_rows, group_cols = _grouping(x, group, along)
    m, k = x.shape
    x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(-(-m // group_rows), -(-k // group_cols), dtype=torch.float32, device=x.device)
    if m and k:
        # a tile of 32 x group, group x 32 or group x group elements: 32 groups of a row's or a column's, one block
        row_groups, col_groups = {"n": (32, 1), "m": (1, 32), "blocks": (1, 1)}[along]
        tile_rows, tile_cols = row_groups * group_rows, col_groups * group_cols
        grid = (-(-m // tile_rows), -(-k // tile_cols))
        warps = max(4, min(16, tile_rows * tile_cols // 1024))  # about 32 elements a thread: the tile in registers
        launch_kernel(_quantize_tiles_kernel, grid, x, q.view(torch.uint8), scale, m, k, *scale.shape,
                      ROW_GROUPS=row_groups, GROUP_ROWS=group_rows, COL_GROUPS=col_groups, GROUP_COLS=group_cols,
                      num_warps=warps)
    return q, scale


quantize_groups = dispatcher(quantize_groups_ref, quantize_groups_triton)
