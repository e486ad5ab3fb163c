"""The fixed ``@triton.jit`` helpers of every generated persistent kernel, as real module-level code.

The generator copies their source into each generated module (:data:`SOURCE`), so a kernel's file is
complete on its own and its hash (the key of its tuned choices) covers the helpers it runs.

``prefetch_weight_rows`` serves programmatic dependent launch (``PDL``: :mod:`..dependent_launch`). A
decode GEMM launched that way starts while the kernel before it drains; until ``gdc_wait`` returns it writes
nothing and reads nothing, but it can bring its first tile's weight rows into L2 (a prefetch is a hint, and
L2 is coherent: it cannot read a stale value).
"""
import inspect

import triton
import triton.language as tl

__all__ = ["tile_coords", "column_halves", "cast_for_store", "merge_logsumexp", "prefetch_weight_rows",
           "SOURCE"]


@triton.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M consecutive M-tiles sweep the N-tiles together, so B tiles stay in L2."""
    tiles_per_group = GROUP_M * num_pid_n
    group = tile_id // tiles_per_group
    first_m = group * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group_m)
    pid_n = (tile_id % tiles_per_group) // group_m
    return pid_m, pid_n


@triton.jit
def column_halves(x, BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    """[BLOCK_M, 2 * HALF] -> its left and right [BLOCK_M, HALF] halves (a register relabelling)."""
    return tl.split(tl.permute(tl.reshape(x, (BLOCK_M, 2, HALF)), (0, 2, 1)))


@triton.jit
def cast_for_store(x, ptr, PORTABLE: tl.constexpr):
    """fp32 -> the output's dtype, rounding to nearest even.

    The Triton 3.6 interpreter truncates fp32 -> bf16; with ``PORTABLE`` (the interpreter, AMD: .targets) the fp32
    bits are rounded to bf16 precision first (add 0x7FFF plus the lowest kept bit, clear the low half), so a
    truncation is exact and a rounding conversion gives the same value.
    """
    if PORTABLE:
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def merge_logsumexp(max_a, sumexp_a, max_b, sumexp_b):
    """Merge two (max, sum exp(x - shift)) pieces of an online logsumexp (shift: max where finite, else 0,
    so infinite maxima give -inf or +inf, not nan)."""
    new_max = tl.maximum(max_a, max_b)
    shift = tl.where(tl.abs(new_max) == float("inf"), 0.0, new_max)
    return new_max, sumexp_a * tl.exp(max_a - shift) + sumexp_b * tl.exp(max_b - shift)


@triton.jit
def prefetch_weight_rows(b_ptr, off_n, first_k, N, K, BLOCK_N: tl.constexpr, PREFETCH_K: tl.constexpr):
    """Bring rows [off_n, off_n + BLOCK_N) x columns [first_k, first_k + PREFETCH_K) of a [N, K] weight into L2:
    one ``prefetch.global.L2`` per 128-byte line of 2-byte elements; nothing waits for them, no register is
    written. (Masked lines prefetch the weight's first line instead: a prefetch cannot fault, but stays in bounds.)"""
    rows = (off_n + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = first_k + tl.arange(0, PREFETCH_K // 64) * 64
    ok = (rows < N)[:, None] & (cols < K)[None, :]
    lines = tl.where(ok, b_ptr + rows[:, None] * K + cols[None, :], b_ptr)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [lines], dtype=tl.int32,
                              is_pure=False, pack=1)


#: the helpers' source, in the generated modules' order and spacing
SOURCE = "\n\n".join(inspect.getsource(helper.fn) for helper in (tile_coords, column_halves, cast_for_store,
                                                                     merge_logsumexp, prefetch_weight_rows))
