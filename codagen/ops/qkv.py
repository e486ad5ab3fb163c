"""F4 (+ B1, B2, B3): the RMSNorm-scaled QKV projection + RoPE, optionally with QK-norm, one GEMM; and OLMo 2's
QKV projection of an un-normed input with QK-norm over the whole Q and K projections (:func:`qkv_norm_rope`).

With QK-norm of heads that no epilogue sub-tile holds whole (:func:`qk_norm_in_epilogue`; Gemma 3's head_dim
256), F4 is two launches: the GEMM stores ``z`` and a row kernel (:mod:`codagen.ops.kernels.qk_norm_rope`)
normalizes and rotates it. Backward: B1 a row kernel (:mod:`codagen.ops.kernels.rope`, with QK-norm
:mod:`codagen.ops.kernels.rope_qk_norm`), then the norm consumer's backward B2 + B3
(:func:`codagen.ops._fused.consumer_rms_norm_backward`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from codagen.epilogue import library

from . import _checks as check
from . import kernels
from ._checks import stats_dtype
from ._custom_op import custom_op, named_gradients
from ._fp8 import check_fp8, consumer_operand, op_operand
from ._fused import (
    consumer_backward_outputs,
    consumer_gradients,
    consumer_input_grad,
    consumer_rms_norm_backward,
    fake_consumer_grads,
    fake_grad,
    lora_args,
    low_rank_operand,
    low_rank_pair,
    or_empty,
    run,
)
from .layouts import kv_heads_of
from .low_rank import LowRank
from .residual import _linear_backward_op

__all__ = ["rms_qkv_rope", "qkv_norm_rope", "qk_norm_in_epilogue", "QK_NORM_SUB_TILE_16BIT",
           "QK_NORM_SUB_TILE_32BIT"]

#: the widest epilogue sub-tile (``BLOCK_N / EPILOGUE_SPLIT`` columns) that every Triton configuration pool offers
#: outside decode (:mod:`codagen.backends.triton.configs`), for fp16/bf16 operands and for fp32 ones
QK_NORM_SUB_TILE_16BIT, QK_NORM_SUB_TILE_32BIT = 128, 64


# ==================================================================================================
# plain: RoPE only
# ==================================================================================================
@custom_op("rms_qkv_rope", fake=lambda normed, qkv_weight, **_: qkv_weight.new_empty(normed.shape[0],
                                                                                     qkv_weight.shape[0]))
def _rms_qkv_rope_op(normed: Tensor, rstd: Tensor, qkv_weight: Tensor, positions: Tensor, frequencies: Tensor,
                     bias: Tensor | None, lora_u: Tensor | None, lora_b: Tensor | None, fp8: bool = False,
                     normed_scale: Tensor | None = None) -> Tensor:
    """``normed_scale``: ``normed`` is e4m3 bits with these scales (:func:`codagen.ops._fp8.consumer_operand`)."""
    vectors = {} if bias is None else {"bias": bias}
    return run(library.rms_qkv_rope(bias=bias is not None), consumer_operand(normed, normed_scale), qkv_weight, lora_u,
               lora_b, fp8, rstd=rstd, positions=positions, frequencies=frequencies, **vectors)["qkv"]


def _fake_backward(x, norm_weight, qkv_weight, weight_grad, input_grad, lora_a, lora_b, bias, bias_grad, **_):
    return (*fake_consumer_grads(x, norm_weight, qkv_weight, weight_grad, input_grad, lora_a, lora_b),
            fake_grad(bias, bias_grad, x))


@custom_op("rms_qkv_rope_backward", fake=_fake_backward)
def _rms_qkv_rope_backward_op(grad_blocks: list[Tensor], grad_residual: Tensor | None, qkv: Tensor, x: Tensor,
                              rstd: Tensor, norm_weight: Tensor, qkv_weight: Tensor, positions: Tensor,
                              frequencies: Tensor, weight_grad: bool, input_grad: bool, lora_a: Tensor | None,
                              lora_b: Tensor | None, lora_u: Tensor | None, lora_scale: float,
                              bias: Tensor | None, bias_grad: bool,
                              fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grad_z, mean_z_dz = kernels.rope_backward(grad_blocks, qkv, positions, frequencies, x.shape[1], bias)  # B1
    # the bias's gradient: grad_z summed over the tokens, in fp32 (one column reduction)
    grad_bias = or_empty(None if not bias_grad else grad_z.sum(dim=0, dtype=torch.float32).to(bias.dtype), x)
    return consumer_backward_outputs(x, consumer_rms_norm_backward(  # B2, B3
        grad_z, qkv_weight, x, rstd, norm_weight, mean_z_dz, grad_residual, weight_grad=weight_grad,
        input_grad=input_grad, lora_a=lora_a, lora_b=lora_b, lora_u=lora_u, lora_scale=lora_scale, fp8=fp8), grad_bias)


def _contiguous(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


def _split_outputs(qkv: Tensor, split_sizes: tuple[int, ...] | None) -> tuple[Tensor, ...]:
    """``(qkv,)``, or its column blocks as views: each then gets its own gradient in the backward."""
    return (qkv,) if split_sizes is None else qkv.split(split_sizes, dim=1)


def _grad_blocks(grads: tuple[Tensor | None, ...], split_sizes: tuple[int, ...] | None,
                 like: Tensor) -> list[Tensor] | None:
    """The gradients of the qkv outputs (qkv, or q, k, v) as B1 takes them, in place (its launcher fixes
    any layout its kernel cannot read); an unused output's as zeros; ``None`` when no output has one."""
    if all(g is None for g in grads):
        return None
    widths = split_sizes or (like.shape[1],)
    return [like.new_zeros(like.shape[0], width) if g is None else g for g, width in zip(grads, widths)]




class _RmsQkvRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normed, rstd, norm_weight, qkv_weight, positions, frequencies, bias, split_sizes, lora_a,
                lora_b, lora_scale, fp8, normed_scale):
        lora_u = low_rank_operand(normed, lora_a, lora_scale)
        qkv = _rms_qkv_rope_op(normed, rstd, qkv_weight, positions, frequencies, bias, lora_u, lora_b, fp8,
                               normed_scale)
        ctx.save_for_backward(qkv, x, rstd, norm_weight, qkv_weight, positions, frequencies, lora_a, lora_b, lora_u,
                              bias)
        ctx.split_sizes, ctx.lora_scale, ctx.fp8 = split_sizes, lora_scale, fp8
        ctx.set_materialize_grads(False)
        return *_split_outputs(qkv, split_sizes), x.view_as(x)

    @staticmethod
    @named_gradients(forward)
    def backward(ctx, needs, *grads):
        *grad_outputs, grad_residual = grads
        qkv, x, rstd, norm_weight, qkv_weight, positions, frequencies, lora_a, lora_b, lora_u, bias = ctx.saved_tensors
        grad_blocks = _grad_blocks(tuple(grad_outputs), ctx.split_sizes, qkv)
        if grad_blocks is None:  # only the residual path carries a gradient
            return dict(x=grad_residual)
        named, (grad_bias,) = consumer_gradients(needs, _rms_qkv_rope_backward_op(
            grad_blocks, _contiguous(grad_residual), qkv, x, rstd, norm_weight, qkv_weight, positions, frequencies,
            needs["qkv_weight"], consumer_input_grad(needs), lora_a, lora_b, lora_u,
            ctx.lora_scale, bias, needs["bias"], ctx.fp8), "qkv_weight", lora_a)
        return dict(**named, bias=grad_bias if needs["bias"] else None)


# ==================================================================================================
# with QK-norm: each Q and K head normalized before RoPE
# ==================================================================================================
def _qk_norm_columns(q_norm_weight: Tensor, k_norm_weight: Tensor, num_heads: int,
                    num_kv_heads: int) -> tuple[Tensor, Tensor]:
    """The per-column vectors of the QK-norm program (columns ``[Q heads | K heads | V heads]``):
    ``qk_norm_weight`` [N] = q_norm's weight on each Q head, k_norm's on each K head, 0 on V;
    ``qk_passthrough`` [N] = 0 on Q/K, 1 on V."""
    head_dim = q_norm_weight.shape[0]
    v_zeros = q_norm_weight.new_zeros(num_kv_heads * head_dim)
    weight = torch.cat((q_norm_weight.repeat(num_heads), k_norm_weight.repeat(num_kv_heads),
                        v_zeros))
    passthrough = torch.cat((q_norm_weight.new_zeros((num_heads + num_kv_heads) * head_dim), v_zeros + 1))
    return weight, passthrough



def qk_norm_in_epilogue(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether QK-norm of heads of ``head_dim`` columns runs in the QKV GEMM's epilogue for operands of ``dtype``
    (program ``rms_qkv_rope_qk_norm``, one launch): where ``head_dim`` divides the widest epilogue sub-tile,
    :data:`QK_NORM_SUB_TILE_16BIT` for fp16/bf16, :data:`QK_NORM_SUB_TILE_32BIT` for fp32 and fp64 (the sub-tile
    widths are powers of two, so a head that divides no wider one fits none). Elsewhere the GEMM stores ``z``
    (program ``rms_linear``) and :func:`codagen.ops.kernels.qk_norm_rope` normalizes and rotates it. The rule reads
    only the shape and dtype, so every backend runs the same path for the same call."""
    widest = QK_NORM_SUB_TILE_16BIT if dtype.itemsize == 2 else QK_NORM_SUB_TILE_32BIT
    return widest % head_dim == 0


def _fake_qk_norm_forward(normed, qkv_weight, **_):
    shape = (normed.shape[0], qkv_weight.shape[0])
    return qkv_weight.new_empty(shape), qkv_weight.new_empty(shape)


def _run_qk_norm(save_preact: bool, normed: Tensor, rstd: Tensor, qkv_weight: Tensor, positions: Tensor,
                 frequencies: Tensor, q_norm_weight: Tensor, k_norm_weight: Tensor, num_heads: int, eps: float,
                 lora_u: Tensor | None, lora_b: Tensor | None, fp8: bool,
                 normed_scale: Tensor | None) -> dict[str, Tensor]:
    head_dim = q_norm_weight.shape[0]
    # the sub-tiles are those of the weight's dtype (e4m3 operands: their activations')
    if not qk_norm_in_epilogue(head_dim, qkv_weight.dtype):  # two launches: z from the GEMM, then a row kernel
        normed = consumer_operand(normed, normed_scale)
        z = run(library.rms_linear(), normed, qkv_weight, lora_u, lora_b, fp8, rstd=rstd)["out"]
        qkv = kernels.qk_norm_rope(z, positions, frequencies, q_norm_weight, k_norm_weight, num_heads, eps)
        return dict(qkv=qkv, preact=z)
    qk_norm_weight, qk_passthrough = _qk_norm_columns(
        q_norm_weight, k_norm_weight, num_heads, kv_heads_of(qkv_weight.shape[0], head_dim, num_heads))
    return run(library.rms_qkv_rope(head_dim, eps, save_preact), consumer_operand(normed, normed_scale), qkv_weight,
               lora_u, lora_b, fp8, rstd=rstd,
               positions=positions, frequencies=frequencies, qk_norm_weight=qk_norm_weight,
               qk_passthrough=qk_passthrough)


@custom_op("rms_qkv_rope_qk_norm", fake=_fake_qk_norm_forward)
def _rms_qkv_rope_qk_norm_op(normed: Tensor, rstd: Tensor, qkv_weight: Tensor, positions: Tensor, frequencies: Tensor,
                             q_norm_weight: Tensor, k_norm_weight: Tensor, num_heads: int,
                             eps: float, lora_u: Tensor | None, lora_b: Tensor | None,
                             fp8: bool = False, normed_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    out = _run_qk_norm(True, normed, rstd, qkv_weight, positions, frequencies, q_norm_weight, k_norm_weight,
                       num_heads, eps, lora_u, lora_b, fp8, normed_scale)
    return out["qkv"], out["preact"]


@custom_op("rms_qkv_rope_qk_norm_inference", fake=lambda **kwargs: _fake_qk_norm_forward(**kwargs)[0])
def _rms_qkv_rope_qk_norm_inference_op(normed: Tensor, rstd: Tensor, qkv_weight: Tensor, positions: Tensor,
                                       frequencies: Tensor, q_norm_weight: Tensor, k_norm_weight: Tensor,
                                       num_heads: int, eps: float, lora_u: Tensor | None,
                                       lora_b: Tensor | None, fp8: bool = False,
                                       normed_scale: Tensor | None = None) -> Tensor:
    """The QK-norm forward without ``preact``: for a model that runs no backward (prefill, decode)."""
    return _run_qk_norm(False, normed, rstd, qkv_weight, positions, frequencies, q_norm_weight, k_norm_weight,
                        num_heads, eps, lora_u, lora_b, fp8, normed_scale)["qkv"]


def _fake_qk_norm_backward(x, norm_weight, qkv_weight, q_norm_weight, k_norm_weight, weight_grad, input_grad, lora_a,
                           lora_b, **_):
    return (*fake_consumer_grads(x, norm_weight, qkv_weight, weight_grad, input_grad, lora_a, lora_b),
            torch.empty_like(q_norm_weight), torch.empty_like(k_norm_weight))


@custom_op("rms_qkv_rope_qk_norm_backward", fake=_fake_qk_norm_backward)
def _rms_qkv_rope_qk_norm_backward_op(grad_blocks: list[Tensor], grad_residual: Tensor | None, preact: Tensor,
                                      x: Tensor, rstd: Tensor, norm_weight: Tensor,
                                      qkv_weight: Tensor, positions: Tensor, frequencies: Tensor,
                                      q_norm_weight: Tensor, k_norm_weight: Tensor, num_heads: int,
                                      eps: float, weight_grad: bool, input_grad: bool, lora_a: Tensor | None,
                                      lora_b: Tensor | None, lora_u: Tensor | None, lora_scale: float,
                                      fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                  Tensor]:
    # B1: RoPE backward + the Q/K heads' RMSNorm backward (+ q_norm/k_norm weight gradients)
    grad_z, mean_z_dz, grad_q_norm_weight, grad_k_norm_weight = kernels.rope_qk_norm_backward(
        grad_blocks, preact, positions, frequencies, q_norm_weight, k_norm_weight, num_heads, eps, x.shape[1])
    return consumer_backward_outputs(x, consumer_rms_norm_backward(  # B2, B3
        grad_z, qkv_weight, x, rstd, norm_weight, mean_z_dz, grad_residual, weight_grad=weight_grad,
        input_grad=input_grad, lora_a=lora_a, lora_b=lora_b, lora_u=lora_u, lora_scale=lora_scale, fp8=fp8),
        grad_q_norm_weight.to(q_norm_weight.dtype), grad_k_norm_weight.to(k_norm_weight.dtype))


class _RmsQkvRopeQkNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normed, rstd, norm_weight, qkv_weight, positions, frequencies, q_norm_weight, k_norm_weight,
                num_heads, eps, split_sizes, lora_a, lora_b, lora_scale, fp8, normed_scale):
        lora_u = low_rank_operand(normed, lora_a, lora_scale)
        qkv, preact = _rms_qkv_rope_qk_norm_op(normed, rstd, qkv_weight, positions, frequencies, q_norm_weight,
                                               k_norm_weight, num_heads, eps, lora_u, lora_b, fp8, normed_scale)
        ctx.save_for_backward(preact, x, rstd, norm_weight, qkv_weight, positions, frequencies, q_norm_weight,
                              k_norm_weight, lora_a, lora_b, lora_u)
        ctx.num_heads, ctx.eps, ctx.split_sizes, ctx.lora_scale, ctx.fp8 = num_heads, eps, split_sizes, lora_scale, fp8
        ctx.set_materialize_grads(False)
        return *_split_outputs(qkv, split_sizes), x.view_as(x)

    @staticmethod
    @named_gradients(forward)
    def backward(ctx, needs, *grads):
        *grad_outputs, grad_residual = grads
        *saved, lora_a, lora_b, lora_u = ctx.saved_tensors  # preact first
        grad_blocks = _grad_blocks(tuple(grad_outputs), ctx.split_sizes, saved[0])
        if grad_blocks is None:  # only the residual path carries a gradient
            return dict(x=grad_residual)
        grads = _rms_qkv_rope_qk_norm_backward_op(
            grad_blocks, _contiguous(grad_residual), *saved, ctx.num_heads, ctx.eps, needs["qkv_weight"],
            consumer_input_grad(needs), lora_a, lora_b, lora_u, ctx.lora_scale, ctx.fp8)
        named, (grad_q_norm_weight, grad_k_norm_weight) = consumer_gradients(needs, grads, "qkv_weight", lora_a)
        return dict(**named, q_norm_weight=grad_q_norm_weight, k_norm_weight=grad_k_norm_weight)


# ==================================================================================================
# no norm before the projection, QK-norm over the whole Q and K projections (OLMo 2)
# ==================================================================================================
@custom_op("qkv_norm_rope", fake=lambda x, qkv_weight, save_preact, **_: (
    x.new_empty(x.shape[0], qkv_weight.shape[0]), x.new_empty(x.shape[0] if save_preact else 0,
                                                              qkv_weight.shape[0])))
def _qkv_norm_rope_op(x: Tensor, qkv_weight: Tensor, positions: Tensor, frequencies: Tensor, q_norm_weight: Tensor,
                      k_norm_weight: Tensor, eps: float, lora_u: Tensor | None, lora_b: Tensor | None,
                      save_preact: bool, fp8: bool = False) -> tuple[Tensor, Tensor]:
    """``(qkv, preact = z)``: the GEMM stores ``z = x @ W_eff^T``, the row kernel normalizes and rotates it (Q and K
    one norm group each); ``preact`` empty with ``save_preact=False``."""
    z = run(library.linear(), x, qkv_weight, lora_u, lora_b, fp8)["out"]
    qkv = kernels.qk_norm_rope(z, positions, frequencies, q_norm_weight, k_norm_weight, 1, eps)
    return qkv, z if save_preact else z.new_empty(0, z.shape[1])


@custom_op("qkv_norm_rope_backward", fake=lambda x, qkv_weight, q_norm_weight, k_norm_weight, weight_grad, input_grad,
           lora_a, lora_b, **_: (fake_grad(x, input_grad, x), fake_grad(qkv_weight, weight_grad, x),
                                 fake_grad(lora_a, True, x), fake_grad(lora_b, True, x),
                                 torch.empty_like(q_norm_weight), torch.empty_like(k_norm_weight)))
def _qkv_norm_rope_backward_op(grad_blocks: list[Tensor], grad_residual: Tensor | None, preact: Tensor, x: Tensor,
                               qkv_weight: Tensor, positions: Tensor, frequencies: Tensor, q_norm_weight: Tensor,
                               k_norm_weight: Tensor, eps: float, weight_grad: bool, input_grad: bool,
                               lora_a: Tensor | None, lora_b: Tensor | None, lora_u: Tensor | None,
                               lora_scale: float,
                               fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # B1: RoPE backward + the Q and K projections' RMSNorm backward (+ q_norm/k_norm weight gradients)
    grad_z, _, grad_q_norm_weight, grad_k_norm_weight = kernels.rope_qk_norm_backward(
        grad_blocks, preact, positions, frequencies, q_norm_weight, k_norm_weight, 1, eps, x.shape[1])
    grads = _linear_backward_op(grad_z, x, qkv_weight, weight_grad, input_grad, lora_a, lora_b, lora_u, lora_scale,
                                grad_residual, fp8)  # B8 (+ the residual's), B9
    return *grads, grad_q_norm_weight.to(q_norm_weight.dtype), grad_k_norm_weight.to(k_norm_weight.dtype)


class _QkvNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, qkv_weight, positions, frequencies, q_norm_weight, k_norm_weight, eps, split_sizes, lora_a,
                lora_b, lora_scale, fp8):
        lora_u = low_rank_operand(x, lora_a, lora_scale)
        qkv, preact = _qkv_norm_rope_op(x, qkv_weight, positions, frequencies, q_norm_weight, k_norm_weight, eps,
                                        lora_u, lora_b, True, fp8)
        ctx.save_for_backward(preact, x, qkv_weight, positions, frequencies, q_norm_weight, k_norm_weight, lora_a,
                              lora_b, lora_u)
        ctx.eps, ctx.split_sizes, ctx.lora_scale, ctx.fp8 = eps, split_sizes, lora_scale, fp8
        ctx.set_materialize_grads(False)
        return *_split_outputs(qkv, split_sizes), x.view_as(x)

    @staticmethod
    @named_gradients(forward)
    def backward(ctx, needs, *grads):
        *grad_outputs, grad_residual = grads
        *saved, lora_a, lora_b, lora_u = ctx.saved_tensors  # preact first
        grad_blocks = _grad_blocks(tuple(grad_outputs), ctx.split_sizes, saved[0])
        if grad_blocks is None:  # only the residual path carries a gradient
            return dict(x=grad_residual)
        grad_x, grad_weight, grad_lora_a, grad_lora_b, grad_q_norm, grad_k_norm = _qkv_norm_rope_backward_op(
            grad_blocks, _contiguous(grad_residual), *saved, ctx.eps, needs["qkv_weight"], needs["x"], lora_a, lora_b,
            lora_u, ctx.lora_scale, ctx.fp8)
        present = lora_a is not None
        return dict(x=grad_x if needs["x"] else None, qkv_weight=grad_weight if needs["qkv_weight"] else None,
                    lora_a=grad_lora_a if present else None, lora_b=grad_lora_b if present else None,
                    q_norm_weight=grad_q_norm, k_norm_weight=grad_k_norm)


def qkv_norm_rope(x: Tensor, qkv_weight: Tensor, positions: Tensor, frequencies: Tensor, q_norm_weight: Tensor,
                  k_norm_weight: Tensor, eps: float, *, split_sizes: tuple[int, int, int] | None = None,
                  pass_residual: bool = False, low_rank: LowRank | None = None,
                  fp8: bool = False) -> Tensor | tuple[Tensor, ...]:
    """OLMo 2's attention input: ``z = x @ qkv_weight^T`` (no norm before it), an RMSNorm over the whole Q projection
    and one over the whole K projection, then RoPE: ``q = rope(RMSNorm(z_q) * q_norm_weight)``, likewise ``k``,
    ``v = z_v``.

    ``q_norm_weight`` [q columns] and ``k_norm_weight`` [k columns] (each head's channels in the pair order of
    ``qkv_weight``'s Q/K rows: :func:`rope_pairs_from_half_split` per head converts Hugging Face's); V has as many
    columns as K. ``positions``, ``frequencies``, ``split_sizes``, ``low_rank`` and ``pass_residual`` as in
    :func:`rms_qkv_rope`: with ``pass_residual=True`` the residual path's gradient joins ``grad_x`` in the input
    gradient GEMM's store (program ``input_grad_residual``).

    Two launches: the GEMM stores ``z`` (the ``preact`` the backward keeps) and one row kernel normalizes and
    rotates it (:func:`codagen.ops.kernels.qk_norm_rope`; a norm over a whole projection needs the whole row, which
    no output tile holds). Backward: B1 rotates the gradient back and applies the two norms' backward
    (:func:`codagen.ops.kernels.rope_qk_norm_backward`, with the norm weights' gradients), then ``grad_x = grad_z @
    W`` and ``grad_W = grad_z^T @ x``. Saved: ``preact``, ``x``; with autograd off nothing, and ``preact`` is not
    stored. ``fp8``: as in :func:`rms_qkv_rope`.
    """
    x = check.activation("x", x)
    like = check.Like("x", x)
    m, d = x.shape
    qkv_weight = check.weight("qkv_weight", qkv_weight, (None, d), "[q + 2 k columns, x features]", like,
                              even_rows=True)
    rows = qkv_weight.shape[0]
    positions = check.index_vector("positions", positions, m, like, allow_float=True)
    frequencies = check.vector("frequencies", frequencies, rows // 2, "[qkv features / 2]", like,
                               dtypes=(torch.float32, torch.float64))
    positions = positions.to(stats_dtype(x.dtype))  # angles are computed in fp32 registers
    q_norm_weight = check.head_vector("q_norm_weight", q_norm_weight, like)
    k_norm_weight = check.head_vector("k_norm_weight", k_norm_weight, like)
    q_cols, k_cols = q_norm_weight.shape[0], k_norm_weight.shape[0]
    if q_cols + 2 * k_cols != rows:
        raise ValueError(f"qkv_weight: expected q_norm_weight's {q_cols} + twice k_norm_weight's {k_cols} rows "
                         f"(Q, K and V), got shape {tuple(qkv_weight.shape)}")
    eps = check.eps(eps)
    split_sizes = check.split_sizes("split_sizes", split_sizes, rows, (q_cols, k_cols, k_cols))
    low_rank = check.low_rank("low_rank", low_rank, d, rows, like)
    fp8 = check_fp8(fp8, x, low_rank)
    if not torch.is_grad_enabled():  # inference: no autograd node, no preact
        qkv, _ = _qkv_norm_rope_op(x, qkv_weight, positions, frequencies, q_norm_weight, k_norm_weight, eps,
                                   *low_rank_pair(x, low_rank), False, fp8)
        return _outputs((*_split_outputs(qkv, split_sizes), x), pass_residual)
    out = _QkvNormRope.apply(x, qkv_weight, positions.detach(), frequencies.detach(), q_norm_weight, k_norm_weight,
                             eps, split_sizes, *lora_args(low_rank), fp8)
    return _outputs(out, pass_residual)


# ==================================================================================================
# the public op
# ==================================================================================================
def rms_qkv_rope(x: Tensor, normed: Tensor, rstd: Tensor, norm_weight: Tensor, qkv_weight: Tensor,
                 positions: Tensor, frequencies: Tensor, q_norm_weight: Tensor | None = None,
                 k_norm_weight: Tensor | None = None, num_heads: int | None = None,
                 qk_norm_eps: float = 1e-6, *, split_sizes: tuple[int, int, int] | None = None,
                 pass_residual: bool = False, low_rank: LowRank | None = None,
                 bias: Tensor | None = None, fp8: bool = False) -> Tensor | tuple[Tensor, ...]:
    """F4: ``qkv = rope(RMSNorm(x) @ qkv_weight^T [+ bias])`` on adjacent pairs, one GEMM; optionally QK-norm before
    RoPE.

    ``z = rstd[m] * (normed @ W^T)``; pair ``j`` of row ``m`` rotates by ``positions[m] * frequencies[j]``
    (``frequencies`` [N/2] from :func:`rope_frequencies`; V pairs are 0). Q/K rows of ``qkv_weight``
    must be in the adjacent-pair layout (:func:`rope_pairs_from_half_split`).

    QK-norm (Qwen3, OLMo-2): with ``q_norm_weight`` and ``k_norm_weight`` (both ``[head_dim]``, in the
    same pair order as the Q/K rows: ``rope_pairs_from_half_split(w, head_dim)`` converts Hugging Face's)
    and ``num_heads`` (Q heads; K and V have ``(N / head_dim - num_heads) / 2`` each), every Q and K
    head ``h`` is normalized before RoPE: ``y_h = z_h * rsqrt(mean(z_h^2) + qk_norm_eps) * gamma``
    (``gamma`` = q_norm's or k_norm's weight); V is not. Still one GEMM where an epilogue sub-tile holds whole
    heads (:func:`qk_norm_in_epilogue`: ``head_dim`` divides 128 for fp16/bf16, 64 for fp32 and fp64): the
    per-head statistic is a segmented sum in the epilogue. Any other even ``head_dim`` (Gemma 3's 256, or 96)
    takes two launches: the GEMM stores ``z`` (the ``preact`` below) and one row kernel computes ``qkv`` from it
    (:func:`codagen.ops.kernels.qk_norm_rope`), the same math; the backward is the same.

    Backward: B1 rotates ``grad_qkv`` back by ``-theta`` and computes ``mean_z_dz = sum qkv * grad_qkv / d``
    (rotations preserve dot products); with QK-norm B1 also applies each Q/K head's RMSNorm backward
    ``dz_h = rho_h (gamma g_h - zhat_h mean(zhat_h gamma g_h))`` (``rho_h`` its rstd, ``zhat_h = z_h rho_h``,
    ``g`` the un-rotated gradient), takes ``mean_z_dz = sum z dz / d`` with the pre-QK-norm ``z`` and
    writes per-row-block partials of the q_norm/k_norm gradients ``sum g zhat``. B2 is the
    RMSNorm-backward GEMM ``grad_z @ W``; B3 ``grad_W = grad_z^T @ n``.

    ``split_sizes=(q_cols, k_cols, v_cols)`` returns ``q, k, v = qkv.split(split_sizes, dim=1)`` instead of
    ``qkv``: views of the one [M, N] output, each with its own gradient. B1 then reads attention's three
    input gradients where they lie; a split of ``qkv`` made outside the op would have autograd concatenate
    them into one [M, N] gradient first (an extra read and write of it). Each size must be even
    (a RoPE pair never straddles two blocks); with QK-norm they are the heads' column counts.

    ``pass_residual=True`` also returns ``residual`` (last), ``x`` passed through: use it
    as the block's residual (the out-projection's ``residual``). Its gradient then comes back into this
    op's backward and B2 writes ``grad_x = grad_residual + norm_grad`` in its one store, where autograd
    would otherwise add the two paths' ``[M, d]`` gradients in a separate kernel.
    ``low_rank=LowRank(a, b, scale)``: ``qkv_weight + scale * b @ a`` (LoRA; ``b``'s rows in the fused row
    order of ``qkv_weight``) in the same GEMM through its low-rank pair ``(scale * normed @ a^T, b)``, so
    RoPE and QK-norm see the sum; the backward GEMM carries ``(scale * grad_z @ b, a)``.
    ``grad_qkv_weight`` is computed only when ``qkv_weight`` requires a gradient.
    ``bias`` [N] (Qwen2's Q/K/V biases, in the fused row order of ``qkv_weight``, without QK-norm): added to ``z``
    in the epilogue before RoPE (program ``rms_qkv_rope_bias``); its gradient is ``grad_z`` summed over the tokens
    after B1 (one column reduction, fp32).
    ``fp8=True``: the GEMMs, forward and backward, on e4m3 operands in blockwise groups (:mod:`codagen.ops._fp8`);
    bf16 inputs, no ``low_rank``; ``normed`` may then be ``_fp8.Quantized``, as an FP8 producer op returns it (its
    GEMM reads it as it is, with no quantize launch).

    Saved: ``qkv`` (attention keeps it alive anyway), ``x``, ``rstd``; with QK-norm ``preact = z``
    [M, N] instead of ``qkv`` (one extra activation of qkv's size: the norm's backward needs the
    pre-norm heads; ``rho`` is recomputed from it). ``n = RMSNorm(x)`` is recomputed. With autograd off
    (``torch.no_grad``) nothing is saved and ``preact`` is not stored (the two-launch path's ``z`` lives only
    until the row kernel has read it).
    """
    x = check.activation("x", x)
    like = check.Like("x", x)
    m, d = x.shape
    normed = check.normed("normed", normed, like, fp8=fp8 is True)
    rstd = check.rstd("rstd", rstd, like)
    norm_weight = check.vector("norm_weight", norm_weight, d, "[features]", like)
    qkv_weight = check.weight("qkv_weight", qkv_weight, (None, d), "[(heads + 2 kv_heads) * head_dim, features]", like,
                              even_rows=True)
    positions = check.index_vector("positions", positions, m, like, allow_float=True)
    frequencies = check.vector("frequencies", frequencies, qkv_weight.shape[0] // 2, "[qkv features / 2]", like,
                               dtypes=(torch.float32, torch.float64))
    positions = positions.to(stats_dtype(x.dtype))  # angles are computed in fp32 registers
    low_rank = check.low_rank("low_rank", low_rank, d, qkv_weight.shape[0], like)
    fp8 = check_fp8(fp8, x, low_rank)
    lora = lora_args(low_rank)
    normed, normed_scale = op_operand(normed)
    if q_norm_weight is None and k_norm_weight is None:
        if num_heads is not None:
            raise ValueError("num_heads: only used with QK-norm (give q_norm_weight and k_norm_weight too)")
        split_sizes = check.split_sizes("split_sizes", split_sizes, qkv_weight.shape[0])
        if bias is not None:
            bias = check.vector("bias", bias, qkv_weight.shape[0], "[qkv features]", like)
        out = _RmsQkvRope.apply(x, normed.detach(), rstd.detach(), norm_weight, qkv_weight, positions.detach(),
                                frequencies.detach(), bias, split_sizes, *lora, fp8, normed_scale)
        return _outputs(out, pass_residual)
    if bias is not None:  # the bias would enter before the norm, inside the kernel
        raise NotImplementedError("bias: a QKV bias together with QK-norm is not supported")
    if q_norm_weight is None or k_norm_weight is None:
        missing = "q_norm_weight" if q_norm_weight is None else "k_norm_weight"
        raise ValueError(f"{missing}: QK-norm needs both q_norm_weight and k_norm_weight, got only one")
    q_norm_weight = check.head_vector("q_norm_weight", q_norm_weight, like)
    head_dim = q_norm_weight.shape[0]
    k_norm_weight = check.vector("k_norm_weight", k_norm_weight, head_dim, "[head_dim] (that of q_norm_weight)", like)
    if num_heads is None:
        raise ValueError("num_heads: QK-norm needs the number of Q heads (to tell Q columns from K columns)")
    num_heads = check.positive_int("num_heads", num_heads)
    rows = qkv_weight.shape[0]
    if rows % head_dim:
        raise ValueError(f"qkv_weight: expected (heads + 2 kv_heads) * head_dim rows with head_dim = {head_dim} "
                         f"(q_norm_weight's length), got shape {tuple(qkv_weight.shape)}")
    kv_rows = rows // head_dim - num_heads
    if kv_rows <= 0 or kv_rows % 2:
        raise ValueError(f"num_heads: qkv_weight holds {rows // head_dim} heads of head_dim {head_dim} = num_heads + "
                         f"2 kv_heads, which num_heads = {num_heads} does not split")
    eps = check.eps(qk_norm_eps, "qk_norm_eps")
    kv_cols = kv_rows // 2 * head_dim
    split_sizes = check.split_sizes("split_sizes", split_sizes, rows, (num_heads * head_dim, kv_cols, kv_cols))
    if not torch.is_grad_enabled():  # inference: no autograd node, no preact
        qkv = _rms_qkv_rope_qk_norm_inference_op(normed, rstd, qkv_weight, positions, frequencies, q_norm_weight,
                                                 k_norm_weight, num_heads, eps, *low_rank_pair(normed, low_rank),
                                                 fp8, normed_scale)
        return _outputs((*_split_outputs(qkv, split_sizes), x), pass_residual)
    out = _RmsQkvRopeQkNorm.apply(x, normed.detach(), rstd.detach(), norm_weight, qkv_weight, positions.detach(),
                                  frequencies.detach(), q_norm_weight, k_norm_weight, num_heads, eps, split_sizes,
                                  *lora, fp8, normed_scale)
    return _outputs(out, pass_residual)


def _outputs(out: tuple[Tensor, ...], pass_residual: bool):
    """``(qkv | q, k, v[, residual])`` as the caller asked; a lone qkv unwrapped."""
    out = out if pass_residual else out[:-1]
    return out[0] if len(out) == 1 else out

