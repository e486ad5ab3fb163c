"""``y = x @ W^T`` in FP8 with blockwise scales: e4m3 operands scaled per group of 128 along each GEMM's K.

The recipe (DeepSeek-V3's; ``docs/notes/fp8-quantizing-epilogue.md``), for ``x`` [M, d_in], ``W`` [d_out, d_in]::

    forward      y      = x @ W^T        x in 1 x 128 groups (along d_in), W in 128 x 128 blocks
    input grad   dx     = dy @ W         dy in 1 x 128 groups (along d_out), the same W blocks
    weight grad  dW     = dy^T @ x       dy and x in 128 x 1 groups (along the tokens)

Each GEMM is one launch of a blockwise program (``Program.with_blockwise_scales``): every 128 of K, the tile's
product is scaled by its groups' scales into an fp32 accumulator, and the result is stored in bf16. Backward keeps
``x`` as e4m3 (half a bf16 copy) and the quantized weight.

Here each operand is quantized by the quantize kernel (``kernels.quantize_groups``): this op takes bf16 activations
from anywhere. The block ops of a patched model run the same GEMMs inside their fused programs
(``codagen.ops._fp8``, ``fp8=True``).

Supported: bf16, fp16 and fp32 ``x`` and ``W`` (one dtype; the GEMMs store bf16), any ``M``, ``d_in`` and ``d_out``
(a last, partial group takes the elements there are). Not supported yet: a bias, LoRA, FP8 weights kept between
steps (the weight is quantized on each call).
"""
from __future__ import annotations

import torch
from torch import Tensor

from codagen.epilogue import library

from . import _checks as check
from . import kernels
from ._custom_op import custom_op, named_gradients
from ._fp8 import GROUP, Quantized, blockwise
from ._fused import fake_grad, or_empty

__all__ = ["fp8_linear", "GROUP"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _groups(rows: int, columns: int, like: Tensor) -> Tensor:
    return like.new_empty(rows, columns, dtype=torch.float32)


def _fake_forward(x: Tensor, weight: Tensor):
    m, d_in = x.shape
    d_out = weight.shape[0]
    bits = torch.uint8
    return (x.new_empty(m, d_out, dtype=torch.bfloat16), x.new_empty(m, d_in, dtype=bits),
            _groups(-(-m // GROUP), d_in, x), weight.new_empty(d_out, d_in, dtype=bits),
            _groups(-(-d_out // GROUP), -(-d_in // GROUP), x))


@custom_op("fp8_linear", fake=_fake_forward)
def _fp8_linear_op(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(y, x_rows, x_rows_scale, weight_blocks, weight_scale)``: the output and what backward reads (``x`` in
    groups of 128 tokens, the weight in blocks). The e4m3 codes cross between the custom ops as their bits (uint8):
    torch's CPU kernels, which the ops' schema checks run, have no float8 comparison."""
    weight_blocks, weight_scale = kernels.quantize_groups(weight, GROUP, "blocks")
    y = blockwise(library.linear(), x, Quantized(weight_blocks, weight_scale), b_block=True)["out"]
    x_rows, x_rows_scale = kernels.quantize_groups(x, GROUP, "m")
    return y, x_rows.view(torch.uint8), x_rows_scale, weight_blocks.view(torch.uint8), weight_scale


@custom_op("fp8_linear_backward", fake=lambda grad_out, x_rows, weight_blocks, input_grad, weight_grad, **_: (
    fake_grad(grad_out.new_empty(grad_out.shape[0], x_rows.shape[1], dtype=torch.bfloat16), input_grad, grad_out),
    fake_grad(grad_out.new_empty(weight_blocks.shape, dtype=torch.bfloat16), weight_grad, grad_out)))
def _fp8_linear_backward_op(grad_out: Tensor, x_rows: Tensor, x_rows_scale: Tensor, weight_blocks: Tensor,
                            weight_scale: Tensor, input_grad: bool, weight_grad: bool) -> tuple[Tensor, Tensor]:
    """``(grad_x, grad_weight)`` in bf16, each empty where not wanted; ``x_rows`` and ``weight_blocks`` are e4m3 codes
    as their bits."""
    x_rows, weight_blocks = x_rows.view(torch.float8_e4m3fn), weight_blocks.view(torch.float8_e4m3fn)
    grad_x = grad_weight = None
    if input_grad:
        grad_x = blockwise(library.input_grad(), grad_out, Quantized(weight_blocks, weight_scale),
                           b_block=True)["grad_input"]
    if weight_grad:
        grad_weight = blockwise(library.weight_grad(), grad_out, Quantized(x_rows, x_rows_scale),
                                b_block=False)["grad_weight"]
    return or_empty(grad_x, grad_out), or_empty(grad_weight, grad_out)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        y, x_rows, x_rows_scale, weight_blocks, weight_scale = _fp8_linear_op(x, weight)
        ctx.save_for_backward(x_rows, x_rows_scale, weight_blocks, weight_scale)
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.set_materialize_grads(False)
        return y

    @staticmethod
    @named_gradients(forward)
    def backward(ctx, needs, grad_out):
        if grad_out is None:
            return {}
        grad_x, grad_weight = _fp8_linear_backward_op(grad_out.contiguous(), *ctx.saved_tensors, needs["x"],
                                                      needs["weight"])
        x_dtype, weight_dtype = ctx.dtypes
        return dict(x=grad_x.to(x_dtype) if needs["x"] else None,
                    weight=grad_weight.to(weight_dtype) if needs["weight"] else None)


def fp8_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``y = x @ weight^T`` in bf16 from three blockwise-scaled e4m3 GEMMs (the module docstring); the gradients come
    back in the inputs' dtypes.

    ``x`` [tokens, in_features] and ``weight`` [out_features, in_features]: contiguous, one dtype (bf16, fp16 or
    fp32) and device."""
    x = check.activation("x", x, desc="[tokens, in_features]")
    if x.dtype not in _DTYPES:  # float64, the other ops' oracle dtype, has no meaning in FP8
        raise ValueError(f"x: expected one of {[str(d) for d in _DTYPES]}, got {x.dtype}")
    weight = check.weight("weight", weight, (None, x.shape[1]), "[out features, x features]", check.Like("x", x))
    return _Fp8Linear.apply(x, weight)
