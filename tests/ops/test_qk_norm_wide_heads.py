"""QK-norm of heads that no epilogue sub-tile holds whole (head_dim 96, 192, 256; 128 with fp32 operands): F4 as
the GEMM that stores ``z`` (program ``rms_linear``) and the row kernel ``kernels.qk_norm_rope``, its backward the
one-GEMM path's. The programs each shape runs; forward and every gradient on both backends against PyTorch in
float64; the 2x rule in bf16 and fp16; the row kernel against the one-GEMM program where both apply."""
from __future__ import annotations

import pytest
import torch

import codagen
from codagen import ops
from codagen.backends import execute, triton_available
from codagen.backends.reference import ReferenceBackend
from codagen.epilogue import library
from codagen.ops import kernels
from codagen.ops.qkv import _qk_norm_columns, qk_norm_in_epilogue

from .conftest import reference_tiles, rms_norm

HEADS, KV_HEADS, D, EPS = 2, 1, 24, 1e-6
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(not triton_available(),
                                                                        reason="Triton is not installed"))]


def leaves(head_dim: int, m: int, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Fresh random leaves of the op in ``dtype`` (drawn in float64, then rounded): x, the input norm's weight,
    the fused QKV weight, q_norm's and k_norm's weights (norm weights near 1, never all ones)."""
    def leaf(*shape, scale=1.0, offset=0.0):
        return (offset + scale * torch.randn(*shape, dtype=torch.float64)).to(dtype).requires_grad_()
    qkv_features = (HEADS + 2 * KV_HEADS) * head_dim
    return dict(x=leaf(m, D), norm_weight=leaf(D, scale=0.3, offset=1.0),
                qkv_weight=leaf(qkv_features, D, scale=D ** -0.5), q_norm=leaf(head_dim, scale=0.3, offset=1.0),
                k_norm=leaf(head_dim, scale=0.3, offset=1.0))


def same_values(params: dict[str, torch.Tensor], dtype) -> dict[str, torch.Tensor]:
    return {name: t.detach().to(dtype).requires_grad_() for name, t in params.items()}


def codagen_qkv(p, positions, frequencies, **options):
    normed, rstd = ops.rms_norm_stats(p["x"], p["norm_weight"], EPS)
    out = ops.rms_qkv_rope(p["x"], normed, rstd, p["norm_weight"], p["qkv_weight"], positions, frequencies,
                           p["q_norm"], p["k_norm"], num_heads=HEADS, qk_norm_eps=EPS, **options)
    return torch.cat(out, dim=1) if isinstance(out, tuple) else out


def pytorch_qkv(p, positions, frequencies):
    """The op's math the unfused PyTorch way, every step at the inputs' dtype (cos and sin of fp32 angles, cast
    as transformers does): RMSNorm, the projection, each Q/K head's RMSNorm, RoPE on adjacent pairs."""
    head_dim = p["q_norm"].shape[0]
    z = (rms_norm(p["x"], p["norm_weight"], EPS) @ p["qkv_weight"].t()).unflatten(1, (-1, head_dim))
    gamma = torch.cat((p["q_norm"].expand(HEADS, head_dim), p["k_norm"].expand(KV_HEADS, head_dim)))
    y = torch.cat((rms_norm(z[:, :HEADS + KV_HEADS], gamma, EPS), z[:, HEADS + KV_HEADS:]), dim=1).flatten(1)
    theta = positions.to(frequencies.dtype)[:, None] * frequencies[None, :]  # in the frequencies' dtype
    cos, sin = theta.cos().to(y.dtype), theta.sin().to(y.dtype)
    even, odd = y[:, 0::2], y[:, 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(1)


def outputs(fn, p, probe, *args, **options) -> dict[str, torch.Tensor]:
    """``qkv`` and the gradient of every leaf for the loss ``sum(qkv * probe)``."""
    qkv = fn(p, *args, **options)
    grads = torch.autograd.grad((qkv * probe).sum(), list(p.values()))
    return {"qkv": qkv.detach(), **{f"grad {name}": g for name, g in zip(p, grads)}}


def rope_inputs(head_dim: int, m: int):
    return torch.randint(0, 4096, (m,)), ops.rope_frequencies(HEADS, KV_HEADS, head_dim)


# ==================================================================================================
# which path runs
# ==================================================================================================
@pytest.mark.parametrize("head_dim, dtype, one_gemm", [
    (256, torch.bfloat16, False), (192, torch.float16, False), (96, torch.bfloat16, False),
    (128, torch.bfloat16, True), (128, torch.float32, False), (64, torch.float32, True),
    (128, torch.float64, False), (64, torch.float64, True)])
def test_the_programs_each_head_dim_runs(monkeypatch, head_dim, dtype, one_gemm):
    """One GEMM where an epilogue sub-tile holds whole heads (head_dim dividing 128, in fp32 and fp64 64); else
    ``rms_linear`` and the row kernel on its output, with and without autograd (the same qkv, bitwise). The
    backward is the same either way: B1 (a row kernel), then the norm-backward and weight-gradient GEMMs."""
    ran, row_kernel_inputs = [], []
    run, row_kernel = ReferenceBackend.run, kernels.qk_norm_rope
    monkeypatch.setattr(ReferenceBackend, "run", lambda self, bound: ran.append(bound.program.name) or run(self, bound))
    monkeypatch.setattr(kernels, "qk_norm_rope", lambda *args: row_kernel_inputs.append(args[0]) or row_kernel(*args))
    assert qk_norm_in_epilogue(head_dim, dtype) == one_gemm
    m = 5
    p = leaves(head_dim, m, dtype)
    positions, frequencies = rope_inputs(head_dim, m)
    frequencies = frequencies.double() if dtype == torch.float64 else frequencies
    programs = {}
    with reference_tiles():
        qkv = codagen_qkv(p, positions, frequencies)
        programs["forward"], ran[:] = ran.copy(), []
        qkv.backward(torch.randn_like(qkv))
        programs["backward"], ran[:] = ran.copy(), []
        with torch.no_grad():
            inferred = codagen_qkv(p, positions, frequencies)
        programs["inference"] = ran.copy()
    assert programs == {"forward": ["rms_qkv_rope_qk_norm"] if one_gemm else ["rms_linear"],
                        "backward": ["rms_norm_backward", "weight_grad"],
                        "inference": ["rms_qkv_rope_qk_norm_inference"] if one_gemm else ["rms_linear"]}
    assert [tuple(z.shape) for z in row_kernel_inputs] == ([] if one_gemm else [tuple(qkv.shape)] * 2)
    torch.testing.assert_close(inferred, qkv.detach(), rtol=0, atol=0)
    for name, t in p.items():
        assert t.grad is not None and t.grad.abs().sum() > 0, name


# ==================================================================================================
# numerics
# ==================================================================================================
@pytest.mark.parametrize("head_dim", [96, 192, 256])
@pytest.mark.parametrize("backend, dtype", [("reference", torch.float64), ("reference", torch.float32),
                                            ("triton", torch.float32)], ids=["reference-fp64", "reference-fp32",
                                                                             "triton-fp32"])
def test_forward_and_gradients_match_pytorch(backend, dtype, head_dim):
    """qkv (as q, k, v views) and the gradients of x, both norm weights and the QKV weight against float64 PyTorch
    on the same values: float64 to 1e-10 of the largest value, float32 to 1e-5 (fp32 rounding noise; the angles,
    which the op takes in fp32 from fp32 frequencies, are those fp32 angles on both sides)."""
    if backend == "triton" and not triton_available():
        pytest.skip("Triton is not installed")
    m = 7
    p = leaves(head_dim, m, dtype)
    positions, frequencies = rope_inputs(head_dim, m)
    frequencies = frequencies.double() if dtype == torch.float64 else frequencies
    probe = torch.randn(m, p["qkv_weight"].shape[0], dtype=torch.float64)
    widths = (HEADS * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim)
    want = outputs(pytorch_qkv, same_values(p, torch.float64), probe, positions, frequencies)
    with codagen.use_backend(backend):
        got = outputs(codagen_qkv, p, probe.to(dtype), positions, frequencies, split_sizes=widths)
    relative = 1e-10 if dtype == torch.float64 else 1e-5
    for name, value in want.items():
        assert got[name].dtype == dtype, name
        error = (got[name].double() - value).abs().max().item()
        assert error <= relative * max(1.0, value.abs().max().item()), f"{name}: max error {error:.3e}"


@pytest.mark.parametrize("head_dim", [96, 256])
@pytest.mark.parametrize("backend, dtype", [("reference", torch.bfloat16), ("reference", torch.float16),
                                            ("triton", torch.float16)], ids=["reference-bf16", "reference-fp16",
                                                                             "triton-fp16"])
def test_two_x_rule(backend, dtype, head_dim):
    """The numerics rule: each output's max error vs float32 PyTorch on the same rounded values is at most 2x that
    of the same computation done in PyTorch at the input dtype, plus 1e-6."""
    if backend == "triton" and not triton_available():
        pytest.skip("Triton is not installed")
    m = 40
    p = leaves(head_dim, m, dtype)
    positions, frequencies = rope_inputs(head_dim, m)
    probe = torch.randn(m, p["qkv_weight"].shape[0]).to(dtype)
    want = outputs(pytorch_qkv, same_values(p, torch.float32), probe.float(), positions, frequencies)
    eager = outputs(pytorch_qkv, p, probe, positions, frequencies)
    with codagen.use_backend(backend):
        got = outputs(codagen_qkv, p, probe, positions, frequencies)
    failures = []
    for name, value in want.items():
        fused_error = (got[name].float() - value).abs().max().item()
        eager_error = (eager[name].float() - value).abs().max().item()
        if not fused_error <= 2 * eager_error + 1e-6:
            failures.append(f"{name}: codagen {fused_error:.3e} > 2 x PyTorch {eager_error:.3e} + 1e-6")
    assert not failures, "\n".join(failures)


# ==================================================================================================
# the row kernel computes what the one-GEMM program computes
# ==================================================================================================
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_row_kernel_computes_the_one_gemm_program(backend, head_dim, dtype):
    """Where both paths can run, ``qk_norm_rope`` on ``rms_linear``'s ``z`` is the ``qkv`` of the program
    ``rms_qkv_rope_qk_norm`` (whose ``preact`` is that ``z``), V rotated by its own frequencies (random here, 0 in
    models): bitwise on the reference backend, to fp32 rounding against the Triton epilogue."""
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the Triton GEMMs take fp16, bf16 and fp32")
    m, n = 9, (HEADS + 2 * KV_HEADS) * head_dim
    x, norm_weight = torch.randn(m, D, dtype=dtype), 1 + 0.3 * torch.randn(D, dtype=dtype)
    normed, rstd = kernels.rms_norm_stats_ref(x, norm_weight, 1e-5)
    qkv_weight = torch.randn(n, D, dtype=dtype) * D ** -0.5
    q_norm, k_norm = 1 + 0.3 * torch.randn(head_dim, dtype=dtype), 1 + 0.3 * torch.randn(head_dim, dtype=dtype)
    positions, frequencies = torch.randint(0, 4096, (m,)).to(rstd.dtype), torch.rand(n // 2, dtype=rstd.dtype)
    qk_norm_weight, qk_passthrough = _qk_norm_columns(q_norm, k_norm, HEADS, KV_HEADS)
    with codagen.use_backend(backend):
        z = execute(library.rms_linear(), normed, qkv_weight, rstd=rstd)["out"]
        fused = execute(library.rms_qkv_rope(head_dim, EPS), normed, qkv_weight, rstd=rstd, positions=positions,
                        frequencies=frequencies, qk_norm_weight=qk_norm_weight, qk_passthrough=qk_passthrough)
    torch.testing.assert_close(z, fused["preact"], rtol=0, atol=0)
    got = kernels.qk_norm_rope_ref(z, positions, frequencies, q_norm, k_norm, HEADS, EPS)
    exact = backend == "reference"
    torch.testing.assert_close(got, fused["qkv"], rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)
