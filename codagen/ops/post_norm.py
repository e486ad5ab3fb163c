"""A GEMM whose output is normalized before its residual add: the sandwich norms of Gemma and GLM-4 and the
post-norms of OLMo 2, ``x = residual + RMSNorm(inp @ W^T) * post_norm_weight``, with the next norm's statistics.

The post-norm needs the whole row of the GEMM's output, which no output tile holds, so the op is the GEMM (LoRA's
low-rank pair in it) and one row kernel after it (:mod:`.kernels.post_norm`), not a single epilogue; the backward
is that kernel's RMSNorm backward, then the GEMM's input and weight gradients.
"""
from __future__ import annotations

import torch
from torch import Tensor

from codagen.epilogue import library

from . import _checks as check
from . import kernels
from ._custom_op import custom_op, named_gradients
from ._fp8 import check_fp8
from ._fused import lora_args, low_rank_operand, run, stats_like
from .low_rank import LowRank
from .residual import _linear_backward

__all__ = ["linear_post_norm_residual_rms"]


def _fake_forward(inp, weight, residual, norm_weight, **_):
    rows = residual.shape[0] if norm_weight is not None else 0
    return (torch.empty_like(residual), residual.new_empty(rows, residual.shape[1]), stats_like(residual, rows),
            torch.empty_like(residual), stats_like(residual, residual.shape[0]))


@custom_op("linear_post_norm_residual_rms", fake=_fake_forward)
def _linear_post_norm_residual_rms_op(inp: Tensor, weight: Tensor, residual: Tensor, post_norm_weight: Tensor,
                                      norm_weight: Tensor | None, eps: float, lora_u: Tensor | None,
                                      lora_b: Tensor | None,
                                      fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(x, normed, rstd, y, rstd_y)``: ``y = inp @ W_eff^T`` (one GEMM), then the row kernel; without a
    ``norm_weight`` ``normed`` and ``rstd`` are empty (no norm next)."""
    y = run(library.linear(), inp, weight, lora_u, lora_b, fp8)["out"]
    x, normed, rstd, rstd_y = kernels.post_norm_residual(y, residual, post_norm_weight, norm_weight, eps)
    if norm_weight is None:
        normed, rstd = residual.new_empty(0, residual.shape[1]), stats_like(residual, 0)
    return x, normed, rstd, y, rstd_y


@custom_op("post_norm_backward", fake=lambda y, rstd_y, post_norm_weight, grad_x: (
    torch.empty_like(y), torch.empty_like(post_norm_weight)))
def _post_norm_backward_op(y: Tensor, rstd_y: Tensor, post_norm_weight: Tensor,
                           grad_x: Tensor) -> tuple[Tensor, Tensor]:
    return kernels.post_norm_backward(y, rstd_y, post_norm_weight, grad_x)


class _LinearPostNormResidualRms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, residual, post_norm_weight, norm_weight, eps, lora_a, lora_b, lora_scale, fp8):
        lora_u = low_rank_operand(inp, lora_a, lora_scale)
        x, normed, rstd, y, rstd_y = _linear_post_norm_residual_rms_op(inp, weight, residual, post_norm_weight,
                                                                       norm_weight, eps, lora_u, lora_b, fp8)
        ctx.save_for_backward(inp, weight, post_norm_weight, y, rstd_y, lora_a, lora_b, lora_u)
        ctx.lora_scale, ctx.fp8 = lora_scale, fp8
        ctx.mark_non_differentiable(normed, rstd)
        ctx.set_materialize_grads(False)
        return x, normed, rstd  # normed, rstd empty without a next norm

    @staticmethod
    @named_gradients(forward)
    def backward(ctx, needs, grad_x, _grad_normed, _grad_rstd):
        if grad_x is None:
            return {}
        inp, weight, post_norm_weight, y, rstd_y, lora_a, lora_b, lora_u = ctx.saved_tensors
        grad_x = grad_x.contiguous()
        grad_y, grad_post_norm_weight = _post_norm_backward_op(y, rstd_y, post_norm_weight, grad_x)
        grad_inp, grad_weight, grad_lora_a, grad_lora_b = _linear_backward(
            grad_y, inp, weight, (lora_a, lora_b, lora_u, ctx.lora_scale), weight_grad=needs["weight"],
            input_grad=needs["inp"], fp8=ctx.fp8)
        # the next norm's weight belongs to its consumer (ownership rule); the residual passes its gradient on
        return dict(inp=grad_inp, weight=grad_weight, residual=grad_x, post_norm_weight=grad_post_norm_weight,
                    lora_a=grad_lora_a, lora_b=grad_lora_b)


def linear_post_norm_residual_rms(inp: Tensor, weight: Tensor, residual: Tensor, post_norm_weight: Tensor,
                                  norm_weight: Tensor | None, eps: float, *,
                                  low_rank: LowRank | None = None,
                                  fp8: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``x = residual + RMSNorm(inp @ weight^T) * post_norm_weight``; returns ``(x, normed = x * norm_weight, rstd)``,
    or ``(x, None, None)`` with ``norm_weight=None``, where no norm comes next (OLMo 2's next GEMM reads ``x``).

    ``RMSNorm(y) = y * rsqrt(mean(y^2) + eps)``, and ``rstd = rsqrt(mean(x^2) + eps)`` for the next norm, whose
    consumer owns its backward (``normed`` and ``rstd`` are non-differentiable). One GEMM (with
    ``low_rank=LowRank(a, b, scale)``, LoRA's ``weight + scale * b @ a`` as its low-rank operand pair) and one row
    kernel (:mod:`codagen.ops.kernels.post_norm`).

    Backward: the post-norm's RMSNorm backward and ``post_norm_weight``'s gradient in one row kernel (plus the
    column sum of its partials), then ``grad_inp = grad_y @ W`` and ``grad_W = grad_y^T @ inp``;
    ``grad_residual = grad_x``. Saved: ``inp``, ``weight``, ``y`` and its ``rstd`` [M]. ``fp8=True``: the GEMMs on
    e4m3 operands in blockwise groups (:mod:`codagen.ops._fp8`; bf16 inputs, no ``low_rank``); ``normed`` stays bf16
    (the row kernel writes it).
    """
    inp = check.activation("inp", inp, desc="[tokens, inp features]")
    like = check.Like("inp", inp)
    residual = check.activation("residual", residual, rows=inp.shape[0], like=like, desc="[inp tokens, features]")
    d = residual.shape[1]
    if d > kernels.post_norm.MAX_COLUMNS:
        raise ValueError(f"residual: {d} features; the post-norm kernel takes at "
                         f"most {kernels.post_norm.MAX_COLUMNS}")
    weight = check.weight("weight", weight, (d, inp.shape[1]), "[residual features, inp features]", like)
    post_norm_weight = check.vector("post_norm_weight", post_norm_weight, d, "[residual features]", like)
    if norm_weight is not None:
        norm_weight = check.vector("norm_weight", norm_weight, d, "[residual features]", like).detach()
    low_rank = check.low_rank("low_rank", low_rank, inp.shape[1], d, like)
    fp8 = check_fp8(fp8, inp, low_rank)
    x, normed, rstd = _LinearPostNormResidualRms.apply(inp, weight, residual, post_norm_weight, norm_weight,
                                                       check.eps(eps), *lora_args(low_rank), fp8)
    return (x, normed, rstd) if norm_weight is not None else (x, None, None)
