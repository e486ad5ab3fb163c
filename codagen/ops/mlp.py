"""The gated MLP: F2 standalone (RMSNorm-scaled gate/up projection + SwiGLU or GeGLU), its twin for an MLP with no
norm before it (OLMo 2), and F2 + F3, the whole MLP with its residual and the next norm's statistics (+ B4, B5, B6,
B7).

``activation`` picks the gate's nonlinearity: ``"silu"`` (SwiGLU: LLaMA, Mistral, Qwen) or ``"gelu_tanh"``
(GeGLU with the tanh approximation of GELU: Gemma 2 and 3). The custom ops take it as a string argument and
run the matching library programs (``library.rms_gate_up_swiglu(activation=...)``,
``library.swiglu_backward(activation)``) and row kernel (``kernels.swiglu_backward``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from codagen.epilogue import library

from . import _checks as check
from . import kernels
from ._custom_op import custom_op, named_gradients
from ._fp8 import GROUP, Quantized, check_fp8, consumer_operand, op_operand
from ._fused import (
    consumer_backward_outputs,
    consumer_gradients,
    consumer_input_grad,
    consumer_rms_norm_backward,
    fake_consumer_grads,
    fake_grad,
    lora_args,
    low_rank_grad_operand,
    low_rank_grads,
    low_rank_operand,
    low_rank_pair,
    or_empty,
    run,
    stats_like,
    weight_gradient,
)
from .low_rank import LowRank
from .residual import _linear_backward_op, normed_output, producer_forward

__all__ = ["rms_gate_up_swiglu", "gate_up_swiglu", "swiglu_mlp_residual_rms"]


def _fake_gate_up(normed, gate_up_weight, **_):
    m, two_f = normed.shape[0], gate_up_weight.shape[0]
    return gate_up_weight.new_empty(m, two_f // 2), gate_up_weight.new_empty(m, two_f)


def _fake_gate_up_backward(x, norm_weight, gate_up_weight, weight_grad, input_grad, lora_a, lora_b, **_):
    return fake_consumer_grads(x, norm_weight, gate_up_weight, weight_grad, input_grad, lora_a, lora_b)


# ==================================================================================================
# F2 standalone: RMSNorm-scaled gate/up projection + SwiGLU or GeGLU
# ==================================================================================================
@custom_op("rms_gate_up_swiglu", fake=_fake_gate_up)
def _rms_gate_up_swiglu_op(normed: Tensor, rstd: Tensor, gate_up_weight: Tensor, lora_u: Tensor | None,
                           lora_b: Tensor | None, activation: str, fp8: bool = False,
                           normed_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``normed_scale``: ``normed`` is e4m3 bits with these scales (:func:`codagen.ops._fp8.consumer_operand`)."""
    out = run(library.rms_gate_up_swiglu(activation=activation), consumer_operand(normed, normed_scale),
              gate_up_weight, lora_u, lora_b, fp8, rstd=rstd)
    return out["out"], out["preact"]


@custom_op("rms_gate_up_swiglu_inference", fake=lambda normed, gate_up_weight, **_: _fake_gate_up(
    normed, gate_up_weight)[0])
def _rms_gate_up_swiglu_inference_op(normed: Tensor, rstd: Tensor, gate_up_weight: Tensor, lora_u: Tensor | None,
                                     lora_b: Tensor | None, activation: str, fp8: bool = False,
                                     normed_scale: Tensor | None = None) -> Tensor:
    """F2 without ``preact``: the forward of a model that runs no backward (prefill, decode)."""
    program = library.rms_gate_up_swiglu(save_preact=False, activation=activation)
    return run(program, consumer_operand(normed, normed_scale), gate_up_weight, lora_u, lora_b, fp8,
               rstd=rstd)["out"]


@custom_op("rms_gate_up_swiglu_backward", fake=_fake_gate_up_backward)
def _rms_gate_up_swiglu_backward_op(grad_act: Tensor, preact: Tensor, x: Tensor, rstd: Tensor, norm_weight: Tensor,
                                    gate_up_weight: Tensor, weight_grad: bool, input_grad: bool, lora_a: Tensor | None,
                                    lora_b: Tensor | None, lora_u: Tensor | None, lora_scale: float,
                                    activation: str,
                                    fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grad_preact, mean_z_dz = kernels.swiglu_backward(grad_act, preact, x.shape[1], activation)
    return consumer_backward_outputs(x, consumer_rms_norm_backward(
        grad_preact, gate_up_weight, x, rstd, norm_weight, mean_z_dz, weight_grad=weight_grad, input_grad=input_grad,
        lora_a=lora_a, lora_b=lora_b, lora_u=lora_u, lora_scale=lora_scale, fp8=fp8))


class _RmsGateUpSwiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normed, rstd, norm_weight, gate_up_weight, lora_a, lora_b, lora_scale, activation, fp8,
                normed_scale):
        lora_u = low_rank_operand(normed, lora_a, lora_scale)
        act, preact = _rms_gate_up_swiglu_op(normed, rstd, gate_up_weight, lora_u, lora_b, activation, fp8,
                                             normed_scale)
        ctx.save_for_backward(preact, x, rstd, norm_weight, gate_up_weight, lora_a, lora_b, lora_u)
        ctx.lora_scale, ctx.activation, ctx.fp8 = lora_scale, activation, fp8
        ctx.set_materialize_grads(False)
        return act

    @staticmethod
    @named_gradients(forward)
    def backward(ctx, needs, grad_act):
        if grad_act is None:
            return {}
        preact, x, rstd, norm_weight, gate_up_weight, lora_a, lora_b, lora_u = ctx.saved_tensors
        named, _ = consumer_gradients(needs, _rms_gate_up_swiglu_backward_op(
            grad_act.contiguous(), preact, x, rstd, norm_weight, gate_up_weight, needs["gate_up_weight"],
            consumer_input_grad(needs), lora_a, lora_b, lora_u, ctx.lora_scale, ctx.activation, ctx.fp8),
            "gate_up_weight", lora_a)
        return named


def _checked_gate_up_inputs(x: Tensor, normed: Tensor, rstd: Tensor, norm_weight: Tensor, gate_up_weight: Tensor,
                            fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The checks both gate/up entry points make of the MLP's input, its norm and the gate/up weight."""
    x = check.activation("x", x)
    like = check.Like("x", x)
    d = x.shape[1]
    return (x, check.normed("normed", normed, like, fp8=fp8), check.rstd("rstd", rstd, like),
            check.vector("norm_weight", norm_weight, d, "[features]", like),
            check.weight("gate_up_weight", gate_up_weight, (None, d), "[2 * ffn features, features]", like,
                         even_rows=True))


def rms_gate_up_swiglu(x: Tensor, normed: Tensor, rstd: Tensor, norm_weight: Tensor, gate_up_weight: Tensor, *,
                       low_rank: LowRank | None = None, activation: str = "silu", fp8: bool = False) -> Tensor:
    """F2: ``act = swiglu(RMSNorm(x) @ gate_up_weight^T)``, rows of ``gate_up_weight`` interleaved ``g0, u0, ...``.

    One GEMM: ``z = rstd[m] * (normed @ W^T)``; stores ``preact = z`` [M, 2F] (saved) and
    ``act[:, j] = f(z[:, 2j]) * z[:, 2j+1]`` [M, F], ``f = silu`` (SwiGLU) or, for ``activation="gelu_tanh"``,
    ``f(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))`` (GeGLU: Gemma's ``gelu_pytorch_tanh``).

    Backward (standalone, so the activation's backward has no GEMM to live in): one elementwise kernel for
    ``(dg, du)`` and ``mean_z_dz = sum (g dg + u du) / d``, then the RMSNorm-backward GEMM and ``grad_W``.
    Prefer :func:`swiglu_mlp_residual_rms`, which moves that backward into the down-projection's epilogue.
    ``low_rank``: as in :func:`rms_qkv_rope` (``b``'s rows interleaved like ``gate_up_weight``'s). ``fp8``: as in
    :func:`swiglu_mlp_residual_rms`.
    Saved: ``preact``, ``x``, ``rstd``; with autograd off (``torch.no_grad``) nothing, and ``preact`` is not stored.
    """
    activation = check.gated_activation("activation", activation)
    x, normed, rstd, norm_weight, gate_up_weight = _checked_gate_up_inputs(x, normed, rstd, norm_weight,
                                                                           gate_up_weight, fp8 is True)
    d, like = x.shape[1], check.Like("x", x)
    low_rank = check.low_rank("low_rank", low_rank, d, gate_up_weight.shape[0], like)
    fp8 = check_fp8(fp8, x, low_rank)
    normed, normed_scale = op_operand(normed)
    if not torch.is_grad_enabled():
        return _rms_gate_up_swiglu_inference_op(normed, rstd, gate_up_weight, *low_rank_pair(normed, low_rank),
                                                activation, fp8, normed_scale)
    return _RmsGateUpSwiglu.apply(x, normed.detach(), rstd.detach(), norm_weight, gate_up_weight,
                                  *lora_args(low_rank), activation, fp8, normed_scale)


# ==================================================================================================
# F2 without a norm before it (OLMo 2's MLP reads the residual stream as it is)
# ==================================================================================================
@custom_op("gate_up_swiglu", fake=lambda x, gate_up_weight, save_preact, **_: (
    x.new_empty(x.shape[0], gate_up_weight.shape[0] // 2),
    x.new_empty(x.shape[0] if save_preact else 0, gate_up_weight.shape[0])))
def _gate_up_swiglu_op(x: Tensor, gate_up_weight: Tensor, lora_u: Tensor | None, lora_b: Tensor | None,
                       activation: str, save_preact: bool, fp8: bool = False) -> tuple[Tensor, Tensor]:
    """``(act, preact)``; ``preact`` empty with ``save_preact=False`` (a forward without backward)."""
    out = run(library.rms_gate_up_swiglu(save_preact, activation, pre_norm=False), x, gate_up_weight, lora_u, lora_b,
              fp8)
    return out["out"], out["preact"] if save_preact else x.new_empty(0, gate_up_weight.shape[0])


@custom_op("gate_up_swiglu_backward", fake=lambda x, gate_up_weight, weight_grad, input_grad, lora_a, lora_b, **_: (
    fake_grad(x, input_grad, x), fake_grad(gate_up_weight, weight_grad, x), fake_grad(lora_a, True, x),
    fake_grad(lora_b, True, x)))
def _gate_up_swiglu_backward_op(grad_act: Tensor, grad_residual: Tensor | None, preact: Tensor, x: Tensor,
                                gate_up_weight: Tensor, weight_grad: bool, input_grad: bool, lora_a: Tensor | None,
                                lora_b: Tensor | None, lora_u: Tensor | None, lora_scale: float,
                                activation: str, fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grad_preact, _ = kernels.swiglu_backward(grad_act, preact, x.shape[1], activation)
    return _linear_backward_op(grad_preact, x, gate_up_weight, weight_grad, input_grad, lora_a, lora_b, lora_u,
                               lora_scale, grad_residual, fp8)


class _GateUpSwiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_up_weight, lora_a, lora_b, lora_scale, activation, fp8):
        lora_u = low_rank_operand(x, lora_a, lora_scale)
        act, preact = _gate_up_swiglu_op(x, gate_up_weight, lora_u, lora_b, activation, True, fp8)
        ctx.save_for_backward(preact, x, gate_up_weight, lora_a, lora_b, lora_u)
        ctx.lora_scale, ctx.activation, ctx.fp8 = lora_scale, activation, fp8
        ctx.set_materialize_grads(False)
        return act, x.view_as(x)

    @staticmethod
    @named_gradients(forward)
    def backward(ctx, needs, grad_act, grad_residual):
        if grad_act is None:  # only the residual path carries a gradient (or none does)
            return dict(x=grad_residual)
        preact, x, gate_up_weight, lora_a, lora_b, lora_u = ctx.saved_tensors
        grad_x, grad_weight, grad_lora_a, grad_lora_b = _gate_up_swiglu_backward_op(
            grad_act.contiguous(), None if grad_residual is None else grad_residual.contiguous(), preact, x,
            gate_up_weight, needs["gate_up_weight"], needs["x"], lora_a, lora_b, lora_u, ctx.lora_scale,
            ctx.activation, ctx.fp8)
        present = lora_a is not None
        return dict(x=grad_x if needs["x"] else None, gate_up_weight=grad_weight if needs["gate_up_weight"] else None,
                    lora_a=grad_lora_a if present else None, lora_b=grad_lora_b if present else None)


def gate_up_swiglu(x: Tensor, gate_up_weight: Tensor, *, low_rank: LowRank | None = None, activation: str = "silu",
                   pass_residual: bool = False, fp8: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """F2 of an MLP with no norm before it (OLMo 2): ``act = swiglu(x @ gate_up_weight^T)``, rows interleaved
    ``g0, u0, ...``; ``activation`` and ``low_rank`` as in :func:`rms_gate_up_swiglu`.

    One GEMM (program ``gate_up_swiglu``, or ``gate_up_geglu``) storing ``preact = x @ W^T`` [M, 2F] (saved) and
    ``act`` [M, F]. Backward: the activation's elementwise backward (:func:`codagen.ops.kernels.swiglu_backward`),
    then ``grad_x = grad_preact @ W`` and ``grad_W = grad_preact^T @ x``. ``pass_residual=True`` returns ``(act,
    residual)``, ``x`` passed through: used as the MLP's residual, its gradient joins ``grad_x`` in the input
    gradient GEMM's store (program ``input_grad_residual``), where autograd would add the two paths' ``[M, d]``
    gradients in a separate kernel. Saved: ``preact``, ``x``; with autograd off nothing, and ``preact`` is not
    stored. ``fp8``: as in :func:`swiglu_mlp_residual_rms`.
    """
    activation = check.gated_activation("activation", activation)
    x = check.activation("x", x)
    like = check.Like("x", x)
    d = x.shape[1]
    gate_up_weight = check.weight("gate_up_weight", gate_up_weight, (None, d), "[2 * ffn features, x features]",
                                  like, even_rows=True)
    low_rank = check.low_rank("low_rank", low_rank, d, gate_up_weight.shape[0], like)
    fp8 = check_fp8(fp8, x, low_rank)
    if not torch.is_grad_enabled():
        act = _gate_up_swiglu_op(x, gate_up_weight, *low_rank_pair(x, low_rank), activation, False, fp8)[0]
        return (act, x) if pass_residual else act
    act, residual = _GateUpSwiglu.apply(x, gate_up_weight, *lora_args(low_rank), activation, fp8)
    return (act, residual) if pass_residual else act


# ==================================================================================================
# F2 + F3 (+ B4, B5, B6, B7): the whole gated MLP with its residual and the next norm's statistics
# ==================================================================================================
# Two autograd nodes, so that ``preact`` [M, 2F] -- the largest activation -- is released as soon as the
# down-projection's backward has used it, before the gate/up backward allocates its outputs:
#   node 1 (F2):  (x, normed, rstd) -> act, preact, x (passed through), mean_z_dz_slot
#   node 2 (F3):  (act, preact, x, mean_z_dz_slot) -> x_out, normed_next, rstd_next       saves preact
# In backward node 2 (B4, B5) hands node 1 three things as gradients of node 1's outputs: grad_preact,
# the residual gradient grad_x_out (the gradient of the passed-through x, joined into B6's store) and
# mean_z_dz, the RMSNorm statistic B4 computes from preact (the gradient of a zero [M] slot output).
@custom_op("swiglu_down_backward", fake=lambda grad_x_out, preact, down_weight, weight_grad, lora_a, lora_b, **_: (
    torch.empty_like(preact), stats_like(grad_x_out, grad_x_out.shape[0]), fake_grad(down_weight, weight_grad, preact),
    fake_grad(lora_a, True, preact), fake_grad(lora_b, True, preact)))
def _swiglu_down_backward_op(grad_x_out: Tensor, preact: Tensor, down_weight: Tensor, weight_grad: bool,
                             lora_a: Tensor | None, lora_b: Tensor | None, lora_u: Tensor | None, lora_scale: float,
                             activation: str, fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """B4 + B5: ``(grad_preact, mean_z_dz, grad_down_weight, grad_lora_a, grad_lora_b)`` (empty where not computed)."""
    # B4: grad_act = grad_x_out @ W_down_eff with the activation's backward in its epilogue (recomputes act for B5)
    grad_b_u = low_rank_grad_operand(grad_x_out, lora_b, lora_scale)
    program = library.swiglu_backward(activation)
    if fp8:  # act as B5 reads it: e4m3 in groups of tokens
        program = program.with_quantized_store("act", "m", GROUP)
    b4 = run(program, grad_x_out, down_weight, grad_b_u, lora_a, fp8, preact=preact)
    mean_z_dz = kernels.finish_row_mean(b4["partial_z_dz"], down_weight.shape[0])
    act = Quantized(b4.pop("act"), b4.pop("act_scale")) if fp8 else b4.pop("act")
    grad_down_weight = weight_gradient(grad_x_out, act, fp8) if weight_grad else None  # B5
    grad_lora_a = grad_lora_b = None
    if lora_a is not None:
        grad_lora_a, grad_lora_b = low_rank_grads(grad_x_out, act, lora_u, grad_b_u)
    return (b4["grad_preact"], mean_z_dz, or_empty(grad_down_weight, preact), or_empty(grad_lora_a, preact),
            or_empty(grad_lora_b, preact))


@custom_op("gate_up_rms_norm_backward", fake=_fake_gate_up_backward)
def _gate_up_rms_norm_backward_op(grad_preact: Tensor, grad_residual: Tensor, x: Tensor, rstd: Tensor,
                                  norm_weight: Tensor, gate_up_weight: Tensor, mean_z_dz: Tensor, weight_grad: bool,
                                  input_grad: bool, lora_a: Tensor | None, lora_b: Tensor | None, lora_u: Tensor | None,
                                  lora_scale: float,
                                  fp8: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """B6 + B7: ``grad_x = grad_residual + norm_grad`` in one store, ``grad_norm_weight``, ``grad_gate_up_weight``
    and the low-rank update's gradients."""
    return consumer_backward_outputs(x, consumer_rms_norm_backward(
        grad_preact, gate_up_weight, x, rstd, norm_weight, mean_z_dz, grad_residual=grad_residual,
        weight_grad=weight_grad, input_grad=input_grad, lora_a=lora_a, lora_b=lora_b, lora_u=lora_u,
        lora_scale=lora_scale, fp8=fp8))


class _MlpGateUp(torch.autograd.Function):
    """Node 1: F2. Its backward is B6 + B7; the activation's backward ran in node 2's B4 epilogue."""

    @staticmethod
    def forward(ctx, x, normed, rstd, norm_weight, gate_up_weight, lora_a, lora_b, lora_scale, activation, fp8,
                normed_scale):
        lora_u = low_rank_operand(normed, lora_a, lora_scale)
        act, preact = _rms_gate_up_swiglu_op(normed, rstd, gate_up_weight, lora_u, lora_b, activation, fp8,
                                             normed_scale)
        # out of place: torch 2.11's Dynamo hands the gradient of an output an in-place op made here to
        # backward as zeros (pytorch/pytorch#180642; docs/notes/compile.md)
        mean_z_dz_slot = x.new_zeros(x.shape[0], dtype=check.stats_dtype(x.dtype))
        ctx.save_for_backward(x, rstd, norm_weight, gate_up_weight, lora_a, lora_b, lora_u)
        ctx.lora_scale, ctx.fp8 = lora_scale, fp8
        ctx.mark_non_differentiable(act)
        ctx.set_materialize_grads(False)
        return act, preact, x.view_as(x), mean_z_dz_slot

    @staticmethod
    @named_gradients(forward)
    def backward(ctx, needs, _grad_act, grad_preact, grad_residual, mean_z_dz):
        if grad_preact is None:  # only the residual path carries a gradient
            return dict(x=grad_residual)
        if mean_z_dz is None or grad_residual is None:
            raise RuntimeError("swiglu_mlp_residual_rms: the gate/up backward needs the down-projection's backward "
                               "(its outputs must only feed that op)")
        x, rstd, norm_weight, gate_up_weight, lora_a, lora_b, lora_u = ctx.saved_tensors
        named, _ = consumer_gradients(needs, _gate_up_rms_norm_backward_op(
            grad_preact.contiguous(), grad_residual.contiguous(), x, rstd, norm_weight, gate_up_weight,
            mean_z_dz.contiguous(), needs["gate_up_weight"], consumer_input_grad(needs), lora_a,
            lora_b, lora_u, ctx.lora_scale, ctx.fp8), "gate_up_weight", lora_a)
        return named


class _MlpDownResidualRms(torch.autograd.Function):
    """Node 2: F3. Its backward is B4 (with the activation's backward) + B5; it releases ``preact``."""

    @staticmethod
    def forward(ctx, act, preact, residual, mean_z_dz_slot, down_weight, next_norm_weight, eps, lora_a, lora_b,
                lora_scale, activation, fp8):
        lora_u = low_rank_operand(act, lora_a, lora_scale)
        x_out, normed_next, rstd_next, *scale = producer_forward(act, down_weight, residual, next_norm_weight, eps,
                                                                 lora_u, lora_b, fp8)
        ctx.save_for_backward(preact, down_weight, lora_a, lora_b, lora_u)
        ctx.lora_scale, ctx.activation, ctx.fp8 = lora_scale, activation, fp8
        ctx.mark_non_differentiable(normed_next, rstd_next, *scale)
        ctx.set_materialize_grads(False)
        return x_out, normed_next, rstd_next, *scale

    @staticmethod
    @named_gradients(forward)
    def backward(ctx, needs, grad_x_out, *_grad_stats):
        if grad_x_out is None:
            return {}
        preact, down_weight, lora_a, lora_b, lora_u = ctx.saved_tensors
        grad = grad_x_out.contiguous()
        weight_grad = needs["down_weight"]
        grad_preact, mean_z_dz, grad_down_weight, grad_lora_a, grad_lora_b = _swiglu_down_backward_op(
            grad, preact, down_weight, weight_grad, lora_a, lora_b, lora_u, ctx.lora_scale, ctx.activation, ctx.fp8)
        present = lora_a is not None
        return dict(preact=grad_preact, residual=grad, mean_z_dz_slot=mean_z_dz,
                    down_weight=grad_down_weight if weight_grad else None,
                    lora_a=grad_lora_a if present else None, lora_b=grad_lora_b if present else None)


def swiglu_mlp_residual_rms(x: Tensor, normed: Tensor, rstd: Tensor, norm_weight: Tensor, gate_up_weight: Tensor,
                            down_weight: Tensor, next_norm_weight: Tensor, eps: float, *,
                            gate_up_low_rank: LowRank | None = None, down_low_rank: LowRank | None = None,
                            activation: str = "silu", fp8: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """F2 + F3: ``x_out = x + swiglu(RMSNorm(x) @ gate_up_weight^T) @ down_weight^T``, two GEMMs.

    Returns ``(x_out, normed_next = x_out * next_norm_weight, rstd_next)`` (the latter two
    non-differentiable, for the next norm's consumer). F2 stores ``preact`` [M, 2F] (saved) and ``act``
    [M, F] (freed after F3); F3 adds the residual and writes the next norm's statistics.

    ``activation``: the gate's nonlinearity, ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU), as in
    :func:`rms_gate_up_swiglu`.

    Backward, two autograd nodes: B4 ``grad_act = grad_x_out @ W_down`` with the activation's backward in its
    epilogue (emits ``grad_preact``, recomputes ``act`` and the partials of ``mean_z_dz``); B5
    ``grad_W_down = grad_x_out^T @ act``; then, with ``preact`` already released, B6 the RMSNorm-backward
    GEMM ``grad_preact @ W_gate_up`` writing ``grad_x = grad_x_out + norm_grad`` in one store and B7
    ``grad_W_gate_up = grad_preact^T @ n``.
    ``gate_up_low_rank`` / ``down_low_rank``: LoRA updates of the two weights (:class:`LowRank`; the gate/up
    one with ``b``'s rows interleaved like ``gate_up_weight``'s), each in its GEMM's low-rank pair: F2 and
    B6 as in :func:`rms_gate_up_swiglu`, F3 with ``(scale * act @ a^T, b)``, B4 with ``(scale * grad_x_out @ b,
    a)``. A weight that requires no gradient gets no weight-gradient GEMM (B5, B7).
    ``fp8=True``: all six GEMMs on e4m3 operands in blockwise groups (:mod:`codagen.ops._fp8`); bf16 inputs, no
    low-rank updates; ``normed`` may be ``_fp8.Quantized`` (a producer's FP8 output), and ``normed_next`` comes back
    so where ``d`` is a multiple of 128 (:func:`codagen.ops.out_proj_residual_rms`).
    Saved: ``preact`` (until B4 has run), ``x``, ``rstd``; ``act`` and ``n = RMSNorm(x)`` are recomputed.
    With autograd off (``torch.no_grad``, inference) the two GEMMs run without autograd nodes, and F2 stores
    ``act`` alone (no ``preact``).
    """
    activation = check.gated_activation("activation", activation)
    fp8 = check_fp8(fp8, x, gate_up_low_rank or down_low_rank)
    x, normed, rstd, norm_weight, gate_up_weight = _checked_gate_up_inputs(x, normed, rstd, norm_weight,
                                                                           gate_up_weight, fp8)
    normed, normed_scale = op_operand(normed)
    d, like = x.shape[1], check.Like("x", x)
    ffn = gate_up_weight.shape[0] // 2
    if ffn % 2:  # the down-projection's backward epilogue works on (gate, up) pairs of a width-ffn tile
        raise ValueError(f"gate_up_weight: expected 2 * ffn rows with an even ffn, got shape "
                         f"{tuple(gate_up_weight.shape)}")
    down_weight = check.weight("down_weight", down_weight, (d, ffn), "[features, ffn features]", like)
    next_norm_weight = check.vector("next_norm_weight", next_norm_weight, d, "[features]", like)
    gate_up_low_rank = check.low_rank("gate_up_low_rank", gate_up_low_rank, d, 2 * ffn, like)
    down_low_rank = check.low_rank("down_low_rank", down_low_rank, ffn, d, like)
    if not torch.is_grad_enabled():  # inference: the two GEMMs without preact, autograd nodes or gradient slot
        act = _rms_gate_up_swiglu_inference_op(normed, rstd, gate_up_weight, *low_rank_pair(normed, gate_up_low_rank),
                                               activation, fp8, normed_scale)
        x_out, normed_next, rstd_next, *scale = producer_forward(act, down_weight, x, next_norm_weight,
                                                                 check.eps(eps), *low_rank_pair(act, down_low_rank),
                                                                 fp8)
        return x_out, normed_output(normed_next, scale), rstd_next
    act, preact, residual, mean_z_dz_slot = _MlpGateUp.apply(x, normed.detach(), rstd.detach(), norm_weight,
                                                            gate_up_weight, *lora_args(gate_up_low_rank), activation,
                                                            fp8, normed_scale)
    x_out, normed_next, rstd_next, *scale = _MlpDownResidualRms.apply(
        act, preact, residual, mean_z_dz_slot, down_weight, next_norm_weight.detach(), check.eps(eps),
        *lora_args(down_low_rank), activation, fp8)
    return x_out, normed_output(normed_next, scale), rstd_next
