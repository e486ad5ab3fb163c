"""B1 with QK-norm: the RoPE backward plus the per-head RMSNorm backward of the Q and K heads.

On each Q/K head ``h`` (``head_dim`` columns, weight ``gamma``), with ``g`` the gradient rotated back::

    rho_h  = rsqrt(mean(z_h^2) + eps),   zhat_h = z_h * rho_h
    dz_h   = rho_h * (gamma * g_h - zhat_h * mean(zhat_h * gamma * g_h))
    grad_gamma = sum over rows and heads of that kind of g_h * zhat_h

V columns pass ``dz = g``; ``mean_z_dz[m] = sum_k z dz / width``. The weight gradients leave the kernel
as per-row-block partials, summed by :func:`codagen.ops.kernels.finish.finish_col_sum_triton` (no atomics).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from codagen.backends import reference

from .._checks import stats_dtype
from ..layouts import kv_heads_of
from ._launch import cos_sin, dispatcher, launch_kernel, launcher, next_power_of_2, portable_math, tl, triton
from .finish import finish_col_sum_triton
from .rope import _cat_columns, _load_pairs, _rope_backward_columns, _store_pairs, _three_blocks, rope_block

__all__ = ["rope_qk_norm_backward", "rope_qk_norm_backward_ref", "rope_qk_norm_backward_triton", "QK_NORM_LAUNCH"]

#: rows per program (its norm-weight gradient partials are [cdiv(M, rows), 2 head_dim]), columns per step
#: (whole heads), warps (``bench/rope_backward.py --qk-norm``)
QK_NORM_LAUNCH = (16, 1024, 4)


@triton.jit
def _qk_norm_heads_backward(grad_ptr, preact_ptr, grad_z_ptr, frequencies_ptr, gamma_even, gamma_odd, n_heads,
                            head_dim, position, row_ok, eps, HEADS: tl.constexpr, HEAD_BLOCK: tl.constexpr,
                            PORTABLE: tl.constexpr):
    """A row's ``n_heads`` heads of one kind (Q or K), HEADS at a time as one ``[HEADS, 2 HEAD_BLOCK]``
    tile, loaded contiguously, pairs split in registers: rotate the gradient back, QK-norm backward
    per head, store ``dz``. Returns the row's ``z dz`` and its terms of the norm weight's gradient
    (even and odd columns) unreduced across heads: the caller sums them once per row and once per
    program, not once per step (a sum across heads crosses warps). Masked lanes load 0 and add 0."""
    head = tl.arange(0, HEADS)[:, None]
    col = tl.arange(0, 2 * HEAD_BLOCK)[None, :]
    pair = tl.arange(0, HEAD_BLOCK)[None, :]
    half_head = head_dim // 2
    inv_head_dim = 1.0 / head_dim
    z_dz = tl.zeros([HEADS, HEAD_BLOCK], dtype=tl.float32)
    grad_gamma_even = tl.zeros([HEADS, HEAD_BLOCK], dtype=tl.float32)
    grad_gamma_odd = tl.zeros([HEADS, HEAD_BLOCK], dtype=tl.float32)
    for first in range(0, n_heads, HEADS):
        in_step = (first + head < n_heads) & row_ok
        mask = in_step & (col < head_dim)
        at = (first + head) * head_dim + col
        g = tl.load(grad_ptr + at, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(preact_ptr + at, mask=mask, other=0.0).to(tl.float32)
        g0, g1 = tl.split(tl.reshape(g, [HEADS, HEAD_BLOCK, 2]))
        z0, z1 = tl.split(tl.reshape(z, [HEADS, HEAD_BLOCK, 2]))
        frequency = tl.load(frequencies_ptr + (first + head) * half_head + pair,
                            mask=in_step & (pair < half_head), other=0.0).to(tl.float32)
        cos, sin = cos_sin(position * frequency, PORTABLE)
        u0 = g0 * cos + g1 * sin  # rotated back by -theta: the gradient of the QK-norm output
        u1 = g1 * cos - g0 * sin
        rho = (1.0 / tl.sqrt(tl.sum(z0 * z0 + z1 * z1, axis=1) * inv_head_dim + eps))[:, None]
        zhat0, zhat1 = z0 * rho, z1 * rho
        gg0, gg1 = gamma_even[None, :] * u0, gamma_odd[None, :] * u1
        mean_zhat_gg = (tl.sum(zhat0 * gg0 + zhat1 * gg1, axis=1) * inv_head_dim)[:, None]
        dz0 = rho * (gg0 - zhat0 * mean_zhat_gg)
        dz1 = rho * (gg1 - zhat1 * mean_zhat_gg)
        dz = tl.reshape(tl.join(dz0, dz1), [HEADS, 2 * HEAD_BLOCK])
        tl.store(grad_z_ptr + at, dz.to(grad_z_ptr.dtype.element_ty), mask=mask)
        z_dz += z0 * dz0 + z1 * dz1
        grad_gamma_even += u0 * zhat0
        grad_gamma_odd += u1 * zhat1
    return z_dz, grad_gamma_even, grad_gamma_odd


@triton.jit
def _rope_qk_norm_backward_kernel(grad_q_ptr, grad_k_ptr, grad_v_ptr, q_stride, k_stride, v_stride, preact_ptr,
                                  positions_ptr, frequencies_ptr, q_norm_weight_ptr, k_norm_weight_ptr,
                                  grad_z_ptr, mean_z_dz_ptr, partial_grad_norm_weight_ptr,
                                  n_rows, n_pairs, head_dim, num_heads, num_kv_heads, eps, inv_width,
                                  ROWS: tl.constexpr, HEADS: tl.constexpr, HEAD_BLOCK: tl.constexpr,
                                  BLOCK: tl.constexpr, PORTABLE: tl.constexpr):
    """ROWS rows per program; each row's Q heads, then K heads (:func:`_qk_norm_heads_backward`), then
    its V columns BLOCK at a time (rotated back only). The gradient arrives as the q, k and v column
    blocks, read in place. Norm-weight gradients accumulate over the program's rows in registers and
    leave as one partial row per program (no atomics)."""
    block = tl.program_id(0)
    in_head_cols = tl.arange(0, 2 * HEAD_BLOCK) < head_dim
    q_gamma_even, q_gamma_odd = _load_pairs(q_norm_weight_ptr, in_head_cols, HEAD_BLOCK)
    k_gamma_even, k_gamma_odd = _load_pairs(k_norm_weight_ptr, in_head_cols, HEAD_BLOCK)
    grad_q_even = tl.zeros([HEADS, HEAD_BLOCK], dtype=tl.float32)
    grad_q_odd = tl.zeros([HEADS, HEAD_BLOCK], dtype=tl.float32)
    grad_k_even = tl.zeros([HEADS, HEAD_BLOCK], dtype=tl.float32)
    grad_k_odd = tl.zeros([HEADS, HEAD_BLOCK], dtype=tl.float32)
    q_cols = num_heads * head_dim
    qk_cols = q_cols + num_kv_heads * head_dim
    for r in range(ROWS):
        row = block * ROWS + r
        row_ok = row < n_rows
        preact_row = preact_ptr + row.to(tl.int64) * 2 * n_pairs
        grad_z_row = grad_z_ptr + row.to(tl.int64) * 2 * n_pairs
        position = tl.load(positions_ptr + row, mask=row_ok, other=0.0).to(tl.float32)
        q_z_dz, q_even, q_odd = _qk_norm_heads_backward(
            grad_q_ptr + row.to(tl.int64) * q_stride, preact_row, grad_z_row, frequencies_ptr, q_gamma_even,
            q_gamma_odd, num_heads, head_dim, position, row_ok, eps, HEADS, HEAD_BLOCK, PORTABLE)
        k_z_dz, k_even, k_odd = _qk_norm_heads_backward(
            grad_k_ptr + row.to(tl.int64) * k_stride, preact_row + q_cols, grad_z_row + q_cols,
            frequencies_ptr + q_cols // 2, k_gamma_even, k_gamma_odd, num_kv_heads, head_dim, position, row_ok,
            eps, HEADS, HEAD_BLOCK, PORTABLE)
        grad_q_even += q_even
        grad_q_odd += q_odd
        grad_k_even += k_even
        grad_k_odd += k_odd
        v_dz = _rope_backward_columns(  # V: rotated back only; none of a row past the end
            grad_v_ptr + row.to(tl.int64) * v_stride, preact_row + qk_cols, grad_z_row + qk_cols,
            frequencies_ptr + qk_cols // 2, preact_row, tl.where(row_ok, 2 * n_pairs - qk_cols, 0), position, True,
            False, BLOCK, PORTABLE)
        row_z_dz = tl.sum(tl.sum(q_z_dz + k_z_dz, axis=1), axis=0) + tl.sum(v_dz, axis=0)
        tl.store(mean_z_dz_ptr + row, row_z_dz * inv_width, mask=row_ok)
    # partial row of this program: [q_norm grad | k_norm grad], each head_dim wide
    partial = partial_grad_norm_weight_ptr + block.to(tl.int64) * 2 * head_dim
    _store_pairs(partial, tl.sum(grad_q_even, axis=0), tl.sum(grad_q_odd, axis=0), in_head_cols, HEAD_BLOCK)
    _store_pairs(partial + head_dim, tl.sum(grad_k_even, axis=0), tl.sum(grad_k_odd, axis=0), in_head_cols,
                 HEAD_BLOCK)


def rope_qk_norm_backward_ref(grad_blocks: Sequence[torch.Tensor], preact: torch.Tensor, positions: torch.Tensor,
                              frequencies: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                              num_heads: int, eps: float, width: int):
    """B1 of ``qkv = rope(qk_norm(z))``, columns ``[Q heads | K heads | V heads]`` (``preact = z``).

    ``g = rotate(grad_qkv, -theta)`` is the gradient of the QK-norm output. On each Q/K head ``h``
    (``head_dim = hd`` columns, weight ``gamma`` = ``q_norm_weight`` or ``k_norm_weight``, pair order)::

        rho_h  = rsqrt(mean(z_h^2) + eps),   zhat_h = z_h * rho_h
        dz_h   = rho_h * (gamma * g_h - zhat_h * mean(zhat_h * gamma * g_h))
        grad_gamma = sum over rows and heads of that kind of g_h * zhat_h

    ``grad_blocks``: ``grad_qkv`` whole (``[grad_qkv]``) or as ``[grad_q, grad_k, grad_v]``.
    V columns: ``dz = g``. ``mean_z_dz[m] = sum_k z dz / width`` with the pre-QK-norm ``z`` (the input
    RMSNorm's statistic). Returns ``(grad_z, mean_z_dz, grad_q_norm_weight, grad_k_norm_weight)``;
    statistics and weight gradients in float32 (float64 for float64 inputs).
    """
    grad_qkv = _cat_columns(grad_blocks)
    cd = stats_dtype(grad_qkv.dtype)
    m, n = grad_qkv.shape
    hd = q_norm_weight.shape[0]
    num_kv_heads = kv_heads_of(n, hd, num_heads)
    qk_cols = (num_heads + num_kv_heads) * hd
    theta = positions.to(cd)[:, None] * frequencies.to(cd)[None, :]
    g = reference.rope_ref(grad_qkv.to(cd), -theta)
    z = preact.to(cd)
    heads = (m, num_heads + num_kv_heads, hd)  # explicit: M may be 0
    z_heads, g_heads = z[:, :qk_cols].reshape(heads), g[:, :qk_cols].reshape(heads)
    gamma = torch.cat((q_norm_weight.to(cd).expand(num_heads, hd), k_norm_weight.to(cd).expand(num_kv_heads, hd)))
    rho = torch.rsqrt(z_heads.square().mean(-1, keepdim=True) + eps)
    zhat = z_heads * rho
    gamma_g = gamma * g_heads
    dz_heads = rho * (gamma_g - zhat * (zhat * gamma_g).mean(-1, keepdim=True))
    grad_z = torch.cat((dz_heads.reshape(m, qk_cols), g[:, qk_cols:]), dim=1)
    mean_z_dz = (z * grad_z).sum(-1) / width
    grad_gamma = g_heads * zhat
    return (grad_z.to(grad_qkv.dtype), mean_z_dz, grad_gamma[:, :num_heads].sum((0, 1)),
            grad_gamma[:, num_heads:].sum((0, 1)))


@launcher
def rope_qk_norm_backward_triton(grad_blocks: Sequence[torch.Tensor], preact: torch.Tensor, positions: torch.Tensor,
                                 frequencies: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                                 num_heads: int, eps: float, width: int, *,
                                 launch: tuple[int, int, int] = QK_NORM_LAUNCH):
    """:func:`rope_qk_norm_backward_ref` as one kernel launch (fp16/bf16/fp32) + the finishing sum of the
    per-program norm-weight gradient partials ``[cdiv(M, rows per program), 2 head_dim]``. ``launch``:
    (rows per program, columns per step, warps), :data:`QK_NORM_LAUNCH` by default."""
    m, n = preact.shape
    hd = q_norm_weight.shape[0]
    num_kv_heads = kv_heads_of(n, hd, num_heads)
    widths = (num_heads * hd, num_kv_heads * hd, num_kv_heads * hd)
    if [b.shape[1] for b in grad_blocks] not in ([n], list(widths)):
        raise ValueError(f"grad_blocks: expected [grad_qkv] ({n} columns) or [grad_q, grad_k, grad_v] ({widths} "
                         f"columns), got widths {[b.shape[1] for b in grad_blocks]}")
    (grad_q, grad_k, grad_v) = grads = _three_blocks(grad_blocks, widths)
    preact = preact.contiguous()  # the kernel steps its rows by N
    grad_z = torch.empty(m, n, dtype=grad_q.dtype, device=preact.device)
    mean_z_dz = torch.empty(m, dtype=torch.float32, device=preact.device)
    rows, step, warps = launch
    blocks = -(-m // rows)
    partial = torch.empty(blocks, 2 * hd, dtype=torch.float32, device=preact.device)
    if m:
        head_block = next_power_of_2(hd // 2)
        launch_kernel(_rope_qk_norm_backward_kernel, (blocks,),
            grad_q, grad_k, grad_v, *(g.stride(0) for g in grads), preact, positions, frequencies, q_norm_weight,
            k_norm_weight, grad_z, mean_z_dz, partial,
            m, n // 2, hd, num_heads, num_kv_heads, eps, 1.0 / width,
            ROWS=rows, HEADS=max(1, step // (2 * head_block)), HEAD_BLOCK=head_block,
            BLOCK=rope_block(widths[2], step), PORTABLE=portable_math(), num_warps=warps)
    grad_norm_weight = finish_col_sum_triton(partial, torch.float32)
    return grad_z, mean_z_dz, grad_norm_weight[:hd], grad_norm_weight[hd:]


rope_qk_norm_backward = dispatcher(rope_qk_norm_backward_ref, rope_qk_norm_backward_triton, tensor_arg=1)
