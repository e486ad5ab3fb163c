"""Edge cases of the public API: bad indices, empty and fully ignored reductions, infinities, execute's
contract. Each test fails if its rule is broken (CPU: reference backend and the Triton interpreter)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import codagen
from codagen import ops
from codagen.backends.reference import ReferenceBackend
from codagen.backends.triton import INTERPRETER_CONFIG, KernelConfig, TritonBackend, load_kernel, pingpong
from codagen.backends.triton.configs import PINGPONG
from codagen.bench.kernels import random_inputs
from codagen.epilogue import ProgramError, bind, finish, library
from codagen.epilogue.ir import (
    Accumulator,
    ColVector,
    Gemm,
    Program,
    Rope,
    RowPartial,
    RowVector,
    TileInput,
    Width,
)
from codagen.ops import kernels


def _head_inputs(m: int, d: int = 16, vocab: int = 40, dtype=torch.float64, requires_grad: bool = True):
    x = torch.randn(m, d, dtype=dtype, requires_grad=requires_grad)
    norm_weight = (1 + 0.1 * torch.randn(d, dtype=dtype)).requires_grad_(requires_grad)
    head = (0.3 * torch.randn(vocab, d, dtype=dtype)).requires_grad_(requires_grad)
    normed, rstd = kernels.rms_norm_stats_ref(x.detach(), norm_weight.detach(), 1e-6)
    return x, normed, rstd, norm_weight, head


def _torch_head_loss(x, norm_weight, head, target, reduction="mean"):
    logits = F.rms_norm(x, (x.shape[1],), norm_weight, 1e-6) @ head.t()
    return F.cross_entropy(logits, target.long(), reduction=reduction)


# --------------------------------------------------------------------------------------------------
# codagen.execute
# --------------------------------------------------------------------------------------------------
def test_execute_refuses_a_program_name():
    a, b = torch.randn(3, 8), torch.randn(5, 8)
    with pytest.raises(TypeError, match=r"program: expected a codagen.Program.*codagen.library.linear\(\)"):
        codagen.execute("linear", a, b)
    with pytest.raises(TypeError, match="program: expected a codagen.Program, got NoneType"):
        codagen.execute(None, a, b)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_execute_outputs_carry_no_autograd_history(backend):
    """execute is a forward primitive on every backend: outputs are detached whatever the inputs."""
    a = torch.randn(3, 8, requires_grad=True)
    b = torch.randn(5, 8, requires_grad=True)
    out = codagen.execute(library.linear(), a, b, backend=backend)["out"]
    assert out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, a.detach() @ b.detach().t())


# --------------------------------------------------------------------------------------------------
# cross-entropy: target dtypes and values, empty and fully ignored means
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8, torch.float32, torch.bool])
def test_cross_entropy_refuses_other_target_dtypes(dtype, grad):
    x, normed, rstd, norm_weight, head = _head_inputs(6)
    target = torch.randint(0, 2, (6,)).to(dtype)
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="target: expected an int32 or int64"):
        ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, target)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_cross_entropy_accepts_int32_and_int64_targets(dtype, grad):
    x, normed, rstd, norm_weight, head = _head_inputs(6)
    target = torch.tensor([0, 39, -100, 5, 7, 1], dtype=dtype)
    with torch.set_grad_enabled(grad):
        loss = ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, target)
    torch.testing.assert_close(loss, _torch_head_loss(x, norm_weight, head, target).detach())


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("bad", [40, 1000, -1, -101])
def test_cross_entropy_refuses_targets_outside_the_vocabulary(bad, grad):
    x, normed, rstd, norm_weight, head = _head_inputs(5)
    target = torch.tensor([1, 2, bad, -100, 3])
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=rf"target: expected values in \[0, 40\) or "
                                                                     rf"ignore_index = -100, got \[{bad}\]"):
        ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, target)


def test_cross_entropy_target_check_honours_ignore_index():
    x, normed, rstd, norm_weight, head = _head_inputs(3)
    target = torch.tensor([1, -1, 2])
    loss = ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, target, ignore_index=-1)
    torch.testing.assert_close(loss, F.cross_entropy(
        F.rms_norm(x, (16,), norm_weight, 1e-6) @ head.t(), target, ignore_index=-1))
    with pytest.raises(ValueError, match="ignore_index = -1, got \\[-100\\]"):
        ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, torch.tensor([1, -100, 2]), ignore_index=-1)


@pytest.mark.parametrize("m", [0, 4], ids=["no_tokens", "all_ignored"])
def test_cross_entropy_mean_over_no_target_is_nan_with_zero_gradients(m):
    """A mean over no counted target is nan (as torch); the gradients are zeros, as F.cross_entropy's
    are when every target is ignored, so a fully padded micro-batch leaves the weights unchanged."""
    x, normed, rstd, norm_weight, head = _head_inputs(m)
    target = torch.full((m,), -100)
    loss = ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, target)
    assert torch.isnan(loss)
    loss.backward()
    for t in (x, norm_weight, head):
        assert torch.equal(t.grad, torch.zeros_like(t))
    with torch.no_grad():
        assert torch.isnan(ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, target))
    if m:  # torch's gradients there are zeros too
        x.grad = norm_weight.grad = head.grad = None
        _torch_head_loss(x, norm_weight, head, target).backward()
        for t in (x, norm_weight, head):
            assert torch.equal(t.grad, torch.zeros_like(t))


def test_cross_entropy_sum_over_no_target_is_zero():
    x, normed, rstd, norm_weight, head = _head_inputs(0)
    loss = ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, torch.zeros(0, dtype=torch.long),
                                         reduction="sum")
    assert loss.item() == 0.0


def test_cross_entropy_partly_ignored_mean_matches_torch():
    x, normed, rstd, norm_weight, head = _head_inputs(6)
    target = torch.tensor([-100, 3, -100, 0, 39, -100])
    loss = ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, target)
    expected = _torch_head_loss(x, norm_weight, head, target)
    torch.testing.assert_close(loss, expected)
    grads = torch.autograd.grad(loss, (x, norm_weight, head))
    for got, want in zip(grads, torch.autograd.grad(expected, (x, norm_weight, head))):
        torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------------------------------
# embedding ids
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [10, 11, -1])
def test_embedding_refuses_ids_outside_the_vocabulary(bad):
    weight = torch.randn(10, 4, requires_grad=True)
    with pytest.raises(ValueError, match=rf"ids: expected values in \[0, 10\), got \[{bad}\]"):
        ops.embedding(torch.tensor([[1, bad], [2, 3]]), weight)


def test_index_check_under_torch_compile_is_a_traced_assert():
    """Under torch.compile(fullgraph=True) the check is a traced device assert (no graph break); on CPU it
    raises RuntimeError naming ids and the range."""
    weight = torch.randn(10, 4)
    embed = torch.compile(ops.embedding, fullgraph=True, backend="eager")
    torch.testing.assert_close(embed(torch.tensor([1, 9]), weight), weight[[1, 9]])
    with pytest.raises(RuntimeError, match=r"ids: values must lie in \[0, 10\)"):
        embed(torch.tensor([1, 10]), weight)


def test_embedding_refuses_other_id_dtypes():
    with pytest.raises(ValueError, match="ids: expected an int32 or int64"):
        ops.embedding(torch.tensor([1, 2], dtype=torch.int16), torch.randn(10, 4))


# --------------------------------------------------------------------------------------------------
# QK-norm: no tokens (both paths); head_dim 64 on the interpreter
# --------------------------------------------------------------------------------------------------
def _qk_norm_inputs(m, head_dim, heads=2, kv_heads=1, d=32, dtype=torch.float64):
    x = torch.randn(m, d, dtype=dtype, requires_grad=True)
    norm_weight = (1 + 0.1 * torch.randn(d, dtype=dtype)).requires_grad_()
    normed, rstd = kernels.rms_norm_stats_ref(x.detach(), norm_weight.detach(), 1e-6)
    qkv_weight = (0.2 * torch.randn((heads + 2 * kv_heads) * head_dim, d, dtype=dtype)).requires_grad_()
    frequencies = ops.rope_frequencies(heads, kv_heads, head_dim).to(torch.float32 if dtype != torch.float64 else dtype)
    q_norm = (1 + 0.1 * torch.randn(head_dim, dtype=dtype)).requires_grad_()
    k_norm = (1 + 0.1 * torch.randn(head_dim, dtype=dtype)).requires_grad_()
    return (x, normed, rstd, norm_weight, qkv_weight, torch.arange(m), frequencies, q_norm, k_norm), heads


@pytest.mark.parametrize("head_dim", [8, 96], ids=["one_gemm", "gemm_and_row_kernel"])
def test_qk_norm_rms_qkv_rope_backward_with_no_tokens(head_dim):
    args, heads = _qk_norm_inputs(0, head_dim)
    qkv = ops.rms_qkv_rope(*args, num_heads=heads)
    assert qkv.shape == (0, 4 * head_dim)
    qkv.sum().backward()
    for t in (args[0], args[3], args[4], args[7], args[8]):
        assert t.grad is not None and not t.grad.any()


def test_qk_norm_head_dim_64_runs_on_the_interpreter():
    """The interpreter's tile widens to whole heads (64 columns) instead of failing inside Triton."""
    args, heads = _qk_norm_inputs(5, 64, dtype=torch.float32)
    with codagen.use_backend("triton"):
        got = ops.rms_qkv_rope(*(t.detach() for t in args), num_heads=heads)
    with codagen.use_backend("reference"):
        want = ops.rms_qkv_rope(*(t.detach() for t in args), num_heads=heads)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_qk_norm_head_dim_without_a_power_of_two_tile_is_a_program_error():
    program = library.rms_qkv_rope(96, 1e-6)
    a, b, tensors = random_inputs(program, 3, 4 * 96, 16, torch.float32, "cpu")
    bound = bind(program, a, b, tensors)
    with pytest.raises(ProgramError, match=r"segment_sum over groups of \[96\] columns"):
        TritonBackend().run(bound)


def test_qk_norm_head_dim_128_in_float32_on_a_gpu_names_the_dtype():
    """On a GPU, float32 operands get 64-column epilogue sub-tiles: a QK-norm head of 128 fits none, and the error
    says to run in bfloat16 or float16; in bf16 the same program has candidates."""
    from codagen.backends.triton.configs import candidates
    program = library.rms_qkv_rope(128, 1e-6)
    with pytest.raises(ProgramError, match=r"groups of \[128\] columns.*sub-tile widths \[64\].*bfloat16 or float16"):
        candidates(program, target="sm_90", operand_bytes=4, smem_limit=232448, tma=True)
    assert candidates(program, target="sm_90", operand_bytes=2, smem_limit=232448, tma=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=["fp16", "fp32", "fp64"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_cross_entropy_with_a_minus_inf_non_target_logit(grad, backend, dtype):
    """A -inf logit off the target has probability 0: the loss is torch's finite cross-entropy, with and
    without gradients (the target logit is selected, never multiplied by a one-hot: -inf * 0 is nan)."""
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the Triton GEMMs take fp16, bf16 and fp32")
    m, d, vocab = 6, 16, 40
    x = (torch.rand(m, d, dtype=dtype) + 0.5).requires_grad_(grad)  # positive: no 0 * -inf in the GEMM
    norm_weight = (torch.rand(d, dtype=dtype) + 0.5).requires_grad_(grad)
    head = 0.3 * torch.randn(vocab, d, dtype=dtype)
    head[[7, 30]] = float("-inf")  # logits 7 and 30 are -inf on every row
    head.requires_grad_(grad)
    normed, rstd = kernels.rms_norm_stats_ref(x.detach(), norm_weight.detach(), 1e-6)
    target = torch.tensor([0, 39, -100, 5, 8, 29])
    want = _torch_head_loss(x.detach().double(), norm_weight.detach().double(), head.detach().double(), target)
    assert torch.isfinite(want)
    with torch.set_grad_enabled(grad), codagen.use_backend(backend):
        loss = ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, target)
    assert loss.requires_grad == grad
    tol = 1e-6 if dtype == torch.float64 else 2e-3 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(loss.detach().double(), want, rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------------
# logsumexp with infinities
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [None, KernelConfig(32, 64, 32, 1, 4, epilogue_split=2, group_m=2)],
                         ids=["whole_tile", "split_tile"])
def test_logsumexp_partial_of_a_tile_holding_inf(cfg):
    """A tile holding +inf has logsumexp +inf (not inf - inf = nan); a tile of -inf has -inf."""
    m, k, vocab = 5, 32, 70
    normed = torch.rand(m, k) + 0.1
    weight = torch.randn(vocab, k)
    weight[3] = float("inf")      # column 3: +inf on every row
    weight[64:] = float("-inf")   # the last tile's columns: -inf on every row
    tensors = dict(rstd=torch.ones(m), target=torch.randint(0, vocab, (m,)))
    program = library.rms_lm_head_cross_entropy()
    triton_backend = TritonBackend() if cfg is None else TritonBackend(config=cfg)
    got = triton_backend.run(bind(program, normed, weight, tensors))["partial_lse"]
    assert torch.equal(got[:, 0], torch.full((m,), float("inf")))
    assert torch.equal(got[:, -1], torch.full((m,), float("-inf")))
    assert torch.isfinite(got[:, 1:-1]).all()
    want = codagen.execute(program, normed, weight, backend="reference", **tensors)["partial_lse"]
    assert torch.equal(finish.logsumexp_from_partials(got), finish.logsumexp_from_partials(want))


def _pair_form_lse_program() -> Program:
    """A logsumexp RowPartial of a value kept as (even, odd) halves: RoPE of the accumulator plus a tile."""
    rope = Rope(Accumulator(), RowVector("positions"), ColVector("frequencies", Width.HALF))
    return Program("rope_lse", Gemm.linear(), (RowPartial("lse", rope + TileInput("bias"), "logsumexp"),))


def _check_pair_form_lse_with_infinities(cfg: KernelConfig, dtype: torch.dtype, device: str, m: int, n: int, k: int,
                                         tol: float) -> None:
    """Every partial of :func:`_pair_form_lse_program` with +inf and -inf in the tile input equals the reference
    backend's on float64 copies: +inf where a tile holds +inf, -inf where it holds only -inf, never nan."""
    inf = float("inf")
    program = _pair_form_lse_program()
    a, b, tensors = random_inputs(program, m, n, k, dtype, device)
    bias = tensors["bias"]
    last_tile = (n - 1) // cfg.block_n * cfg.block_n
    bias[0, 5] = inf                       # one +inf in the first tile
    bias[1, :] = -inf                      # a row of -inf: every tile -inf
    bias[2, 3], bias[2, 4] = inf, -inf     # +inf and -inf in one tile
    bias[3, last_tile:] = -inf             # the last tile's columns -inf
    bias[4, n - 4], bias[4, 10] = inf, -inf  # +inf in the last, partial tile
    got = TritonBackend(config=cfg).run(bind(program, a, b, dict(tensors)))["lse"].cpu()
    exact = {name: t.double().cpu() for name, t in tensors.items()}
    want = ReferenceBackend(block_n=cfg.block_n).run(bind(program, a.double().cpu(), b.double().cpu(), exact))["lse"]
    assert not torch.isnan(got).any(), got
    infinite = torch.isinf(want)
    assert torch.equal(torch.isinf(got), infinite) and torch.equal(got[infinite].double(), want[infinite])
    assert got[0, 0] == inf and (got[1] == -inf).all() and got[2, 0] == inf and got[3, -1] == -inf and got[4, -1] == inf
    torch.testing.assert_close(got[~infinite].double(), want[~infinite], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("cfg", [INTERPRETER_CONFIG, KernelConfig(32, 64, 32, 1, 4, epilogue_split=2, group_m=2)],
                         ids=["whole_tile", "split_tile"])
def test_logsumexp_partial_of_a_pair_form_value_holding_inf(cfg, dtype):
    """The Triton interpreter: whole sub-tiles and column halves merged."""
    _check_pair_form_lse_with_infinities(cfg, dtype, "cpu", 6, 70, 32, tol=1e-3)


@pytest.mark.parametrize("schedule", ["persistent", "pingpong"])
@pytest.mark.parametrize("program", ["rope_lse", "rms_lm_head_cross_entropy"])
def test_logsumexp_and_target_programs_compile_for_sm90(program, schedule):
    """The kernels of the pair-form logsumexp and of the cross-entropy forward (its target logit a select)
    compile for Hopper without a GPU (bf16; persistent: TMA mainloop and epilogue)."""
    from tests.sm90 import sm90_ptx
    program = _pair_form_lse_program() if program == "rope_lse" else library.rms_lm_head_cross_entropy()
    if schedule == "pingpong":
        if not pingpong.RUNTIME:
            pytest.skip("the installed Triton has no Gluon runtime for the ping-pong kernels")
        kernel = load_kernel(program, dtypes="test", arch="sm_90", interpret=False, schedule="pingpong")
        ptx = pingpong.compile_sm90(kernel, program, pingpong.PIECE_WIDTHS[0], torch.bfloat16).asm["ptx"]
    else:
        constexprs = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, EPILOGUE_SPLIT=2, SUB_N=64,
                          TMA_MAINLOOP=True, TMA_EPILOGUE=True, UPCAST_OPERANDS=False, DOT_PRECISION="tf32",
                          FLATTEN=True, PORTABLE=False, PDL=False, PREFETCH_K=0)
        ptx = sm90_ptx(program, "kernel", {"a_ptr": "*bf16", "b_ptr": "*bf16"}, ("M", "N", "K"), constexprs, 8, 3)
    assert "wgmma.mma_async" in ptx


_INFINITE_LSE_SCRIPT = textwrap.dedent("""
    import torch
    from codagen.ops import kernels
    inf = float("inf")
    partial = torch.tensor([[inf, 1.0], [-inf, -inf], [2.0, inf], [1.0, 2.0]])
    target = torch.zeros_like(partial)
    got = kernels.finish_cross_entropy_triton(partial, target)
    assert got[:3].tolist() == [inf, -inf, inf], got
    torch.testing.assert_close(got, kernels.finish_cross_entropy_ref(partial, target))
    logits = torch.randn(3, 40)
    logits[0, 3] = logits[2, 39] = inf
    row_loss, _ = kernels.cross_entropy_logits_grad_triton(logits.clone(), torch.tensor([1, 2, 3]), torch.ones(3), 40)
    assert row_loss[[0, 2]].tolist() == [inf, inf], row_loss
    torch.testing.assert_close(row_loss[1], torch.logsumexp(logits[1], 0) - logits[1, 2])
    print("ok")
""")


def test_finishers_and_row_kernel_keep_infinite_logsumexps():
    """The cross-entropy finisher and row kernel (Triton interpreter): +inf stays +inf, -inf stays -inf."""
    result = subprocess.run([sys.executable, "-c", _INFINITE_LSE_SCRIPT], env=dict(os.environ, TRITON_INTERPRET="1"),
                            capture_output=True, text=True, timeout=300,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# --------------------------------------------------------------------------------------------------
# GPU: infinite logits in bf16
# --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [KernelConfig(32, 64, 32, 1, 4, epilogue_split=2, group_m=2),
                                 KernelConfig(128, 128, 64, 3, 8, epilogue_split=2, tma_epilogue=True),
                                 PINGPONG[0]],
                         ids=lambda cfg: cfg.short())
def test_logsumexp_partial_of_a_pair_form_value_holding_inf_on_cuda(cfg):
    """Compiled kernels (persistent and ping-pong), bf16 operands: as in the interpreter."""
    _check_pair_form_lse_with_infinities(cfg, torch.bfloat16, "cuda", 300, 520, 256, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_cross_entropy_with_a_minus_inf_non_target_logit_on_cuda(grad):
    """bf16 on the GPU: a -inf logit off the target leaves torch's finite loss, with and without gradients."""
    m, d, vocab = 300, 256, 1000
    x = (torch.rand(m, d, device="cuda") + 0.5).bfloat16().requires_grad_(grad)  # positive: no 0 * -inf in the GEMM
    norm_weight = (torch.rand(d, device="cuda") + 0.5).bfloat16().requires_grad_(grad)
    head = (0.1 * torch.randn(vocab, d, device="cuda")).bfloat16()
    head[[7, 300, 999]] = float("-inf")
    head.requires_grad_(grad)
    normed, rstd = kernels.rms_norm_stats(x.detach(), norm_weight.detach(), 1e-6)
    target = torch.randint(0, vocab, (m,), device="cuda")
    target[target == 7] = 8
    target[target == 300] = 301
    target[target == 999] = 998
    target[::11] = -100
    want = _torch_head_loss(x.detach().double(), norm_weight.detach().double(), head.detach().double(), target)
    assert torch.isfinite(want)
    with torch.set_grad_enabled(grad):
        loss = ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, target)
    torch.testing.assert_close(loss.detach().double(), want, rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------------------------------
# GPU: the index checks add no host sync; a bad index is a device-side assert
# --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_index_checks_add_no_host_sync_on_cuda(monkeypatch):
    """Cross-entropy (with and without gradients) and the embedding, forward and backward, run with
    ``torch.cuda.set_sync_debug_mode("error")``: any host synchronization raises."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    norm_weight = torch.ones(128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    head = (0.1 * torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    normed, rstd = kernels.rms_norm_stats(x.detach(), norm_weight.detach(), 1e-6)
    target = torch.randint(0, 512, (64,), device="cuda")
    target[::7] = -100
    ids = torch.randint(0, 512, (4, 16), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, target)
        loss.backward()
        with torch.no_grad():
            ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, target)
        ops.embedding(ids, head).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


_CUDA_BAD_TARGET_SCRIPT = textwrap.dedent("""
    import os, torch
    os.environ["CODAGEN_TRITON_AUTOTUNE"] = "0"
    from codagen import ops
    from codagen.ops import kernels
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    normed, rstd = kernels.rms_norm_stats(x, w, 1e-6)
    head = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, 128, (8,), device="cuda")
    target[3] = BAD
    loss = ops.rms_lm_head_cross_entropy(x, normed, rstd, w, head, target)
    torch.cuda.synchronize()
    print("no error", flush=True)
""")


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [128, -1])
def test_a_bad_target_is_a_device_side_assert_on_cuda(bad):
    """In a fresh process (a device-side assert ends the CUDA context): a target outside [0, vocab) fails the
    device-side check, named. The assert is asynchronous: CUDA reports it at the next API call (the next
    launch or the synchronization), so the test checks the message, not where it surfaces; that the check
    adds no host sync is tested on its own (``test_index_checks_add_no_host_sync_on_cuda``)."""
    result = subprocess.run([sys.executable, "-c", _CUDA_BAD_TARGET_SCRIPT.replace("BAD", str(bad))],
                            capture_output=True, text=True, timeout=300,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode != 0 and "no error" not in result.stdout, result.stdout + result.stderr[-3000:]
    assert "target: values must lie in [0, 128)" in result.stderr, result.stderr[-3000:]
