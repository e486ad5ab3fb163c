"""The fused ops with a LoRA update ``low_rank=LowRank(a, b, scale)`` (``W + scale * b @ a``), in float64 on the
reference backend, against plain PyTorch math: outputs and the gradients of a, b, the inputs, the residual and
the norm weights; frozen base weights get no weight-gradient GEMM; bad low-rank arguments are refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import codagen
from codagen import ops
from codagen.models.llama import rotate_pairs
from codagen.ops import LowRank

M, D, FFN, HEADS, KV_HEADS, HD, R = 24, 32, 40, 4, 2, 8, 3
EPS = 1e-5
QKV = (HEADS + 2 * KV_HEADS) * HD


@pytest.fixture(autouse=True)
def reference_backend():
    with codagen.use_backend("reference"):
        yield


def leaf(*shape, scale=1.0, grad=True):
    return (scale * torch.randn(*shape, dtype=torch.float64)).requires_grad_(grad)


def rms(x, gamma):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * gamma


def swiglu(z):
    return F.silu(z[:, 0::2]) * z[:, 1::2]


def lora_pair(out_features, in_features, scale=0.7):
    return leaf(R, in_features, scale=0.3), leaf(out_features, R, scale=0.3), scale


def effective(w, pair):
    a, b, s = pair
    return w + s * b @ a


def check_grads(fused_loss, reference_loss, tensors, names):
    """Both losses equal, and every tensor's gradient (None where the reference gives None)."""
    got = torch.autograd.grad(fused_loss, tensors, allow_unused=True)
    want = torch.autograd.grad(reference_loss, tensors, allow_unused=True)
    torch.testing.assert_close(fused_loss, reference_loss, rtol=1e-10, atol=1e-12)
    for name, g, w in zip(names, got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=lambda m: f"{name}: {m}")


def stats(x, gamma):
    normed, rstd = ops.rms_norm_stats(x, gamma, EPS)
    return normed, rstd


def test_out_proj_residual_rms():
    inp, w, residual, gamma = leaf(M, D), leaf(D, D, scale=0.2), leaf(M, D), leaf(D)
    a, b, s = pair = lora_pair(D, D)
    probe = torch.randn(M, D, dtype=torch.float64)
    x_out, normed, rstd = ops.out_proj_residual_rms(inp, w, residual, gamma, EPS, low_rank=LowRank(a, b, s))
    want = inp @ effective(w, pair).t() + residual
    torch.testing.assert_close(normed, want * gamma)
    torch.testing.assert_close(rstd, torch.rsqrt(want.pow(2).mean(-1) + EPS))
    check_grads((x_out * probe).sum(), (want * probe).sum(), (inp, w, residual, a, b),
                ("inp", "weight", "residual", "a", "b"))


@pytest.mark.parametrize("qk_norm, hd", [(False, HD), (True, HD), (True, 96)], ids=["plain", "qk_norm", "qk_norm_96"])
def test_rms_qkv_rope(qk_norm, hd):
    """head_dim 96 with QK-norm: the GEMM with its low-rank pair stores z, a row kernel normalizes and rotates it."""
    qkv_features = (HEADS + 2 * KV_HEADS) * hd
    x, gamma, w = leaf(M, D), leaf(D), leaf(qkv_features, D, scale=0.2)
    a, b, s = pair = lora_pair(qkv_features, D, scale=2.0)
    positions = torch.randint(0, 50, (M,)).double()
    freqs = ops.rope_frequencies(HEADS, KV_HEADS, hd).double()
    q_norm, k_norm = leaf(hd), leaf(hd)
    normed, rstd = stats(x, gamma)
    norm_args = (q_norm, k_norm, HEADS) if qk_norm else ()
    qkv = ops.rms_qkv_rope(x, normed, rstd, gamma, w, positions, freqs.float(), *norm_args, qk_norm_eps=EPS,
                           low_rank=LowRank(a, b, s))
    z = rms(x, gamma) @ effective(w, pair).t()
    if qk_norm:
        heads = z.unflatten(1, (-1, hd))
        qk = heads[:, : HEADS + KV_HEADS]
        weight = torch.cat((q_norm.expand(HEADS, hd), k_norm.expand(KV_HEADS, hd)))
        qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + EPS) * weight
        z = torch.cat((qk, heads[:, HEADS + KV_HEADS:]), dim=1).flatten(1)
    want = rotate_pairs(z, positions[:, None] * freqs[None, :])
    probe = torch.randn_like(want)
    tensors, names = [x, gamma, w, a, b], ["x", "norm_weight", "qkv_weight", "a", "b"]
    if qk_norm:
        tensors, names = tensors + [q_norm, k_norm], names + ["q_norm", "k_norm"]
    check_grads((qkv * probe).sum(), (want * probe).sum(), tensors, names)


def test_rms_gate_up_swiglu():
    x, gamma, w = leaf(M, D), leaf(D), leaf(2 * FFN, D, scale=0.2)
    a, b, s = pair = lora_pair(2 * FFN, D)
    normed, rstd = stats(x, gamma)
    act = ops.rms_gate_up_swiglu(x, normed, rstd, gamma, w, low_rank=LowRank(a, b, s))
    want = swiglu(rms(x, gamma) @ effective(w, pair).t())
    probe = torch.randn_like(want)
    check_grads((act * probe).sum(), (want * probe).sum(), (x, gamma, w, a, b),
                ("x", "norm_weight", "weight", "a", "b"))


@pytest.mark.parametrize("adapted", ["both", "gate_up", "down"])
def test_swiglu_mlp_residual_rms(adapted):
    x, gamma, next_gamma = leaf(M, D), leaf(D), leaf(D)
    w_gu, w_d = leaf(2 * FFN, D, scale=0.2), leaf(D, FFN, scale=0.2)
    a_gu, b_gu, s_gu = gu = lora_pair(2 * FFN, D, scale=0.5)
    a_d, b_d, s_d = dn = lora_pair(D, FFN, scale=1.5)
    normed, rstd = stats(x, gamma)
    gu_lr = LowRank(a_gu, b_gu, s_gu) if adapted in ("both", "gate_up") else None
    d_lr = LowRank(a_d, b_d, s_d) if adapted in ("both", "down") else None
    x_out, _, _ = ops.swiglu_mlp_residual_rms(x, normed, rstd, gamma, w_gu, w_d, next_gamma, EPS,
                                              gate_up_low_rank=gu_lr, down_low_rank=d_lr)
    w_gu_eff = effective(w_gu, gu) if gu_lr is not None else w_gu
    w_d_eff = effective(w_d, dn) if d_lr is not None else w_d
    want = x + swiglu(rms(x, gamma) @ w_gu_eff.t()) @ w_d_eff.t()
    probe = torch.randn_like(want)
    check_grads((x_out * probe).sum(), (want * probe).sum(), (x, gamma, w_gu, w_d, a_gu, b_gu, a_d, b_d),
                ("x", "norm_weight", "gate_up", "down", "a_gu", "b_gu", "a_d", "b_d"))


def spy(monkeypatch, *modules):
    """Record the name of every program ``modules`` execute."""
    names = []
    for module in modules:
        def recording(program, *args, execute=module.execute, **kwargs):
            names.append(program.name)
            return execute(program, *args, **kwargs)
        monkeypatch.setattr(module, "execute", recording)
    return names


def spy_block_ops(monkeypatch):
    """:func:`spy` on every module of the block ops that executes programs."""
    from codagen.ops import _fused, linear
    return spy(monkeypatch, _fused, linear)


def test_frozen_base_weights_get_no_weight_gradient_gemm(monkeypatch):
    """With the base weights frozen, the block ops and the LM-head cross-entropy run no ``weight_grad``
    program; the LoRA factors, the inputs and the norm weights still get theirs."""
    from codagen.ops import cross_entropy
    x, gamma = leaf(M, D), leaf(D)
    w_qkv, w_o, w_gu, w_d, head = (leaf(*shape, scale=0.2, grad=False)
                                   for shape in ((QKV, D), (D, HEADS * HD), (2 * FFN, D), (D, FFN), (50, D)))
    lrs = [LowRank(*lora_pair(*shape)) for shape in ((QKV, D), (D, HEADS * HD), (2 * FFN, D), (D, FFN))]
    block_names = spy_block_ops(monkeypatch)
    ce_names = spy(monkeypatch, cross_entropy)
    positions, freqs = torch.arange(M).double(), ops.rope_frequencies(HEADS, KV_HEADS, HD)
    normed, rstd = stats(x, gamma)
    qkv = ops.rms_qkv_rope(x, normed, rstd, gamma, w_qkv, positions, freqs, low_rank=lrs[0])
    h, normed, rstd = ops.out_proj_residual_rms(qkv[:, : HEADS * HD].contiguous(), w_o, x, gamma, EPS,
                                                low_rank=lrs[1])
    h, normed, rstd = ops.swiglu_mlp_residual_rms(h, normed, rstd, gamma, w_gu, w_d, gamma, EPS,
                                                  gate_up_low_rank=lrs[2], down_low_rank=lrs[3])
    loss = ops.rms_lm_head_cross_entropy(h, normed, rstd, gamma, head, torch.randint(0, 50, (M,)))
    loss.backward()
    assert "weight_grad" not in block_names + ce_names, block_names + ce_names
    assert {"rms_norm_backward", "swiglu_backward", "input_grad"} <= set(block_names)
    assert all(w.grad is None for w in (w_qkv, w_o, w_gu, w_d, head))
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for lr in lrs for t in (lr.a, lr.b))
    assert x.grad is not None and gamma.grad is not None
    # and with the weights trainable the same calls do run it
    block_names.clear()
    w_o.requires_grad_(True)
    out, _, _ = ops.out_proj_residual_rms(leaf(M, HEADS * HD), w_o, x, gamma, EPS, low_rank=lrs[1])
    out.sum().backward()
    assert block_names.count("weight_grad") == 1 and w_o.grad is not None


def test_bad_low_rank_arguments_are_refused():
    inp, w, residual, gamma = leaf(M, D), leaf(D, D), leaf(M, D), leaf(D)
    a, b, s = lora_pair(D, D)
    with pytest.raises(TypeError, match="low_rank: expected a codagen.ops.LowRank"):
        ops.out_proj_residual_rms(inp, w, residual, gamma, EPS, low_rank=(a, b, s))
    with pytest.raises(ValueError, match=r"low_rank.a: expected shape \[r, in features\]"):
        ops.out_proj_residual_rms(inp, w, residual, gamma, EPS, low_rank=LowRank(a[:, :5], b, s))
    with pytest.raises(ValueError, match=r"low_rank.b: expected shape \[out features, r\] with r = 3"):
        ops.out_proj_residual_rms(inp, w, residual, gamma, EPS, low_rank=LowRank(a, b[:, :2], s))
    with pytest.raises(ValueError, match="low_rank.a: expected dtype torch.float64"):
        ops.out_proj_residual_rms(inp, w, residual, gamma, EPS, low_rank=LowRank(a.float(), b, s))
    with pytest.raises(ValueError, match="low_rank.scale: expected a finite float"):
        ops.out_proj_residual_rms(inp, w, residual, gamma, EPS, low_rank=LowRank(a, b, float("nan")))
    x = leaf(M, D)
    normed, rstd = stats(x, gamma)
    with pytest.raises(ValueError, match=r"down_low_rank.a: expected shape \[r, in features\] = \('\*', 40\)"):
        ops.swiglu_mlp_residual_rms(x, normed, rstd, gamma, leaf(2 * FFN, D), leaf(D, FFN), gamma, EPS,
                                    down_low_rank=LowRank(a, b, s))


def test_compiled_lora_ops_fullgraph_match_eager():
    """The LoRA paths of the MLP op (its low-rank operands, the frozen weights' skipped gradients) compile with
    torch.compile(fullgraph=True) and give the eager gradients."""
    x, gamma = leaf(M, D).float(), leaf(D).float()
    w_gu, w_d = leaf(2 * FFN, D, scale=0.2, grad=False).float(), leaf(D, FFN, scale=0.2, grad=False).float()
    factors = [t.float().detach().requires_grad_() for t in (*lora_pair(2 * FFN, D)[:2], *lora_pair(D, FFN)[:2])]
    probe = torch.randn(M, D)

    def step(x, a_gu, b_gu, a_d, b_d):
        normed, rstd = ops.rms_norm_stats(x, gamma, EPS)
        out, _, _ = ops.swiglu_mlp_residual_rms(x, normed, rstd, gamma, w_gu, w_d, gamma, EPS,
                                                gate_up_low_rank=LowRank(a_gu, b_gu, 0.5),
                                                down_low_rank=LowRank(a_d, b_d, 2.0))
        return (out * probe).sum()

    leaves = (x.detach().requires_grad_(), *factors)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)  # raises on any graph break
    want = torch.autograd.grad(step(*leaves), leaves)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    for name, g, w in zip(("x", "a_gu", "b_gu", "a_d", "b_d"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda msg: f"{name}: {msg}")


@pytest.mark.parametrize("op", ["qkv", "gate_up", "out_proj"])
def test_frozen_inputs_skip_the_input_gradient_gemm(monkeypatch, op):
    """When neither the input nor the norm weight (nor the base weight) needs a gradient -- the first block
    of a LoRA model with frozen embeddings -- no GEMM over W runs in backward; the LoRA gradients still
    equal PyTorch's."""
    names = spy_block_ops(monkeypatch)
    x, gamma = leaf(M, D, grad=False), leaf(D, grad=False)
    normed, rstd = stats(x, gamma)
    if op == "qkv":
        w = leaf(QKV, D, scale=0.2, grad=False)
        a, b, s = pair = lora_pair(QKV, D)
        positions, freqs = torch.arange(M).double(), ops.rope_frequencies(HEADS, KV_HEADS, HD).double()
        out = ops.rms_qkv_rope(x, normed, rstd, gamma, w, positions, freqs, low_rank=LowRank(a, b, s))
        want = rotate_pairs(rms(x, gamma) @ effective(w, pair).t(), positions[:, None] * freqs[None, :])
    elif op == "gate_up":
        w = leaf(2 * FFN, D, scale=0.2, grad=False)
        a, b, s = pair = lora_pair(2 * FFN, D)
        out = ops.rms_gate_up_swiglu(x, normed, rstd, gamma, w, low_rank=LowRank(a, b, s))
        want = swiglu(rms(x, gamma) @ effective(w, pair).t())
    else:
        w = leaf(D, D, scale=0.2, grad=False)
        a, b, s = pair = lora_pair(D, D)
        residual = leaf(M, D, grad=False)
        out = ops.out_proj_residual_rms(x, w, residual, gamma, EPS, low_rank=LowRank(a, b, s))[0]
        want = x @ effective(w, pair).t() + residual
    probe = torch.randn_like(want)
    names.clear()
    check_grads((out * probe).sum(), (want * probe).sum(), (a, b), ("a", "b"))
    assert not {"rms_norm_backward", "input_grad", "weight_grad"} & set(names), names
