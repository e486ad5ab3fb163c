"""Small row-wise kernels the ops need outside any GEMM, each with a PyTorch ``*_ref`` twin.

- :func:`rms_norm_stats`: the first block's RMSNorm statistics (no producer GEMM precedes it);
- :func:`rope_backward` (B1): rotate the QKV gradient back and compute ``mean_z_dz`` for the RMSNorm backward;
- :func:`rope_qk_norm_backward` (B1 with QK-norm): the same, plus the per-head RMSNorm backward of the Q/K
  heads and the q_norm / k_norm weight gradients (per-row-block partials, summed after the launch);
- :func:`swiglu_backward`: SwiGLU backward + ``mean_z_dz`` for the standalone gate/up op (the fused MLP op
  does this in the down-projection's input-gradient epilogue instead);
- :func:`mean_row_dot`: ``mean_z_dz = sum_k z dz / width`` for ops whose output gradient arrives as is;
- :func:`cross_entropy_logits_grad`: a chunk of logits -> each row's loss, its gradient (in place) and
  ``mean_z_dz`` (two passes over the row: a logsumexp kept per group of 8 logits, then softmax minus
  one-hot);
- :func:`scale_cast`: ``(src * factor).to(dtype)`` with ``factor`` a device scalar, one rounding (the LM
  head's saved gradients times the loss gradient);
- :func:`embedding_backward`: the embedding table's gradient, each vocabulary row's tokens summed in
  token order (8 rows x one column block per program);
- :func:`finish_rstd`, :func:`finish_row_mean`, :func:`finish_col_sum`, :func:`finish_cross_entropy`: a
  fused GEMM's tile partials finished into ``rstd``, ``mean_z_dz``, a norm weight's gradient or each row's
  cross-entropy, one launch each (the ``_ref`` twins are :mod:`codagen.epilogue.finish`'s; in PyTorch each
  is two to four launches).

Each comes as ``foo_ref`` (PyTorch), ``foo_triton`` (one launch of a module-level ``@triton.jit`` kernel)
and the dispatcher ``foo``: the kernel for CUDA tensors when the selected backend is ``triton`` and the
dtype is not float64 (the oracle dtype); otherwise the twin. (The tests run the ``*_triton`` launchers
on CPU under ``TRITON_INTERPRET=1``.) Kernels keep fp32 statistics and write one value per row: no
atomics, so results are deterministic.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch

from codagen.backends import on_device, reference, resolve_backend_name
from codagen.epilogue import finish

from ._checks import stats_dtype
from .layouts import kv_heads_of

try:  # the package must import without Triton (or without a GPU)
    import triton
    import triton.language as tl

    from codagen.backends.triton.device_math import cos_sin, sigmoid
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None

__all__ = [f"{name}{kind}" for name in ("rms_norm_stats", "rope_backward", "rope_qk_norm_backward", "swiglu_backward",
                                        "mean_row_dot", "cross_entropy_logits_grad", "scale_cast",
                                        "embedding_backward", "finish_rstd", "finish_row_mean", "finish_col_sum",
                                        "finish_cross_entropy")
           for kind in ("", "_ref", "_triton")]

_MAX_BLOCK = 2048
#: (BLOCK, num_warps) of the cross-entropy row kernel (``bench/cross_entropy_rows.py``)
_CROSS_ENTROPY_LAUNCH = (4096, 8)
#: logits per running max in its pass 1: 16 bytes of bf16, one thread's vector load
_CROSS_ENTROPY_GROUP = 8
#: QK-norm B1 launch (``bench/rope_backward.py --qk-norm``): rows per program (its norm-weight gradient
#: partials are [cdiv(M, rows), 2 head_dim]), columns per step (whole heads), warps
_QK_NORM_LAUNCH = (16, 1024, 4)


def _on_tensor_device(fn):
    """Launch ``fn``'s kernel on its first tensor's device (:func:`codagen.backends.on_device`); a first
    argument that is a sequence of tensors gives its first one's (an empty one leaves ``fn`` to refuse it)."""
    @functools.wraps(fn)
    def launch(first, *args, **kwargs):
        tensor = first if isinstance(first, torch.Tensor) else next(iter(first), None)
        with on_device(tensor.device) if tensor is not None else contextlib.nullcontext():
            return fn(first, *args, **kwargs)
    return launch


def _use_triton(t: torch.Tensor) -> bool:
    return (triton is not None and t.is_cuda and t.dtype != torch.float64
            and resolve_backend_name(t.device) == "triton")


def _interpreting() -> bool:
    """Whether the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``): no inline PTX there."""
    return bool(triton.knobs.runtime.interpret)


def _block(columns: int) -> int:
    return min(triton.next_power_of_2(max(columns, 1)), _MAX_BLOCK)


def _rope_block(columns: int, limit: int = 1024) -> int:
    """B1's columns per step: at most ``limit`` (1024: 4 warps x 8 bf16 = one 16-byte load per thread and
    tensor)."""
    return min(max(triton.next_power_of_2(columns), 2), limit)


# --------------------------------------------------------------------------------------------------
# Triton kernels: one program per row, looping over the row in blocks
# --------------------------------------------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _rms_norm_stats_kernel(x_ptr, norm_weight_ptr, normed_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * n_cols
        sumsq = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            sumsq += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / n_cols + eps)
        tl.store(rstd_ptr + row, rstd)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            gamma = tl.load(norm_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(normed_ptr + row * n_cols + cols, (x * gamma).to(normed_ptr.dtype.element_ty), mask=mask)

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
    def _rope_backward_chunk(grad_ptr, values_ptr, grad_z_ptr, frequencies_ptr, n_valid, position,
                             PRE_ROPE: tl.constexpr, BLOCK: tl.constexpr, INTERPRETER: tl.constexpr):
        """BLOCK columns of a row from an even column on (``n_valid`` of them in bounds): rotate the gradient
        back and store it; return the lanes' share of ``sum z * dz``. ``values`` are the RoPE outputs
        (dotted with the incoming gradient: rotations preserve dot products) or, ``PRE_ROPE``, its inputs
        (dotted with the rotated-back gradient)."""
        mask = tl.arange(0, BLOCK) < n_valid
        g0, g1 = _load_pairs(grad_ptr, mask, BLOCK // 2)
        y0, y1 = _load_pairs(values_ptr, mask, BLOCK // 2)
        pair = tl.arange(0, BLOCK // 2)
        frequency = tl.load(frequencies_ptr + pair, mask=2 * pair < n_valid, other=0.0).to(tl.float32)
        cos, sin = cos_sin(position * frequency, INTERPRETER)
        u0, u1 = g0 * cos + g1 * sin, g1 * cos - g0 * sin  # rotate by -theta
        _store_pairs(grad_z_ptr, u0, u1, mask, BLOCK // 2)
        if PRE_ROPE:
            return y0 * u0 + y1 * u1
        return y0 * g0 + y1 * g1

    @triton.jit
    def _rope_backward_columns(grad_ptr, values_ptr, grad_z_ptr, frequencies_ptr, n_cols, position,
                               PRE_ROPE: tl.constexpr, BLOCK: tl.constexpr, INTERPRETER: tl.constexpr):
        """A row's ``n_cols`` columns of one column block, BLOCK at a time (:func:`_rope_backward_chunk`);
        returns the lanes' share of their ``sum z * dz``."""
        z_dz = tl.zeros([BLOCK // 2], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            z_dz += _rope_backward_chunk(grad_ptr + start, values_ptr + start, grad_z_ptr + start,
                                         frequencies_ptr + start // 2, n_cols - start, position, PRE_ROPE, BLOCK,
                                         INTERPRETER)
        return z_dz

    @triton.jit
    def _rope_backward_kernel(grad_q_ptr, grad_k_ptr, grad_v_ptr, q_stride, k_stride, v_stride, q_cols, k_cols,
                              v_cols, qkv_ptr, positions_ptr, frequencies_ptr, grad_z_ptr, mean_z_dz_ptr, inv_width,
                              BLOCK: tl.constexpr, INTERPRETER: tl.constexpr):
        """One row per program. The gradient arrives as three column blocks (q, k, v, as attention's
        backward wrote them, each with its own row stride), read in place: no concatenation first."""
        row = tl.program_id(0).to(tl.int64)
        n = q_cols + k_cols + v_cols
        position = tl.load(positions_ptr + row).to(tl.float32)
        qkv_row, grad_z_row = qkv_ptr + row * n, grad_z_ptr + row * n
        z_dz = _rope_backward_columns(grad_q_ptr + row * q_stride, qkv_row, grad_z_row, frequencies_ptr, q_cols,
                                      position, False, BLOCK, INTERPRETER)
        z_dz += _rope_backward_columns(grad_k_ptr + row * k_stride, qkv_row + q_cols, grad_z_row + q_cols,
                                       frequencies_ptr + q_cols // 2, k_cols, position, False, BLOCK, INTERPRETER)
        column = q_cols + k_cols
        z_dz += _rope_backward_columns(grad_v_ptr + row * v_stride, qkv_row + column, grad_z_row + column,
                                       frequencies_ptr + column // 2, v_cols, position, False, BLOCK, INTERPRETER)
        tl.store(mean_z_dz_ptr + row, tl.sum(z_dz, axis=0) * inv_width)

    @triton.jit
    def _qk_norm_heads_backward(grad_ptr, preact_ptr, grad_z_ptr, frequencies_ptr, gamma_even, gamma_odd, n_heads,
                                head_dim, position, row_ok, eps, HEADS: tl.constexpr, HEAD_BLOCK: tl.constexpr,
                                INTERPRETER: tl.constexpr):
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
            cos, sin = cos_sin(position * frequency, INTERPRETER)
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
                                      BLOCK: tl.constexpr, INTERPRETER: tl.constexpr):
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
                q_gamma_odd, num_heads, head_dim, position, row_ok, eps, HEADS, HEAD_BLOCK, INTERPRETER)
            k_z_dz, k_even, k_odd = _qk_norm_heads_backward(
                grad_k_ptr + row.to(tl.int64) * k_stride, preact_row + q_cols, grad_z_row + q_cols,
                frequencies_ptr + q_cols // 2, k_gamma_even, k_gamma_odd, num_kv_heads, head_dim, position, row_ok,
                eps, HEADS, HEAD_BLOCK, INTERPRETER)
            grad_q_even += q_even
            grad_q_odd += q_odd
            grad_k_even += k_even
            grad_k_odd += k_odd
            v_dz = _rope_backward_columns(  # V: rotated back only; none of a row past the end
                grad_v_ptr + row.to(tl.int64) * v_stride, preact_row + qk_cols, grad_z_row + qk_cols,
                frequencies_ptr + qk_cols // 2, tl.where(row_ok, 2 * n_pairs - qk_cols, 0), position, True, BLOCK,
                INTERPRETER)
            row_z_dz = tl.sum(tl.sum(q_z_dz + k_z_dz, axis=1), axis=0) + tl.sum(v_dz, axis=0)
            tl.store(mean_z_dz_ptr + row, row_z_dz * inv_width, mask=row_ok)
        # partial row of this program: [q_norm grad | k_norm grad], each head_dim wide
        partial = partial_grad_norm_weight_ptr + block.to(tl.int64) * 2 * head_dim
        _store_pairs(partial, tl.sum(grad_q_even, axis=0), tl.sum(grad_q_odd, axis=0), in_head_cols, HEAD_BLOCK)
        _store_pairs(partial + head_dim, tl.sum(grad_k_even, axis=0), tl.sum(grad_k_odd, axis=0), in_head_cols,
                     HEAD_BLOCK)

    @triton.jit
    def _swiglu_backward_kernel(grad_ptr, preact_ptr, grad_preact_ptr, mean_z_dz_ptr, n_out, inv_width,
                                BLOCK: tl.constexpr, INTERPRETER: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_dz = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_out, BLOCK):
            j = start + tl.arange(0, BLOCK)
            mask = j < n_out
            dy = tl.load(grad_ptr + row * n_out + j, mask=mask, other=0.0).to(tl.float32)
            gate_at, up_at = row * 2 * n_out + 2 * j, row * 2 * n_out + 2 * j + 1
            gate = tl.load(preact_ptr + gate_at, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(preact_ptr + up_at, mask=mask, other=0.0).to(tl.float32)
            sig = sigmoid(gate, INTERPRETER)
            d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
            d_up = dy * gate * sig
            z_dz += gate * d_gate + up * d_up
            out_ty = grad_preact_ptr.dtype.element_ty
            tl.store(grad_preact_ptr + gate_at, d_gate.to(out_ty), mask=mask)
            tl.store(grad_preact_ptr + up_at, d_up.to(out_ty), mask=mask)
        tl.store(mean_z_dz_ptr + row, tl.sum(z_dz, axis=0) * inv_width)

    @triton.jit
    def _mean_row_dot_kernel(a_ptr, b_ptr, out_ptr, n_cols, inv_width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            a = tl.load(a_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            acc += a * b
        tl.store(out_ptr + row, tl.sum(acc, axis=0) * inv_width)


    @triton.jit
    def _cross_entropy_logits_grad_kernel(logits_ptr, target_ptr, row_weight_ptr, row_loss_ptr, mean_z_dz_ptr,
                                          n_cols, inv_width, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        """One row per program, two passes over it.

        Pass 1 keeps a running max and ``sum exp(z - max)`` per group of GROUP adjacent logits (a thread's
        own 16-byte vector): one exp per logit plus one per group, and no exchange between threads until
        the row's end. Pass 2 walks the blocks backwards, so it starts on the ones pass 1 read last (still
        in L2), and writes ``dz`` over the logits."""
        row = tl.program_id(0).to(tl.int64)
        logits_row = logits_ptr + row * n_cols
        target = tl.load(target_ptr + row)
        # an ignored (negative) target, or one past the vocabulary, has no logit
        target_logit = tl.load(logits_row + target, mask=(target >= 0) & (target < n_cols), other=0.0)
        group_max = tl.full([BLOCK // GROUP], float("-inf"), tl.float32)
        group_sum = tl.zeros([BLOCK // GROUP], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(logits_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            z = tl.reshape(z, [BLOCK // GROUP, GROUP])
            new_max = tl.maximum(group_max, tl.max(z, axis=1))
            # shift = max where finite, else 0: no finite logit yet keeps the sum 0, a +inf one makes it +inf
            shift = tl.where(tl.abs(new_max) == float("inf"), 0.0, new_max)
            group_sum = group_sum * tl.exp(group_max - shift) + tl.sum(tl.exp(z - shift[:, None]), axis=1)
            group_max = new_max
        row_max = tl.max(group_max, axis=0)
        row_shift = tl.where(tl.abs(row_max) == float("inf"), 0.0, row_max)
        lse = row_shift + tl.log(tl.sum(group_sum * tl.exp(group_max - row_shift), axis=0))
        # pass 2: dz = (softmax(z) - onehot(target)) * row_weight
        weight = tl.load(row_weight_ptr + row).to(tl.float32)
        z_dz = tl.zeros([BLOCK], dtype=tl.float32)
        last = tl.cdiv(n_cols, BLOCK) - 1
        for block in range(0, last + 1):
            cols = (last - block) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_cols
            z = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
            dz = (tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)) * weight
            z_dz += tl.where(mask, z * dz, 0.0)  # past the row's end dz = exp(-lse) may overflow
            tl.store(logits_row + cols, dz.to(logits_ptr.dtype.element_ty), mask=mask)
        tl.store(row_loss_ptr + row, lse - target_logit.to(tl.float32))
        tl.store(mean_z_dz_ptr + row, tl.sum(z_dz, axis=0) * inv_width)

    @triton.jit
    def _scale_cast_kernel(src_ptr, factor_ptr, out_ptr, numel, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        factor = tl.load(factor_ptr).to(tl.float32)
        src = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offsets, (src * factor).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _embedding_backward_kernel(grad_out_ptr, token_order_ptr, row_start_ptr, grad_weight_ptr, vocab, n_cols,
                                   ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """Program (r, c), for each vocabulary row v of its ROWS: ``grad_weight[v, c block] = sum of
        grad_out[t, c block]`` over the tokens t with id v, in ascending t (``token_order`` is a stable sort):
        fp32 sum, one store, zeros for unused rows. ROWS rows per program: most rows have no token or one,
        and a program per row spent more time starting than working."""
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        for r in range(ROWS):
            vocab_row = tl.program_id(0).to(tl.int64) * ROWS + r
            if vocab_row < vocab:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                # a frequent token has many rows: keep several loads in flight
                for i in tl.range(tl.load(row_start_ptr + vocab_row), tl.load(row_start_ptr + vocab_row + 1),
                                  num_stages=4):
                    token = tl.load(token_order_ptr + i).to(tl.int64)
                    acc += tl.load(grad_out_ptr + token * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(grad_weight_ptr + vocab_row * n_cols + cols, acc.to(grad_weight_ptr.dtype.element_ty),
                         mask=mask)

    @triton.jit
    def _finish_partials_kernel(partial_ptr, out_ptr, n_out, n_tiles, out_stride, tile_stride, scale, eps,
                                RSQRT: tl.constexpr, OUTS: tl.constexpr, TILES: tl.constexpr):
        """OUTS outputs per program, TILES partials of each a step: ``out[i] = scale * sum_t partial[i, t]``
        in fp32, then ``rsqrt(out + eps)`` (RSQRT), rounded once to ``out``'s dtype. Row partials [M, tiles]
        come with ``tile_stride = 1``, column partials [tiles, N] with ``out_stride = 1``."""
        outs = tl.program_id(0) * OUTS + tl.arange(0, OUTS)
        total = tl.zeros([OUTS], dtype=tl.float32)
        for start in range(0, n_tiles, TILES):
            tiles = start + tl.arange(0, TILES)
            mask = (outs < n_out)[:, None] & (tiles < n_tiles)[None, :]
            at = outs.to(tl.int64)[:, None] * out_stride + tiles.to(tl.int64)[None, :] * tile_stride
            total += tl.sum(tl.load(partial_ptr + at, mask=mask, other=0.0), axis=1)
        total = total * scale
        if RSQRT:
            total = 1.0 / tl.sqrt(total + eps)
        tl.store(out_ptr + outs, total.to(out_ptr.dtype.element_ty), mask=outs < n_out)

    @triton.jit
    def _finish_cross_entropy_kernel(partial_lse_ptr, partial_target_ptr, row_loss_ptr, n_rows, n_tiles,
                                     lse_row_stride, lse_tile_stride, target_row_stride, target_tile_stride,
                                     ROWS: tl.constexpr, TILES: tl.constexpr):
        """ROWS rows per program: ``row_loss = logsumexp_t(partial_lse[m, t]) - sum_t partial_target[m, t]``,
        the logsumexp kept online (running max and sum) over steps of TILES partials."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        running_max = tl.full([ROWS], float("-inf"), tl.float32)
        running_sum = tl.zeros([ROWS], dtype=tl.float32)
        target = tl.zeros([ROWS], dtype=tl.float32)
        for start in range(0, n_tiles, TILES):
            tiles = start + tl.arange(0, TILES)
            mask = row_ok[:, None] & (tiles < n_tiles)[None, :]
            lse_at = rows.to(tl.int64)[:, None] * lse_row_stride + tiles.to(tl.int64)[None, :] * lse_tile_stride
            partial = tl.load(partial_lse_ptr + lse_at, mask=mask, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(partial, axis=1))
            # shift = max where finite, else 0: a row of -inf stays -inf and one holding +inf is +inf, not nan
            shift = tl.where(tl.abs(new_max) == float("inf"), 0.0, new_max)
            running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(partial - shift[:, None]), axis=1)
            running_max = new_max
            target_at = (rows.to(tl.int64)[:, None] * target_row_stride
                         + tiles.to(tl.int64)[None, :] * target_tile_stride)
            target += tl.sum(tl.load(partial_target_ptr + target_at, mask=mask, other=0.0).to(tl.float32), axis=1)
        tl.store(row_loss_ptr + rows, running_max + tl.log(running_sum) - target, mask=row_ok)


# --------------------------------------------------------------------------------------------------
# RMSNorm statistics (first block)
# --------------------------------------------------------------------------------------------------
def rms_norm_stats_ref(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``rstd = rsqrt(mean(x^2) + eps)`` (fp32; fp64 for fp64 x) and ``normed = x * norm_weight`` (x's dtype)."""
    cd = stats_dtype(x.dtype)
    xf = x.to(cd)
    rstd = torch.rsqrt(xf.square().mean(dim=-1) + eps)
    return (xf * norm_weight.to(cd)).to(x.dtype), rstd


def rms_norm_stats(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (rms_norm_stats_triton if _use_triton(x) else rms_norm_stats_ref)(x, norm_weight, eps)


@_on_tensor_device
def rms_norm_stats_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm_stats_ref` as one kernel launch (fp16/bf16/fp32)."""
    m, n = x.shape
    normed = torch.empty_like(x)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _rms_norm_stats_kernel[(m,)](x, norm_weight, normed, rstd, n, eps, BLOCK=_block(n))
    return normed, rstd


# --------------------------------------------------------------------------------------------------
# B1: RoPE backward
# --------------------------------------------------------------------------------------------------
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
                      frequencies: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_z = rotate(grad_qkv, -positions[m] * frequencies[j])``, ``mean_z_dz[m] = sum_k qkv grad_qkv / width``.

    ``grad_blocks``: ``grad_qkv`` as its column blocks, left to right: ``[grad_qkv]``, or
    ``[grad_q, grad_k, grad_v]`` as attention's backward wrote them (the kernel reads them in place).
    ``sum_k z dz = sum_k qkv grad_qkv`` because a rotation preserves dot products, so the pre-RoPE
    activations are never needed. ``width`` is the normalized dimension d (x's width), not N.
    """
    grad_qkv = _cat_columns(grad_blocks)
    cd = stats_dtype(grad_qkv.dtype)
    grad = grad_qkv.to(cd)
    theta = positions.to(cd)[:, None] * frequencies.to(cd)[None, :]
    grad_z = reference.rope_ref(grad, -theta).to(grad_qkv.dtype)
    mean_z_dz = (qkv.to(cd) * grad).sum(dim=-1) / width
    return grad_z, mean_z_dz


def rope_backward(grad_blocks: Sequence[torch.Tensor], qkv: torch.Tensor, positions: torch.Tensor,
                  frequencies: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    impl = rope_backward_triton if _use_triton(qkv) else rope_backward_ref
    return impl(grad_blocks, qkv, positions, frequencies, width)


@_on_tensor_device
def rope_backward_triton(grad_blocks: Sequence[torch.Tensor], qkv: torch.Tensor, positions: torch.Tensor,
                         frequencies: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_backward_ref` as one kernel launch (fp16/bf16/fp32); up to three column blocks, each an
    even number of columns wide (a pair never straddles two blocks)."""
    m, n = qkv.shape
    if not 1 <= len(grad_blocks) <= 3 or any(b.shape[1] % 2 for b in grad_blocks):
        raise ValueError(f"grad_blocks: expected 1 to 3 column blocks of even widths, got widths "
                         f"{[b.shape[1] for b in grad_blocks]}")
    (grad_q, grad_k, grad_v) = blocks = _three_blocks(grad_blocks)
    qkv = qkv.contiguous()  # the kernel steps its rows by N
    grad_z = torch.empty(m, n, dtype=grad_q.dtype, device=qkv.device)
    mean_z_dz = torch.empty(m, dtype=torch.float32, device=qkv.device)
    if m:
        _rope_backward_kernel[(m,)](grad_q, grad_k, grad_v, *(b.stride(0) for b in blocks),
                                    *(b.shape[1] for b in blocks), qkv, positions, frequencies, grad_z, mean_z_dz,
                                    1.0 / width, BLOCK=_rope_block(max(b.shape[1] for b in blocks)),
                                    INTERPRETER=_interpreting())
    return grad_z, mean_z_dz


# --------------------------------------------------------------------------------------------------
# B1 with QK-norm: RoPE backward + per-head RMSNorm backward of the Q/K heads
# --------------------------------------------------------------------------------------------------
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


def rope_qk_norm_backward(grad_blocks: Sequence[torch.Tensor], preact: torch.Tensor, positions: torch.Tensor,
                          frequencies: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                          num_heads: int, eps: float, width: int):
    impl = rope_qk_norm_backward_triton if _use_triton(preact) else rope_qk_norm_backward_ref
    return impl(grad_blocks, preact, positions, frequencies, q_norm_weight, k_norm_weight, num_heads, eps, width)


@_on_tensor_device
def rope_qk_norm_backward_triton(grad_blocks: Sequence[torch.Tensor], preact: torch.Tensor, positions: torch.Tensor,
                                 frequencies: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                                 num_heads: int, eps: float, width: int):
    """:func:`rope_qk_norm_backward_ref` as one kernel launch (fp16/bf16/fp32) + the finishing sum of the
    per-program norm-weight gradient partials ``[cdiv(M, rows per program), 2 head_dim]``."""
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
    rows, step, warps = _QK_NORM_LAUNCH
    blocks = -(-m // rows)
    partial = torch.empty(blocks, 2 * hd, dtype=torch.float32, device=preact.device)
    if m:
        head_block = triton.next_power_of_2(hd // 2)
        _rope_qk_norm_backward_kernel[(blocks,)](
            grad_q, grad_k, grad_v, *(g.stride(0) for g in grads), preact, positions, frequencies, q_norm_weight,
            k_norm_weight, grad_z, mean_z_dz, partial,
            m, n // 2, hd, num_heads, num_kv_heads, eps, 1.0 / width,
            ROWS=rows, HEADS=max(1, step // (2 * head_block)), HEAD_BLOCK=head_block,
            BLOCK=_rope_block(widths[2], step), INTERPRETER=_interpreting(), num_warps=warps)
    grad_norm_weight = finish_col_sum_triton(partial, torch.float32)
    return grad_z, mean_z_dz, grad_norm_weight[:hd], grad_norm_weight[hd:]


# --------------------------------------------------------------------------------------------------
# SwiGLU backward (standalone gate/up op)
# --------------------------------------------------------------------------------------------------
def swiglu_backward_ref(grad_act: torch.Tensor, preact: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved ``(dg, du)`` of ``act = silu(g) * u`` and ``mean_z_dz[m] = sum_j (g dg + u du) / width``."""
    cd = stats_dtype(grad_act.dtype)
    preact_c = preact.to(cd)
    grad_preact = reference.swiglu_backward_ref(preact_c, grad_act.to(cd))
    return grad_preact.to(grad_act.dtype), (preact_c * grad_preact).sum(dim=-1) / width


def swiglu_backward(grad_act: torch.Tensor, preact: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (swiglu_backward_triton if _use_triton(grad_act) else swiglu_backward_ref)(grad_act, preact, width)


@_on_tensor_device
def swiglu_backward_triton(grad_act: torch.Tensor, preact: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`swiglu_backward_ref` as one kernel launch (fp16/bf16/fp32)."""
    m, f = grad_act.shape
    grad_preact = torch.empty_like(preact)
    mean_z_dz = torch.empty(m, dtype=torch.float32, device=grad_act.device)
    if m:
        _swiglu_backward_kernel[(m,)](grad_act, preact, grad_preact, mean_z_dz, f, 1.0 / width, BLOCK=_block(f),
                                      INTERPRETER=_interpreting())
    return grad_preact, mean_z_dz


# --------------------------------------------------------------------------------------------------
# mean_z_dz of a plain output
# --------------------------------------------------------------------------------------------------
def mean_row_dot_ref(z: torch.Tensor, grad_z: torch.Tensor, width: int) -> torch.Tensor:
    """``mean_z_dz[m] = sum_k z[m, k] grad_z[m, k] / width``."""
    cd = stats_dtype(z.dtype)
    return (z.to(cd) * grad_z.to(cd)).sum(dim=-1) / width


def mean_row_dot(z: torch.Tensor, grad_z: torch.Tensor, width: int) -> torch.Tensor:
    return (mean_row_dot_triton if _use_triton(z) else mean_row_dot_ref)(z, grad_z, width)


@_on_tensor_device
def mean_row_dot_triton(z: torch.Tensor, grad_z: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`mean_row_dot_ref` as one kernel launch (fp16/bf16/fp32)."""
    m, n = z.shape
    out = torch.empty(m, dtype=torch.float32, device=z.device)
    if m:
        _mean_row_dot_kernel[(m,)](z, grad_z, out, n, 1.0 / width, BLOCK=_block(n))
    return out


# --------------------------------------------------------------------------------------------------
# cross-entropy over a chunk of stored logits
# --------------------------------------------------------------------------------------------------
def cross_entropy_logits_grad_ref(logits: torch.Tensor, target: torch.Tensor, row_weight: torch.Tensor,
                                  width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of each row of ``logits`` [rows, V] and its gradient, written over ``logits``.

    ``row_loss[m] = logsumexp(z[m]) - z[m, target[m]]`` (just ``logsumexp`` where the target is outside
    ``[0, V)``, e.g. ignore_index); ``logits`` becomes ``dz = (softmax(z) - onehot(target)) * row_weight[m]``
    (in its dtype); returns ``(row_loss, mean_z_dz = sum_k z dz / width)`` (fp32; fp64 for fp64 logits).
    """
    cd = stats_dtype(logits.dtype)
    z = logits.to(cd)
    vocab = z.shape[1]
    valid = (target >= 0) & (target < vocab)
    index = target.clamp(0, max(vocab - 1, 0)).long()[:, None]
    lse = torch.logsumexp(z, dim=-1)
    target_logit = torch.where(valid, z.gather(1, index)[:, 0], 0.0)
    onehot = torch.zeros_like(z).scatter_(1, index, valid[:, None].to(cd))
    dz = (torch.exp(z - lse[:, None]) - onehot) * row_weight.to(cd)[:, None]
    mean_z_dz = (z * dz).sum(dim=-1) / width
    logits.copy_(dz)  # last: z may be logits itself
    return lse - target_logit, mean_z_dz


def cross_entropy_logits_grad(logits: torch.Tensor, target: torch.Tensor, row_weight: torch.Tensor,
                              width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (cross_entropy_logits_grad_triton if _use_triton(logits) else cross_entropy_logits_grad_ref)(
        logits, target, row_weight, width)


@_on_tensor_device
def cross_entropy_logits_grad_triton(logits: torch.Tensor, target: torch.Tensor, row_weight: torch.Tensor,
                                     width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cross_entropy_logits_grad_ref` as one kernel launch (fp16/bf16/fp32; contiguous logits)."""
    m, vocab = logits.shape
    row_loss = torch.empty(m, dtype=torch.float32, device=logits.device)
    mean_z_dz = torch.empty(m, dtype=torch.float32, device=logits.device)
    if m:
        block, warps = _CROSS_ENTROPY_LAUNCH
        _cross_entropy_logits_grad_kernel[(m,)](
            logits, target, row_weight, row_loss, mean_z_dz, vocab, 1.0 / width,
            BLOCK=max(min(block, triton.next_power_of_2(vocab)), _CROSS_ENTROPY_GROUP), GROUP=_CROSS_ENTROPY_GROUP,
            num_warps=warps)
    return row_loss, mean_z_dz


# --------------------------------------------------------------------------------------------------
# scaling saved gradients by the loss gradient
# --------------------------------------------------------------------------------------------------
def scale_cast_ref(src: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(src * factor).to(dtype)``, the product in fp32 (fp64 for fp64 ``src``): ``factor`` is never rounded
    to ``src``'s dtype (PyTorch's ``bf16 * fp32 scalar tensor`` would round it to bf16 first)."""
    cd = stats_dtype(src.dtype)
    return (src.to(cd) * factor.to(cd)).to(dtype)


def scale_cast(src: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (scale_cast_triton if _use_triton(src) else scale_cast_ref)(src, factor, dtype)


@_on_tensor_device
def scale_cast_triton(src: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`scale_cast_ref` as one kernel launch (contiguous ``src``; fp16/bf16/fp32)."""
    src = src.contiguous()
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    if src.numel():
        block = 4096
        _scale_cast_kernel[(triton.cdiv(src.numel(), block),)](src, factor, out, src.numel(), BLOCK=block)
    return out


# --------------------------------------------------------------------------------------------------
# embedding backward
# --------------------------------------------------------------------------------------------------
def embedding_backward_ref(grad_out: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``grad_weight[v] = sum_{t: ids[t] = v} grad_out[t]`` [vocab, d], summed in fp32 (fp64 for fp64)."""
    cd = stats_dtype(grad_out.dtype)
    grad_weight = grad_out.new_zeros(vocab, grad_out.shape[1], dtype=cd)
    return grad_weight.index_add_(0, ids.long(), grad_out.to(cd)).to(grad_out.dtype)


def embedding_backward(grad_out: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return (embedding_backward_triton if _use_triton(grad_out) else embedding_backward_ref)(grad_out, ids, vocab)


@_on_tensor_device
def embedding_backward_triton(grad_out: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """:func:`embedding_backward_ref` as a stable sort of the ids and one kernel launch that sums each
    vocabulary row's tokens in token order. No atomics: deterministic."""
    tokens, d = grad_out.shape
    grad_weight = torch.empty(vocab, d, dtype=grad_out.dtype, device=grad_out.device)
    if vocab and d:
        sorted_ids, token_order = torch.sort(ids.to(torch.int32), stable=True)
        vocab_rows = torch.arange(vocab + 1, dtype=torch.int32, device=ids.device)
        row_start = torch.searchsorted(sorted_ids, vocab_rows, out_int32=True)  # [vocab + 1]: row v is [start v, start v+1)
        block, rows = min(triton.next_power_of_2(d), 1024), 8
        _embedding_backward_kernel[(triton.cdiv(vocab, rows), triton.cdiv(d, block))](
            grad_out, token_order, row_start, grad_weight, vocab, d, ROWS=rows, BLOCK=block)
    return grad_weight


# --------------------------------------------------------------------------------------------------
# finishing reductions of a fused GEMM's tile partials
# --------------------------------------------------------------------------------------------------
#: partials one program of a finisher reads a step, and at most this many tiles' partials of an output
_FINISH_ELEMENTS, _FINISH_MAX_TILES = 4096, 64


def finish_rstd_ref(partial_sumsq: torch.Tensor, width: int, eps: float) -> torch.Tensor:
    return finish.rstd_from_partial_sumsq(partial_sumsq, width, eps)


def finish_rstd(partial_sumsq: torch.Tensor, width: int, eps: float) -> torch.Tensor:
    """``rstd[m] = rsqrt(sum_t partial_sumsq[m, t] / width + eps)``."""
    return (finish_rstd_triton if _use_triton(partial_sumsq) else finish_rstd_ref)(partial_sumsq, width, eps)


@_on_tensor_device
def finish_rstd_triton(partial_sumsq: torch.Tensor, width: int, eps: float) -> torch.Tensor:
    return _finish(partial_sumsq, over_rows=False, dtype=torch.float32, scale=1.0 / width, eps=eps, rsqrt=True)


def finish_row_mean_ref(partial: torch.Tensor, width: int) -> torch.Tensor:
    return finish.sum_row_partials(partial) / width


def finish_row_mean(partial: torch.Tensor, width: int) -> torch.Tensor:
    """``out[m] = sum_t partial[m, t] / width`` (``mean_z_dz`` from a program's ``partial_z_dz``)."""
    return (finish_row_mean_triton if _use_triton(partial) else finish_row_mean_ref)(partial, width)


@_on_tensor_device
def finish_row_mean_triton(partial: torch.Tensor, width: int) -> torch.Tensor:
    return _finish(partial, over_rows=False, dtype=torch.float32, scale=1.0 / width)


def finish_col_sum_ref(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return finish.sum_col_partials(partial).to(dtype)


def finish_col_sum(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out[n] = sum_t partial[t, n]`` rounded once to ``dtype`` (a norm weight's gradient from its partials)."""
    return (finish_col_sum_triton if _use_triton(partial) else finish_col_sum_ref)(partial, dtype)


@_on_tensor_device
def finish_col_sum_triton(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _finish(partial, over_rows=True, dtype=dtype)


def finish_cross_entropy_ref(partial_lse: torch.Tensor, partial_target: torch.Tensor) -> torch.Tensor:
    return finish.logsumexp_from_partials(partial_lse) - finish.sum_row_partials(partial_target)


def finish_cross_entropy(partial_lse: torch.Tensor, partial_target: torch.Tensor) -> torch.Tensor:
    """``row_loss[m] = logsumexp_t(partial_lse[m, t]) - sum_t partial_target[m, t]`` (the LM head's
    cross-entropy per row from ``rms_lm_head_cross_entropy``'s partials; ignored rows are masked later)."""
    impl = finish_cross_entropy_triton if _use_triton(partial_lse) else finish_cross_entropy_ref
    return impl(partial_lse, partial_target)


@_on_tensor_device
def finish_cross_entropy_triton(partial_lse: torch.Tensor, partial_target: torch.Tensor) -> torch.Tensor:
    n_rows, n_tiles = partial_lse.shape
    if partial_target.shape != partial_lse.shape:
        raise ValueError(f"partial_target: expected the shape of partial_lse {tuple(partial_lse.shape)}, got "
                         f"{tuple(partial_target.shape)}")
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=partial_lse.device)
    if n_rows:
        rows, tiles = _finish_step(n_rows, n_tiles)
        _finish_cross_entropy_kernel[(triton.cdiv(n_rows, rows),)](
            partial_lse, partial_target, row_loss, n_rows, n_tiles, *partial_lse.stride(), *partial_target.stride(),
            ROWS=rows, TILES=tiles)
    return row_loss


def _finish_step(n_out: int, n_tiles: int) -> tuple[int, int]:
    """(outputs per program, tiles per step) of a finisher: at most :data:`_FINISH_MAX_TILES` tiles and
    :data:`_FINISH_ELEMENTS` partials a step."""
    tiles = min(triton.next_power_of_2(max(n_tiles, 1)), _FINISH_MAX_TILES)
    return min(triton.next_power_of_2(n_out), _FINISH_ELEMENTS // tiles), tiles


def _finish(partial: torch.Tensor, *, over_rows: bool, dtype: torch.dtype, scale: float = 1.0, eps: float = 0.0,
            rsqrt: bool = False) -> torch.Tensor:
    """One launch of the finisher over fp32 ``partial``: a sum along its rows (``over_rows``: the tiles are
    rows, one output per column) or along its columns (one output per row)."""
    n_tiles, n_out = partial.shape if over_rows else partial.shape[::-1]
    tile_stride, out_stride = partial.stride() if over_rows else partial.stride()[::-1]
    out = torch.empty(n_out, dtype=dtype, device=partial.device)
    if n_out:
        outs, tiles = _finish_step(n_out, n_tiles)
        _finish_partials_kernel[(triton.cdiv(n_out, outs),)](partial, out, n_out, n_tiles, out_stride, tile_stride,
                                                             scale, eps, RSQRT=rsqrt, OUTS=outs, TILES=tiles)
    return out
