"""codagen.ops on a GPU in bf16: the 2x numerics rule, peak memory, determinism, CUDA-graph capture.

The 2x rule (docs/method.md section 4): for every output and gradient, the max error of the fused bf16 computation
against a float32 reference is at most 2x the max error of the same eager computation in bf16, + 1e-6.
The float32 reference and both bf16 runs start from the same bf16-rounded parameters and inputs.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .conftest import Config, assert_two_x_rule, bf16_problem, eager_model, forward_backward, fuse_params, fused_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Llama-like proportions at a size that runs in seconds; M = 600 and vocab = 5000 are not tile multiples
CFG = Config(batch=2, seq=300, hidden=512, heads=8, kv_heads=2, head_dim=64, ffn=1376, vocab=5000, layers=2)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"], ids=["swiglu", "geglu"])
def test_bf16_block_two_x_rule(activation):
    assert_two_x_rule(dataclasses.replace(CFG, activation=activation), "cuda")


def _peak_bytes(model, params, x, positions, probe) -> int:
    """Peak memory of one block-stack forward+backward above what is allocated before it."""
    forward_backward(model, params, x, positions, None, probe, CFG)  # warm-up: autotuning, workspaces
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    forward_backward(model, params, x, positions, None, probe, CFG)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_block_peak_memory_not_above_eager():
    (params, x, positions, _, probe), _ = bf16_problem(CFG, "cuda")
    eager = _peak_bytes(eager_model, params, x, positions, probe)
    fused = _peak_bytes(fused_model, fuse_params(params, CFG), x, positions, probe)  # weights stored fused
    assert fused <= eager, f"fused block fwd+bwd peaks at {fused / 2**20:.1f} MiB, eager at {eager / 2**20:.1f} MiB"


@sdpa_kernel(SDPBackend.MATH)  # deterministic attention, so replay and eager run compare bitwise
def test_block_captures_in_a_cuda_graph():
    """No host sync anywhere in forward or backward: the whole step captures and replays."""
    (params, x, positions, target, probe), _ = bf16_problem(CFG, "cuda")
    want = forward_backward(fused_model, params, x, positions, target, probe, CFG)  # also warms up / autotunes
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward_backward(fused_model, params, x, positions, target, probe, CFG)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = forward_backward(fused_model, params, x, positions, target, probe, CFG)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for key in want[2]:
        assert torch.equal(got[2][key], want[2][key]), key


# QK-norm (Qwen3) at a realistic size: M = 2048 tokens, d = 1024, 16 Q heads / 4 KV heads
def _qk_norm_config(head_dim: int) -> Config:
    return Config(batch=2, seq=1024, hidden=1024, heads=16, kv_heads=4, head_dim=head_dim, ffn=2816, vocab=5000,
                  layers=2, qk_norm=True)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_bf16_qk_norm_block_two_x_rule(head_dim):
    """Hidden state, loss and every gradient (x, norm weights, qkv, q_norm, k_norm, ...) under the 2x rule; heads of
    256 (Gemma 3's) take the GEMM and the ``qk_norm_rope`` row kernel."""
    assert_two_x_rule(_qk_norm_config(head_dim), "cuda")


@sdpa_kernel(SDPBackend.MATH)  # flash attention's backward may accumulate with atomics; ours must not
@pytest.mark.parametrize("qk_norm_head_dim", [None, 128, 256], ids=["plain", "qk_norm", "qk_norm_256"])
def test_bf16_block_bitwise_deterministic(qk_norm_head_dim):
    cfg = CFG if qk_norm_head_dim is None else _qk_norm_config(qk_norm_head_dim)
    bf16, _ = bf16_problem(cfg, "cuda")
    first = forward_backward(fused_model, *bf16, cfg)
    second = forward_backward(fused_model, *bf16, cfg)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for key in first[2]:
        assert torch.equal(first[2][key], second[2][key]), key


def test_bf16_embedding_backward_two_x_rule_and_bitwise_deterministic():
    """A frequent token (a quarter of the rows), unused vocabulary rows, 520 features (a ragged column block)."""
    from codagen import ops

    tokens, vocab, features = 4096, 5000, 520
    weight = torch.randn(vocab, features, device="cuda").bfloat16().requires_grad_()
    ids = torch.randint(0, vocab, (2, tokens // 2), device="cuda")
    ids[0, : tokens // 4] = 7
    grad_out = torch.randn(2, tokens // 2, features, device="cuda").bfloat16()
    exact = torch.zeros(vocab, features, dtype=torch.float64, device="cuda").index_add_(
        0, ids.reshape(-1), grad_out.reshape(-1, features).double())
    eager = torch.autograd.grad(torch.nn.functional.embedding(ids, weight), weight, grad_out)[0]
    runs = [torch.autograd.grad(ops.embedding(ids, weight), weight, grad_out)[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    fused_err, eager_err = ((g.double() - exact).abs().max().item() for g in (runs[0], eager))
    assert fused_err <= 2 * eager_err + 1e-6, (fused_err, eager_err)


def test_scale_cast_is_one_rounding_of_the_fp32_product():
    from codagen.ops import kernels

    src = torch.randn(3000, 77, device="cuda")
    factor = torch.tensor(1 / 3, device="cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = kernels.scale_cast(src, factor, dtype)
        assert torch.equal(got, (src * factor).to(dtype)), dtype


def test_bf16_lm_head_cross_entropy_without_grad_two_x_rule():
    """Evaluation (no gradient): one fused GEMM per chunk and one finishing launch, several chunks (the
    chunk size made small), an ignored row, vocabulary 5000 (not a tile multiple); the 2x rule against
    fp32, with eager bf16 (logits rounded to bf16, cross-entropy in fp32) as the yardstick. The rule is
    applied per row (32 rows' losses, one call each), and the chunked mean is held to eager bf16's largest
    row error: a mean's error averages signed row errors, so eager's own mean error can fall far below any
    row's by cancellation."""
    from codagen import ops
    from codagen.ops import cross_entropy

    tokens, d, vocab = 1000, 512, 5000
    x = torch.randn(tokens, d, device="cuda").bfloat16()
    gamma = (1 + 0.1 * torch.randn(d, device="cuda")).bfloat16()
    weight = (torch.randn(vocab, d, device="cuda") / d ** 0.5).bfloat16()
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    target[3] = -100
    normed, rstd = ops.rms_norm_stats(x, gamma, 1e-5)
    budget = cross_entropy.CHUNK_BYTES
    cross_entropy.CHUNK_BYTES = 256 * vocab * 2  # 256 rows a chunk: four chunks, the last ragged
    try:
        with torch.no_grad():
            got = ops.rms_lm_head_cross_entropy(x, normed, rstd, gamma, weight, target)
    finally:
        cross_entropy.CHUNK_BYTES = budget

    def row_losses(dtype):
        h = torch.nn.functional.rms_norm(x.to(dtype), (d,), gamma.to(dtype), 1e-5)
        return torch.nn.functional.cross_entropy((h @ weight.to(dtype).t()).float(), target, reduction="none")
    exact, eager = row_losses(torch.float32), row_losses(torch.bfloat16)
    kept = target != -100
    eager_row_err = (eager - exact)[kept].abs().max().item()
    mean_err = (got - exact[kept].mean()).abs().item()
    assert mean_err <= 2 * eager_row_err + 1e-6, (mean_err, eager_row_err)
    rows = [i for i in range(0, tokens, tokens // 32) if target[i] != -100]
    with torch.no_grad():
        fused = torch.stack([ops.rms_lm_head_cross_entropy(x[i:i + 1], normed[i:i + 1], rstd[i:i + 1], gamma, weight,
                                                           target[i:i + 1]) for i in rows])
    fused_err, eager_err = ((v - exact[rows]).abs().max().item() for v in (fused, eager[rows]))
    assert fused_err <= 2 * eager_err + 1e-6, (fused_err, eager_err)
