"""``codagen.ops.fp8_linear``: the three blockwise-scaled e4m3 GEMMs against float64 math of the same quantized
operands (by the 2x rule, the peer being the reference backend: PyTorch's fp32 product stored in bf16), its
distance from the unquantized product, determinism and its refusals. CPU: the Triton kernels in the interpreter;
GPU: compiled."""
from __future__ import annotations

import pytest
import torch

import codagen
from codagen.ops import fp8_linear, kernels
from codagen.ops.fp8_linear import GROUP

from ..conftest import decoded


def dequantized(x: torch.Tensor, along: str) -> torch.Tensor:
    """``x`` quantized as the op quantizes it (groups of 128 ``along``), back in float64."""
    return decoded(*kernels.quantize_groups_ref(x, GROUP, along), GROUP, along)


def quantized_math(x, weight, grad_out):
    """(y, grad_x, grad_weight) of the recipe in float64: each GEMM of the dequantized operands it reads."""
    y = dequantized(x, "n") @ dequantized(weight, "blocks").t()
    grad_x = dequantized(grad_out, "n") @ dequantized(weight, "blocks")
    grad_weight = dequantized(grad_out, "m").t() @ dequantized(x, "m")
    return y, grad_x, grad_weight


def run(backend: str, x, weight, grad_out):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    with codagen.use_backend(backend):
        y = fp8_linear(x, weight)
        y.backward(grad_out.to(y.dtype))
    return y.detach(), x.grad, weight.grad


def inputs(m, d_in, d_out, device="cpu", dtype=torch.float32):
    x = torch.randn(m, d_in, device=device).to(dtype)
    weight = (torch.randn(d_out, d_in, device=device) / d_in ** 0.5).to(dtype)
    grad_out = torch.randn(m, d_out, device=device).to(torch.bfloat16).to(dtype)
    return x, weight, grad_out


def check_against_the_quantized_math(m, d_in, d_out, device, dtype):
    x, weight, grad_out = inputs(m, d_in, d_out, device, dtype)
    got, peer = run("triton", x, weight, grad_out), run("reference", x, weight, grad_out)
    # the quantized math in float64 (grad_out as the op sees it: bf16, the output's dtype)
    want = quantized_math(x.cpu().float(), weight.cpu().float(), grad_out.cpu().to(torch.bfloat16).float())
    for name, g, p, w in zip(("y", "grad_x", "grad_weight"), got, peer, want):
        assert g.shape == w.shape and g.dtype == (torch.bfloat16 if name == "y" else dtype), name
        ours, theirs = ((t.cpu().double() - w).abs().max().item() for t in (g, p))
        assert ours <= 2 * theirs + 1e-6, (name, ours, theirs)
        # and the peer is the quantized math to the output's rounding (bf16: 2^-8 of the largest value; the fp32
        # accumulation's error is far below it)
        assert theirs <= 2 ** -8 * w.abs().max().item(), (name, theirs)


@pytest.mark.parametrize("m, d_in, d_out", [(200, 256, 384), (70, 192, 130)])
def test_interpreter_fp8_linear_is_the_quantized_math(m, d_in, d_out):
    """Partial groups everywhere in the second shape: 70 tokens, d_in 192 and d_out 130."""
    pytest.importorskip("triton")
    check_against_the_quantized_math(m, d_in, d_out, "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("m, d_in, d_out", [(4096, 4096, 4096), (1000, 2048, 5632)])
def test_gpu_fp8_linear_is_the_quantized_math(m, d_in, d_out):
    from codagen.backends.triton.targets import of_device
    if of_device(torch.device("cuda")).fp8_mma is None:
        pytest.skip("this GPU has no e4m3 matrix instruction")
    check_against_the_quantized_math(m, d_in, d_out, "cuda", torch.bfloat16)


def test_fp8_linear_is_within_e4m3_precision_of_the_linear():
    """Two e4m3 roundings per product (3 mantissa bits each): a few percent from x @ W^T, on every output."""
    x, weight, grad_out = inputs(256, 256, 128)
    y, grad_x, grad_weight = run("reference", x, weight, grad_out)
    for got, want in ((y, x @ weight.t()), (grad_x, grad_out @ weight), (grad_weight, grad_out.t() @ x)):
        relative = (got.double() - want.double()).norm() / want.double().norm()
        assert 0.005 < relative < 0.06, relative  # quantized (not the bf16 linear), and not worse than e4m3


def test_fp8_linear_is_deterministic():
    pytest.importorskip("triton")
    x, weight, grad_out = inputs(130, 128, 256)
    first, second = run("triton", x, weight, grad_out), run("triton", x, weight, grad_out)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_fp8_linear_computes_only_the_gradients_asked_for():
    x, weight, grad_out = inputs(16, 128, 128)
    frozen = weight.clone()
    x = x.requires_grad_()
    with codagen.use_backend("reference"):
        fp8_linear(x, frozen).backward(grad_out.bfloat16())
    assert x.grad is not None and frozen.grad is None


@pytest.mark.parametrize("x, weight, message", [
    (torch.randn(4, 8).double(), torch.randn(8, 8).double(), "x: expected one of .*, got torch.float64"),
    (torch.randn(4, 8), torch.randn(8, 6), r"weight: expected shape \[out features, x features\] = \('\*', 8\)"),
    (torch.randn(4, 8), torch.randn(8, 8).bfloat16(), r"weight: expected dtype torch.float32 \(that of x\)"),
])
def test_fp8_linear_refuses_what_it_cannot_take(x, weight, message):
    """The argument sweep of every op is ``tests/ops/test_op_errors.py``'s; these are the FP8 op's own."""
    with pytest.raises(ValueError, match=message):
        fp8_linear(x, weight)
