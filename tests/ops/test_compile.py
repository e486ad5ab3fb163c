"""Models built from codagen.ops compile with torch.compile(fullgraph=True): no graph breaks."""
from __future__ import annotations

import pytest
import torch

from codagen import ops

from .conftest import Config, forward_backward, fused_model, make_inputs, make_params, reference_tiles


@pytest.mark.slow  # ~40 s of Inductor compilation on 2 CPU cores; kept in the default run
def test_compiled_block_fullgraph_matches_eager_ops():
    cfg = Config(batch=2, seq=4, hidden=16, heads=2, kv_heads=1, head_dim=8, ffn=16, vocab=24, layers=1)
    params = make_params(cfg, dtype=torch.float32)
    x, positions, target, probe = make_inputs(cfg, dtype=torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(fused_model, fullgraph=True)  # raises on any graph break
    with reference_tiles():
        want = forward_backward(fused_model, params, x, positions, target, probe, cfg)
        got = forward_backward(compiled, params, x, positions, target, probe, cfg)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for key in want[2]:
        torch.testing.assert_close(got[2][key], want[2][key], rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


def test_compiled_qk_norm_qkv_rope_fullgraph_matches_eager():
    """The QK-norm variant of F4 (its own custom ops and autograd node) compiles without graph breaks.
    Only the op, not a whole block: the block's other ops are covered above, and compiling is slow."""
    m, d, heads, kv_heads, head_dim = 6, 16, 2, 1, 8
    x = torch.randn(m, d, requires_grad=True)
    norm_weight, qkv_weight = torch.randn(d, requires_grad=True), torch.randn((heads + 2 * kv_heads) * head_dim, d,
                                                                              requires_grad=True)
    q_norm, k_norm = torch.randn(head_dim, requires_grad=True), torch.randn(head_dim, requires_grad=True)
    positions, frequencies = torch.arange(m), ops.rope_frequencies(heads, kv_heads, head_dim)
    probe = torch.randn(m, (heads + 2 * kv_heads) * head_dim)
    leaves = (x, norm_weight, qkv_weight, q_norm, k_norm)

    def step(x, norm_weight, qkv_weight, q_norm, k_norm):
        normed, rstd = ops.rms_norm_stats(x, norm_weight, 1e-6)
        qkv = ops.rms_qkv_rope(x, normed, rstd, norm_weight, qkv_weight, positions, frequencies, q_norm, k_norm,
                               num_heads=heads, qk_norm_eps=1e-6)
        return (qkv * probe).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)  # raises on any graph break
    with reference_tiles():
        want = torch.autograd.grad(step(*leaves), leaves)
        got = torch.autograd.grad(compiled(*leaves), leaves)
    for name, g, w in zip(("x", "norm_weight", "qkv_weight", "q_norm", "k_norm"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda msg: f"{name}: {msg}")


def test_compiled_embedding_fullgraph_matches_eager():
    weight = torch.randn(11, 8, requires_grad=True)
    ids = torch.randint(0, 11, (2, 5))
    probe = torch.randn(2, 5, 8)

    def step(weight):
        return (ops.embedding(ids, weight, padding_idx=0) * probe).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)  # raises on any graph break
    want = torch.autograd.grad(step(weight), weight)[0]
    got = torch.autograd.grad(compiled(weight), weight)[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_compiled_geglu_mlp_ops_fullgraph_match_eager():
    """The MLP ops with ``activation="gelu_tanh"`` (a string argument of their custom ops and autograd nodes)
    compile without graph breaks: the standalone gate/up op and the fused MLP, forward and backward."""
    m, d, ffn = 6, 16, 8
    x = torch.randn(m, d, requires_grad=True)
    norm_weight = (1 + 0.2 * torch.randn(d)).requires_grad_()
    gate_up, down = torch.randn(2 * ffn, d, requires_grad=True), torch.randn(d, ffn, requires_grad=True)
    probe_act, probe_out = torch.randn(m, ffn), torch.randn(m, d)
    leaves = (x, norm_weight, gate_up, down)

    def step(x, norm_weight, gate_up, down):
        normed, rstd = ops.rms_norm_stats(x, norm_weight, 1e-6)
        act = ops.rms_gate_up_swiglu(x, normed, rstd, norm_weight, gate_up, activation="gelu_tanh")
        out, _, _ = ops.swiglu_mlp_residual_rms(x, normed, rstd, norm_weight, gate_up, down, norm_weight, 1e-6,
                                                activation="gelu_tanh")
        return (act * probe_act).sum() + (out * probe_out).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)  # raises on any graph break
    with reference_tiles():
        want = torch.autograd.grad(step(*leaves), leaves)
        got = torch.autograd.grad(compiled(*leaves), leaves)
    for name, g, w in zip(("x", "norm_weight", "gate_up_weight", "down_weight"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda msg: f"{name}: {msg}")
