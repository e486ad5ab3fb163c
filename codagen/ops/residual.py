"""The producers of the residual stream: the first block's norm statistics and F1/F3, the out-projection
with its residual add and the next norm's statistics (``codagen/ops/_fused.py`` has the norm split).
"""
from __future__ import annotations

import torch
from torch import Tensor

from codagen.epilogue import library

from . import _checks as check
from . import kernels
from ._custom_op import custom_op, named_gradients
from ._fp8 import GROUP, Quantized, blockwise, check_fp8
from ._fused import (
    fake_grad,
    lora_args,
    low_rank_grad_operand,
    low_rank_grads,
    low_rank_operand,
    or_empty,
    run,
    stats_like,
    weight_gradient,
)
from .low_rank import LowRank

__all__ = ["rms_norm_stats", "out_proj_residual_rms", "producer_forward", "normed_output"]


# ==================================================================================================
# rms_norm_stats: the first block's norm (no producer GEMM)
# ==================================================================================================
@custom_op("rms_norm_stats", fake=lambda x, **_: (torch.empty_like(x), stats_like(x, x.shape[0])))
def _rms_norm_stats_op(x: Tensor, norm_weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return kernels.rms_norm_stats(x, norm_weight, eps)


def rms_norm_stats(x: Tensor, norm_weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """RMSNorm statistics without a GEMM: ``normed = x * norm_weight`` and ``rstd = rsqrt(mean(x^2) + eps)``.

    For the first block, whose residual stream (the embeddings) no fused GEMM produces. Both outputs
    are non-differentiable: the norm's consumer op owns its backward. ``rstd`` is float32 [M]
    (float64 for float64 ``x``).
    """
    x = check.activation("x", x)
    norm_weight = check.vector("norm_weight", norm_weight, x.shape[1], "[x features]", check.Like("x", x))
    eps = check.eps(eps)
    return _rms_norm_stats_op(x.detach(), norm_weight.detach(), eps)


# ==================================================================================================
# F1/F3: out-projection + residual + RMSNorm statistics
# ==================================================================================================
@custom_op("out_proj_residual_rms", fake=lambda residual, **_: (torch.empty_like(residual), torch.empty_like(residual),
                                                               stats_like(residual, residual.shape[0])))
def out_proj_residual_rms_op(inp: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                             lora_u: Tensor | None, lora_b: Tensor | None,
                             fp8: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(x = inp @ W_eff^T + residual, normed = x * norm_weight, rstd)``, one GEMM + the rstd finisher."""
    out = run(library.residual_rms_stats(), inp, weight, lora_u, lora_b, fp8, residual=residual,
              norm_weight=norm_weight)
    rstd = kernels.finish_rstd(out["partial_sumsq"], residual.shape[1], eps)
    return out["residual_out"], out["normed"], rstd


def _fake_quantized_normed(residual, **_):
    m, d = residual.shape
    return (torch.empty_like(residual), residual.new_empty(m, d, dtype=torch.uint8),
            residual.new_empty(m, d // GROUP, dtype=torch.float32), stats_like(residual, m))


@custom_op("out_proj_residual_rms_fp8", fake=_fake_quantized_normed)
def out_proj_residual_rms_fp8_op(inp: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor,
                                 eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FP8 with ``normed`` stored for the next FP8 GEMM: ``(x, normed`` as e4m3 bits ``, its scales [M, d / 128],
    rstd)``, one blockwise GEMM + the rstd finisher (``d`` a multiple of 128)."""
    program = library.residual_rms_stats().with_quantized_store("normed", "n", GROUP)
    out = blockwise(program, inp, weight, b_block=True, residual=residual, norm_weight=norm_weight)
    rstd = kernels.finish_rstd(out["partial_sumsq"], residual.shape[1], eps)
    return out["residual_out"], out["normed"].view(torch.uint8), out["normed_scale"], rstd


def producer_forward(inp: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                     lora_u: Tensor | None, lora_b: Tensor | None, fp8: bool) -> tuple[Tensor, ...]:
    """A producer's forward: ``(x, normed, rstd)``, or with ``fp8`` and whole groups of 128 columns ``(x, normed``
    as e4m3 bits ``, rstd, normed's scales)``, which :func:`normed_output` makes the consumer's operand."""
    if fp8 and residual.shape[1] % GROUP == 0:
        x, codes, scale, rstd = out_proj_residual_rms_fp8_op(inp, weight, residual, norm_weight, eps)
        return x, codes, rstd, scale
    return out_proj_residual_rms_op(inp, weight, residual, norm_weight, eps, lora_u, lora_b, fp8)


def normed_output(normed: Tensor, scale: tuple[Tensor, ...]) -> Tensor | Quantized:
    """A producer Function's ``normed`` output as the ops hand it on: bf16, or :class:`Quantized` from its e4m3 bits
    and ``scale`` (its one extra output)."""
    return Quantized(normed.view(torch.float8_e4m3fn), scale[0]) if scale else normed


@custom_op("linear_backward", fake=lambda inp, weight, weight_grad, input_grad, lora_a, lora_b, **_: (
    fake_grad(inp, input_grad, inp), fake_grad(weight, weight_grad, inp), fake_grad(lora_a, True, inp),
    fake_grad(lora_b, True, inp)))
def _linear_backward_op(grad_out: Tensor, inp: Tensor, weight: Tensor, weight_grad: bool, input_grad: bool,
                        lora_a: Tensor | None, lora_b: Tensor | None, lora_u: Tensor | None,
                        lora_scale: float, grad_residual: Tensor | None = None,
                        fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """B8 + B9: ``grad_inp = grad_out @ W_eff [+ grad_residual]`` (with ``input_grad``; ``grad_residual``: the
    gradient of the residual stream that ``inp`` also is, added in the GEMM's store), ``grad_W = grad_out^T @ inp``
    (with ``weight_grad``) and the low-rank update's ``(grad_a, grad_b)`` (empty tensors where not computed);
    ``fp8``: both GEMMs on e4m3 operands."""
    grad_b_u = low_rank_grad_operand(grad_out, lora_b, lora_scale)
    residual = {} if grad_residual is None else {"grad_residual": grad_residual}
    grad_inp = (run(library.input_grad(grad_residual is not None), grad_out, weight, grad_b_u, lora_a, fp8,
                    **residual)["grad_input"] if input_grad else None)
    grad_weight = weight_gradient(grad_out, inp, fp8) if weight_grad else None
    grad_lora_a = grad_lora_b = None
    if lora_a is not None:
        grad_lora_a, grad_lora_b = low_rank_grads(grad_out, inp, lora_u, grad_b_u)
    return (or_empty(grad_inp, inp), or_empty(grad_weight, inp), or_empty(grad_lora_a, inp),
            or_empty(grad_lora_b, inp))


def _linear_backward(grad: Tensor, inp: Tensor, weight: Tensor, lora: tuple, *, weight_grad: bool,
                    input_grad: bool, grad_residual: Tensor | None = None, fp8: bool = False
                    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """``codagen::linear_backward`` with the gradients nobody needs skipped (a frozen weight's, or the
    input's when it comes from frozen layers); ``lora = (lora_a, lora_b, lora_u, lora_scale)``; ``grad_residual``
    joins ``grad_inp`` in its store. Returns ``(grad_inp, grad_weight, grad_lora_a, grad_lora_b)`` with None for
    what is not computed."""
    lora_a, lora_b, lora_u, lora_scale = lora
    grad_inp, grad_weight, grad_lora_a, grad_lora_b = _linear_backward_op(
        grad, inp, weight, weight_grad, input_grad, lora_a, lora_b, lora_u, lora_scale, grad_residual, fp8)
    present = lora_a is not None
    return (grad_inp if input_grad else None, grad_weight if weight_grad else None, grad_lora_a if present else None,
            grad_lora_b if present else None)


class _OutProjResidualRms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, residual, norm_weight, eps, lora_a, lora_b, lora_scale, fp8):
        lora_u = low_rank_operand(inp, lora_a, lora_scale)
        residual_out, normed, rstd, *scale = producer_forward(inp, weight, residual, norm_weight, eps, lora_u, lora_b,
                                                              fp8)
        ctx.save_for_backward(inp, weight, lora_a, lora_b, lora_u)
        ctx.lora_scale, ctx.fp8 = lora_scale, fp8
        ctx.mark_non_differentiable(normed, rstd, *scale)
        ctx.set_materialize_grads(False)
        return residual_out, normed, rstd, *scale

    @staticmethod
    @named_gradients(forward)
    def backward(ctx, needs, grad_residual_out, *_grad_stats):
        if grad_residual_out is None:
            return {}
        inp, weight, lora_a, lora_b, lora_u = ctx.saved_tensors
        grad = grad_residual_out.contiguous()
        grad_inp, grad_weight, grad_lora_a, grad_lora_b = _linear_backward(
            grad, inp, weight, (lora_a, lora_b, lora_u, ctx.lora_scale), weight_grad=needs["weight"],
            input_grad=needs["inp"], fp8=ctx.fp8)
        # residual_out = inp @ W^T + residual: the residual's gradient passes through unchanged; the
        # norm weight's gradient belongs to the norm's consumer (ownership rule).
        return dict(inp=grad_inp, weight=grad_weight, residual=grad, lora_a=grad_lora_a, lora_b=grad_lora_b)


def out_proj_residual_rms(inp: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor,
                          eps: float, *, low_rank: LowRank | None = None,
                          fp8: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """F1/F3: ``x = inp @ weight^T + residual``; returns ``(x, normed = x * norm_weight, rstd)``.

    One GEMM: the epilogue adds the residual tile, stores ``x`` and ``normed`` and writes per-tile
    partial sums of ``x^2``, finished to ``rstd = rsqrt(sum / d + eps)``. ``normed`` and ``rstd`` are
    non-differentiable (the norm's consumer owns its backward).

    ``low_rank=LowRank(a, b, scale)``: ``weight + scale * b @ a`` (LoRA) in the same GEMM, through its
    low-rank operand pair ``(scale * inp @ a^T, b)``.

    ``fp8=True``: every GEMM, forward and backward, on e4m3 operands in blockwise groups (:mod:`codagen.ops._fp8`);
    bf16 inputs, no ``low_rank``. Where ``d`` is a multiple of 128, ``normed`` comes back as ``_fp8.Quantized``:
    e4m3 with a scale per row and 128 columns, stored by the GEMM as the next FP8 GEMM reads it.

    Backward: ``grad_inp = grad_x @ W`` (B8, with the pair ``(scale * grad_x @ b, a)``), ``grad_W = grad_x^T @
    inp`` (B9, skipped when ``weight`` needs no gradient), ``grad_residual = grad_x``; ``grad_b = grad_x^T @ u``,
    ``grad_a = (scale * grad_x @ b)^T @ inp``. Saved: ``inp``, ``weight`` (and ``u`` [M, r]).
    """
    inp = check.activation("inp", inp, desc="[tokens, inp features]")
    like = check.Like("inp", inp)
    residual = check.activation("residual", residual, rows=inp.shape[0], like=like, desc="[inp tokens, features]")
    d = residual.shape[1]
    weight = check.weight("weight", weight, (d, inp.shape[1]), "[residual features, inp features]", like)
    norm_weight = check.vector("norm_weight", norm_weight, d, "[residual features]", like)
    low_rank = check.low_rank("low_rank", low_rank, inp.shape[1], d, like)
    fp8 = check_fp8(fp8, inp, low_rank)
    x, normed, rstd, *scale = _OutProjResidualRms.apply(inp, weight, residual, norm_weight.detach(), check.eps(eps),
                                                        *lora_args(low_rank), fp8)
    return x, normed_output(normed, scale), rstd
