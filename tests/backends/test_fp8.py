"""Rowwise-scaled e4m3 GEMMs (``Program.with_rowwise_scales``): the programs, the reference backend against float64
math of the quantized operands, the refusals, and on the GPU the Triton kernel against ``torch._scaled_mm`` and the
rowwise quantize kernel against its twin (under the interpreter it runs in ``tests/ops/test_kernels.py``).

The interpreter runs the Triton kernel with its operands decoded to fp32 before the dot (Triton 3.6's interpreter
aborts on an e4m3 ``tl.dot``: ``docs/notes/fp8-mainloop-compile.md``); the sm_90 compile is in
``test_compile_matrix.py``."""
from __future__ import annotations

import pytest
import torch

import codagen
from codagen.epilogue import ProgramError, library
from codagen.epilogue.core import quantize_groups_ref
from codagen.epilogue.ir import Accumulator, Gemm, Program, QuantizedStore, Store, SwiGLU, TileInput
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


def assert_backends_agree(program, a, b, tensors) -> None:
    """The Triton kernel (in the interpreter on CPU) and the reference backend give ``program``'s outputs within one
    bf16 step (they accumulate in different orders), every element written."""
    got, want = ({name: t.double() for name, t in codagen.execute(program, a, b, backend=backend, **tensors).items()}
                 for backend in ("triton", "reference"))
    for name, value in want.items():
        assert not got[name].isnan().any(), name
        torch.testing.assert_close(got[name], value, rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("program", [library.linear(), library.input_grad(), library.weight_grad(),
                                     library.rms_gate_up_swiglu()], ids=lambda p: p.name)
def test_interpreter_runs_e4m3_programs_as_the_reference_does(program):
    """The Triton kernel in the interpreter, in each training layout: it decodes e4m3 operands to fp32 before the dot
    (as it does bf16 ones), products of e4m3 values are exact in fp32, so it agrees with the reference backend to
    the accumulation order."""
    pytest.importorskip("triton")
    program = program.with_rowwise_scales()
    m, n, k = 70, 96, 160
    (a_shape, b_shape) = program.gemm.shapes(m, n, k)
    a, b = (torch.randn(shape).to(torch.float8_e4m3fn) for shape in (a_shape, b_shape))
    tensors = {"a_scale": torch.rand(m) + 0.5, "b_scale": torch.rand(n) + 0.5}
    if "rstd" in program.inputs:
        tensors["rstd"] = torch.rand(m) + 0.5
    assert_backends_agree(program, a, b, tensors)


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


# --------------------------------------------------------------------------------------------------
# Blockwise scales (Gemm.k_scale_group): 1 x G activations, G x G weight blocks or 1 x G on both operands
# --------------------------------------------------------------------------------------------------
def blockwise_operands(program, m: int, n: int, k: int, device="cpu"):
    """Random e4m3 operands of ``program``'s layouts and fresh K-group scales in [0.5, 1.5)."""
    gemm, groups = program.gemm, -(-k // program.gemm.k_scale_group)
    a_shape, b_shape = gemm.shapes(m, n, k)
    scale_m = n if not gemm.b_scale_block else -(-n // gemm.k_scale_group)
    a_scale_shape, _ = gemm.shapes(m, n, groups)
    _, b_scale_shape = gemm.shapes(m, scale_m, groups)
    a, b = (torch.randn(shape, device=device).to(torch.float8_e4m3fn) for shape in (a_shape, b_shape))
    return a, b, {"a_scale": torch.rand(a_scale_shape, device=device) + 0.5,
                  "b_scale": torch.rand(b_scale_shape, device=device) + 0.5}


def grouped_product(program, a, b, a_scale, b_scale) -> torch.Tensor:
    """``sum_g (A[:, g] @ B[g, :]) * a_scale[m, g] * b_scale[n or its block, g]`` in float64, group by group."""
    gemm, group = program.gemm, program.gemm.k_scale_group
    a = a.double() if gemm.a_layout == "mk" else a.double().t()        # [M, K]
    b = b.double().t() if gemm.b_layout == "nk" else b.double()        # [K, N]
    a_scale = a_scale.double() if gemm.a_layout == "mk" else a_scale.double().t()  # [M, K/G]
    b_scale = b_scale.double() if gemm.b_layout == "nk" else b_scale.double().t()  # [N or N/G, K/G]
    if gemm.b_scale_block:
        b_scale = b_scale.repeat_interleave(group, dim=0)[:b.shape[1]]
    k = a.shape[1]
    return sum((a[:, start:start + group] @ b[start:start + group]) * a_scale[:, g, None] * b_scale[None, :, g]
               for g, start in enumerate(range(0, k, group)))


BLOCKWISE = [(library.linear(), True), (library.input_grad(), True), (library.weight_grad(), False),
             (library.linear(), False), (library.rms_gate_up_swiglu(), True)]


def test_blockwise_scales_name_the_gemm_and_refuse_what_they_cannot_take():
    program = library.linear().with_blockwise_scales(128, b_block=True)
    assert program.name == "linear_blockwise" and program.gemm.operand_tensors == ("a_scale", "b_scale")
    assert "a_scale[m, g] * b_scale[n / 128, g]  (K in groups g of 128)" in str(program)
    assert library.linear().with_blockwise_scales(128, b_block=True) is program
    with pytest.raises(ProgramError, match="has K-group scales already"):
        program.with_blockwise_scales()
    with pytest.raises(ProgramError, match="K-group scales already; rowwise scales are the other recipe"):
        program.with_rowwise_scales()
    with pytest.raises(ProgramError, match="scales its accumulator rowwise already"):
        library.linear().with_rowwise_scales().with_blockwise_scales()
    with pytest.raises(ProgramError, match="K-group scales with a low-rank operand pair"):
        program.with_low_rank()
    with pytest.raises(ProgramError, match="k_scale_group must be None or a power of two >= 16"):
        library.linear().with_blockwise_scales(96)
    with pytest.raises(ProgramError, match="b_scale_block needs k_scale_group"):
        Gemm(b_scale_block=True)


@pytest.mark.parametrize("program, b_block", BLOCKWISE, ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("m, n, k", [(40, 48, 100), (65, 96, 256)])
def test_reference_backend_blockwise_is_the_grouped_float64_sum(program, b_block, m, n, k):
    program = program.with_blockwise_scales(32, b_block=b_block)
    a, b, scales = blockwise_operands(program, m, n, k)
    tensors = dict(scales, rstd=torch.rand(m) + 0.5) if "rstd" in program.inputs else scales
    out = codagen.execute(program, a, b, backend="reference", **tensors)
    want = grouped_product(program, a, b, **scales)
    if "rstd" in program.inputs:
        want = want * tensors["rstd"].double()[:, None]
    got = out["preact" if "preact" in out else next(iter(out))].double()
    torch.testing.assert_close(got, want, rtol=2 ** -8, atol=1e-5)


@pytest.mark.parametrize("program, b_block", BLOCKWISE, ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("group, m, n, k", [(32, 40, 64, 100), (128, 65, 128, 320)])
def test_interpreter_blockwise_gemm_agrees_with_the_reference(program, b_block, group, m, n, k):
    """The K-grouped mainloop in the interpreter (BLOCK_K cut to the group, B's block scale a scalar per K tile),
    K not a multiple of the group (a last, partial group), M not one of the tile."""
    pytest.importorskip("triton")
    program = program.with_blockwise_scales(group, b_block=b_block)
    a, b, tensors = blockwise_operands(program, m, n, k)
    if "rstd" in program.inputs:
        tensors["rstd"] = torch.rand(m) + 0.5
    assert_backends_agree(program, a, b, tensors)


def test_bind_checks_the_k_group_scales():
    program = library.linear().with_blockwise_scales(32, b_block=True)
    a, b, scales = blockwise_operands(program, 8, 64, 100)

    def run(**changes):
        codagen.execute(program, changes.pop("a", a), b, backend="reference", **{**scales, **changes})
    run()
    with pytest.raises(ProgramError, match=r"b_scale: expected shape \[cdiv\(N, 32\), cdiv\(K, 32\)\] \(K = 100\) "
                                           r"= \(2, 4\), got \(64, 4\)"):
        run(b_scale=torch.rand(64, 4))
    with pytest.raises(ProgramError, match=r"a_scale: expected float32 K-group scales, got torch.bfloat16"):
        run(a_scale=scales["a_scale"].bfloat16())
    with pytest.raises(ProgramError, match=r"missing tensor\(s\) \['b_scale'\]"):
        codagen.execute(program, a, b, backend="reference", a_scale=scales["a_scale"])
    with pytest.raises(ProgramError, match="K-group scales .* scale float8_e4m3fn operands, got torch.bfloat16"):
        codagen.execute(program, a.bfloat16(), b.bfloat16(), backend="reference", **scales)


# --------------------------------------------------------------------------------------------------
# The quantizing epilogue (QuantizedStore): e4m3 with one scale per row and group of columns
# --------------------------------------------------------------------------------------------------
def quantizing_program(group: int) -> Program:
    """A residual add whose sum is stored in bf16 and in e4m3 twice: groups of columns (the next GEMM's operand) and
    groups of rows (a weight gradient's operand); and a SwiGLU's half-width output quantized too (the down
    projection's operand)."""
    acc = Accumulator()
    x = acc + TileInput("residual")
    return Program("quantizing", Gemm.linear(), (Store("out", x), QuantizedStore("out_e4m3", x, group=group),
                                                 QuantizedStore("out_e4m3_rows", x, group=group, along="m"),
                                                 QuantizedStore("act_e4m3", SwiGLU(acc), scale="act_scale",
                                                                group=group // 2)))


def test_quantized_store_is_two_outputs_and_refuses_bad_groups():
    program = quantizing_program(64)
    assert [name for o in program.outputs for name in o.names] == ["out", "out_e4m3", "out_e4m3_scale", "out_e4m3_rows",
                                                                  "out_e4m3_rows_scale", "act_e4m3", "act_scale"]
    assert "out_e4m3[m, n], out_e4m3_scale[m, n / 64] <- e4m3 of t0, scaled per 64 columns" in str(program)
    assert "out_e4m3_rows[m, n], out_e4m3_rows_scale[m / 64, n] <- e4m3 of t0, scaled per 64 rows" in str(program)
    assert [o.name for o in program.row_groups()] == ["out_e4m3_rows"]
    with pytest.raises(ProgramError, match="along must be 'n' .* or 'm' .*, got 'k'"):
        QuantizedStore("q", Accumulator(), along="k")
    with pytest.raises(ProgramError, match="group must be a power of two >= 16, got 48"):
        QuantizedStore("q", Accumulator(), group=48)
    with pytest.raises(ProgramError, match=r"output names repeat: \['q_scale'\]"):
        Program("p", Gemm.linear(), (QuantizedStore("q", Accumulator()), Store("q_scale", Accumulator())))
    a, b = torch.randn(4, 16), torch.randn(96, 16)
    with pytest.raises(ProgramError, match=r"the quantized store 'out_e4m3' \(scales per 64 columns\) needs whole "
                                           r"groups of 64 columns, got 96 columns"):
        codagen.execute(program, a, b, backend="reference", residual=torch.randn(4, 96))


def test_reference_quantized_store_matches_quantize_groups_and_dequantizes_within_half_a_step():
    program = quantizing_program(32)
    m, n, k = 9, 128, 48
    a, b, residual = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
    out = codagen.execute(program, a, b, backend="reference", residual=residual)
    x = a @ b.t() + residual
    q, scale = quantize_groups_ref(x, 1, 32)
    assert torch.equal(out["out_e4m3"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(out["out_e4m3_scale"], scale)
    dequantized = out["out_e4m3"].double().unflatten(1, (4, 32)) * out["out_e4m3_scale"].double()[:, :, None]
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value relative to its group's amax (subnormals included)
    error = (dequantized.flatten(1) - x.double()).unflatten(1, (4, 32)).abs().amax(2)
    assert (error <= 2 ** -4 * 448 * scale.double()).all()
    assert (out["out_e4m3"].float().unflatten(1, (4, 32)).abs().amax(2) == 448).all()  # each amax lands on 448


def check_quantized_store_against_the_reference(group: int, m: int, n: int, device: str) -> None:
    """Integer-valued operands make the Triton kernel's and the reference backend's accumulators exact, so the
    residual sum's codes and scales, in groups of columns and of rows, agree bit for bit: ties, the group's amax,
    masked rows (M not a multiple of the tile, a last partial group of rows) and N not a multiple of the tile. The
    half-width SwiGLU output (the kernel's own sigmoid) is within one e4m3 step of the reference's code."""
    program = quantizing_program(group)
    k, dtype = 64, torch.float32 if device == "cpu" else torch.bfloat16
    a = torch.randint(-3, 4, (m, k), device=device).to(dtype)
    b = torch.randint(-3, 4, (n, k), device=device).to(dtype)
    residual = (torch.randint(-8, 9, (m, n), device=device) / 4).to(dtype)
    got, want = (codagen.execute(program, a, b, backend=backend, residual=residual)
                 for backend in ("triton", "reference"))
    assert got["out_e4m3"].dtype == got["act_e4m3"].dtype == torch.float8_e4m3fn
    for codes in ("out_e4m3", "out_e4m3_rows"):
        assert torch.equal(got[codes].view(torch.uint8), want[codes].view(torch.uint8)), codes
        assert torch.equal(got[f"{codes}_scale"], want[f"{codes}_scale"]), codes
    torch.testing.assert_close(got["act_scale"], want["act_scale"], rtol=1e-5, atol=0)
    torch.testing.assert_close(got["act_e4m3"].float(), want["act_e4m3"].float(), rtol=2 ** -3, atol=2 ** -9)


def test_reference_quantized_store_along_m_is_the_groups_of_the_transpose():
    """Groups of rows: one scale per column and 32 rows, the last group partial (M = 70)."""
    m, n, k = 70, 64, 48
    a, b, residual = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
    out = codagen.execute(quantizing_program(32), a, b, backend="reference", residual=residual)
    x = a @ b.t() + residual
    q, scale = quantize_groups_ref(x.t().contiguous(), 1, 32)
    assert out["out_e4m3_rows_scale"].shape == (3, n)
    assert torch.equal(out["out_e4m3_rows"].view(torch.uint8), q.t().contiguous().view(torch.uint8))
    assert torch.equal(out["out_e4m3_rows_scale"], scale.t())
    assert (out["out_e4m3_rows"][64:].float().abs().amax(0) == 448).all()  # the partial group's amax lands on 448


@pytest.mark.parametrize("group, m, n", [(32, 37, 128), (64, 70, 192), (128, 33, 256)])
def test_interpreter_quantized_store_is_the_reference_bitwise(group, m, n):
    pytest.importorskip("triton")
    check_quantized_store_against_the_reference(group, m, n, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("group, m, n", [(128, 1000, 4096), (64, 4096, 1536)])
def test_gpu_quantized_store_is_the_reference_bitwise(group, m, n):
    check_quantized_store_against_the_reference(group, m, n, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("program, b_block", BLOCKWISE[:3], ids=lambda v: getattr(v, "name", str(v)))
def test_gpu_blockwise_gemm_keeps_the_numerics_rule(program, b_block):
    """The Triton kernel's error against the grouped float64 product is at most twice PyTorch's (the reference
    backend: the dequantized operands multiplied in fp32, stored in bf16), plus 1e-6."""
    from codagen.backends.triton.targets import of_device
    if of_device(torch.device("cuda")).fp8_mma is None:
        pytest.skip("this GPU has no e4m3 matrix instruction")
    program = program.with_blockwise_scales(128, b_block=b_block)
    a, b, scales = blockwise_operands(program, 4096, 4096, 4096, "cuda")
    got, peer = (codagen.execute(program, a, b, backend=backend, **scales) for backend in ("triton", "reference"))
    want = grouped_product(program, a, b, **scales)
    (name,) = got
    assert got[name].dtype == torch.bfloat16 and torch.isfinite(got[name]).all()
    ours, theirs = ((t[name].double() - want).abs().max().item() for t in (got, peer))
    assert ours <= 2 * theirs + 1e-6, (ours, theirs)


def test_a_quantizing_epilogue_feeds_a_blockwise_gemm():
    """The chain the quantizing epilogue exists for, in the interpreter: a bf16-operand GEMM stores its output in
    e4m3 with 1 x 128 scales; the next GEMM reads it with 128 x 128 weight blocks; the result is the reference
    backend's chain, and within e4m3's precision of the unquantized product."""
    pytest.importorskip("triton")
    m, d, n = 48, 256, 128
    x_in, w_in, residual = torch.randn(m, 64).half(), (torch.randn(d, 64) / 8).half(), torch.randn(m, d).half()
    weight = torch.randn(n, d) / 16
    # the weight in 128 x 128 blocks: one scale per block (what a weight quantizer gives)
    blocks = weight.unflatten(0, (n // 128, 128)).unflatten(2, (d // 128, 128))      # [N/G, G, K/G, G]
    w_scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448                   # [N/G, K/G]
    wq = (blocks / w_scale[:, None, :, None]).flatten(2).flatten(0, 1).to(torch.float8_e4m3fn)
    first, second = quantizing_program(128), library.linear().with_blockwise_scales(128, b_block=True)
    results = {}
    for backend in ("triton", "reference"):
        h = codagen.execute(first, x_in, w_in, backend=backend, residual=residual)
        results[backend] = codagen.execute(second, h["out_e4m3"], wq, backend=backend, a_scale=h["out_e4m3_scale"],
                                           b_scale=w_scale)["out"].double()
    torch.testing.assert_close(results["triton"], results["reference"], rtol=2 ** -7, atol=1e-5)
    h_exact = x_in.double() @ w_in.double().t() + residual.double()
    exact = h_exact @ weight.double().t()
    relative = (results["triton"] - exact).norm() / exact.norm()
    assert relative < 0.05, relative  # two e4m3 roundings (3 mantissa bits each)


def test_quantizing_epilogues_feed_a_weight_gradient():
    """The weight gradient's chain, in the interpreter: two bf16-operand GEMMs store their outputs (the activation
    X [tokens, in] and the output gradient dY [tokens, out]) in e4m3 with one scale per column and 128 tokens; the
    blockwise weight gradient dY^T @ X reads both with their scales along its K, the tokens (200: a partial last
    group). The result is the reference backend's chain, and within e4m3's precision of the unquantized product."""
    pytest.importorskip("triton")
    tokens, d_in, d_out = 200, 128, 64
    quantized = {}
    for name, width in (("x", d_in), ("grad", d_out)):
        acc = Accumulator()
        quantized[name] = (Program(f"{name}_rows", Gemm.linear(), (QuantizedStore(name, acc, along="m"),)),
                           torch.randn(tokens, 32).half(), (torch.randn(width, 32) / 4).half())
    weight_grad = library.weight_grad().with_blockwise_scales(128)
    results = {}
    for backend in ("triton", "reference"):
        out = {name: codagen.execute(program, a, b, backend=backend) for name, (program, a, b) in quantized.items()}
        results[backend] = codagen.execute(weight_grad, out["grad"]["grad"], out["x"]["x"], backend=backend,
                                           a_scale=out["grad"]["grad_scale"], b_scale=out["x"]["x_scale"]
                                           )["grad_weight"].double()
    torch.testing.assert_close(results["triton"], results["reference"], rtol=2 ** -7, atol=1e-5)
    x, grad = ((a.double() @ b.double().t()) for _, a, b in (quantized["x"], quantized["grad"]))
    exact = grad.t() @ x
    relative = (results["triton"] - exact).norm() / exact.norm()
    assert relative < 0.05, relative  # two e4m3 roundings (3 mantissa bits each)


def test_the_pingpong_schedule_refuses_the_fp8_programs():
    """Its mainloop takes 16-bit operands and its stores are bf16 pieces: these programs take the persistent kernel."""
    pytest.importorskip("triton")
    from codagen.backends.triton import pingpong
    assert "K-group-scaled" in pingpong.refusal(library.rms_gate_up_swiglu().with_blockwise_scales(b_block=True))
    assert "quantized stores" in pingpong.refusal(quantizing_program(128))
    assert pingpong.refusal(library.rms_gate_up_swiglu()) is None


def test_groups_of_rows_no_tile_holds_are_refused_naming_the_store():
    pytest.importorskip("triton")
    from codagen.backends.triton.configs import candidates
    program = Program("rows_256", Gemm.linear(), (QuantizedStore("q", Accumulator(), group=256, along="m"),))
    with pytest.raises(ProgramError, match=r"the quantized store 'q' \(scales per 256 rows\) needs tiles of a "
                                           r"multiple of that many rows; .* have \[128\] rows"):
        candidates(program, target="sm_90", operand_bytes=2, smem_limit=232448, tma=True, tma_epilogue=True)


def test_a_program_may_not_take_the_k_group_scales_names():
    with pytest.raises(ProgramError, match=r"\['a_scale', 'b_scale'\] are the GEMM's K-group scales"):
        Program("p", Gemm(k_scale_group=128), (Store("a_scale", Accumulator()),))


@pytest.mark.parametrize("x, group, along, message", [
    (torch.randn(4, 8), 128, "k", r"along must be one of \('n', 'm', 'blocks'\), got 'k'"),
    (torch.randn(4, 8), 96, "n", "group must be a power of two >= 16, got 96"),
    (torch.randn(2, 4, 8), 128, "n", r"x must be a 2-D floating-point matrix, got shape \(2, 4, 8\)"),
    (torch.ones(4, 8, dtype=torch.int32), 128, "n", "x must be a 2-D floating-point matrix.*torch.int32"),
])
def test_quantize_groups_refuses_what_it_cannot_take(x, group, along, message):
    for quantize in (kernels.quantize_groups_ref, kernels.quantize_groups):
        with pytest.raises(ValueError, match=message):
            quantize(x, group, along)
