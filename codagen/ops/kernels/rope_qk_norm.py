"""B1 with QK-norm: the RoPE backward plus the RMSNorm backward of the Q and K norm groups.

A norm group is a head (``head_dim`` columns) or, for QK-norm over the whole projection (OLMo 2), all of Q or all
of K (:func:`codagen.ops.kernels.qk_norm_rope.norm_groups`). On each Q/K group ``h`` (``w`` columns, weight
``gamma``), with ``g`` the gradient rotated back::

    rho_h  = rsqrt(mean(z_h^2) + eps),   zhat_h = z_h * rho_h
    dz_h   = rho_h * (gamma * g_h - zhat_h * mean(zhat_h * gamma * g_h))
    grad_gamma = sum over rows and groups of that kind of g_h * zhat_h

V columns pass ``dz = g``; ``mean_z_dz[m] = sum_k z dz / width``. The weight gradients leave the kernel
as per-row-block partials, summed by :func:`codagen.ops.kernels.finish.finish_col_sum_triton` (no atomics).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from codagen.backends import reference

from .._checks import stats_dtype
from ._launch import cos_sin, dispatcher, launch_kernel, launcher, next_power_of_2, portable_math, tl, triton
from .finish import finish_col_sum_triton
from .qk_norm_rope import norm_groups, row_kernel_warps
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
                                  n_rows, n_pairs, q_width, k_width, q_groups, k_groups, eps, inv_width,
                                  ROWS: tl.constexpr, Q_HEADS: tl.constexpr, Q_BLOCK: tl.constexpr,
                                  K_HEADS: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                                  PORTABLE: tl.constexpr):
    """ROWS rows per program; each row's Q groups, then K groups (:func:`_qk_norm_heads_backward`), then
    its V columns BLOCK at a time (rotated back only). The gradient arrives as the q, k and v column
    blocks, read in place. Norm-weight gradients accumulate over the program's rows in registers and
    leave as one partial row per program (no atomics)."""
    block = tl.program_id(0)
    in_q_cols = tl.arange(0, 2 * Q_BLOCK) < q_width
    in_k_cols = tl.arange(0, 2 * K_BLOCK) < k_width
    q_gamma_even, q_gamma_odd = _load_pairs(q_norm_weight_ptr, in_q_cols, Q_BLOCK)
    k_gamma_even, k_gamma_odd = _load_pairs(k_norm_weight_ptr, in_k_cols, K_BLOCK)
    grad_q_even = tl.zeros([Q_HEADS, Q_BLOCK], dtype=tl.float32)
    grad_q_odd = tl.zeros([Q_HEADS, Q_BLOCK], dtype=tl.float32)
    grad_k_even = tl.zeros([K_HEADS, K_BLOCK], dtype=tl.float32)
    grad_k_odd = tl.zeros([K_HEADS, K_BLOCK], dtype=tl.float32)
    q_cols = q_groups * q_width
    qk_cols = q_cols + k_groups * k_width
    for r in range(ROWS):
        row = block * ROWS + r
        row_ok = row < n_rows
        preact_row = preact_ptr + row.to(tl.int64) * 2 * n_pairs
        grad_z_row = grad_z_ptr + row.to(tl.int64) * 2 * n_pairs
        position = tl.load(positions_ptr + row, mask=row_ok, other=0.0).to(tl.float32)
        q_z_dz, q_even, q_odd = _qk_norm_heads_backward(
            grad_q_ptr + row.to(tl.int64) * q_stride, preact_row, grad_z_row, frequencies_ptr, q_gamma_even,
            q_gamma_odd, q_groups, q_width, position, row_ok, eps, Q_HEADS, Q_BLOCK, PORTABLE)
        k_z_dz, k_even, k_odd = _qk_norm_heads_backward(
            grad_k_ptr + row.to(tl.int64) * k_stride, preact_row + q_cols, grad_z_row + q_cols,
            frequencies_ptr + q_cols // 2, k_gamma_even, k_gamma_odd, k_groups, k_width, position, row_ok,
            eps, K_HEADS, K_BLOCK, PORTABLE)
        grad_q_even += q_even
        grad_q_odd += q_odd
        grad_k_even += k_even
        grad_k_odd += k_odd
        v_dz = _rope_backward_columns(  # V: rotated back only; none of a row past the end
            grad_v_ptr + row.to(tl.int64) * v_stride, preact_row + qk_cols, grad_z_row + qk_cols,
            frequencies_ptr + qk_cols // 2, preact_row, tl.where(row_ok, 2 * n_pairs - qk_cols, 0), position, True,
            False, BLOCK, PORTABLE)
        row_z_dz = (tl.sum(tl.sum(q_z_dz, axis=1), axis=0) + tl.sum(tl.sum(k_z_dz, axis=1), axis=0)
                    + tl.sum(v_dz, axis=0))
        tl.store(mean_z_dz_ptr + row, row_z_dz * inv_width, mask=row_ok)
    # partial row of this program: [q_norm grad | k_norm grad], q_width and k_width wide
    partial = partial_grad_norm_weight_ptr + block.to(tl.int64) * (q_width + k_width)
    _store_pairs(partial, tl.sum(grad_q_even, axis=0), tl.sum(grad_q_odd, axis=0), in_q_cols, Q_BLOCK)
    _store_pairs(partial + q_width, tl.sum(grad_k_even, axis=0), tl.sum(grad_k_odd, axis=0), in_k_cols, K_BLOCK)


def rope_qk_norm_backward_ref(grad_blocks: Sequence[torch.Tensor], preact: torch.Tensor, positions: torch.Tensor,
                              frequencies: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                              num_heads: int, eps: float, width: int):
    """B1 of ``qkv = rope(qk_norm(z))``, columns ``[Q groups | K groups | V]`` (``preact = z``; the groups as in
    :func:`codagen.ops.kernels.qk_norm_rope.qk_norm_rope_ref`: ``num_heads`` Q groups of ``q_norm_weight``'s length).

    ``g = rotate(grad_qkv, -theta)`` is the gradient of the QK-norm output. On each Q/K group ``h``
    (``w`` columns, weight ``gamma`` = ``q_norm_weight`` or ``k_norm_weight``, pair order)::

        rho_h  = rsqrt(mean(z_h^2) + eps),   zhat_h = z_h * rho_h
        dz_h   = rho_h * (gamma * g_h - zhat_h * mean(zhat_h * gamma * g_h))
        grad_gamma = sum over rows and groups of that kind of g_h * zhat_h

    ``grad_blocks``: ``grad_qkv`` whole (``[grad_qkv]``) or as ``[grad_q, grad_k, grad_v]``.
    V columns: ``dz = g``. ``mean_z_dz[m] = sum_k z dz / width`` with the pre-QK-norm ``z`` (the input
    RMSNorm's statistic). Returns ``(grad_z, mean_z_dz, grad_q_norm_weight, grad_k_norm_weight)``;
    statistics and weight gradients in float32 (float64 for float64 inputs).
    """
    grad_qkv = _cat_columns(grad_blocks)
    cd = stats_dtype(grad_qkv.dtype)
    m, n = grad_qkv.shape
    theta = positions.to(cd)[:, None] * frequencies.to(cd)[None, :]
    g = reference.rope_ref(grad_qkv.to(cd), -theta)
    z = preact.to(cd)
    parts, grad_gammas = [], []
    start = 0
    for groups, gamma in zip(norm_groups(n, q_norm_weight, k_norm_weight, num_heads), (q_norm_weight, k_norm_weight)):
        w = gamma.shape[0]
        shape = (m, groups, w)  # explicit: M may be 0
        z_groups, g_groups = (t[:, start:start + groups * w].reshape(shape) for t in (z, g))
        rho = torch.rsqrt(z_groups.square().mean(-1, keepdim=True) + eps)
        zhat = z_groups * rho
        gamma_g = gamma.to(cd) * g_groups
        parts.append((rho * (gamma_g - zhat * (zhat * gamma_g).mean(-1, keepdim=True))).reshape(m, groups * w))
        grad_gammas.append((g_groups * zhat).sum((0, 1)))
        start += groups * w
    grad_z = torch.cat((*parts, g[:, start:]), dim=1)
    mean_z_dz = (z * grad_z).sum(-1) / width
    return (grad_z.to(grad_qkv.dtype), mean_z_dz, *grad_gammas)


@launcher
def rope_qk_norm_backward_triton(grad_blocks: Sequence[torch.Tensor], preact: torch.Tensor, positions: torch.Tensor,
                                 frequencies: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                                 num_heads: int, eps: float, width: int, *,
                                 launch: tuple[int, int, int] = QK_NORM_LAUNCH):
    """:func:`rope_qk_norm_backward_ref` as one kernel launch (fp16/bf16/fp32) + the finishing sum of the
    per-program norm-weight gradient partials ``[cdiv(M, rows per program), q_width + k_width]``. ``launch``:
    (rows per program, columns per step, warps), :data:`QK_NORM_LAUNCH` by default; the warps grow with wide norm
    groups (:func:`~codagen.ops.kernels.qk_norm_rope.row_kernel_warps`)."""
    m, n = preact.shape
    q_width, k_width = q_norm_weight.shape[0], k_norm_weight.shape[0]
    q_groups, k_groups = norm_groups(n, q_norm_weight, k_norm_weight, num_heads)
    widths = (q_groups * q_width, k_groups * k_width, k_groups * k_width)
    if [b.shape[1] for b in grad_blocks] not in ([n], list(widths)):
        raise ValueError(f"grad_blocks: expected [grad_qkv] ({n} columns) or [grad_q, grad_k, grad_v] ({widths} "
                         f"columns), got widths {[b.shape[1] for b in grad_blocks]}")
    (grad_q, grad_k, grad_v) = grads = _three_blocks(grad_blocks, widths)
    preact = preact.contiguous()  # the kernel steps its rows by N
    grad_z = torch.empty(m, n, dtype=grad_q.dtype, device=preact.device)
    mean_z_dz = torch.empty(m, dtype=torch.float32, device=preact.device)
    rows, step, warps = launch
    blocks = -(-m // rows)
    partial = torch.empty(blocks, q_width + k_width, dtype=torch.float32, device=preact.device)
    if m:
        q_block, k_block = next_power_of_2(q_width // 2), next_power_of_2(k_width // 2)
        launch_kernel(_rope_qk_norm_backward_kernel, (blocks,),
            grad_q, grad_k, grad_v, *(g.stride(0) for g in grads), preact, positions, frequencies, q_norm_weight,
            k_norm_weight, grad_z, mean_z_dz, partial,
            m, n // 2, q_width, k_width, q_groups, k_groups, eps, 1.0 / width,
            ROWS=rows, Q_HEADS=max(1, step // (2 * q_block)), Q_BLOCK=q_block, K_HEADS=max(1, step // (2 * k_block)),
            K_BLOCK=k_block, BLOCK=rope_block(widths[2], step), PORTABLE=portable_math(),
            num_warps=row_kernel_warps(warps, max(q_width, k_width)))
    grad_norm_weight = finish_col_sum_triton(partial, torch.float32)
    return grad_z, mean_z_dz, grad_norm_weight[:q_width], grad_norm_weight[q_width:]


rope_qk_norm_backward = dispatcher(rope_qk_norm_backward_ref, rope_qk_norm_backward_triton, tensor_arg=1)
