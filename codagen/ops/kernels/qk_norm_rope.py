"""F4's QK-norm and RoPE as a row kernel, for heads no epilogue sub-tile of the QKV GEMM holds whole (head_dim 256).

The QKV GEMM stores ``z = rstd * (normed @ W^T)`` (program ``rms_linear``, the ``preact`` the backward keeps);
this kernel computes what the fused program ``rms_qkv_rope_qk_norm`` computes from ``z`` in its epilogue. On
each Q/K head ``h`` (``head_dim`` columns, weight ``gamma`` = q_norm's or k_norm's), then on every pair ``j``::

    rstd_h = rsqrt(sum(z_h^2) * (1 / head_dim) + eps),   y_h = z_h * (gamma * rstd_h)
    qkv[m, 2j:2j+2] = rotate(y[m, 2j:2j+2], positions[m] * frequencies[j])

V columns pass through (``y = z``) and rotate by their own frequencies (0 from ``rope_frequencies``), as in the
program. One program per row; Q and K heads a few whole heads per step, V a column block per step.
"""
from __future__ import annotations

import torch

from codagen.backends import reference

from .._checks import stats_dtype
from ..layouts import kv_heads_of
from ._launch import cos_sin, dispatcher, launch_kernel, launcher, next_power_of_2, portable_math, tl, triton
from .rope import ROPE_MAX_BLOCK, _load_pairs, _store_pairs, rope_block

__all__ = ["qk_norm_rope", "qk_norm_rope_ref", "qk_norm_rope_triton"]


@triton.jit
def _qk_norm_rope_heads(preact_ptr, qkv_ptr, frequencies_ptr, gamma_even, gamma_odd, n_heads, head_dim, position,
                        eps, HEADS: tl.constexpr, HEAD_BLOCK: tl.constexpr, PORTABLE: tl.constexpr):
    """A row's ``n_heads`` heads of one kind (Q or K), HEADS at a time as one ``[HEADS, 2 HEAD_BLOCK]`` tile,
    loaded contiguously, pairs split in registers: each head's RMSNorm times ``gamma``, rotated, stored.
    Masked lanes load 0 and store nothing."""
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
                         n_cols, head_dim, num_heads, num_kv_heads, eps, HEADS: tl.constexpr,
                         HEAD_BLOCK: tl.constexpr, BLOCK: tl.constexpr, PORTABLE: tl.constexpr):
    """One row per program: its Q heads, its K heads (:func:`_qk_norm_rope_heads`), then its V columns
    (:func:`_rope_columns`). Both norm weights are loaded once, as pairs."""
    row = tl.program_id(0).to(tl.int64)
    in_head_cols = tl.arange(0, 2 * HEAD_BLOCK) < head_dim
    q_gamma_even, q_gamma_odd = _load_pairs(q_norm_weight_ptr, in_head_cols, HEAD_BLOCK)
    k_gamma_even, k_gamma_odd = _load_pairs(k_norm_weight_ptr, in_head_cols, HEAD_BLOCK)
    position = tl.load(positions_ptr + row).to(tl.float32)
    preact_row, qkv_row = preact_ptr + row * n_cols, qkv_ptr + row * n_cols
    q_cols = num_heads * head_dim
    qk_cols = q_cols + num_kv_heads * head_dim
    _qk_norm_rope_heads(preact_row, qkv_row, frequencies_ptr, q_gamma_even, q_gamma_odd, num_heads, head_dim,
                        position, eps, HEADS, HEAD_BLOCK, PORTABLE)
    _qk_norm_rope_heads(preact_row + q_cols, qkv_row + q_cols, frequencies_ptr + q_cols // 2, k_gamma_even,
                        k_gamma_odd, num_kv_heads, head_dim, position, eps, HEADS, HEAD_BLOCK, PORTABLE)
    _rope_columns(preact_row + qk_cols, qkv_row + qk_cols, frequencies_ptr + qk_cols // 2, n_cols - qk_cols,
                  position, BLOCK, PORTABLE)


def qk_norm_rope_ref(preact: torch.Tensor, positions: torch.Tensor, frequencies: torch.Tensor,
                     q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, num_heads: int,
                     eps: float) -> torch.Tensor:
    """``qkv = rope(qk_norm(z))`` from ``preact = z`` [M, N], columns ``[Q heads | K heads | V heads]``.

    On each Q/K head ``h`` (``head_dim = hd`` columns, weight ``gamma`` = ``q_norm_weight`` or
    ``k_norm_weight``, pair order)::

        rstd_h = rsqrt(sum(z_h^2) * (1 / hd) + eps),   y_h = z_h * (gamma * rstd_h)

    V: ``y = z``. Then pair ``j`` of row ``m`` rotates by ``positions[m] * frequencies[j]`` (V's pairs by theirs,
    0 from ``rope_frequencies``). Arithmetic in float32 (float64 for float64 ``preact``); ``qkv`` in
    ``preact``'s dtype.
    """
    cd = stats_dtype(preact.dtype)
    z = preact.to(cd)
    m, n = z.shape
    hd = q_norm_weight.shape[0]
    num_kv_heads = kv_heads_of(n, hd, num_heads)
    qk_cols = (num_heads + num_kv_heads) * hd
    z_heads = z[:, :qk_cols].reshape(m, num_heads + num_kv_heads, hd)  # explicit: M may be 0
    gamma = torch.cat((q_norm_weight.to(cd).expand(num_heads, hd), k_norm_weight.to(cd).expand(num_kv_heads, hd)))
    rstd = torch.rsqrt(z_heads.square().sum(-1, keepdim=True) * (1.0 / hd) + eps)
    y = torch.cat(((z_heads * (gamma * rstd)).reshape(m, qk_cols), z[:, qk_cols:]), dim=1)
    theta = positions.to(cd)[:, None] * frequencies.to(cd)[None, :]
    return reference.rope_ref(y, theta).to(preact.dtype)


@launcher
def qk_norm_rope_triton(preact: torch.Tensor, positions: torch.Tensor, frequencies: torch.Tensor,
                        q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, num_heads: int, eps: float, *,
                        launch: tuple[int, int] | None = None) -> torch.Tensor:
    """:func:`qk_norm_rope_ref` as one kernel launch (fp16/bf16/fp32). ``launch``: ``(columns per step,
    warps)``, by default :data:`~codagen.ops.kernels.rope.ROPE_MAX_BLOCK` and 4 warps; a step holds as many
    whole heads as fit (at least one)."""
    m, n = preact.shape
    hd = q_norm_weight.shape[0]
    num_kv_heads = kv_heads_of(n, hd, num_heads)
    preact = preact.contiguous()  # the kernel steps its rows by N
    qkv = torch.empty(m, n, dtype=preact.dtype, device=preact.device)
    step, warps = launch or (ROPE_MAX_BLOCK, 4)
    if m:
        head_block = next_power_of_2(hd // 2)
        launch_kernel(_qk_norm_rope_kernel, (m,), preact, positions, frequencies, q_norm_weight, k_norm_weight, qkv,
                      n, hd, num_heads, num_kv_heads, eps, HEADS=max(1, step // (2 * head_block)),
                      HEAD_BLOCK=head_block, BLOCK=rope_block(num_kv_heads * hd, step), PORTABLE=portable_math(),
                      num_warps=warps)
    return qkv


qk_norm_rope = dispatcher(qk_norm_rope_ref, qk_norm_rope_triton)
