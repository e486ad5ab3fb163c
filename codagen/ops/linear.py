"""``RMSNorm(x) @ W^T`` as one GEMM: logits for inference, or any norm consumer without an epilogue op."""
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


@custom_op("rms_linear", fake=lambda normed, weight, **_: normed.new_empty(normed.shape[0], weight.shape[0]))
def _rms_linear_op(normed: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    return execute(library.rms_linear(), normed, weight, rstd=rstd)["out"]


@custom_op("rms_linear_backward", fake=lambda x, norm_weight, weight, weight_grad, **_: (
    torch.empty_like(x), torch.empty_like(norm_weight), fake_grad(weight, weight_grad, x)))
def _rms_linear_backward_op(grad_out: Tensor, out: Tensor, x: Tensor, rstd: Tensor, norm_weight: Tensor,
                            weight: Tensor, weight_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    mean_z_dz = kernels.mean_row_dot(out, grad_out, x.shape[1])
    grad_x, grad_norm_weight, grad_weight, _, _ = consumer_rms_norm_backward(grad_out, weight, x, rstd, norm_weight,
                                                                            mean_z_dz, weight_grad=weight_grad)
    return grad_x, grad_norm_weight, or_empty(grad_weight, x)


class _RmsLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normed, rstd, norm_weight, weight):
        out = _rms_linear_op(normed, rstd, weight)
        ctx.save_for_backward(out, x, rstd, norm_weight, weight)
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    @named_gradients(forward)
    def backward(ctx, needs, grad_out):
        if grad_out is None:
            return {}
        weight_grad = needs["weight"]
        grad_x, grad_norm_weight, grad_weight = _rms_linear_backward_op(grad_out.contiguous(), *ctx.saved_tensors,
                                                                        weight_grad)
        return dict(x=grad_x, norm_weight=grad_norm_weight, weight=grad_weight if weight_grad else None)


def rms_linear(x: Tensor, normed: Tensor, rstd: Tensor, norm_weight: Tensor, weight: Tensor) -> Tensor:
    """``out = RMSNorm(x) @ weight^T = rstd[m] * (normed @ weight^T)``, one GEMM.

    Backward: ``mean_z_dz = sum out * grad_out / d`` (one row-reduction kernel), then the RMSNorm-backward
    GEMM and ``grad_W``. Saved: ``out``, ``x``, ``rstd``. For training logits use
    :func:`rms_lm_head_cross_entropy`, which never stores them.
    """
    x = check.activation("x", x)
    like = check.Like("x", x)
    d = x.shape[1]
    normed = check.normed("normed", normed, like)
    rstd = check.rstd("rstd", rstd, like)
    norm_weight = check.vector("norm_weight", norm_weight, d, "[features]", like)
    weight = check.weight("weight", weight, (None, d), "[out features, features]", like)
    return _RmsLinear.apply(x, normed.detach(), rstd.detach(), norm_weight, weight)
