"""B1, the RoPE backward: rotate the QKV gradient back and take the RMSNorm backward's row statistic.

``grad_z[m, 2j:2j+2] = R(-positions[m] * frequencies[j]) grad_qkv[m, 2j:2j+2]`` (adjacent pairs) and
``mean_z_dz[m] = sum_k qkv[m, k] grad_qkv[m, k] / width``: a rotation preserves dot products, so the
statistic needs the RoPE outputs, never its inputs. With a bias inside the rotation (``qkv = rope(z + bias)``) the
norm's statistic is that of ``z`` alone: ``sum_k bias[k] grad_z[m, k]`` is subtracted. One program per row; the
gradient arrives as up to three column blocks (q, k, v as attention's backward wrote them), read in place.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from codagen.backends import reference

from .._checks import stats_dtype
from ._launch import cos_sin, dispatcher, launch_kernel, launcher, next_power_of_2, portable_math, tl, triton

__all__ = ["rope_backward", "rope_backward_ref", "rope_backward_triton", "rope_block"]

#: widest column step of B1: 4 warps x 8 bf16 = one 16-byte load per thread and tensor
ROPE_MAX_BLOCK = 1024


def rope_block(columns: int, limit: int = ROPE_MAX_BLOCK) -> int:
    """B1's columns per step: the power of two of ``columns``, at least 2 (a pair), at most ``limit``."""
    return min(max(next_power_of_2(columns), 2), limit)


@triton.jit
def _load_pairs(ptr, mask, HALF: tl.constexpr):
    """2 HALF contiguous values from ``ptr`` (``mask`` per column) as fp32 ``(even, odd)`` columns, split
    in registers: one contiguous load instead of two loads with stride 2."""
    values = tl.load(ptr + tl.arange(0, 2 * HALF), mask=mask, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(values, [HALF, 2]))


@triton.jit
def _store_pairs(ptr, even, odd, mask, HALF: tl.constexpr):
    """The inverse of :func:`_load_pairs`: ``even`` and ``odd`` interleaved back, one contiguous store."""
    values = tl.reshape(tl.join(even, odd), [2 * HALF])
    tl.store(ptr + tl.arange(0, 2 * HALF), values.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_backward_chunk(grad_ptr, values_ptr, grad_z_ptr, frequencies_ptr, bias_ptr, n_valid, position,
                         PRE_ROPE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                         PORTABLE: tl.constexpr):
    """BLOCK columns of a row from an even column on (``n_valid`` of them in bounds): rotate the gradient
    back and store it; return the lanes' share of ``sum z * dz``. ``values`` are the RoPE outputs
    (dotted with the incoming gradient: rotations preserve dot products) or, ``PRE_ROPE``, its inputs
    (dotted with the rotated-back gradient). ``HAS_BIAS``: the RoPE outputs rotated ``z + bias``, so the
    bias's share ``bias * dz`` is taken off."""
    mask = tl.arange(0, BLOCK) < n_valid
    g0, g1 = _load_pairs(grad_ptr, mask, BLOCK // 2)
    y0, y1 = _load_pairs(values_ptr, mask, BLOCK // 2)
    pair = tl.arange(0, BLOCK // 2)
    frequency = tl.load(frequencies_ptr + pair, mask=2 * pair < n_valid, other=0.0).to(tl.float32)
    cos, sin = cos_sin(position * frequency, PORTABLE)
    u0, u1 = g0 * cos + g1 * sin, g1 * cos - g0 * sin  # rotate by -theta
    _store_pairs(grad_z_ptr, u0, u1, mask, BLOCK // 2)
    if PRE_ROPE:
        return y0 * u0 + y1 * u1
    z_dz = y0 * g0 + y1 * g1
    if HAS_BIAS:
        b0, b1 = _load_pairs(bias_ptr, mask, BLOCK // 2)
        z_dz -= b0 * u0 + b1 * u1
    return z_dz


@triton.jit
def _rope_backward_columns(grad_ptr, values_ptr, grad_z_ptr, frequencies_ptr, bias_ptr, n_cols, position,
                           PRE_ROPE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                           PORTABLE: tl.constexpr):
    """A row's ``n_cols`` columns of one column block, BLOCK at a time (:func:`_rope_backward_chunk`);
    returns the lanes' share of their ``sum z * dz``."""
    z_dz = tl.zeros([BLOCK // 2], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        z_dz += _rope_backward_chunk(grad_ptr + start, values_ptr + start, grad_z_ptr + start,
                                     frequencies_ptr + start // 2, bias_ptr + start, n_cols - start, position,
                                     PRE_ROPE, HAS_BIAS, BLOCK, PORTABLE)
    return z_dz


@triton.jit
def _rope_backward_kernel(grad_q_ptr, grad_k_ptr, grad_v_ptr, q_stride, k_stride, v_stride, q_cols, k_cols,
                          v_cols, qkv_ptr, positions_ptr, frequencies_ptr, bias_ptr, grad_z_ptr, mean_z_dz_ptr,
                          inv_width, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PORTABLE: tl.constexpr):
    """One row per program. The gradient arrives as three column blocks (q, k, v, as attention's
    backward wrote them, each with its own row stride), read in place: no concatenation first."""
    row = tl.program_id(0).to(tl.int64)
    n = q_cols + k_cols + v_cols
    position = tl.load(positions_ptr + row).to(tl.float32)
    qkv_row, grad_z_row = qkv_ptr + row * n, grad_z_ptr + row * n
    z_dz = _rope_backward_columns(grad_q_ptr + row * q_stride, qkv_row, grad_z_row, frequencies_ptr, bias_ptr,
                                  q_cols, position, False, HAS_BIAS, BLOCK, PORTABLE)
    z_dz += _rope_backward_columns(grad_k_ptr + row * k_stride, qkv_row + q_cols, grad_z_row + q_cols,
                                   frequencies_ptr + q_cols // 2, bias_ptr + q_cols, k_cols, position, False,
                                   HAS_BIAS, BLOCK, PORTABLE)
    column = q_cols + k_cols
    z_dz += _rope_backward_columns(grad_v_ptr + row * v_stride, qkv_row + column, grad_z_row + column,
                                   frequencies_ptr + column // 2, bias_ptr + column, v_cols, position, False,
                                   HAS_BIAS, BLOCK, PORTABLE)
    tl.store(mean_z_dz_ptr + row, tl.sum(z_dz, axis=0) * inv_width)


def _cat_columns(grad_blocks) -> torch.Tensor:
    return grad_blocks[0] if len(grad_blocks) == 1 else torch.cat(tuple(grad_blocks), dim=1)


def _three_blocks(grad_blocks, widths: tuple[int, int, int] | None = None) -> list[torch.Tensor]:
    """The gradient's column blocks as exactly three [M, cols] views with unit column stride: ``widths``
    splits a single block (the QK-norm kernel needs q | k | v); a plain RoPE backward pads with empty ones."""
    blocks = list(grad_blocks)
    if len(blocks) == 1 and widths is not None:
        blocks = list(blocks[0].split(widths, dim=1))
    blocks += [blocks[0][:, :0]] * (3 - len(blocks))
    return [b if b.stride(1) == 1 or b.shape[1] <= 1 else b.contiguous() for b in blocks]


def rope_backward_ref(grad_blocks: Sequence[torch.Tensor], qkv: torch.Tensor, positions: torch.Tensor,
                      frequencies: torch.Tensor, width: int,
                      bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_z = rotate(grad_qkv, -positions[m] * frequencies[j])``, ``mean_z_dz[m] = sum_k qkv grad_qkv / width``
    (minus ``sum_k bias grad_z / width`` with ``bias``: ``qkv = rope(z + bias)``).

    ``grad_blocks``: ``grad_qkv`` as its column blocks, left to right: ``[grad_qkv]``, or
    ``[grad_q, grad_k, grad_v]`` as attention's backward wrote them (the kernel reads them in place).
    ``sum_k z dz = sum_k qkv grad_qkv`` because a rotation preserves dot products, so the pre-RoPE
    activations are never needed. ``width`` is the normalized dimension d (x's width), not N.
    """
    grad_qkv = _cat_columns(grad_blocks)
    cd = stats_dtype(grad_qkv.dtype)
    grad = grad_qkv.to(cd)
    theta = positions.to(cd)[:, None] * frequencies.to(cd)[None, :]
    grad_z = reference.rope_ref(grad, -theta)
    z_dz = (qkv.to(cd) * grad).sum(dim=-1)
    if bias is not None:
        z_dz = z_dz - (bias.to(cd) * grad_z).sum(dim=-1)
    return grad_z.to(grad_qkv.dtype), z_dz / width


@launcher
def rope_backward_triton(grad_blocks: Sequence[torch.Tensor], qkv: torch.Tensor, positions: torch.Tensor,
                         frequencies: torch.Tensor, width: int, bias: torch.Tensor | None = None, *,
                         launch: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_backward_ref` as one kernel launch (fp16/bf16/fp32); up to three column blocks, each an
    even number of columns wide (a pair never straddles two blocks). ``launch``: ``(columns per step,
    warps)`` instead of :func:`rope_block` of the widest block and 4 warps (``bench/rope_backward.py``)."""
    m, n = qkv.shape
    if not 1 <= len(grad_blocks) <= 3 or any(b.shape[1] % 2 for b in grad_blocks):
        raise ValueError(f"grad_blocks: expected 1 to 3 column blocks of even widths, got widths "
                         f"{[b.shape[1] for b in grad_blocks]}")
    (grad_q, grad_k, grad_v) = blocks = _three_blocks(grad_blocks)
    qkv = qkv.contiguous()  # the kernel steps its rows by N
    grad_z = torch.empty(m, n, dtype=grad_q.dtype, device=qkv.device)
    mean_z_dz = torch.empty(m, dtype=torch.float32, device=qkv.device)
    block, warps = launch or (rope_block(max(b.shape[1] for b in blocks)), 4)
    if m:
        launch_kernel(_rope_backward_kernel, (m,), grad_q, grad_k, grad_v, *(b.stride(0) for b in blocks),
                      *(b.shape[1] for b in blocks), qkv, positions, frequencies,
                      qkv if bias is None else bias.contiguous(), grad_z, mean_z_dz, 1.0 / width,
                      HAS_BIAS=bias is not None, BLOCK=block, PORTABLE=portable_math(), num_warps=warps)
    return grad_z, mean_z_dz


rope_backward = dispatcher(rope_backward_ref, rope_backward_triton, tensor_arg=1)
