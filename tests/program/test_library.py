"""The CODA program library against naive float64 PyTorch math (reference backend, CPU).

Small tiles (16 x 8) so that every partial reduction spans several tiles, including a ragged last one.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from codagen.backends.reference import ReferenceBackend, rope_ref
from codagen.epilogue import bind, finish, library
from codagen.epilogue.ir import ProgramError

F64 = torch.float64
EPS = 1e-6


def run(program, a, b, **tensors):
    return ReferenceBackend(block_m=16, block_n=8).run(bind(program, a, b, tensors))


def rms_norm(x, weight):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * weight


def rstd_of(x):
    return torch.rsqrt(x.square().mean(-1) + EPS)


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def pairs_from_half_split(weight, head_dim):
    """Rows of each head reordered so HF's half-split RoPE pairs (i, i + hd/2) become adjacent (2i, 2i+1)."""
    heads = weight.shape[0] // head_dim
    w = weight.view(heads, 2, head_dim // 2, -1)
    return w.transpose(1, 2).reshape(weight.shape)


SHAPES = [(1, 24), (7, 40), (129, 36)]   # (tokens M, hidden d); d is not a multiple of the 8-wide tile
#: the gate's nonlinearity of each ``activation`` option: SwiGLU's and GeGLU's
GATES = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


@pytest.mark.parametrize("m, d", SHAPES)
def test_residual_rms_stats(m, d):
    inp, w_o = torch.randn(m, 20, dtype=F64), torch.randn(d, 20, dtype=F64)
    residual, gamma = torch.randn(m, d, dtype=F64), torch.randn(d, dtype=F64)
    out = run(library.residual_rms_stats(), inp, w_o, residual=residual, norm_weight=gamma)
    x = inp @ w_o.T + residual
    torch.testing.assert_close(out["residual_out"], x)
    torch.testing.assert_close(out["normed"], x * gamma)
    assert out["partial_sumsq"].shape == (m, -(-d // 8))
    torch.testing.assert_close(finish.rstd_from_partial_sumsq(out["partial_sumsq"], d, EPS), rstd_of(x))


@pytest.mark.parametrize("m, d", SHAPES)
def test_rmsnorm_commutes_with_the_consumer_gemm(m, d):
    """rstd * ((x * gamma) @ W^T) == RMSNorm(x) @ W^T: the row scale moves into the consumer's epilogue."""
    x, gamma, w = torch.randn(m, d, dtype=F64), torch.randn(d, dtype=F64), torch.randn(10, d, dtype=F64)
    out = run(library.rms_linear(), x * gamma, w, rstd=rstd_of(x))["out"]
    torch.testing.assert_close(out, rms_norm(x, gamma) @ w.T)


def soft_capped(logits, softcap):
    """Gemma 2's final logit soft-cap, as Hugging Face applies it."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


@pytest.mark.parametrize("m, d", SHAPES)
def test_soft_capped_rms_linear(m, d):
    """``out = cap * tanh(z / cap)`` and ``preact = z``; the inference program stores ``out`` alone. Logits of
    a few caps: some saturated, some not."""
    softcap = 4.0
    x, gamma, w = torch.randn(m, d, dtype=F64), torch.randn(d, dtype=F64), torch.randn(10, d, dtype=F64)
    logits = rms_norm(x, gamma) @ w.T
    out = run(library.rms_linear(softcap), x * gamma, w, rstd=rstd_of(x))
    torch.testing.assert_close(out["out"], soft_capped(logits, softcap))
    torch.testing.assert_close(out["preact"], logits)
    inferred = run(library.rms_linear(softcap, save_preact=False), x * gamma, w, rstd=rstd_of(x))
    assert list(inferred) == ["out"]
    torch.testing.assert_close(inferred["out"], out["out"], rtol=0, atol=0)


@pytest.mark.parametrize("activation", list(GATES))
@pytest.mark.parametrize("m, d", SHAPES)
def test_gate_up_swiglu_with_interleaved_weights(m, d, activation):
    ffn = 12
    x, gamma = torch.randn(m, d, dtype=F64), torch.randn(d, dtype=F64)
    w_gate, w_up = torch.randn(ffn, d, dtype=F64), torch.randn(ffn, d, dtype=F64)
    gate_up = torch.stack((w_gate, w_up), 1).reshape(2 * ffn, d)       # rows g0, u0, g1, u1, ...
    out = run(library.rms_gate_up_swiglu(activation=activation), x * gamma, gate_up, rstd=rstd_of(x))
    h = rms_norm(x, gamma)
    torch.testing.assert_close(out["out"], GATES[activation](h @ w_gate.T) * (h @ w_up.T))
    torch.testing.assert_close(out["preact"][:, 0::2], h @ w_gate.T)
    inference = run(library.rms_gate_up_swiglu(save_preact=False, activation=activation), x * gamma, gate_up,
                    rstd=rstd_of(x))
    assert list(inference) == ["out"]
    torch.testing.assert_close(inference["out"], out["out"], rtol=0, atol=0)


def test_gated_programs_by_activation():
    """Each activation has its own programs (names key the tuning table); GeGLU's stand in on SwiGLU's tuning."""
    names = {(activation, save_preact): library.rms_gate_up_swiglu(save_preact, activation).name
             for activation in library.ACTIVATIONS for save_preact in (True, False)}
    assert names == {("silu", True): "rms_gate_up_swiglu", ("silu", False): "rms_gate_up_swiglu_inference",
                     ("gelu_tanh", True): "rms_gate_up_geglu", ("gelu_tanh", False): "rms_gate_up_geglu_inference"}
    assert [library.swiglu_backward(a).name for a in library.ACTIVATIONS] == ["swiglu_backward", "geglu_backward"]
    assert library.rms_gate_up_swiglu(activation="silu") == library.rms_gate_up_swiglu()
    assert library.swiglu_backward("silu") == library.swiglu_backward()
    assert library.rms_gate_up_swiglu().tuning_stand_in is None and library.swiglu_backward().tuning_stand_in is None
    geglu = library.rms_gate_up_swiglu(activation="gelu_tanh")
    assert geglu.tuning_stand_in == library.rms_gate_up_swiglu()
    assert library.rms_gate_up_swiglu(False, "gelu_tanh").tuning_stand_in == geglu
    assert library.swiglu_backward("gelu_tanh").tuning_stand_in == library.swiglu_backward()
    for bad in ("gelu", "relu", None):
        with pytest.raises(ValueError, match=r"activation must be one of \('silu', 'gelu_tanh'\)"):
            library.rms_gate_up_swiglu(activation=bad)
        with pytest.raises(ValueError, match="activation must be one of"):
            library.swiglu_backward(bad)


def rope_frequencies(heads, kv_heads, head_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=F64) / head_dim)
    return torch.cat([inv_freq.repeat(heads + kv_heads), torch.zeros(kv_heads * head_dim // 2, dtype=F64)])


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])   # MHA and GQA
@pytest.mark.parametrize("m", [1, 7, 33])
def test_qkv_rope_matches_half_split_rope_on_permuted_weights(heads, kv_heads, m):
    d, hd = 24, 8
    x, gamma = torch.randn(m, d, dtype=F64), torch.randn(d, dtype=F64)
    w_q, w_k, w_v = (torch.randn(h * hd, d, dtype=F64) for h in (heads, kv_heads, kv_heads))
    positions = torch.randperm(4 * m)[:m].float()
    # Hugging Face convention: half-split rotate_half on Q and K.
    h = rms_norm(x, gamma)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, hd, 2, dtype=F64) / hd)
    angle = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((angle.cos(), angle.cos()), -1), torch.cat((angle.sin(), angle.sin()), -1)

    def hf_rope(t, n_heads):
        t = t.view(m, n_heads, hd)
        return (t * cos[:, None] + rotate_half(t) * sin[:, None]).reshape(m, -1)

    q_ref, k_ref, v_ref = hf_rope(h @ w_q.T, heads), hf_rope(h @ w_k.T, kv_heads), h @ w_v.T
    qkv_weight = torch.cat((pairs_from_half_split(w_q, hd), pairs_from_half_split(w_k, hd), w_v))
    qkv = run(library.rms_qkv_rope(), x * gamma, qkv_weight, rstd=rstd_of(x), positions=positions,
              frequencies=rope_frequencies(heads, kv_heads, hd))["qkv"]
    q, k, v = qkv.split((heads * hd, kv_heads * hd, kv_heads * hd), -1)
    # Same channels, pair order: q[:, 2i] is HF's channel i, q[:, 2i+1] is channel i + hd/2 of each head.
    def unpair(t, n):
        return t.view(m, n, hd // 2, 2).transpose(2, 3).reshape(m, -1)

    torch.testing.assert_close(unpair(q, heads), q_ref)
    torch.testing.assert_close(unpair(k, kv_heads), k_ref)
    torch.testing.assert_close(v, v_ref)
    # Attention scores are unchanged: q.k is invariant to one permutation of both.
    torch.testing.assert_close(q.view(m, heads, hd)[:, 0] @ k.view(m, kv_heads, hd)[:, 0].T,
                               q_ref.view(m, heads, hd)[:, 0] @ k_ref.view(m, kv_heads, hd)[:, 0].T)


@pytest.mark.parametrize("heads, kv_heads, hd", [(4, 2, 8), (2, 1, 16)])
@pytest.mark.parametrize("m", [1, 7, 129])
def test_qkv_rope_qk_norm_matches_hugging_face_order(heads, kv_heads, hd, m):
    """QK-norm (Qwen3): per-head RMSNorm of q and k before half-split RoPE, in HF order; the program runs on
    pair-permuted weights and q/k norm weights, with V columns passed through."""
    d, eps = 24, 1e-6
    x, gamma = torch.randn(m, d, dtype=F64), torch.randn(d, dtype=F64)
    w_q, w_k, w_v = (torch.randn(h * hd, d, dtype=F64) for h in (heads, kv_heads, kv_heads))
    q_norm, k_norm = 1 + 0.3 * torch.randn(hd, dtype=F64), 1 + 0.3 * torch.randn(hd, dtype=F64)
    positions = torch.randperm(4 * m)[:m].float()
    h = rms_norm(x, gamma)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, hd, 2, dtype=F64) / hd)
    angle = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((angle.cos(), angle.cos()), -1), torch.cat((angle.sin(), angle.sin()), -1)

    def hf_norm_rope(t, n_heads, weight):
        t = t.view(m, n_heads, hd)
        t = t * torch.rsqrt(t.square().mean(-1, keepdim=True) + eps) * weight
        return (t * cos[:, None] + rotate_half(t) * sin[:, None]).reshape(m, -1)

    q_ref, k_ref, v_ref = hf_norm_rope(h @ w_q.T, heads, q_norm), hf_norm_rope(h @ w_k.T, kv_heads, k_norm), h @ w_v.T
    qkv_weight = torch.cat((pairs_from_half_split(w_q, hd), pairs_from_half_split(w_k, hd), w_v))
    q_pairs, k_pairs = (pairs_from_half_split(w[:, None], hd)[:, 0] for w in (q_norm, k_norm))
    zeros = torch.zeros(kv_heads * hd, dtype=F64)
    qk_norm_weight = torch.cat((q_pairs.repeat(heads), k_pairs.repeat(kv_heads), zeros))
    qk_passthrough = torch.cat((torch.zeros((heads + kv_heads) * hd, dtype=F64), zeros + 1))
    out = run(library.rms_qkv_rope(hd, eps), x * gamma, qkv_weight, rstd=rstd_of(x), positions=positions,
              frequencies=rope_frequencies(heads, kv_heads, hd), qk_norm_weight=qk_norm_weight,
              qk_passthrough=qk_passthrough)
    q, k, v = out["qkv"].split((heads * hd, kv_heads * hd, kv_heads * hd), -1)
    unpair = lambda t, n: t.view(m, n, hd // 2, 2).transpose(2, 3).reshape(m, -1)  # noqa: E731
    torch.testing.assert_close(unpair(q, heads), q_ref)
    torch.testing.assert_close(unpair(k, kv_heads), k_ref)
    torch.testing.assert_close(v, v_ref)
    torch.testing.assert_close(out["preact"], h @ qkv_weight.T)  # z before QK-norm and RoPE, saved for backward


def cross_entropy_targets(m, vocab):
    target = torch.randint(0, vocab, (m,))
    target[torch.rand(m) < 0.3] = -100
    target[0] = vocab - 1                      # the last column, in the ragged last tile
    return target


@pytest.mark.parametrize("softcap", [None, 8.0], ids=["uncapped", "softcap"])  # logits ~ N(0, 12^2)
@pytest.mark.parametrize("m, vocab", [(1, 50), (7, 50), (129, 37)])
def test_cross_entropy_forward_from_partial_logsumexp(m, vocab, softcap):
    d = 16
    x, gamma, w = torch.randn(m, d, dtype=F64), torch.randn(d, dtype=F64), 3 * torch.randn(vocab, d, dtype=F64)
    target = cross_entropy_targets(m, vocab)
    out = run(library.rms_lm_head_cross_entropy(softcap), x * gamma, w, rstd=rstd_of(x), target=target)
    assert out["partial_lse"].shape == (m, -(-vocab // 8))
    lse = finish.logsumexp_from_partials(out["partial_lse"])
    loss = torch.where(target != -100, lse - finish.sum_row_partials(out["partial_target"]), 0.0)
    logits = soft_capped(rms_norm(x, gamma) @ w.T, softcap)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
    torch.testing.assert_close(loss, F.cross_entropy(logits, target, ignore_index=-100, reduction="none"))


def norm_backward(dz, consumer_weight, x, gamma, partial_z_dz, grad_residual):
    """B2/B6 + weight and norm-weight gradients, as the ops layer chains them."""
    d = x.shape[1]
    mean_z_dz = finish.sum_row_partials(partial_z_dz) / d
    out = run(library.rms_norm_backward("add"), dz, consumer_weight, grad_residual=grad_residual, residual=x,
              rstd=rstd_of(x), norm_weight=gamma, mean_z_dz=mean_z_dz)
    grad_weight = run(library.weight_grad(), dz, out["normed"])["grad_weight"]
    torch.testing.assert_close(out["normed"], rms_norm(x, gamma))
    return out["grad_x"], finish.sum_col_partials(out["partial_grad_norm_weight"]), grad_weight


def leaves(m, d):
    x = torch.randn(m, d, dtype=F64, requires_grad=True)
    gamma = (1 + 0.1 * torch.randn(d, dtype=F64)).requires_grad_()
    return x, gamma, torch.randn(m, d, dtype=F64)


@pytest.mark.parametrize("activation", list(GATES))
@pytest.mark.parametrize("m, d", SHAPES)
def test_swiglu_backward_and_rmsnorm_backward_through_the_mlp(m, d, activation):
    ffn = 12
    x, gamma, grad_residual = leaves(m, d)
    w_gu = torch.randn(2 * ffn, d, dtype=F64, requires_grad=True)
    w_down = torch.randn(d, ffn, dtype=F64, requires_grad=True)
    grad_out = torch.randn(m, d, dtype=F64)
    z = rms_norm(x, gamma) @ w_gu.T
    y = (GATES[activation](z[:, 0::2]) * z[:, 1::2]) @ w_down.T
    ((y * grad_out).sum() + (x * grad_residual).sum()).backward()

    forward = run(library.rms_gate_up_swiglu(activation=activation), (x * gamma).detach(), w_gu.detach(),
                  rstd=rstd_of(x).detach())
    back = run(library.swiglu_backward(activation), grad_out, w_down.detach(), preact=forward["preact"])
    torch.testing.assert_close(back["act"], forward["out"])
    grad_w_down = run(library.weight_grad(), grad_out, back["act"])["grad_weight"]
    torch.testing.assert_close(grad_w_down, w_down.grad)
    grad_x, grad_gamma, grad_w_gu = norm_backward(back["grad_preact"], w_gu.detach(), x.detach(), gamma.detach(),
                                                  back["partial_z_dz"], grad_residual)
    torch.testing.assert_close(grad_x, x.grad)
    torch.testing.assert_close(grad_gamma, gamma.grad)
    torch.testing.assert_close(grad_w_gu, w_gu.grad)


@pytest.mark.parametrize("m, d", SHAPES)
def test_rope_backward_and_rmsnorm_backward_through_qkv(m, d):
    heads, kv_heads, hd = 2, 1, 8
    n = (heads + 2 * kv_heads) * hd
    x, gamma, grad_residual = leaves(m, d)
    w_qkv = torch.randn(n, d, dtype=F64, requires_grad=True)
    positions, freqs = torch.arange(m).float() + 5, rope_frequencies(heads, kv_heads, hd)
    grad_qkv = torch.randn(m, n, dtype=F64)
    theta = positions.double()[:, None] * freqs[None, :]
    qkv_ref = rope_ref(rms_norm(x, gamma) @ w_qkv.T, theta)
    ((qkv_ref * grad_qkv).sum() + (x * grad_residual).sum()).backward()

    qkv = run(library.rms_qkv_rope(), (x * gamma).detach(), w_qkv.detach(), rstd=rstd_of(x).detach(),
              positions=positions, frequencies=freqs)["qkv"]
    # B1 (elementwise): rotate the gradient back; rotations preserve dot products, so
    # sum(qkv * grad_qkv) == sum(z * dz) without the pre-RoPE z.
    grad_z = rope_ref(grad_qkv, -theta)
    z = rms_norm(x, gamma).detach() @ w_qkv.detach().T
    torch.testing.assert_close((qkv * grad_qkv).sum(1), (z * grad_z).sum(1))
    partial_z_dz = (qkv * grad_qkv).sum(1, keepdim=True)
    grad_x, grad_gamma, grad_w = norm_backward(grad_z, w_qkv.detach(), x.detach(), gamma.detach(), partial_z_dz,
                                               grad_residual)
    torch.testing.assert_close(grad_x, x.grad)
    torch.testing.assert_close(grad_gamma, gamma.grad)
    torch.testing.assert_close(grad_w, w_qkv.grad)


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["uncapped", "softcap"])  # logits ~ N(0, d) with d 24-40
@pytest.mark.parametrize("m, d", SHAPES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_backward_and_rmsnorm_backward_through_the_lm_head(m, d, reduction, softcap):
    """With a soft-cap the backward's ``grad_logits`` is the gradient of the GEMM's z (through the cap) and its
    statistic ``sum z dz``: the RMSNorm backward then gives autograd's gradients of the capped loss."""
    vocab = 45
    x, gamma, grad_residual = leaves(m, d)
    w = torch.randn(vocab, d, dtype=F64, requires_grad=True)
    target = cross_entropy_targets(m, vocab)
    grad_loss = torch.rand((), dtype=F64) + 0.5
    loss = F.cross_entropy(soft_capped(rms_norm(x, gamma) @ w.T, softcap), target, ignore_index=-100,
                           reduction=reduction)
    (loss * grad_loss + (x * grad_residual).sum()).backward()

    normed, rstd = (x * gamma).detach(), rstd_of(x).detach()
    fwd = run(library.rms_lm_head_cross_entropy(softcap), normed, w.detach(), rstd=rstd, target=target)
    valid = (target != -100).double()
    row_weight = valid / valid.sum().clamp(min=1) if reduction == "mean" else valid
    back = run(library.rms_lm_head_cross_entropy_backward(softcap), normed, w.detach(), rstd=rstd,
               lse=finish.logsumexp_from_partials(fwd["partial_lse"]), target=target, row_weight=row_weight,
               grad_scale=grad_loss.reshape(1))
    grad_x, grad_gamma, grad_w = norm_backward(back["grad_logits"], w.detach(), x.detach(), gamma.detach(),
                                               back["partial_z_dz"], grad_residual)
    torch.testing.assert_close(grad_x, x.grad)
    torch.testing.assert_close(grad_gamma, gamma.grad)
    torch.testing.assert_close(grad_w, w.grad)


def test_soft_capped_programs_are_named_apart_and_tuned_as_their_uncapped_twins():
    """A cap gives each LM-head program a name of its own (``_softcap``) and its uncapped twin as the tuning
    stand-in; without one the programs are those of no option at all."""
    uncapped = {"rms_linear": library.rms_linear, "rms_lm_head_cross_entropy": library.rms_lm_head_cross_entropy,
                "rms_lm_head_cross_entropy_backward": library.rms_lm_head_cross_entropy_backward}
    for name, factory in uncapped.items():
        assert factory(None) == factory() and factory().name == name and factory().tuning_stand_in is None
        capped = factory(30.0)
        assert capped.name == f"{name}_softcap" and capped.tuning_stand_in is factory()
        assert factory(30) == capped and factory(15.0) != capped  # the cap is part of the program
        assert set(capped.inputs) == set(factory().inputs)
    inference = library.rms_linear(30.0, save_preact=False)
    assert inference.name == "rms_linear_softcap_inference" and inference.tuning_stand_in is library.rms_linear()
    assert library.rms_linear(None, save_preact=False) == library.rms_linear()


@pytest.mark.parametrize("softcap", [0.0, -30.0, math.inf, math.nan, True, "30"])
def test_a_bad_softcap_is_refused(softcap):
    for factory in (library.rms_linear, library.rms_lm_head_cross_entropy, library.rms_lm_head_cross_entropy_backward):
        with pytest.raises(ProgramError, match=f"{factory.__name__}: softcap must be a positive finite float"):
            factory(softcap)


def test_qkv_program_with_a_bias():
    """Qwen2's bias: ``rope(z + bias)`` (the reference backend's math against float64), the plain program's tuned
    choices standing in; a bias with QK-norm is refused."""
    m, d, n = 5, 8, 12
    x, gamma, w, bias = (torch.randn(m, d, dtype=F64), torch.randn(d, dtype=F64), torch.randn(n, d, dtype=F64),
                         torch.randn(n, dtype=F64))
    positions, frequencies = torch.arange(m, dtype=F64), torch.rand(n // 2, dtype=F64)
    program = library.rms_qkv_rope(bias=True)
    assert program.name == "rms_qkv_rope_bias" and program.tuning_stand_in is library.rms_qkv_rope()
    out = run(program, x * gamma, w, rstd=rstd_of(x), bias=bias, positions=positions, frequencies=frequencies)
    want = rope_ref(rms_norm(x, gamma) @ w.T + bias, positions[:, None] * frequencies[None, :])
    torch.testing.assert_close(out["qkv"], want)
    with pytest.raises(ProgramError, match="rms_qkv_rope: bias together with QK-norm is not supported"):
        library.rms_qkv_rope(4, bias=True)


def test_rms_norm_backward_accumulates_in_place():
    m, d, n = 9, 16, 10
    x, gamma, grad_residual = leaves(m, d)
    dz, w = torch.randn(m, n, dtype=F64), torch.randn(n, d, dtype=F64)
    common = dict(residual=x.detach(), rstd=rstd_of(x).detach(), norm_weight=gamma.detach(),
                  mean_z_dz=torch.randn(m, dtype=F64))
    fresh = run(library.rms_norm_backward("add"), dz, w, grad_residual=grad_residual, **common)["grad_x"]
    in_place = grad_residual.clone()
    run(library.rms_norm_backward("accumulate"), dz, w, grad_residual=in_place, **common)
    torch.testing.assert_close(in_place, fresh)


def test_weight_grad_accumulates_and_input_grad_is_plain():
    dy, x = torch.randn(13, 6, dtype=F64), torch.randn(13, 4, dtype=F64)
    main_grad = torch.randn(6, 4, dtype=F64)
    expected = main_grad + dy.T @ x
    run(library.weight_grad(accumulate=True), dy, x, grad_weight=main_grad)
    torch.testing.assert_close(main_grad, expected)
    w = torch.randn(6, 4, dtype=F64)
    torch.testing.assert_close(run(library.input_grad(), dy, w)["grad_input"], dy @ w)
