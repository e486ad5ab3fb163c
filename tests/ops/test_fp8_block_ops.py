"""The block ops with ``fp8=True``: every GEMM they launch, forward and backward, is a blockwise e4m3 program; each of
those programs keeps the 2x rule against float64 math of the same quantized operands (the Triton kernel in the
interpreter on CPU, compiled on the GPU; the peer is the reference backend: PyTorch's fp32 product of the dequantized
operands, stored as the kernel stores); the ops stay within FP8's distance of the unquantized block; and they refuse
what FP8 cannot take."""
from __future__ import annotations

import pytest
import torch

import codagen
from codagen import ops
from codagen.epilogue import library
from codagen.epilogue.ir import Program, QuantizedStore, Store
from codagen.epilogue.primitives import ColVector, RowVector, TileInput
from codagen.ops import _fp8, _fused, kernels

from ..conftest import finished
from .test_fp8_linear import dequantized

#: the programs the block ops run in FP8, each with whether its B operand is a weight (blocks) or an activation
FP8_PROGRAMS = [(library.residual_rms_stats(), True), (library.rms_qkv_rope(), True),
                (library.rms_qkv_rope(bias=True), True), (library.rms_qkv_rope(16, 1e-6, True), True),
                (library.rms_linear(), True), (library.rms_gate_up_swiglu(), True),
                (library.swiglu_backward("silu"), True), (library.rms_norm_backward("add"), True),
                (library.rms_norm_backward("none"), True), (library.input_grad(True), True),
                (library.input_grad(), True), (library.weight_grad(), False),
                # the backward's recomputed operands, stored as the weight gradients read them
                (library.rms_norm_backward("add").with_quantized_store("normed", "m"), True),
                (library.rms_norm_backward("none").with_quantized_store("normed", "m"), True),
                (library.swiglu_backward("silu").with_quantized_store("act", "m"), True),
                # a producer storing the next FP8 GEMM's operand (groups of 128 columns: N a multiple of 128)
                (library.residual_rms_stats().with_quantized_store("normed", "n"), True)]


def epilogue_inputs(program, m: int, n: int, device="cpu") -> dict[str, torch.Tensor]:
    """Fresh random inputs of ``program``'s epilogue: tiles and column vectors in bf16 (the FP8 GEMMs' activation
    dtype), row vectors (rstd, positions, row statistics) and RoPE frequencies in fp32."""
    tensors = {}
    for name, spec in program.inputs.items():
        if isinstance(spec, TileInput):
            t = torch.randn(m, spec.width.columns(n), device=device).to(torch.bfloat16)
        elif isinstance(spec, RowVector):
            t = torch.arange(m, device=device).float() if name == "positions" else torch.rand(m, device=device) + 0.5
        elif isinstance(spec, ColVector):
            columns = spec.width.columns(n)
            if name == "frequencies":
                t = torch.rand(columns, device=device) * 0.1
            elif name == "qk_passthrough":
                t = (torch.arange(columns, device=device) >= 2 * columns // 3).to(torch.bfloat16)
            else:
                t = (1 + 0.2 * torch.randn(columns, device=device)).to(torch.bfloat16)
        else:
            raise TypeError(f"{name}: no random input for {type(spec).__name__}")
        tensors[name] = t
    return tensors


def check_fp8_program(program, b_block: bool, m: int, n: int, k: int, device: str) -> None:
    """``program`` on e4m3 operands (``_fp8.blockwise``) on the Triton backend and on the reference backend, against
    the plain program in float64 on the dequantized operands: every output within twice the reference's error."""
    a_shape, b_shape = program.gemm.shapes(m, n, k)
    a = torch.randn(a_shape, device=device).to(torch.bfloat16)
    b = (torch.randn(b_shape, device=device) * k ** -0.5).to(torch.bfloat16)
    tensors = epilogue_inputs(program, m, n, device)
    fp8_program = program.with_blockwise_scales(_fp8.GROUP, b_block)
    got, peer = (finished(fp8_program, _fp8_outputs(program, a, b, b_block, backend, tensors))
                 for backend in ("triton", "reference"))
    gemm = program.gemm
    a_along = "n" if gemm.a_layout == "mk" else "m"
    b_along = "blocks" if b_block else "n" if gemm.b_layout == "nk" else "m"
    exact = {name: t.double().cpu() for name, t in tensors.items()}
    # the oracle stores every output as it is: a quantized store's codes are compared, decoded, with the value
    oracle = Program(program.name, program.gemm, tuple(Store(o.name, o.value) if isinstance(o, QuantizedStore) else o
                                                       for o in program.outputs))
    with codagen.use_backend("reference"):
        want = finished(oracle, codagen.execute(oracle, dequantized(a.cpu(), a_along), dequantized(b.cpu(), b_along),
                                                **exact))
    quantized = {o.name for o in program.outputs if isinstance(o, QuantizedStore)}
    for name, value in want.items():
        assert not got[name].isnan().any(), name
        ours, theirs = ((t[name].cpu() - value).abs().max().item() for t in (got, peer))
        assert ours <= 2 * theirs + 1e-6, (program.name, name, ours, theirs)
        # and the peer is the quantized math to the stores' rounding (bf16: 2^-8 of the largest value, fp32 partial
        # sums far below it; e4m3 codes: half a step, 2^-4 of the largest value), so that a fault both backends
        # share (the operands' grouping, a scale) fails too
        rounding = 2 ** -4 if name in quantized else 2 ** -8
        assert theirs <= rounding * value.abs().max().item(), (program.name, name, theirs)


def _fp8_outputs(program, a, b, b_block, backend, tensors):
    with codagen.use_backend(backend):
        return _fp8.blockwise(program, a, b, b_block=b_block, **tensors)


@pytest.mark.parametrize("program, b_block", FP8_PROGRAMS, ids=lambda v: getattr(v, "name", str(v)))
def test_interpreter_fp8_programs_keep_the_2x_rule(program, b_block):
    pytest.importorskip("triton")
    n = 256 if "normed_e4m3" in program.name and "residual" in program.name else 48 if "swiglu" in program.name else 96
    check_fp8_program(program, b_block, 70, n, 200, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("program, b_block", FP8_PROGRAMS, ids=lambda v: getattr(v, "name", str(v)))
def test_gpu_fp8_programs_keep_the_2x_rule(program, b_block):
    from codagen.backends.triton.targets import of_device
    if of_device(torch.device("cuda")).fp8_mma is None:
        pytest.skip("this GPU has no e4m3 matrix instruction")
    check_fp8_program(program, b_block, 2048, 1024, 1536, "cuda")


# --- the block ops ---------------------------------------------------------------------------------------------------
M, HEADS, KV_HEADS, HEAD_DIM, FFN = 70, 4, 2, 16, 48
#: the widths of the block: one that groups of 128 columns do not divide (the producers store ``normed`` in bf16)
#: and one they do (``normed`` in e4m3, read by the next GEMM as it is)
WIDTHS = (64, 256)


def block_leaves(qk_norm: bool = False, d: int = 64):
    """A block's bf16 leaves: x, the two norm weights, the four GEMM weights (QK-norm weights with ``qk_norm``)."""
    def leaf(*shape, scale=1.0, offset=0.0):
        return (offset + torch.randn(*shape) * scale).to(torch.bfloat16).requires_grad_()
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    leaves = dict(x=leaf(M, d), attn_norm=leaf(d, scale=0.2, offset=1), mlp_norm=leaf(d, scale=0.2, offset=1),
                  qkv=leaf(qkv_rows, d, scale=d ** -0.5), o=leaf(d, HEADS * HEAD_DIM, scale=(HEADS * HEAD_DIM) ** -0.5),
                  gate_up=leaf(2 * FFN, d, scale=d ** -0.5), down=leaf(d, FFN, scale=FFN ** -0.5))
    if qk_norm:
        leaves.update(q_norm=leaf(HEAD_DIM, scale=0.2, offset=1), k_norm=leaf(HEAD_DIM, scale=0.2, offset=1))
    return leaves


def run_block(leaves: dict, fp8: bool, bias: torch.Tensor | None = None):
    """A pre-norm block of the three block ops (RMSNorm + QKV + RoPE, attention left out: Q is the out-projection's
    input; out-projection + residual; the gated MLP + residual), its loss and every leaf's gradient."""
    leaves = {name: t.detach().clone().requires_grad_() for name, t in leaves.items()}
    x = leaves["x"]
    positions, frequencies = torch.arange(M).float(), ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM)
    normed, rstd = ops.rms_norm_stats(x, leaves["attn_norm"], 1e-6)
    qk_norm = {} if "q_norm" not in leaves else dict(q_norm_weight=leaves["q_norm"], k_norm_weight=leaves["k_norm"],
                                                      num_heads=HEADS)
    q, k, v, residual = ops.rms_qkv_rope(
        x, normed, rstd, leaves["attn_norm"], leaves["qkv"], positions, frequencies, **qk_norm,
        split_sizes=(HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM), pass_residual=True, bias=bias,
        fp8=fp8)
    h, normed, rstd = ops.out_proj_residual_rms(q.contiguous(), leaves["o"], residual, leaves["mlp_norm"], 1e-6,
                                                fp8=fp8)
    assert isinstance(normed, _fp8.Quantized) == (fp8 and x.shape[1] % _fp8.GROUP == 0)
    out, _, _ = ops.swiglu_mlp_residual_rms(h, normed, rstd, leaves["mlp_norm"], leaves["gate_up"], leaves["down"],
                                            leaves["attn_norm"], 1e-6, fp8=fp8)
    loss = out.float().pow(2).mean() + (k.float().sum() + v.float().sum()) * 1e-2
    loss.backward()
    return out.detach(), {name: t.grad for name, t in leaves.items()}


def spy_programs(monkeypatch) -> list[str]:
    """The names of the programs the block ops execute, blockwise or not."""
    names = []
    for module in (_fp8, _fused):
        def recording(program, *args, execute=module.execute, **kwargs):
            names.append(program.name)
            return execute(program, *args, **kwargs)
        monkeypatch.setattr(module, "execute", recording)
    return names


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_every_gemm_of_the_fp8_block_ops_is_blockwise(monkeypatch, qk_norm, d):
    leaves = block_leaves(qk_norm, d)
    names = spy_programs(monkeypatch)
    quantized = []
    monkeypatch.setattr(_fp8.kernels, "quantize_groups",
                        lambda x, group, along, quantize=kernels.quantize_groups: quantized.append(along) or
                        quantize(x, group, along))
    with codagen.use_backend("reference"):
        run_block(leaves, fp8=True)
    # forward: QKV, O, gate/up, down; backward: each one's input-gradient and weight-gradient GEMM
    assert len(names) == 12 and all(name.endswith("_blockwise") for name in names), names
    assert names.count("weight_grad_blockwise") == 4, names
    # the input-gradient GEMMs that recompute a weight gradient's operand store it in e4m3 along the tokens: the
    # norm consumers' normed inputs (QKV, gate/up) and the SwiGLU output (down)
    assert sum(name.startswith("rms_norm_backward_normed_e4m3") for name in names) == 2
    assert sum("_act_e4m3_" in name for name in names) == 1
    # the producers store normed in e4m3 where groups of 128 divide the width, and the gate/up GEMM reads it so
    stored = sum(name == "residual_rms_stats_normed_e4m3_blockwise" for name in names)
    assert stored == (2 if d % _fp8.GROUP == 0 else 0), names
    # every weight in blocks, each other GEMM's A operand along its K, the other operands of the weight gradients
    # (the four gradients, the out-projection's input) along the tokens
    assert quantized.count("blocks") == 8 and quantized.count("m") == 5, quantized
    assert quantized.count("n") == (7 if stored else 8), quantized
    names.clear()
    with codagen.use_backend("reference"):
        run_block(leaves, fp8=False)
    assert len(names) == 12 and not any(name.endswith("_blockwise") for name in names), names


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp8_block_ops_are_within_fp8_distance_of_the_bf16_block(backend, d):
    """Against the block in float64: the FP8 block's output and gradients are off by e4m3's rounding, more than the
    bf16 block and under 15% of their norm (3-5% for the output and the activations' gradients, 7-9% for the weight
    gradients, whose GEMMs read two quantized operands of gradients quantized before)."""
    if backend == "triton":
        pytest.importorskip("triton")
    leaves = block_leaves(d=d)
    bias = (torch.randn((HEADS + 2 * KV_HEADS) * HEAD_DIM) * 0.1).to(torch.bfloat16)
    with codagen.use_backend(backend):
        fp8 = run_block(leaves, fp8=True, bias=bias)
        bf16 = run_block(leaves, fp8=False, bias=bias)
    with codagen.use_backend("reference"):
        exact = run_block({name: t.double() for name, t in leaves.items()}, fp8=False, bias=bias.double())

    def distance(got, want):
        return ((got.double() - want).norm() / want.norm()).item()
    for name in ("out", *leaves):
        got, bf16_got, want = ((out if name == "out" else grads[name]) for out, grads in (fp8, bf16, exact))
        fp8_distance, bf16_distance = distance(got, want), distance(bf16_got, want)
        assert bf16_distance < fp8_distance < 0.15, (name, fp8_distance, bf16_distance)


def test_fp8_runs_deterministically():
    leaves = block_leaves(qk_norm=True, d=256)
    first, second = (run_block(leaves, fp8=True) for _ in range(2))
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(first[1][name], second[1][name]) for name in leaves)


@pytest.mark.parametrize("change, error, message", [
    (dict(fp8=1), TypeError, "fp8: expected a bool, got int"),
    (dict(dtype=torch.float32), ValueError, "fp8: FP8 GEMMs store bfloat16 activations, so x must be torch.bfloat16, "
                                            "got torch.float32"),
    (dict(low_rank=True), NotImplementedError, "fp8: a low-rank update"),
])
def test_the_fp8_block_ops_refuse_what_fp8_cannot_take(change, error, message):
    dtype = change.get("dtype", torch.bfloat16)
    x, w = torch.randn(8, 32).to(dtype), torch.randn(32, 32).to(dtype)
    gamma = torch.ones(32, dtype=dtype)
    low_rank = ops.LowRank(torch.randn(2, 32).to(dtype), torch.randn(32, 2).to(dtype)) if "low_rank" in change else None
    with pytest.raises(error, match=message):
        ops.out_proj_residual_rms(x, w, x, gamma, 1e-6, low_rank=low_rank, fp8=change.get("fp8", True))
