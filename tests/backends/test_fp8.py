"""Rowwise-scaled e4m3 GEMMs (``Program.with_rowwise_scales``): the programs, the reference backend against float64
math of the quantized operands, the refusals, and on the GPU the Triton kernel against ``torch._scaled_mm`` and the
rowwise quantize kernel against its twin (under the interpreter it runs in ``tests/ops/test_kernels.py``).

The Triton 3.6 interpreter cannot run an e4m3 ``tl.dot``, so the Triton kernel is tested on the GPU only
(``docs/notes/fp8-mainloop-compile.md``); its sm_90 compile is in ``test_compile_matrix.py``."""
from __future__ import annotations

import pytest
import torch

import codagen
from codagen.epilogue import ProgramError, library
from codagen.ops import kernels


def operands(m: int, n: int, k: int, device="cpu"):
    """e4m3 ``x`` [M, K] and ``w`` [N, K] with their rowwise scales (:mod:`codagen.ops.kernels.quantize`)."""
    torch.manual_seed(0)
    x, w = torch.randn(m, k, device=device), 0.1 * torch.randn(n, k, device=device)
    (xq, x_scale), (wq, w_scale) = kernels.quantize_rowwise(x), kernels.quantize_rowwise(w)
    return xq, x_scale, wq, w_scale


def dequantized_product(xq, x_scale, wq, w_scale) -> torch.Tensor:
    """``(xq @ wq^T) * x_scale[m] * w_scale[n]`` in float64: the quantized math exactly."""
    return (xq.double() @ wq.double().t()) * x_scale.double()[:, None] * w_scale.double()[None, :]


def test_rowwise_scales_scale_the_accumulator_before_everything_else():
    program = library.rms_gate_up_swiglu().with_rowwise_scales()
    assert program.name == "rms_gate_up_swiglu_rowwise"
    assert list(program.inputs) == ["a_scale", "b_scale", "rstd"]
    assert "t0 = (((acc * a_scale[m]) * b_scale[n]) * rstd[m])" in str(program)
    assert library.rms_gate_up_swiglu().with_rowwise_scales() is program  # one program per source program


def test_rowwise_scales_refuse_a_low_rank_pair_and_a_taken_name():
    with pytest.raises(ProgramError, match="rowwise scales with a low-rank operand pair are not supported"):
        library.linear().with_low_rank().with_rowwise_scales()
    with pytest.raises(ProgramError, match="'a_scale' and 'b_scale' are the rowwise scales"):
        library.linear().with_rowwise_scales().with_rowwise_scales()


@pytest.mark.parametrize("m, n, k", [(37, 24, 64), (5, 130, 48)])
def test_reference_backend_runs_e4m3_operands_into_bf16_activations(m, n, k):
    xq, x_scale, wq, w_scale = operands(m, n, k)
    with codagen.use_backend("reference"):
        out = codagen.execute(library.linear().with_rowwise_scales(), xq, wq, a_scale=x_scale, b_scale=w_scale)["out"]
    assert out.dtype == torch.bfloat16  # an "input" store of e4m3 operands
    want = dequantized_product(xq, x_scale, wq, w_scale)
    # fp32 accumulation of exact e4m3 products, then one bf16 rounding
    torch.testing.assert_close(out.double(), want, rtol=2 ** -8, atol=1e-6)


def test_reference_backend_runs_a_fused_program_on_e4m3_operands():
    """The scales come first: the gate/up program's rstd and SwiGLU act on the dequantized product."""
    xq, x_scale, wq, w_scale = operands(9, 32, 64)
    rstd = torch.rand(9) + 0.5
    with codagen.use_backend("reference"):
        out = codagen.execute(library.rms_gate_up_swiglu().with_rowwise_scales(), xq, wq, a_scale=x_scale,
                              b_scale=w_scale, rstd=rstd)
    z = dequantized_product(xq, x_scale, wq, w_scale) * rstd.double()[:, None]
    torch.testing.assert_close(out["preact"].double(), z, rtol=2 ** -8, atol=1e-6)
    want = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
    torch.testing.assert_close(out["out"].double(), want, rtol=2 ** -7, atol=1e-5)


def test_e4m3_operands_with_a_low_rank_pair_are_refused():
    xq, x_scale, wq, w_scale = operands(4, 8, 16)
    program = library.linear().with_low_rank()
    with codagen.use_backend("reference"), pytest.raises(ProgramError, match="a low-rank operand pair with "
                                                                              "torch.float8_e4m3fn operands"):
        codagen.execute(program, xq, wq, a2=xq[:, :2].contiguous(), b2=wq[:, :2].contiguous())


def test_triton_backend_refuses_e4m3_cpu_tensors_naming_the_way_that_runs_them():
    pytest.importorskip("triton")
    xq, x_scale, wq, w_scale = operands(4, 8, 16)
    with codagen.use_backend("triton"), pytest.raises(ProgramError, match="float8_e4m3fn operands run compiled on "
                                                                           "a GPU.*backend='reference'"):
        codagen.execute(library.linear().with_rowwise_scales(), xq, wq, a_scale=x_scale, b_scale=w_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(4096, 4096, 4096), (1000, 1536, 512)])
def test_gpu_rowwise_fp8_gemm_keeps_the_numerics_rule_against_scaled_mm(m, n, k):
    """The Triton kernel's error against the float64 quantized math is at most twice ``torch._scaled_mm``'s
    (rowwise, bf16 out), plus 1e-6; outputs poisoned first (CODAGEN_POISON_OUTPUTS, the tests' setting)."""
    from codagen.backends.triton.targets import of_device
    device = torch.device("cuda")
    if of_device(device).fp8_mma is None:
        pytest.skip("this GPU has no e4m3 matrix instruction")
    xq, x_scale, wq, w_scale = operands(m, n, k, device)
    with codagen.use_backend("triton"):
        got = codagen.execute(library.linear().with_rowwise_scales(), xq, wq, a_scale=x_scale, b_scale=w_scale)["out"]
    peer = torch._scaled_mm(xq, wq.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :],
                            out_dtype=torch.bfloat16)
    want = dequantized_product(xq, x_scale, wq, w_scale)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    ours, theirs = (got.double() - want).abs().max().item(), (peer.double() - want).abs().max().item()
    assert ours <= 2 * theirs + 1e-6, (ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_quantize_rowwise_is_its_twin_bitwise(dtype):
    torch.manual_seed(0)
    x = (torch.randn(300, 5000) * 10.0 ** torch.empty(300, 1).uniform_(-3, 3)).to(dtype)
    got_q, got_scale = kernels.quantize_rowwise_triton(x.cuda())
    want_q, want_scale = kernels.quantize_rowwise_ref(x)
    assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got_scale.cpu(), want_scale)
