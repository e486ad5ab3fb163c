"""F4's QK-norm and RoPE as a row kernel, where no epilogue sub-tile of the QKV GEMM holds a norm's columns whole.

Two cases: heads wider than any sub-tile (Gemma 3's head_dim 256), and QK-norm over the whole Q and the whole K
projection (OLMo 2), one norm group of ``heads * head_dim`` columns each. The QKV GEMM stores ``z`` (the
``preact`` the backward keeps: ``rstd * (normed @ W^T)``, program ``rms_linear``, or OLMo 2's un-normed
``x @ W^T``, program ``linear``); this kernel computes what the fused program ``rms_qkv_rope_qk_norm`` computes from
``z`` in its epilogue. On each Q/K norm group ``h`` (``width`` columns, weight ``gamma`` = q_norm's or k_norm's),
then on every pair ``j``::

    rstd_h = rsqrt(sum(z_h^2) * (1 / width) + eps),   y_h = z_h * (gamma * rstd_h)
    qkv[m, 2j:2j+2] = rotate(y[m, 2j:2j+2], positions[m] * frequencies[j])

A group's width is its weight's length: ``head_dim`` per head, or the projection's columns (then Q and K have
one group each, of different widths under GQA). V columns pass through (``y = z``) and rotate by their own
frequencies (0 from ``rope_frequencies``), as in the program. One program per row; Q and K a few whole groups per
step, V a column block per step.
"""
from __future__ import annotations

import torch

from codagen.backends import reference

from .._checks import stats_dtype
from ._launch import cos_sin, dispatcher, launch_kernel, launcher, next_power_of_2, portable_math, tl, triton
from .rope import ROPE_MAX_BLOCK, _load_pairs, _store_pairs, rope_block

__all__ = ["qk_norm_rope", "qk_norm_rope_ref", "qk_norm_rope_triton", "norm_groups", "row_kernel_warps"]


@triton.jit
def _qk_norm_rope_heads(preact_ptr, qkv_ptr, frequencies_ptr, gamma_even, gamma_odd, n_heads, head_dim, position,
                        eps, HEADS: tl.constexpr, HEAD_BLOCK: tl.constexpr, PORTABLE: tl.constexpr):
    """A row's ``n_heads`` norm groups of one kind (Q or K; ``head_dim`` columns each: a head, or the whole
    projection), HEADS at a time as one ``[HEADS, 2 HEAD_BLOCK]`` tile, loaded contiguously, pairs split in
    registers: each group's RMSNorm times ``gamma``, rotated, stored. Masked lanes load 0 and store nothing."""
    head = tl.arange(0, HEADS)[:, None]
    col = tl.arange(0, 2 * HEAD_BLOCK)[None, :]
    pair = tl.arange(0, HEAD_BLOCK)[None, :]
    half_head = head_dim // 2
    inv_head_dim = 1.0 / head_dim
    for first in range(0, n_heads, HEADS):
        in_step = first + head < n_heads
        mask = in_step & (col < head_dim)
        at = (first + head) * head_dim + col
        z = tl.load(preact_ptr + at, mask=mask, other=0.0).to(tl.float32)
        z0, z1 = tl.split(tl.reshape(z, [HEADS, HEAD_BLOCK, 2]))
        rstd = tl.rsqrt(tl.sum(z0 * z0 + z1 * z1, axis=1) * inv_head_dim + eps)[:, None]
        y0 = z0 * (gamma_even[None, :] * rstd)  # the program's z * (qk_norm_weight * qk_rstd)
        y1 = z1 * (gamma_odd[None, :] * rstd)
        frequency = tl.load(frequencies_ptr + (first + head) * half_head + pair,
                            mask=in_step & (pair < half_head), other=0.0).to(tl.float32)
        cos, sin = cos_sin(position * frequency, PORTABLE)
        qkv = tl.reshape(tl.join(y0 * cos - y1 * sin, y0 * sin + y1 * cos), [HEADS, 2 * HEAD_BLOCK])
        tl.store(qkv_ptr + at, qkv.to(qkv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_columns(preact_ptr, qkv_ptr, frequencies_ptr, n_cols, position, BLOCK: tl.constexpr,
                  PORTABLE: tl.constexpr):
    """A row's ``n_cols`` columns from an even column on, BLOCK at a time: each pair rotated by its angle."""
    pair = tl.arange(0, BLOCK // 2)
    for start in range(0, n_cols, BLOCK):
        mask = start + tl.arange(0, BLOCK) < n_cols
        y0, y1 = _load_pairs(preact_ptr + start, mask, BLOCK // 2)
        frequency = tl.load(frequencies_ptr + start // 2 + pair, mask=start + 2 * pair < n_cols,
                            other=0.0).to(tl.float32)
        cos, sin = cos_sin(position * frequency, PORTABLE)
        _store_pairs(qkv_ptr + start, y0 * cos - y1 * sin, y0 * sin + y1 * cos, mask, BLOCK // 2)


@triton.jit
def _qk_norm_rope_kernel(preact_ptr, positions_ptr, frequencies_ptr, q_norm_weight_ptr, k_norm_weight_ptr, qkv_ptr,
                         n_cols, q_width, k_width, q_groups, k_groups, eps, Q_HEADS: tl.constexpr,
                         Q_BLOCK: tl.constexpr, K_HEADS: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                         PORTABLE: tl.constexpr):
    """One row per program: its Q groups, its K groups (:func:`_qk_norm_rope_heads`; ``q_groups`` of ``q_width``
    columns, ``k_groups`` of ``k_width``), then its V columns (:func:`_rope_columns`). Both norm weights are loaded
    once, as pairs."""
    row = tl.program_id(0).to(tl.int64)
    q_gamma_even, q_gamma_odd = _load_pairs(q_norm_weight_ptr, tl.arange(0, 2 * Q_BLOCK) < q_width, Q_BLOCK)
    k_gamma_even, k_gamma_odd = _load_pairs(k_norm_weight_ptr, tl.arange(0, 2 * K_BLOCK) < k_width, K_BLOCK)
    position = tl.load(positions_ptr + row).to(tl.float32)
    preact_row, qkv_row = preact_ptr + row * n_cols, qkv_ptr + row * n_cols
    q_cols = q_groups * q_width
    qk_cols = q_cols + k_groups * k_width
    _qk_norm_rope_heads(preact_row, qkv_row, frequencies_ptr, q_gamma_even, q_gamma_odd, q_groups, q_width,
                        position, eps, Q_HEADS, Q_BLOCK, PORTABLE)
    _qk_norm_rope_heads(preact_row + q_cols, qkv_row + q_cols, frequencies_ptr + q_cols // 2, k_gamma_even,
                        k_gamma_odd, k_groups, k_width, position, eps, K_HEADS, K_BLOCK, PORTABLE)
    _rope_columns(preact_row + qk_cols, qkv_row + qk_cols, frequencies_ptr + qk_cols // 2, n_cols - qk_cols,
                  position, BLOCK, PORTABLE)


def norm_groups(n_cols: int, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                num_heads: int) -> tuple[int, int]:
    """``(q_groups, k_groups)`` of a ``[Q | K | V]`` row of ``n_cols`` columns: ``num_heads`` Q groups of
    ``len(q_norm_weight)`` columns, and as many K groups of ``len(k_norm_weight)`` as fill K's columns, V's being as
    many (per head: the K heads; over the whole projection: 1 and 1)."""
    return num_heads, (n_cols - num_heads * q_norm_weight.shape[0]) // (2 * k_norm_weight.shape[0])


def row_kernel_warps(warps: int, widest_group: int) -> int:
    """The warps of a row kernel that holds a norm group of ``widest_group`` columns in registers: at least
    ``warps``, and one per 256 of its columns up to 16 (a whole projection's 4096 columns spread over 512 threads
    keep the tile's arrays in registers)."""
    return max(warps, min(16, next_power_of_2(widest_group) // 256))


def qk_norm_rope_ref(preact: torch.Tensor, positions: torch.Tensor, frequencies: torch.Tensor,
                     q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, num_heads: int,
                     eps: float) -> torch.Tensor:
    """``qkv = rope(qk_norm(z))`` from ``preact = z`` [M, N], columns ``[Q groups | K groups | V]``.

    ``num_heads`` Q norm groups of ``q_norm_weight``'s length (the Q heads, or 1 for a norm over the whole Q
    projection), then as many K groups of ``k_norm_weight``'s length as :func:`norm_groups` finds. On each group
    ``h`` (``w`` columns, weight ``gamma`` = ``q_norm_weight`` or ``k_norm_weight``, pair order)::

        rstd_h = rsqrt(sum(z_h^2) * (1 / w) + eps),   y_h = z_h * (gamma * rstd_h)

    V: ``y = z``. Then pair ``j`` of row ``m`` rotates by ``positions[m] * frequencies[j]`` (V's pairs by theirs,
    0 from ``rope_frequencies``). Arithmetic in float32 (float64 for float64 ``preact``); ``qkv`` in
    ``preact``'s dtype.
    """
    cd = stats_dtype(preact.dtype)
    z = preact.to(cd)
    m, n = z.shape
    q_groups, k_groups = norm_groups(n, q_norm_weight, k_norm_weight, num_heads)
    parts = []
    start = 0
    for groups, gamma in ((q_groups, q_norm_weight), (k_groups, k_norm_weight)):
        width = gamma.shape[0]
        z_groups = z[:, start:start + groups * width].reshape(m, groups, width)  # explicit: M may be 0
        rstd = torch.rsqrt(z_groups.square().sum(-1, keepdim=True) * (1.0 / width) + eps)
        parts.append((z_groups * (gamma.to(cd) * rstd)).reshape(m, groups * width))
        start += groups * width
    y = torch.cat((*parts, z[:, start:]), dim=1)
    theta = positions.to(cd)[:, None] * frequencies.to(cd)[None, :]
    return reference.rope_ref(y, theta).to(preact.dtype)


@launcher
def qk_norm_rope_triton(preact: torch.Tensor, positions: torch.Tensor, frequencies: torch.Tensor,
                        q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, num_heads: int, eps: float, *,
                        launch: tuple[int, int] | None = None) -> torch.Tensor:
    """:func:`qk_norm_rope_ref` as one kernel launch (fp16/bf16/fp32). ``launch``: ``(columns per step,
    warps)``, by default :data:`~codagen.ops.kernels.rope.ROPE_MAX_BLOCK` and 4 warps (more for wide norm groups:
    :func:`row_kernel_warps`); a step holds as many whole groups as fit (at least one)."""
    m, n = preact.shape
    q_width, k_width = q_norm_weight.shape[0], k_norm_weight.shape[0]
    q_groups, k_groups = norm_groups(n, q_norm_weight, k_norm_weight, num_heads)
    preact = preact.contiguous()  # the kernel steps its rows by N
    qkv = torch.empty(m, n, dtype=preact.dtype, device=preact.device)
    step, warps = launch or (ROPE_MAX_BLOCK, row_kernel_warps(4, max(q_width, k_width)))
    if m:
        q_block, k_block = next_power_of_2(q_width // 2), next_power_of_2(k_width // 2)
        launch_kernel(_qk_norm_rope_kernel, (m,), preact, positions, frequencies, q_norm_weight, k_norm_weight, qkv,
                      n, q_width, k_width, q_groups, k_groups, eps, Q_HEADS=max(1, step // (2 * q_block)),
                      Q_BLOCK=q_block, K_HEADS=max(1, step // (2 * k_block)), K_BLOCK=k_block,
                      BLOCK=rope_block(n - q_groups * q_width - k_groups * k_width, step), PORTABLE=portable_math(),
                      num_warps=warps)
    return qkv


qk_norm_rope = dispatcher(qk_norm_rope_ref, qk_norm_rope_triton)
