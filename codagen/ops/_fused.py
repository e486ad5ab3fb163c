"""What the fused block ops share: the low-rank operand pair, the norm consumer's backward, gradients
that are not computed.

RMSNorm is split around the GEMMs (docs/method.md section 2): the producer of the residual stream ``x``
returns ``(x, normed = x * gamma, rstd)`` with ``rstd = rsqrt(mean(x^2) + eps)``; ``normed`` and ``rstd``
are non-differentiable. The single consumer of that norm takes ``(x, normed, rstd, norm_weight)``,
multiplies its accumulator by ``rstd`` and, in backward, computes the whole RMSNorm backward for ``x``
and ``norm_weight`` (:func:`consumer_rms_norm_backward`) with the row statistic ``mean_z_dz = sum_k z dz
/ d`` taken from its own output side (docs/method.md section 3).
"""
from __future__ import annotations

import torch
from torch import Tensor

from codagen.backends import execute
from codagen.epilogue import library

from . import kernels
from ._checks import stats_dtype
from ._fp8 import GROUP, Quantized, blockwise
from .low_rank import LowRank

__all__ = ["stats_like", "or_empty", "fake_grad", "run", "weight_gradient", "low_rank_operand", "low_rank_grads",
           "low_rank_grad_operand", "lora_args", "low_rank_pair", "consumer_rms_norm_backward",
           "consumer_backward_outputs", "fake_consumer_grads", "consumer_input_grad", "consumer_gradients"]


def stats_like(x: Tensor, length: int) -> Tensor:
    """An uninitialized [length] row statistic in ``x``'s statistics dtype."""
    return x.new_empty(length, dtype=stats_dtype(x.dtype))


def or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    """``t``, or an empty tensor for a gradient not computed (a frozen weight's, an absent adapter's)."""
    return like.new_empty(0) if t is None else t


def fake_grad(t: Tensor | None, wanted: bool, like: Tensor) -> Tensor:
    """The fake of the gradient of ``t``: its shape where computed, else empty (:func:`or_empty`)."""
    return torch.empty_like(t) if wanted and t is not None else like.new_empty(0)


# --- the low-rank pair (LoRA, codagen.ops.low_rank) ------------------------------------------------
def run(program, a: Tensor, b: Tensor, a2: Tensor | None, b2: Tensor | None, fp8: bool = False,
        **tensors: Tensor) -> dict[str, Tensor]:
    """``execute(program, ...)`` of a GEMM whose ``b`` is a weight, with the GEMM's low-rank operand pair ``(a2,
    b2)`` when ``a2`` is given; ``fp8``: on e4m3 operands, the weight in blocks (:func:`codagen.ops._fp8.blockwise`;
    no low-rank pair)."""
    if fp8:
        if a2 is not None:
            raise NotImplementedError(f"{program.name}: a low-rank operand pair with FP8 GEMMs is not supported yet")
        return blockwise(program, a, b, b_block=True, **tensors)
    if a2 is None:
        return execute(program, a, b, **tensors)
    return execute(program.with_low_rank(), a, b, a2=a2, b2=b2, **tensors)


def weight_gradient(grad_out: Tensor, inp: Tensor | Quantized, fp8: bool = False) -> Tensor:
    """``grad_W = grad_out^T @ inp`` (program ``weight_grad``); ``fp8``: both operands in e4m3, grouped along the
    tokens (:func:`codagen.ops._fp8.blockwise`; ``inp`` may be quantized so already)."""
    if fp8:
        return blockwise(library.weight_grad(), grad_out, inp, b_block=False)["grad_weight"]
    return execute(library.weight_grad(), grad_out, inp)["grad_weight"]


def low_rank_operand(inp: Tensor, lora_a: Tensor | None, scale: float) -> Tensor | None:
    """``u = scale * inp @ a^T`` [M, r], the A2 operand of the forward GEMM's low-rank pair (B2 is ``b``)."""
    if lora_a is None:
        return None
    u = inp @ lora_a.t()
    return u if scale == 1.0 else u.mul_(scale)


def low_rank_grads(grad: Tensor, inp: Tensor, u: Tensor, grad_b_u: Tensor,
                   row_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(grad_a, grad_b)`` of ``out = row_scale * (... + u @ b^T)`` with ``u = scale * inp' @ a^T``:
    ``grad_b = grad^T @ (row_scale * u)`` and ``grad_a = grad_b_u^T @ inp``, where ``grad_b_u = scale *
    grad @ b`` (the backward GEMM's A2 operand) and ``inp = row_scale * inp'`` (a consumer GEMM's
    normalized input ``n``, which includes rstd; a producer's own input with ``row_scale`` None)."""
    if row_scale is not None:
        u = (u * row_scale[:, None]).to(u.dtype)
    return grad_b_u.t() @ inp, grad.t() @ u


def low_rank_grad_operand(grad: Tensor, lora_b: Tensor | None, scale: float) -> Tensor | None:
    """``scale * grad @ b`` [M, r]: the A2 operand of the input-gradient GEMM (its B2 is ``a``, "kn")."""
    if lora_b is None:
        return None
    g = grad @ lora_b
    return g if scale == 1.0 else g.mul_(scale)


def lora_args(low_rank: LowRank | None) -> tuple[Tensor | None, Tensor | None, float]:
    """``(lora_a, lora_b, lora_scale)``, the Functions' low-rank inputs."""
    return (None, None, 1.0) if low_rank is None else (low_rank.a, low_rank.b, float(low_rank.scale))


def low_rank_pair(inp: Tensor, low_rank: LowRank | None) -> tuple[Tensor | None, Tensor | None]:
    """``(u, b)``, the forward GEMM's low-rank operand pair for ``low_rank`` (:func:`low_rank_operand`; both None
    without one): what a forward without autograd passes the op directly."""
    lora_a, lora_b, scale = lora_args(low_rank)
    return low_rank_operand(inp, lora_a, scale), lora_b


# --- the norm consumer's backward -----------------------------------------------------------------
def consumer_rms_norm_backward(grad_z: Tensor, weight: Tensor, x: Tensor, rstd: Tensor, norm_weight: Tensor,
                               mean_z_dz: Tensor, grad_residual: Tensor | None = None, *, weight_grad: bool = True,
                               input_grad: bool = True, lora_a: Tensor | None = None, lora_b: Tensor | None = None,
                               lora_u: Tensor | None = None, lora_scale: float = 1.0, fp8: bool = False):
    """B2/B6 + B3/B7: the RMSNorm backward of a consumer GEMM ``z = rstd * ((x * gamma) @ W^T)``.

    One GEMM ``G = grad_z @ W`` whose epilogue writes ``grad_x = [grad_residual +] rstd * (gamma * G - c *
    mean_z_dz)`` (``c = x * rstd``), the normalized activation ``n = c * gamma`` and per-tile partials of
    ``G * c``; then the plain GEMM ``grad_W = grad_z^T @ n`` (only with ``weight_grad``) and the finishing
    sum ``grad_gamma = sum_tiles(partials)``.

    With a low-rank update (``lora_a`` [r, d], ``lora_b`` [N, r], ``lora_u = scale * normed @ a^T`` saved
    by the forward) the effective weight is ``W + scale * b @ a``: the GEMM carries the pair
    ``(scale * grad_z @ b, a)``, so ``G`` and everything in the epilogue include the update, and
    ``grad_a``, ``grad_b`` come from ``n`` and ``rstd * u`` (:func:`low_rank_grads`).

    Without ``input_grad`` (neither ``x`` nor the norm weight needs a gradient: the first block of a model
    with frozen embeddings and norms) and without ``weight_grad`` no GEMM over ``W`` runs: the low-rank
    gradients need only ``grad_a = ((g_b * rstd)^T @ x) * gamma``, which equals ``g_b^T @ n``.
    ``fp8``: both GEMMs on e4m3 operands (:func:`run`, :func:`weight_gradient`).
    Returns ``(grad_x, grad_norm_weight, grad_weight, grad_lora_a, grad_lora_b)``, None where not computed.
    """
    if not (input_grad or weight_grad):
        if lora_a is None:
            return None, None, None, None, None
        grad_b_u = low_rank_grad_operand(grad_z, lora_b, lora_scale)
        grad_lora_a = ((grad_b_u * rstd[:, None]).to(x.dtype).t() @ x) * norm_weight.to(x.dtype)
        grad_lora_b = low_rank_grads(grad_z, x, lora_u, grad_b_u, rstd)[1]
        return None, None, None, grad_lora_a, grad_lora_b
    tensors = dict(residual=x, rstd=rstd, norm_weight=norm_weight, mean_z_dz=mean_z_dz)
    if grad_residual is None:
        program = library.rms_norm_backward("none")
    else:
        program = library.rms_norm_backward("add")
        tensors["grad_residual"] = grad_residual
    if fp8:  # n as the weight gradient reads it: e4m3 in groups of tokens
        program = program.with_quantized_store("normed", "m", GROUP)
    grad_b_u = low_rank_grad_operand(grad_z, lora_b, lora_scale)
    out = run(program, grad_z, weight, grad_b_u, lora_a, fp8, **tensors)
    grad_norm_weight = kernels.finish_col_sum(out.pop("partial_grad_norm_weight"), norm_weight.dtype)
    n = Quantized(out.pop("normed"), out.pop("normed_scale")) if fp8 else out.pop("normed")
    grad_weight = weight_gradient(grad_z, n, fp8) if weight_grad else None
    grad_lora_a = grad_lora_b = None
    if lora_a is not None:
        grad_lora_a, grad_lora_b = low_rank_grads(grad_z, n, lora_u, grad_b_u, rstd)
    return out["grad_x"], grad_norm_weight, grad_weight, grad_lora_a, grad_lora_b


def consumer_backward_outputs(x: Tensor, out: tuple, *extra: Tensor) -> tuple[Tensor, ...]:
    """A consumer backward's ``(grad_x, grad_norm_weight, grad_weight, grad_lora_a, grad_lora_b, *extra)``
    with empty tensors for the gradients not computed (custom ops return tensors only)."""
    return (*(or_empty(t, x) for t in out), *extra)


def fake_consumer_grads(x, norm_weight, weight, weight_grad, input_grad, lora_a, lora_b) -> tuple[Tensor, ...]:
    """The fake of :func:`consumer_backward_outputs` (without ``extra``)."""
    return (fake_grad(x, input_grad, x), fake_grad(norm_weight, input_grad, x), fake_grad(weight, weight_grad, x),
            fake_grad(lora_a, True, x), fake_grad(lora_b, True, x))


def consumer_input_grad(needs: dict[str, bool]) -> bool:
    """Whether a consumer op's backward needs its GEMM over ``W``: for ``x`` or for the norm weight."""
    return needs["x"] or needs["norm_weight"]


def consumer_gradients(needs: dict[str, bool], grads: tuple[Tensor, ...], weight: str,
                       lora_a: Tensor | None) -> tuple[dict[str, Tensor | None], list[Tensor]]:
    """``(named, rest)`` of a consumer backward op's ``(grad_x, grad_norm_weight, grad_weight, grad_lora_a,
    grad_lora_b, *rest)``: ``named`` maps the Function's inputs ``x``, ``norm_weight``, ``weight`` (the GEMM
    weight's input name), ``lora_a`` and ``lora_b`` to their gradients, None for the ones not computed
    (frozen weight, no adapter; ``needs``: :func:`codagen.ops._custom_op.named_gradients`)."""
    grad_x, grad_norm_weight, grad_weight, grad_lora_a, grad_lora_b, *rest = grads
    input_grad, present = consumer_input_grad(needs), lora_a is not None
    named = {"x": grad_x if input_grad else None, "norm_weight": grad_norm_weight if input_grad else None,
             weight: grad_weight if needs[weight] else None,
             "lora_a": grad_lora_a if present else None, "lora_b": grad_lora_b if present else None}
    return named, rest
