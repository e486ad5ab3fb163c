"""``RMSNorm(x) @ W^T`` as one GEMM, optionally soft-capped (Gemma 2): logits for inference, or any norm consumer
without an epilogue op."""
from __future__ import annotations

import torch
from torch import Tensor

from codagen.backends import execute
from codagen.epilogue import library

from . import _checks as check
from . import kernels
from ._custom_op import custom_op, named_gradients
from ._fused import consumer_rms_norm_backward, fake_grad, or_empty

__all__ = ["rms_linear"]


def _fake_logits(normed: Tensor, weight: Tensor, **_) -> Tensor:
    return normed.new_empty(normed.shape[0], weight.shape[0])


@custom_op("rms_linear", fake=_fake_logits)
def _rms_linear_op(normed: Tensor, rstd: Tensor, weight: Tensor, softcap: float | None) -> Tensor:
    """``out`` alone: the uncapped program (whose ``out`` is also what backward needs), or the capped
    inference program."""
    return execute(library.rms_linear(softcap, save_preact=False), normed, weight, rstd=rstd)["out"]


@custom_op("rms_linear_softcap", fake=lambda normed, weight, **_: (_fake_logits(normed, weight),
                                                                   _fake_logits(normed, weight)))
def _rms_linear_softcap_op(normed: Tensor, rstd: Tensor, weight: Tensor, softcap: float) -> tuple[Tensor, Tensor]:
    """``(out, preact)``: the capped logits and, for backward, the logits ``z`` before the cap."""
    out = execute(library.rms_linear(softcap), normed, weight, rstd=rstd)
    return out["out"], out["preact"]


@custom_op("rms_linear_backward", fake=lambda x, norm_weight, weight, weight_grad, **_: (
    torch.empty_like(x), torch.empty_like(norm_weight), fake_grad(weight, weight_grad, x)))
def _rms_linear_backward_op(grad_out: Tensor, z: Tensor, x: Tensor, rstd: Tensor, norm_weight: Tensor,
                            weight: Tensor, weight_grad: bool, softcap: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """``z``: the GEMM's output ``rstd * (normed @ W^T)``, which is ``out`` without a cap."""
    if softcap is None:
        grad_z, mean_z_dz = grad_out, kernels.mean_row_dot(z, grad_out, x.shape[1])
    else:
        grad_z, mean_z_dz = kernels.softcap_backward(grad_out, z, softcap, x.shape[1])
    grad_x, grad_norm_weight, grad_weight, _, _ = consumer_rms_norm_backward(grad_z, weight, x, rstd, norm_weight,
                                                                            mean_z_dz, weight_grad=weight_grad)
    return grad_x, grad_norm_weight, or_empty(grad_weight, x)


class _RmsLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normed, rstd, norm_weight, weight, softcap):
        if softcap is None:
            out = z = _rms_linear_op(normed, rstd, weight, None)
        else:
            out, z = _rms_linear_softcap_op(normed, rstd, weight, softcap)
        ctx.save_for_backward(z, x, rstd, norm_weight, weight)
        ctx.softcap = softcap
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    @named_gradients(forward)
    def backward(ctx, needs, grad_out):
        if grad_out is None:
            return {}
        weight_grad = needs["weight"]
        grad_x, grad_norm_weight, grad_weight = _rms_linear_backward_op(grad_out.contiguous(), *ctx.saved_tensors,
                                                                        weight_grad, ctx.softcap)
        return dict(x=grad_x, norm_weight=grad_norm_weight, weight=grad_weight if weight_grad else None)


def rms_linear(x: Tensor, normed: Tensor, rstd: Tensor, norm_weight: Tensor, weight: Tensor, *,
               softcap: float | None = None) -> Tensor:
    """``out = RMSNorm(x) @ weight^T = rstd[m] * (normed @ weight^T)``, one GEMM.

    Backward: ``mean_z_dz = sum out * grad_out / d`` (one row-reduction kernel), then the RMSNorm-backward
    GEMM and ``grad_W``. Saved: ``out``, ``x``, ``rstd``. For training logits use
    :func:`rms_lm_head_cross_entropy`, which never stores them.

    ``softcap = cap`` (Gemma 2's ``final_logit_softcapping``): ``out = cap * tanh(z / cap)`` with ``z = rstd[m] *
    (normed @ weight^T)``, in the same GEMM's epilogue. With gradients the GEMM also stores ``z`` (saved in
    place of ``out``); backward is one row kernel, ``grad_z = grad_out * (1 - tanh(z / cap)^2)`` and
    ``mean_z_dz = sum z grad_z / d``, then the same GEMMs. Without (``torch.no_grad()`` or nothing requiring
    grad) only ``out`` is stored.
    """
    x = check.activation("x", x)
    like = check.Like("x", x)
    d = x.shape[1]
    normed = check.normed("normed", normed, like)
    rstd = check.rstd("rstd", rstd, like)
    norm_weight = check.vector("norm_weight", norm_weight, d, "[features]", like)
    weight = check.weight("weight", weight, (None, d), "[out features, features]", like)
    softcap = check.softcap(softcap)
    if softcap is not None and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, norm_weight, weight))):
        return _rms_linear_op(normed.detach(), rstd.detach(), weight, softcap)
    return _RmsLinear.apply(x, normed.detach(), rstd.detach(), norm_weight, weight, softcap)
