"""Gemma 2's final logit soft-cap in the LM-head ops, on both CPU backends, by the numerics rule.

``ops.rms_lm_head_cross_entropy(..., softcap=cap)`` against ``F.cross_entropy(cap * tanh(logits / cap), target,
ignore_index=-100)`` and ``ops.rms_linear(..., softcap=cap)`` against ``cap * tanh(logits / cap)``: the loss, the
capped logits and the gradients of ``x``, the norm weight and the head weight, in training (several chunks of
tokens too) and evaluation. Fresh inputs whose logits spread over a few caps (the tanh saturated and not), ignored
rows, a vocabulary that is no multiple of the tile (the reference backend's 16 x 8 tiles, the interpreter's 32 x 32).

The numerics rule (``docs/method.md`` section 4): each tensor's max error against float64 math on the same rounded
inputs is at most twice that of the same computation in eager PyTorch at the input dtype, plus 1e-6. The loss is
one number whose eager error can be luckily small, so its eager error counts as at least the rounding of the exact
loss to the input dtype. With float32 inputs both sides are float32 rounding noise, so the rule is a relative one
(``tests/backends/test_triton.py``): ``max |error| <= 1e-5 * max(1, max |exact|)``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from codagen import ops
from codagen.backends import triton_available, use_backend
from codagen.ops import cross_entropy

from .conftest import reference_tiles, rms_norm

M, D, VOCAB, CAP, EPS = 21, 32, 75, 30.0, 1e-6


def backend(name: str):
    if name == "reference":
        return reference_tiles(block_m=16, block_n=8)
    if not triton_available():
        pytest.skip("Triton is not installed")
    return use_backend("triton")


#: (backend, input dtype); the interpreter's bf16 dot is wrong, so it runs fp16 and fp32
CASES = pytest.mark.parametrize("backend_name, dtype", [
    ("reference", torch.float32), ("reference", torch.bfloat16), ("reference", torch.float16),
    ("triton", torch.float32), ("triton", torch.float16)], ids=lambda v: str(v).removeprefix("torch."))


def problem(dtype):
    """Leaves at ``dtype`` (logits ~ N(0, CAP^2): |logits| up to a few caps), targets with a quarter ignored, and
    float64 copies of the same rounded values."""
    x = torch.randn(M, D).to(dtype)
    gamma = (1 + 0.2 * torch.randn(D)).to(dtype)
    weight = (CAP / D ** 0.5 * torch.randn(VOCAB, D)).to(dtype)
    target = torch.randint(0, VOCAB, (M,))
    target[torch.randperm(M)[: M // 4]] = -100
    target[0] = VOCAB - 1  # the last column, in the ragged last tile
    leaves = [t.requires_grad_() for t in (x, gamma, weight)]
    return leaves, [t.detach().double().requires_grad_() for t in leaves], target


def eager_logits(x, gamma, weight):
    """Hugging Face's Gemma 2 head at the leaves' dtype: the norm, the head GEMM and the cap, each rounded."""
    logits = rms_norm(x, gamma, EPS) @ weight.t()
    return CAP * torch.tanh(logits / CAP)


def eager_loss(x, gamma, weight, target, reduction):
    logits = eager_logits(x, gamma, weight)
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), target, ignore_index=-100,
                           reduction=reduction)


def fused_logits(x, gamma, weight):
    normed, rstd = ops.rms_norm_stats(x, gamma, EPS)
    return ops.rms_linear(x, normed, rstd, gamma, weight, softcap=CAP)


def fused_loss(x, gamma, weight, target, reduction):
    normed, rstd = ops.rms_norm_stats(x, gamma, EPS)
    return ops.rms_lm_head_cross_entropy(x, normed, rstd, gamma, weight, target, reduction=reduction, softcap=CAP)


def outputs(objective, leaves) -> dict[str, torch.Tensor]:
    """What is compared: the value and the gradients of the leaves, as float64."""
    value, scalar = objective(*leaves)
    grads = torch.autograd.grad(scalar, leaves)
    return {"value": value.detach().double(),
            **{f"grad {name}": g.double() for name, g in zip(("x", "norm_weight", "weight"), grads)}}


def assert_numerics_rule(dtype, fused, eager, exact):
    failures = []
    for name, want in exact.items():
        error = (fused[name] - want).abs().max().item()
        if dtype == torch.float32:
            bound = 1e-5 * max(1.0, want.abs().max().item())
        else:
            eager_error = (eager[name] - want).abs().max().item()
            if want.dim() == 0:  # one number: at least its own rounding to the input dtype
                eager_error = max(eager_error, torch.finfo(dtype).eps / 2 * want.abs().item())
            bound = 2 * eager_error + 1e-6
        if not error <= bound:
            failures.append(f"{name}: fused {error:.3e} > {bound:.3e}")
    assert not failures, "\n".join(failures)


@CASES
@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_with_softcap(backend_name, dtype, reduction, chunks, monkeypatch):
    """Training: the gradients are made in the forward pass, chunk by chunk (3 chunks: grad_W accumulated)."""
    if chunks > 1:
        monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", -(-M // chunks) * VOCAB * torch.finfo(dtype).bits // 8)
    leaves, leaves64, target = problem(dtype)
    grad_loss = torch.rand(()) + 0.5  # a scaled loss scales the saved gradients

    def loss_of(model):
        def objective(x, gamma, weight):
            loss = model(x, gamma, weight, target, reduction)
            return loss, loss * grad_loss.to(loss.dtype)
        return objective

    exact = outputs(loss_of(eager_loss), leaves64)
    eager = outputs(loss_of(eager_loss), leaves)
    with backend(backend_name):
        fused = outputs(loss_of(fused_loss), leaves)
        with torch.no_grad():  # evaluation: the capped cross-entropy GEMM, no logits
            evaluated = fused_loss(*leaves, target, reduction).double()
    assert_numerics_rule(dtype, fused, eager, exact)
    assert_numerics_rule(dtype, {"value": evaluated}, eager, {"value": exact["value"]})


@CASES
def test_rms_linear_with_softcap(backend_name, dtype):
    """The capped logits and, through a random probe, their gradients; under ``no_grad`` the inference program."""
    leaves, leaves64, _ = problem(dtype)
    probe = torch.randn(M, VOCAB).to(dtype)

    def probed(model):
        def objective(x, gamma, weight):
            logits = model(x, gamma, weight)
            return logits, (logits * probe.to(logits.dtype)).sum()
        return objective

    exact = outputs(probed(eager_logits), leaves64)
    eager = outputs(probed(eager_logits), leaves)
    with backend(backend_name):
        fused = outputs(probed(fused_logits), leaves)
        with torch.no_grad():
            inferred = fused_logits(*leaves)
    assert_numerics_rule(dtype, fused, eager, exact)
    assert inferred.dtype == dtype
    torch.testing.assert_close(inferred.double(), fused["value"], rtol=0, atol=0)  # the same epilogue math


def test_the_cap_matters():
    """The problem's logits reach the tanh's saturation: capping changes the logits and the loss by far more than
    any error the rule allows, so the tests above fail for a cap left out or applied twice."""
    (x, gamma, weight), _, target = problem(torch.float32)
    with torch.no_grad():
        logits = rms_norm(x, gamma, EPS) @ weight.t()
        capped = CAP * torch.tanh(logits / CAP)
        assert logits.abs().max() > 2 * CAP and (capped - logits).abs().max() > CAP
        assert (CAP * torch.tanh(capped / CAP) - capped).abs().max() > 1.0
        assert abs(F.cross_entropy(capped, target) - F.cross_entropy(logits, target)) > 1.0
