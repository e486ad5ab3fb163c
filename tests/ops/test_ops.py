"""codagen.ops one by one: gradcheck on tiny float64 shapes, layouts, argument errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

from codagen import ops
from codagen.ops import kernels

from .conftest import GATE_ACTIVATIONS, reference_tiles, rms_norm, rope_half_split

EPS = 1e-5
M, D, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 5, 6, 2, 1, 4, 4, 7
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM


@pytest.fixture(autouse=True)
def _reference_backend():
    with reference_tiles(block_m=2, block_n=4):  # several tiles even on tiny shapes
        yield


def rand(*shape, requires_grad=True):
    return torch.randn(*shape, dtype=torch.float64).requires_grad_(requires_grad)


def norm_weight():
    return (1 + 0.3 * torch.randn(D, dtype=torch.float64)).requires_grad_()


def stats(x, gamma):
    """(x, normed, rstd, gamma) as the norm's consumer receives them."""
    return (x, *ops.rms_norm_stats(x, gamma, EPS), gamma)


# ==================================================================================================
# gradcheck: each op composed with the producer of its (non-differentiable) normed and rstd, so the
# consumer's backward must supply the whole RMSNorm gradient (ownership rule)
# ==================================================================================================
def test_rms_norm_stats_values_and_no_grad():
    x, gamma = rand(M, D), norm_weight()
    normed, rstd = ops.rms_norm_stats(x, gamma, EPS)
    torch.testing.assert_close(rstd, torch.rsqrt(x.pow(2).mean(-1) + EPS))
    torch.testing.assert_close(normed, x * gamma)
    assert not normed.requires_grad and not rstd.requires_grad


def test_gradcheck_out_proj_residual_rms():
    inp, weight, residual, gamma, head = rand(M, 4), rand(D, 4), rand(M, D), norm_weight(), rand(3, D)

    def f(inp, weight, residual, gamma, head):
        x, normed, rstd = ops.out_proj_residual_rms(inp, weight, residual, gamma, EPS)
        assert not normed.requires_grad and not rstd.requires_grad
        return x, ops.rms_linear(x, normed, rstd, gamma, head)

    assert gradcheck(f, (inp, weight, residual, gamma, head))
    x, normed, rstd = ops.out_proj_residual_rms(inp, weight, residual, gamma, EPS)
    want = inp @ weight.t() + residual
    torch.testing.assert_close(x, want)
    torch.testing.assert_close(normed, want * gamma)
    torch.testing.assert_close(rstd, torch.rsqrt(want.pow(2).mean(-1) + EPS))


def test_gradcheck_rms_qkv_rope():
    x, gamma, weight = rand(M, D), norm_weight(), rand(QKV, D)
    positions = torch.randint(0, 50, (M,))
    frequencies = ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM, base=7.0).double()

    def f(x, gamma, weight):
        return ops.rms_qkv_rope(*stats(x, gamma), weight, positions, frequencies)

    assert gradcheck(f, (x, gamma, weight))


def test_gradcheck_rms_qkv_rope_bias():
    """Qwen2's Q/K/V biases inside the epilogue: ``rope(z + bias)``; every input's gradient, the bias's too."""
    x, gamma, weight, bias = rand(M, D), norm_weight(), rand(QKV, D), rand(QKV)
    positions = torch.randint(0, 50, (M,))
    frequencies = ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM, base=7.0).double()

    def f(x, gamma, weight, bias):
        return ops.rms_qkv_rope(*stats(x, gamma), weight, positions, frequencies, bias=bias,
                                split_sizes=(HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM))

    assert gradcheck(f, (x, gamma, weight, bias))
    from codagen.models.llama import rotate_pairs
    z = rms_norm(x, gamma, EPS) @ weight.t() + bias
    got = torch.cat(f(x, gamma, weight, bias), dim=1)
    torch.testing.assert_close(got, rotate_pairs(z, positions.double()[:, None] * frequencies[None, :]))
    with pytest.raises(NotImplementedError, match="bias: a QKV bias together with QK-norm is not supported"):
        ops.rms_qkv_rope(*stats(x, gamma), weight, positions, frequencies, rand(HEAD_DIM), rand(HEAD_DIM),
                         num_heads=HEADS, bias=bias)


def test_gradcheck_rms_qkv_rope_qk_norm():
    """Every input: x, the input norm weight, the qkv weight, q_norm and k_norm (eps large enough that
    finite differences see it)."""
    x, gamma, weight = rand(M, D), norm_weight(), rand(QKV, D)
    q_norm, k_norm = (1 + 0.3 * rand(HEAD_DIM, requires_grad=False)).requires_grad_(), \
        (1 + 0.3 * rand(HEAD_DIM, requires_grad=False)).requires_grad_()
    positions = torch.randint(0, 50, (M,))
    frequencies = ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM, base=7.0).double()

    def f(x, gamma, weight, q_norm, k_norm):
        return ops.rms_qkv_rope(*stats(x, gamma), weight, positions, frequencies, q_norm, k_norm, num_heads=HEADS,
                                qk_norm_eps=0.01)

    assert gradcheck(f, (x, gamma, weight, q_norm, k_norm))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_gradcheck_rms_qkv_rope_pass_residual(qk_norm):
    """``pass_residual=True``: x comes back as the residual; the gradient reaching it joins x's gradient
    inside the op's backward (the "add" store of B2), as if x had fed both paths directly."""
    x, gamma, weight = rand(M, D), norm_weight(), rand(QKV, D)
    positions = torch.randint(0, 50, (M,))
    frequencies = ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM, base=7.0).double()
    qk = (torch.ones(HEAD_DIM, dtype=torch.float64), 1 + 0.3 * rand(HEAD_DIM, requires_grad=False)) if qk_norm else ()
    options = dict(num_heads=HEADS, qk_norm_eps=0.01) if qk_norm else {}

    def f(x, gamma, weight):
        qkv, residual = ops.rms_qkv_rope(*stats(x, gamma), weight, positions, frequencies, *qk, **options,
                                         pass_residual=True)
        return qkv, residual.sin()

    assert gradcheck(f, (x, gamma, weight))
    qkv, residual = ops.rms_qkv_rope(*stats(x, gamma), weight, positions, frequencies, *qk, **options,
                                     pass_residual=True)
    torch.testing.assert_close(residual, x)
    torch.testing.assert_close(qkv, ops.rms_qkv_rope(*stats(x, gamma), weight, positions, frequencies, *qk, **options))
    # the residual alone carries a gradient: it passes straight through
    residual.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))


SPLIT = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_gradcheck_rms_qkv_rope_split_sizes(qk_norm):
    """``split_sizes``: q, k, v come back as views of the one output, each with its own gradient, which
    reaches B1 as is; values and gradients those of ``qkv`` (also with an output left unused, and with
    the residual passed through)."""
    x, gamma, weight = rand(M, D), norm_weight(), rand(QKV, D)
    positions = torch.randint(0, 50, (M,))
    frequencies = ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM, base=7.0).double()
    qk = (1 + 0.3 * rand(HEAD_DIM, requires_grad=False), 1 + 0.3 * rand(HEAD_DIM, requires_grad=False)) \
        if qk_norm else ()
    options = dict(num_heads=HEADS, qk_norm_eps=0.01) if qk_norm else {}

    def f(x, gamma, weight):
        q, k, v, residual = ops.rms_qkv_rope(*stats(x, gamma), weight, positions, frequencies, *qk, **options,
                                             split_sizes=SPLIT, pass_residual=True)
        return q, k.sin(), v, residual.cos()

    assert gradcheck(f, (x, gamma, weight))
    qkv = ops.rms_qkv_rope(*stats(x, gamma), weight, positions, frequencies, *qk, **options)
    q, k, v = ops.rms_qkv_rope(*stats(x, gamma), weight, positions, frequencies, *qk, **options, split_sizes=SPLIT)
    assert q._base is k._base is v._base is not None  # views of one buffer, not copies
    torch.testing.assert_close(torch.cat((q, k, v), 1), qkv)
    probe = rand(M, SPLIT[0], requires_grad=False)  # only q used: k and v get no gradient
    want = torch.autograd.grad((qkv[:, :SPLIT[0]] * probe).sum(), (x, gamma, weight))
    got = torch.autograd.grad((q * probe).sum(), (x, gamma, weight))
    for name, a, b in zip(("x", "gamma", "weight"), got, want):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


def test_rms_qkv_rope_split_sizes_backward_concatenates_nothing():
    """With ``split_sizes`` no ``cat`` runs outside the op's backward (the Triton B1 kernel reads the three
    gradients in place); splitting ``qkv`` outside the op instead makes autograd concatenate them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class TopLevelOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    x, gamma, weight = rand(M, D), norm_weight(), rand(QKV, D)
    positions, frequencies = torch.arange(M), ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM).double()
    probes = [rand(M, c, requires_grad=False) for c in SPLIT]
    for split_in_op in (True, False):
        if split_in_op:
            blocks = ops.rms_qkv_rope(*stats(x, gamma), weight, positions, frequencies, split_sizes=SPLIT)
        else:
            blocks = ops.rms_qkv_rope(*stats(x, gamma), weight, positions, frequencies).split(SPLIT, dim=1)
        loss = sum((b * p).sum() for b, p in zip(blocks, probes))
        with TopLevelOps() as seen:
            loss.backward()
        cats = [n for n in seen.names if n.startswith("aten.cat")]
        assert "codagen.rms_qkv_rope_backward.default" in seen.names
        assert (cats == []) if split_in_op else cats, seen.names


def test_rms_qkv_rope_split_sizes_errors():
    x, gamma = rand(M, D, requires_grad=False), norm_weight().detach()
    normed, rstd = ops.rms_norm_stats(x, gamma, EPS)
    weight, positions, frequencies = rand(QKV, D, requires_grad=False), torch.zeros(M), torch.zeros(QKV // 2)
    head = rand(HEAD_DIM, requires_grad=False)
    for sizes in ((8, 4), (8, 4, 6), (7, 5, 4), (8, 4, 4.0), (0, 8, 8), "qkv"):
        with pytest.raises(ValueError, match="split_sizes: expected three even column counts summing to 16"):
            ops.rms_qkv_rope(x, normed, rstd, gamma, weight, positions, frequencies, split_sizes=sizes)
    with pytest.raises(ValueError, match=r"split_sizes: expected q, k, v column counts \(8, 4, 4\)"):
        ops.rms_qkv_rope(x, normed, rstd, gamma, weight, positions, frequencies, head, head, num_heads=HEADS,
                         split_sizes=(4, 8, 4))


def test_rms_qkv_rope_qk_norm_forward_values():
    """Pair-order layouts throughout: QK-norm per head of the projection, V untouched, then RoPE."""
    x, gamma, weight = rand(M, D, requires_grad=False), norm_weight().detach(), rand(QKV, D, requires_grad=False)
    q_norm, k_norm = rand(HEAD_DIM, requires_grad=False), rand(HEAD_DIM, requires_grad=False)
    positions = torch.randint(0, 50, (M,))
    frequencies = ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM).double()
    got = ops.rms_qkv_rope(*stats(x, gamma), weight, positions, frequencies, q_norm, k_norm, num_heads=HEADS,
                           qk_norm_eps=EPS)
    z = (rms_norm(x, gamma, EPS) @ weight.t()).view(M, HEADS + 2 * KV_HEADS, HEAD_DIM)
    head_gamma = torch.stack([q_norm] * HEADS + [k_norm] * KV_HEADS + [torch.ones(HEAD_DIM)] * KV_HEADS)
    normed_heads = torch.rsqrt(z.square().mean(-1, keepdim=True) + EPS) * z * head_gamma
    y = torch.cat((normed_heads[:, :HEADS + KV_HEADS], z[:, HEADS + KV_HEADS:]), 1).reshape(M, QKV)
    from codagen.models.llama import rotate_pairs
    torch.testing.assert_close(got, rotate_pairs(y, positions.double()[:, None] * frequencies[None, :]))


def test_gradcheck_qkv_norm_rope():
    """OLMo 2's QKV: every input (x, the weight, q_norm over all Q heads, k_norm over all K heads, a LoRA pair),
    split into q, k, v; eps large enough that finite differences see it."""
    x, weight = rand(M, D), rand(QKV, D)
    q_norm = (1 + 0.3 * rand(HEADS * HEAD_DIM, requires_grad=False)).requires_grad_()
    k_norm = (1 + 0.3 * rand(KV_HEADS * HEAD_DIM, requires_grad=False)).requires_grad_()
    lora_a, lora_b = rand(2, D), rand(QKV, 2)
    positions = torch.randint(0, 50, (M,))
    frequencies = ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM, base=7.0).double()
    sizes = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)

    def f(x, weight, q_norm, k_norm, lora_a, lora_b):
        return ops.qkv_norm_rope(x, weight, positions, frequencies, q_norm, k_norm, 0.01, split_sizes=sizes,
                                 low_rank=ops.LowRank(lora_a, lora_b, 0.5))

    def passed_through(x, weight, q_norm, k_norm, lora_a, lora_b):  # x also the residual: its gradient joins in
        *qkv, residual = ops.qkv_norm_rope(x, weight, positions, frequencies, q_norm, k_norm, 0.01,
                                           split_sizes=sizes, pass_residual=True,
                                           low_rank=ops.LowRank(lora_a, lora_b, 0.5))
        return (*qkv, residual.sin())

    assert gradcheck(f, (x, weight, q_norm, k_norm, lora_a, lora_b))
    assert gradcheck(passed_through, (x, weight, q_norm, k_norm, lora_a, lora_b))


def test_qkv_norm_rope_forward_values():
    """One RMSNorm over the whole Q projection and one over the whole K projection (not per head), then RoPE."""
    x, weight = rand(M, D, requires_grad=False), rand(QKV, D, requires_grad=False)
    q_norm, k_norm = rand(HEADS * HEAD_DIM, requires_grad=False), rand(KV_HEADS * HEAD_DIM, requires_grad=False)
    positions = torch.randint(0, 50, (M,))
    frequencies = ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM).double()
    got = ops.qkv_norm_rope(x, weight, positions, frequencies, q_norm, k_norm, EPS)
    z_q, z_k, z_v = (x @ weight.t()).split((HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM), dim=1)
    y = torch.cat((rms_norm(z_q, q_norm, EPS), rms_norm(z_k, k_norm, EPS), z_v), dim=1)
    from codagen.models.llama import rotate_pairs
    torch.testing.assert_close(got, rotate_pairs(y, positions.double()[:, None] * frequencies[None, :]))


def test_qkv_norm_rope_refuses_norm_weights_that_do_not_span_the_projections():
    args = (rand(M, D), rand(QKV, D), torch.arange(M), ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM).double())
    with pytest.raises(ValueError, match=r"qkv_weight: expected q_norm_weight's 4 \+ twice k_norm_weight's 4 rows"):
        ops.qkv_norm_rope(*args, rand(HEAD_DIM), rand(HEAD_DIM), EPS)  # per-head weights


def test_rms_qkv_rope_matches_half_split_rope():
    """Permuted weights + adjacent-pair RoPE = Hugging Face half-split RoPE, up to the same permutation."""
    x, gamma = rand(M, D, requires_grad=False), norm_weight().detach()
    wq, wk, wv = rand(HEADS * HEAD_DIM, D), rand(KV_HEADS * HEAD_DIM, D), rand(KV_HEADS * HEAD_DIM, D)
    positions = torch.randint(0, 1000, (M,))
    fused_weight = torch.cat((ops.rope_pairs_from_half_split(wq, HEAD_DIM),
                              ops.rope_pairs_from_half_split(wk, HEAD_DIM), wv)).detach()
    frequencies = ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM).double()
    qkv = ops.rms_qkv_rope(*stats(x, gamma), fused_weight, positions, frequencies)
    h = rms_norm(x, gamma, EPS)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))).double()  # HF: fp32
    want_q = rope_half_split((h @ wq.t()).view(M, HEADS, HEAD_DIM).transpose(0, 1), positions, inv_freq)
    want_k = rope_half_split((h @ wk.t()).view(M, KV_HEADS, HEAD_DIM).transpose(0, 1), positions, inv_freq)
    q, k, v = qkv.split((HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM), dim=1)
    unpermute = lambda t: ops.rope_half_split_from_pairs(t.t(), HEAD_DIM).t()  # noqa: E731 (columns back)
    torch.testing.assert_close(unpermute(q), want_q.transpose(0, 1).reshape(M, -1).detach())
    torch.testing.assert_close(unpermute(k), want_k.transpose(0, 1).reshape(M, -1).detach())
    torch.testing.assert_close(v, (h @ wv.t()).detach())


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gradcheck_rms_gate_up_swiglu(activation):
    x, gamma, weight = rand(M, D), norm_weight(), rand(2 * FFN, D)

    def f(x, gamma, weight):
        return ops.rms_gate_up_swiglu(*stats(x, gamma), weight, activation=activation)

    assert gradcheck(f, (x, gamma, weight))
    act = f(x, gamma, weight)
    h = rms_norm(x, gamma, EPS)
    torch.testing.assert_close(act, GATE_ACTIVATIONS[activation](h @ weight[0::2].t()) * (h @ weight[1::2].t()))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gradcheck_gate_up_swiglu(activation):
    """The gate/up GEMM of an MLP with no norm before it (OLMo 2), with a LoRA pair."""
    x, weight, lora_a, lora_b = rand(M, D), rand(2 * FFN, D), rand(2, D), rand(2 * FFN, 2)

    def f(x, weight, lora_a, lora_b):
        return ops.gate_up_swiglu(x, weight, low_rank=ops.LowRank(lora_a, lora_b, 0.5), activation=activation)

    def passed_through(x, weight, lora_a, lora_b):  # x also the residual: its gradient joins the input gradient's
        act, residual = ops.gate_up_swiglu(x, weight, low_rank=ops.LowRank(lora_a, lora_b, 0.5),
                                           activation=activation, pass_residual=True)
        return act, residual.sin()

    assert gradcheck(f, (x, weight, lora_a, lora_b))
    assert gradcheck(passed_through, (x, weight, lora_a, lora_b))
    effective = weight + 0.5 * lora_b @ lora_a
    torch.testing.assert_close(f(x, weight, lora_a, lora_b),
                               GATE_ACTIVATIONS[activation](x @ effective[0::2].t()) * (x @ effective[1::2].t()))


def test_gradcheck_linear_post_norm_residual_without_a_next_norm():
    """``norm_weight=None`` (OLMo 2: no norm before the next GEMM): ``(x, None, None)``, the same ``x``."""
    inp, weight, residual, post, gamma = rand(M, FFN), rand(D, FFN), rand(M, D), norm_weight(), norm_weight()

    def f(inp, weight, residual, post):
        x, normed, rstd = ops.linear_post_norm_residual_rms(inp, weight, residual, post, None, EPS)
        assert normed is None and rstd is None
        return x

    assert gradcheck(f, (inp, weight, residual, post))
    with_next = ops.linear_post_norm_residual_rms(inp, weight, residual, post, gamma, EPS)[0]
    torch.testing.assert_close(f(inp, weight, residual, post), with_next, rtol=0, atol=0)
    torch.testing.assert_close(with_next, residual + rms_norm(inp @ weight.t(), post, EPS))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gradcheck_swiglu_mlp_residual_rms(activation):
    x, gamma, gate_up, down, next_gamma, head = rand(M, D), norm_weight(), rand(2 * FFN, D), rand(D, FFN), \
        norm_weight(), rand(3, D)

    def f(x, gamma, gate_up, down, next_gamma, head):
        x_out, normed, rstd = ops.swiglu_mlp_residual_rms(*stats(x, gamma), gate_up, down, next_gamma, EPS,
                                                          activation=activation)
        assert not normed.requires_grad and not rstd.requires_grad
        return x_out, ops.rms_linear(x_out, normed, rstd, next_gamma, head)

    assert gradcheck(f, (x, gamma, gate_up, down, next_gamma, head))
    x_out, _ = f(x, gamma, gate_up, down, next_gamma, head)
    h = rms_norm(x, gamma, EPS)
    act = GATE_ACTIVATIONS[activation](h @ gate_up[0::2].t()) * (h @ gate_up[1::2].t())
    torch.testing.assert_close(x_out, x + act @ down.t())


def test_mlp_gate_up_node_refuses_a_backward_without_the_down_projection():
    """The gate/up node's backward takes mean_z_dz and the residual gradient from the down-projection
    node; a gradient reaching it any other way gets a clear error, not a wrong norm gradient."""
    from codagen.ops.mlp import _MlpGateUp
    x, normed, rstd, gamma = stats(rand(M, D), norm_weight())
    act, preact, residual, mean_z_dz_slot = _MlpGateUp.apply(x, normed, rstd, gamma, rand(2 * FFN, D), None, None, 1.0,
                                                             "silu", False, None)
    with pytest.raises(RuntimeError, match="down-projection's backward"):
        preact.sum().backward()


def soft_capped(logits, softcap):
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


#: soft-caps of the tiny logits' scale (N(0, D) with D = 6): the tanh saturated and not
SOFTCAPS = pytest.mark.parametrize("softcap", [None, 2.0], ids=["uncapped", "softcap"])


@SOFTCAPS
def test_gradcheck_rms_linear(softcap):
    x, gamma, weight = rand(M, D), norm_weight(), rand(VOCAB, D)

    def f(x, gamma, weight):
        return ops.rms_linear(*stats(x, gamma), weight, softcap=softcap)

    assert gradcheck(f, (x, gamma, weight))
    torch.testing.assert_close(f(x, gamma, weight), soft_capped(rms_norm(x, gamma, EPS) @ weight.t(), softcap))


@SOFTCAPS
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradcheck_rms_lm_head_cross_entropy(reduction, softcap):
    x, gamma, weight = rand(M, D), norm_weight(), rand(VOCAB, D)
    target = torch.randint(0, VOCAB, (M,))
    target[1] = -100

    def f(x, gamma, weight):
        return ops.rms_lm_head_cross_entropy(*stats(x, gamma), weight, target, reduction=reduction, softcap=softcap)

    assert gradcheck(f, (x, gamma, weight))
    want = F.cross_entropy(soft_capped(rms_norm(x, gamma, EPS) @ weight.t(), softcap), target, reduction=reduction)
    torch.testing.assert_close(f(x, gamma, weight), want)
    with torch.no_grad():  # evaluation: the fused cross-entropy GEMM
        torch.testing.assert_close(f(x, gamma, weight), want)


def test_cross_entropy_int32_targets_and_all_ignored():
    x, gamma, weight = rand(M, D), norm_weight(), rand(VOCAB, D)
    target = torch.randint(0, VOCAB, (M,), dtype=torch.int32)
    got = ops.rms_lm_head_cross_entropy(*stats(x, gamma), weight, target, reduction="sum")
    torch.testing.assert_close(got, F.cross_entropy(rms_norm(x, gamma, EPS) @ weight.t(), target.long(),
                                                    reduction="sum"))
    ignored = torch.full((M,), -100)
    assert ops.rms_lm_head_cross_entropy(*stats(x, gamma), weight, ignored, reduction="sum") == 0
    assert ops.rms_lm_head_cross_entropy(*stats(x, gamma), weight, ignored).isnan()  # as torch's mean


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_cross_entropy_scales_saved_gradients_by_the_loss_gradient(monkeypatch, dtype):
    """The gradients are made in the forward pass for a loss gradient of 1; a scaled loss must scale them
    all. bf16 with several chunks takes the fp32 grad_W accumulator, rounded once after the scale."""
    from codagen.ops import cross_entropy

    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", 2 * VOCAB * torch.empty((), dtype=dtype).element_size())
    x, gamma, weight = (t.detach().to(dtype).requires_grad_() for t in (rand(M, D), norm_weight(), rand(VOCAB, D)))
    target = torch.randint(0, VOCAB, (M,))
    factor = 0.37
    (ops.rms_lm_head_cross_entropy(*stats(x, gamma), weight, target) * factor).backward()
    leaves64 = [t.detach().double().requires_grad_() for t in (x, gamma, weight)]
    (F.cross_entropy(rms_norm(leaves64[0], leaves64[1], EPS) @ leaves64[2].t(), target) * factor).backward()
    for name, got, want in zip(("x", "norm_weight", "lm_head_weight"), (x, gamma, weight), leaves64):
        assert got.grad.dtype == dtype, name
        tol = 1e-10 if dtype == torch.float64 else 3e-2 * want.grad.abs().max().item()
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=0, atol=tol, msg=lambda m: f"{name}: {m}")


def test_embedding_matches_torch_and_zeroes_the_padding_row():
    weight = rand(VOCAB, D)
    ids = torch.randint(0, VOCAB, (2, 9))
    ids[0, :4] = 3  # a repeated id
    assert gradcheck(lambda w: ops.embedding(ids, w), (weight,))
    for padding_idx in (None, 3, -1):
        out = ops.embedding(ids, weight, padding_idx)
        probe = torch.randn_like(out)
        got = torch.autograd.grad((out * probe).sum(), weight)[0]
        want_out = F.embedding(ids, weight, padding_idx)
        want = torch.autograd.grad((want_out * probe).sum(), weight)[0]
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ==================================================================================================
# Each fused step is one GEMM program: count the programs each op's forward and backward run
# ==================================================================================================
def test_programs_per_op(monkeypatch):
    from codagen.backends.reference import ReferenceBackend

    ran = []
    run = ReferenceBackend.run
    monkeypatch.setattr(ReferenceBackend, "run", lambda self, bound: ran.append(bound.program.name) or run(self, bound))

    def programs(f, *args):
        ran.clear()
        out = f(*args)
        forward = list(ran)
        ran.clear()
        loss = sum((o * torch.randn_like(o)).sum() for o in (out if isinstance(out, tuple) else (out,))
                   if o.requires_grad)
        loss.backward()
        return forward, list(ran)

    x, gamma = rand(M, D), norm_weight()
    frequencies = ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM).double()
    assert programs(ops.rms_qkv_rope, *stats(x, gamma), rand(QKV, D), torch.arange(M), frequencies) == (
        ["rms_qkv_rope"], ["rms_norm_backward", "weight_grad"])  # + the B1 row kernel
    q_norm, k_norm = norm_weight()[:HEAD_DIM], norm_weight()[:HEAD_DIM]
    assert programs(ops.rms_qkv_rope, *stats(x, gamma), rand(QKV, D), torch.arange(M), frequencies, q_norm, k_norm,
                    HEADS) == (["rms_qkv_rope_qk_norm"], ["rms_norm_backward", "weight_grad"])  # + the B1 row kernel
    assert programs(ops.out_proj_residual_rms, rand(M, 4), rand(D, 4), x, gamma, EPS) == (
        ["residual_rms_stats"], ["input_grad", "weight_grad"])
    assert programs(ops.swiglu_mlp_residual_rms, *stats(x, gamma), rand(2 * FFN, D), rand(D, FFN), gamma, EPS) == (
        ["rms_gate_up_swiglu", "residual_rms_stats"],
        ["swiglu_backward", "weight_grad", "rms_norm_backward", "weight_grad"])
    geglu_mlp = lambda *args: ops.swiglu_mlp_residual_rms(*args, activation="gelu_tanh")  # noqa: E731
    assert programs(geglu_mlp, *stats(x, gamma), rand(2 * FFN, D), rand(D, FFN), gamma, EPS) == (
        ["rms_gate_up_geglu", "residual_rms_stats"],
        ["geglu_backward", "weight_grad", "rms_norm_backward", "weight_grad"])
    geglu = lambda *args: ops.rms_gate_up_swiglu(*args, activation="gelu_tanh")  # noqa: E731
    assert programs(geglu, *stats(x, gamma), rand(2 * FFN, D)) == (
        ["rms_gate_up_geglu"], ["rms_norm_backward", "weight_grad"])  # + the GeGLU backward row kernel
    # OLMo 2: no norm before the GEMMs; the norms over the whole projections and after the GEMMs are row kernels
    assert programs(ops.gate_up_swiglu, x, rand(2 * FFN, D)) == (["gate_up_swiglu"], ["input_grad", "weight_grad"])
    # x passed through as the residual: its gradient joins in the input-gradient GEMM's store
    assert programs(lambda *args: torch.cat(ops.gate_up_swiglu(*args, pass_residual=True), dim=1), x,
                    rand(2 * FFN, D)) == (["gate_up_swiglu"], ["input_grad_residual", "weight_grad"])
    assert programs(ops.qkv_norm_rope, x, rand(QKV, D), torch.arange(M), frequencies, rand(HEADS * HEAD_DIM),
                    rand(KV_HEADS * HEAD_DIM), EPS) == (["linear"], ["input_grad", "weight_grad"])
    target = torch.randint(0, VOCAB, (M,))
    # training: the gradient is made in the forward pass (+ the cross-entropy row kernel); backward only scales
    assert programs(ops.rms_lm_head_cross_entropy, *stats(x, gamma), rand(VOCAB, D), target) == (
        ["rms_linear", "rms_norm_backward", "weight_grad"], [])
    # with a soft-cap the same GEMMs: the row kernel caps the stored logits
    assert programs(lambda *args: ops.rms_lm_head_cross_entropy(*args, softcap=2.0), *stats(x, gamma),
                    rand(VOCAB, D), target) == (["rms_linear", "rms_norm_backward", "weight_grad"], [])
    assert programs(lambda *args: ops.rms_linear(*args, softcap=2.0), *stats(x, gamma), rand(VOCAB, D)) == (
        ["rms_linear_softcap"], ["rms_norm_backward", "weight_grad"])  # + the soft-cap backward row kernel
    # evaluation: one fused GEMM, no logits
    for softcap, program in ((None, "rms_lm_head_cross_entropy"), (2.0, "rms_lm_head_cross_entropy_softcap")):
        ran.clear()
        with torch.no_grad():
            ops.rms_lm_head_cross_entropy(*stats(x, gamma), rand(VOCAB, D), target, softcap=softcap)
        assert ran == [program]


def test_inference_forward_stores_nothing_for_backward(monkeypatch):
    """Under ``no_grad`` the ops that save a pre-activation for backward run its inference program (which does
    not store it), and return what their training forward returns, bitwise."""
    from codagen.backends.reference import ReferenceBackend

    ran = []
    run = ReferenceBackend.run
    monkeypatch.setattr(ReferenceBackend, "run", lambda self, bound: ran.append(bound.program.name) or run(self, bound))
    x, gamma = rand(M, D), norm_weight()
    frequencies = ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM).double()
    cases = {
        "rms_gate_up_swiglu": (lambda: ops.rms_gate_up_swiglu(*stats(x, gamma), rand(2 * FFN, D)),
                               ["rms_gate_up_swiglu_inference"]),
        "swiglu_mlp_residual_rms": (
            lambda: ops.swiglu_mlp_residual_rms(*stats(x, gamma), rand(2 * FFN, D), rand(D, FFN), gamma, EPS),
            ["rms_gate_up_swiglu_inference", "residual_rms_stats"]),
        "rms_gate_up_swiglu with GeGLU": (
            lambda: ops.rms_gate_up_swiglu(*stats(x, gamma), rand(2 * FFN, D), activation="gelu_tanh"),
            ["rms_gate_up_geglu_inference"]),
        "swiglu_mlp_residual_rms with GeGLU": (
            lambda: ops.swiglu_mlp_residual_rms(*stats(x, gamma), rand(2 * FFN, D), rand(D, FFN), gamma, EPS,
                                                activation="gelu_tanh"),
            ["rms_gate_up_geglu_inference", "residual_rms_stats"]),
        "rms_linear with a soft-cap": (lambda: ops.rms_linear(*stats(x, gamma), rand(VOCAB, D), softcap=2.0),
                                       ["rms_linear_softcap_inference"]),
        "rms_qkv_rope with QK-norm": (
            lambda: ops.rms_qkv_rope(*stats(x, gamma), rand(QKV, D), torch.arange(M), frequencies, rand(HEAD_DIM),
                                     rand(HEAD_DIM), HEADS, split_sizes=(HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM,
                                                                         KV_HEADS * HEAD_DIM), pass_residual=True),
            ["rms_qkv_rope_qk_norm_inference"]),
    }
    for name, (call, inference_programs) in cases.items():
        torch.manual_seed(0)
        trained = call()
        torch.manual_seed(0)
        ran.clear()
        with torch.no_grad():
            inferred = call()
        assert ran == inference_programs, name
        for got, want in zip(inferred if isinstance(inferred, tuple) else (inferred,),
                             trained if isinstance(trained, tuple) else (trained,), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=0, msg=name)


# ==================================================================================================
# The row kernels' reference twins (the Triton kernels are checked against them in test_ops_triton.py)
# ==================================================================================================
def test_rope_backward_ref_is_the_adjoint_of_rope():
    z, grad_qkv = rand(M, QKV, requires_grad=False), rand(M, QKV, requires_grad=False)
    positions = torch.randint(0, 100, (M,)).double()
    frequencies = ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM).double()
    z.requires_grad_()
    from codagen.backends.reference import rope_ref
    qkv = rope_ref(z, positions[:, None] * frequencies[None, :])
    (want_grad_z,) = torch.autograd.grad(qkv, z, grad_qkv)
    grad_z, mean_z_dz = kernels.rope_backward_ref([grad_qkv], qkv.detach(), positions, frequencies, width=D)
    torch.testing.assert_close(grad_z, want_grad_z)
    torch.testing.assert_close(mean_z_dz, (z * want_grad_z).sum(-1).detach() / D)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(HEADS, KV_HEADS, HEAD_DIM), (4, 2, 6)])
def test_rope_qk_norm_backward_ref_matches_autograd(heads, kv_heads, head_dim):
    n = (heads + 2 * kv_heads) * head_dim
    z, grad_qkv = rand(M, n), rand(M, n, requires_grad=False)
    q_norm, k_norm = rand(head_dim), rand(head_dim)
    positions = torch.randint(0, 100, (M,)).double()
    frequencies = ops.rope_frequencies(heads, kv_heads, head_dim).double()
    qk = (heads + kv_heads) * head_dim
    heads_z = z[:, :qk].view(M, -1, head_dim)
    head_gamma = torch.cat((q_norm.expand(heads, head_dim), k_norm.expand(kv_heads, head_dim)))
    y = torch.cat(((heads_z * torch.rsqrt(heads_z.square().mean(-1, keepdim=True) + EPS) * head_gamma).flatten(1),
                   z[:, qk:]), 1)
    from codagen.backends.reference import rope_ref
    qkv = rope_ref(y, positions[:, None] * frequencies[None, :])
    want = torch.autograd.grad(qkv, (z, q_norm, k_norm), grad_qkv)
    got = kernels.rope_qk_norm_backward_ref([grad_qkv], z.detach(), positions, frequencies, q_norm.detach(),
                                            k_norm.detach(), heads, EPS, width=D)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], (z * want[0]).sum(-1).detach() / D)  # pre-QK-norm z times its gradient
    torch.testing.assert_close(got[2], want[1])
    torch.testing.assert_close(got[3], want[2])


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_swiglu_backward_ref_matches_autograd(activation):
    preact, grad_act = 3 * rand(M, 2 * FFN), rand(M, FFN, requires_grad=False)  # gates well into both tails
    act = GATE_ACTIVATIONS[activation](preact[:, 0::2]) * preact[:, 1::2]
    (want,) = torch.autograd.grad(act, preact, grad_act)
    grad_preact, mean_z_dz = kernels.swiglu_backward_ref(grad_act, preact.detach(), width=D, activation=activation)
    torch.testing.assert_close(grad_preact, want)
    torch.testing.assert_close(mean_z_dz, (preact * want).sum(-1).detach() / D)


def test_cross_entropy_logits_grad_ref_matches_autograd():
    """Row losses and the in-place gradient against autograd of F.cross_entropy; an ignored row and a target
    past the vocabulary take no target term (loss ``lse``, gradient the softmax alone)."""
    logits = rand(M, VOCAB, requires_grad=False)
    target = torch.randint(0, VOCAB, (M,))
    target[0], target[1] = -100, VOCAB
    row_weight = torch.rand(M, dtype=torch.float64)
    z = logits.clone().requires_grad_()
    valid = (target >= 0) & (target < VOCAB)
    row_loss_want = torch.where(valid, F.cross_entropy(z, target.clamp(0, VOCAB - 1), reduction="none"),
                                torch.logsumexp(z, -1))
    (grad_want,) = torch.autograd.grad((row_loss_want * row_weight).sum(), z)
    row_loss, mean_z_dz = kernels.cross_entropy_logits_grad_ref(logits, target, row_weight, width=D)
    torch.testing.assert_close(row_loss, row_loss_want.detach())
    torch.testing.assert_close(logits, grad_want)  # written in place
    torch.testing.assert_close(mean_z_dz, (z.detach() * grad_want).sum(-1) / D)


# ==================================================================================================
# Layouts
# ==================================================================================================
def test_gate_up_interleave_round_trip():
    gate, up = rand(FFN, D, requires_grad=False), rand(FFN, D, requires_grad=False)
    fused = ops.interleave_gate_up(gate, up)
    assert torch.equal(fused[0::2], gate) and torch.equal(fused[1::2], up)
    g, u = ops.split_gate_up(fused)
    assert torch.equal(g, gate) and torch.equal(u, up)


def test_rope_permutation_round_trip_and_pairs():
    w = rand(3 * HEAD_DIM, D, requires_grad=False)
    p = ops.rope_pairs_from_half_split(w, HEAD_DIM)
    half = HEAD_DIM // 2
    for head in range(3):
        for i in range(half):
            assert torch.equal(p[head * HEAD_DIM + 2 * i], w[head * HEAD_DIM + i])
            assert torch.equal(p[head * HEAD_DIM + 2 * i + 1], w[head * HEAD_DIM + i + half])
    assert torch.equal(ops.rope_half_split_from_pairs(p, HEAD_DIM), w)
    # a QK-norm weight [head_dim] is permuted like one head's rows
    q_norm = rand(HEAD_DIM, requires_grad=False)
    assert torch.equal(ops.rope_pairs_from_half_split(q_norm, HEAD_DIM), ops.rope_pairs_from_half_split(
        q_norm[:, None], HEAD_DIM)[:, 0])


def test_rope_frequencies_layout():
    freqs = ops.rope_frequencies(4, 2, 8, base=500000.0)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 8, 2, dtype=torch.int64).float() / 8))
    assert freqs.dtype == torch.float32 and freqs.shape == ((4 + 2 * 2) * 8 // 2,)
    assert torch.equal(freqs[: 4 * 4], inv.repeat(4)) and torch.equal(freqs[16:24], inv.repeat(2))
    assert torch.equal(freqs[24:], torch.zeros(8))
    custom = torch.rand(4)
    assert torch.equal(ops.rope_frequencies(1, 1, 8, inv_freq=custom)[:4], custom)
    # built where asked (no host-to-device copy, e.g. inside CUDA-graph capture), from inv_freq too
    for given in (None, custom):
        on_meta = ops.rope_frequencies(4, 2, 8, inv_freq=given, device="meta")
        assert on_meta.device.type == "meta" and on_meta.shape == freqs.shape and on_meta.dtype == torch.float32


# ==================================================================================================
# Errors name the argument and what was expected
# ==================================================================================================
def qk_norm_cases(x, normed, rstd, gamma):
    weight, positions = rand(QKV, D, requires_grad=False), torch.zeros(M)
    frequencies, head = torch.zeros(QKV // 2), rand(HEAD_DIM, requires_grad=False)

    def call(q_norm=head, k_norm=head, num_heads=HEADS, eps=EPS, qkv_weight=weight, freqs=frequencies):
        return lambda: ops.rms_qkv_rope(x, normed, rstd, gamma, qkv_weight, positions, freqs, q_norm, k_norm,
                                        num_heads=num_heads, qk_norm_eps=eps)
    return [
        (call(k_norm=None), "k_norm_weight: QK-norm needs both q_norm_weight and k_norm_weight"),
        (call(q_norm=None, num_heads=None), "q_norm_weight: QK-norm needs both"),
        (lambda: ops.rms_qkv_rope(x, normed, rstd, gamma, weight, positions, frequencies, num_heads=2),
         "num_heads: only used with QK-norm"),
        (call(q_norm=rand(2, HEAD_DIM, requires_grad=False)), "q_norm_weight: expected a vector"),
        (call(q_norm=rand(3, requires_grad=False)), "with an even head_dim, got shape (3,)"),
        (call(k_norm=rand(HEAD_DIM + 2, requires_grad=False)), "k_norm_weight: expected shape"),
        (call(num_heads=None), "num_heads: QK-norm needs the number of Q heads"),
        (call(num_heads=0), "num_heads: expected a positive int"),
        (call(num_heads=3), "num_heads: qkv_weight holds 4 heads of head_dim 4"),
        (call(eps=0.0), "qk_norm_eps: expected a positive float"),
        (call(q_norm=rand(6, requires_grad=False), k_norm=rand(6, requires_grad=False)),
         "rows with head_dim = 6 (q_norm_weight's length)"),
    ]


def test_errors_name_the_argument():
    x, gamma = rand(M, D, requires_grad=False), norm_weight().detach()
    normed, rstd = ops.rms_norm_stats(x, gamma, EPS)
    weight = rand(2 * FFN, D, requires_grad=False)
    cases = [
        (lambda: ops.rms_norm_stats(x[None], gamma, EPS), "x: expected a 2-D tensor"),
        (lambda: ops.rms_norm_stats(x.int(), gamma, EPS), "x: expected one of"),
        (lambda: ops.rms_norm_stats(x, gamma[:-1], EPS), "norm_weight: expected shape"),
        (lambda: ops.rms_norm_stats(x, gamma, -1.0), "eps: expected a positive float"),
        (lambda: ops.rms_gate_up_swiglu(x, normed, rstd.float(), gamma, weight), "rstd: expected dtype torch.float64"),
        (lambda: ops.rms_gate_up_swiglu(x, normed[:2], rstd, gamma, weight), "normed: expected"),
        (lambda: ops.rms_gate_up_swiglu(x, normed, rstd, gamma, weight.float()), "gate_up_weight: expected dtype"),
        (lambda: ops.rms_gate_up_swiglu(x, normed, rstd, gamma, weight[:-1]), "gate_up_weight: expected an even"),
        (lambda: ops.rms_gate_up_swiglu(x, normed, rstd, gamma, weight.t().contiguous().t()), "contiguous"),
        (lambda: ops.rms_gate_up_swiglu(x, normed, rstd, gamma, weight.to("meta")), "gate_up_weight: expected device"),
        (lambda: ops.swiglu_mlp_residual_rms(x, normed, rstd, gamma, weight, rand(D, FFN + 1), gamma, EPS),
         "down_weight: expected shape"),
        (lambda: ops.swiglu_mlp_residual_rms(x, normed, rstd, gamma, rand(6, D), rand(D, 3), gamma, EPS),
         "gate_up_weight: expected 2 \\* ffn rows with an even ffn"),
        (lambda: ops.rms_qkv_rope(x, normed, rstd, gamma, rand(QKV, D), torch.zeros(M + 1), torch.zeros(QKV // 2)),
         "positions: expected shape"),
        (lambda: ops.rms_qkv_rope(x, normed, rstd, gamma, rand(QKV, D), torch.zeros(M), torch.zeros(QKV)),
         "frequencies: expected shape"),
        *qk_norm_cases(x, normed, rstd, gamma),
        (lambda: ops.out_proj_residual_rms(rand(M, 4), rand(D, 4), x[:-1], gamma, EPS),
         "residual: expected 5 rows \\[inp tokens, features\\], got shape (4, 6)"),
        (lambda: ops.out_proj_residual_rms(rand(M, 4).float(), rand(D, 4), x, gamma, EPS),
         "residual: expected dtype torch.float32 (that of inp), got torch.float64"),
        (lambda: ops.out_proj_residual_rms(rand(M, 4), rand(D, 3), x, gamma, EPS), "weight: expected shape"),
        (lambda: ops.rms_lm_head_cross_entropy(x, normed, rstd, gamma, rand(VOCAB, D), torch.zeros(M)),
         "target: expected an int32 or int64"),
        (lambda: ops.rms_lm_head_cross_entropy(x, normed, rstd, gamma, rand(VOCAB, D), torch.zeros(M, dtype=int),
                                               reduction="none"), "reduction: expected 'mean' or 'sum'"),
        (lambda: ops.embedding(torch.zeros(3), weight), "ids: expected an int32 or int64 tensor"),
        (lambda: ops.embedding(torch.zeros(3, dtype=int), gamma), "weight: expected a 2-D"),
        (lambda: ops.embedding(torch.zeros(3, dtype=int), weight, padding_idx=2 * FFN), "padding_idx: expected"),
        (lambda: ops.rope_frequencies(3, 2, 8), "num_heads (3) must be a multiple of num_kv_heads (2)"),
        (lambda: ops.rope_pairs_from_half_split(rand(10, D), 4), "multiple of head_dim"),
        (lambda: ops.interleave_gate_up(rand(3, D), rand(4, D)), "up_weight: expected the shape"),
    ]
    for call, message in cases:
        with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
            call()
