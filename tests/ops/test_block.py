"""codagen.ops against a naive eager LLaMA block, in float64 on the reference backend.

The eager model uses the standard (Hugging Face) layouts: separate q/k/v/gate/up weights and half-split
RoPE. The fused model builds its weights from the same leaf tensors through the layout conversions
(differentiably), so every gradient is compared on the standard parameters (both models: conftest.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from codagen import ops

from .conftest import (
    Config,
    assert_close,
    assert_two_x_rule,
    eager_model,
    forward_backward,
    fuse_params,
    fused_model,
    make_inputs,
    make_params,
    reference_tiles,
    rms_norm,
    unfuse_grads,
)


@pytest.fixture(autouse=True)
def _reference_backend():
    with reference_tiles():
        yield


# ==================================================================================================
# Tests
# ==================================================================================================
CONFIGS = {
    "gqa": Config(),
    "mha": Config(heads=4, kv_heads=4, layers=1),
    "m1": Config(batch=1, seq=1, layers=1),
    "m7": Config(batch=1, seq=7, heads=2, kv_heads=1, ffn=24, vocab=37),
    "m129": Config(batch=1, seq=129, hidden=16, heads=2, kv_heads=1, ffn=16, vocab=33, layers=1),
    "qk_norm": Config(qk_norm=True),
    "qk_norm_m1": Config(batch=1, seq=1, layers=1, qk_norm=True),
    "qk_norm_m129": Config(batch=1, seq=129, hidden=16, heads=2, kv_heads=1, head_dim=16, ffn=16, vocab=33, layers=1,
                           qk_norm=True),
    "geglu": Config(activation="gelu_tanh"),  # Gemma's MLP
    "geglu_m129": Config(batch=1, seq=129, hidden=16, heads=2, kv_heads=1, ffn=16, vocab=33, layers=1,
                         activation="gelu_tanh"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_matches_eager_float64(name):
    cfg = CONFIGS[name]
    params = make_params(cfg)
    x, positions, target, probe = make_inputs(cfg)
    want_hidden, want_loss, want_grads = forward_backward(eager_model, params, x, positions, target, probe, cfg)
    got_hidden, got_loss, got_grads = forward_backward(fused_model, params, x, positions, target, probe, cfg)
    assert_close("hidden", got_hidden, want_hidden)
    assert_close("loss", got_loss, want_loss)
    assert sorted(got_grads) == sorted(want_grads)
    # With one token per sequence every attention weight is exactly 1, so the output does not depend on
    # q or k: their weights' gradients are zero by construction (eager shows rounding noise or 0).
    zero_by_construction = ({f"{layer}.{w}" for layer in range(cfg.layers) for w in ("q", "k", "q_norm", "k_norm")}
                            if cfg.seq == 1 else set())
    for key, want in want_grads.items():
        if key not in zero_by_construction:
            assert want.abs().max() > 0, f"{key}: the eager gradient is zero, the test would be vacuous"
        assert_close(f"grad {key}", got_grads[key], want)


@pytest.mark.parametrize("name", ["gqa", "qk_norm", "geglu"])
def test_block_with_fused_leaf_parameters(name):
    """A model that stores qkv and gate_up in the fused layouts gets the same gradients, mapped back."""
    cfg = CONFIGS[name]
    params = make_params(cfg)
    x, positions, target, probe = make_inputs(cfg)
    want = forward_backward(eager_model, params, x, positions, None, probe, cfg)
    got = forward_backward(fused_model, fuse_params(params, cfg), x, positions, None, probe, cfg)
    assert_close("hidden", got[0], want[0])
    grads = unfuse_grads(got[2], cfg)
    assert sorted(grads) == sorted(want[2])
    for key, value in want[2].items():
        assert_close(f"grad {key}", grads[key], value)


@pytest.mark.parametrize("name", ["gqa", "qk_norm"])
def test_block_is_bitwise_deterministic(name):
    cfg = CONFIGS[name]
    params = make_params(cfg)
    x, positions, target, probe = make_inputs(cfg)
    first = forward_backward(fused_model, params, x, positions, target, probe, cfg)
    second = forward_backward(fused_model, params, x, positions, target, probe, cfg)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for key in first[2]:
        assert torch.equal(first[2][key], second[2][key]), key


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_chunks_and_reductions(monkeypatch, reduction):
    """Several token chunks give the single-chunk result; sum and mean match torch with ignore_index."""
    from codagen.ops import cross_entropy

    cfg = CONFIGS["m7"]
    m, d, v = 23, cfg.hidden, cfg.vocab
    x = torch.randn(m, d, dtype=torch.float64, requires_grad=True)
    gamma = (1 + 0.2 * torch.randn(d, dtype=torch.float64)).requires_grad_()
    weight = (torch.randn(v, d, dtype=torch.float64) / d ** 0.5).requires_grad_()
    target = torch.randint(0, v, (m,))
    target[[0, 5, 6, 22]] = 7  # a custom ignore_index inside [0, vocab)

    def fused():
        normed, rstd = ops.rms_norm_stats(x, gamma, cfg.eps)
        loss = ops.rms_lm_head_cross_entropy(x, normed, rstd, gamma, weight, target, ignore_index=7,
                                             reduction=reduction)
        return (loss, *torch.autograd.grad(loss, (x, gamma, weight)))

    logits = rms_norm(x, gamma, cfg.eps) @ weight.t()
    want_loss = F.cross_entropy(logits, target, ignore_index=7, reduction=reduction)
    want = (want_loss, *torch.autograd.grad(want_loss, (x, gamma, weight)))
    one_chunk = fused()
    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", 5 * v * x.element_size())  # 5 rows: 5 chunks
    assert cross_entropy.chunk_rows(m, v, x.element_size()) == 5
    chunked = fused()
    for name, a, b, c in zip(("loss", "grad x", "grad gamma", "grad W"), one_chunk, chunked, want):
        assert_close(name, a, c)
        assert_close(name + " (chunked)", b, c)
    assert one_chunk[1][[0, 5, 6, 22]].abs().max() == 0, "ignored rows must get no gradient"


def test_cross_entropy_chunk_rows_bounds_memory():
    from codagen.ops.cross_entropy import chunk_rows

    assert chunk_rows(16384, 128256, 2, budget=512 * 2**20) == 2048 - 2048 % 128
    assert chunk_rows(16384, 128256, 2, budget=512 * 2**20) * 128256 * 2 <= 512 * 2**20
    assert chunk_rows(10, 32000, 2) == 10
    assert chunk_rows(0, 32000, 2) == 1
    assert chunk_rows(100, 10**9, 4, budget=1) == 1


def test_the_lm_head_pads_its_logits_rows_to_16_bytes():
    """A chunk's logits rows fill whole 16-byte units (TMA operands): Granite's 49155 rows pad to 49160 in bf16, the
    appended rows zero; an aligned vocabulary keeps the weight itself."""
    from codagen.ops.cross_entropy import padded_head

    weight = torch.randn(49155, 8)
    for dtype, rows in ((torch.bfloat16, 49160), (torch.float32, 49156), (torch.float64, 49156)):
        padded = padded_head(weight, dtype)
        assert padded.shape == (rows, 8) and torch.equal(padded[:49155], weight) and not padded[49155:].any()
    aligned = torch.randn(49152, 8)
    assert padded_head(aligned, torch.bfloat16) is aligned


@pytest.mark.parametrize("qk_norm, activation", [(False, "silu"), (True, "silu"), (False, "gelu_tanh")],
                         ids=["plain", "qk_norm", "geglu"])
def test_bf16_block_two_x_rule_on_reference_backend(qk_norm, activation):
    """The ops' own dtype choices (what is rounded to bf16 where) keep the 2x rule; the GPU test
    (tests/ops/test_gpu.py) checks the same on the Triton kernels."""
    assert_two_x_rule(Config(batch=2, seq=24, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=300,
                             qk_norm=qk_norm, activation=activation))
