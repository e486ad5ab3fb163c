"""Every public op refuses a bad tensor argument with an error naming it as the op's signature spells it.

Each op of ``codagen.ops.__all__`` that takes tensors is called with valid arguments and then with one
argument made wrong at a time: not a tensor, an integer (or too narrow an integer) dtype, float16 where the
op's reference argument is float32, one column too many, one dimension too many, another device (meta).
The error's subject (the name before its first colon) and any argument it is compared against
(``that of inp``, ``x.shape``, ``the shape of gate_weight``) must be parameters of the op called, and the
wrong argument must be one of them.
"""
from __future__ import annotations

import inspect
import re

import pytest
import torch

from codagen import ops
from codagen.ops import kernels

M, D, FFN, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 5, 16, 12, 20, 2, 1, 8
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM


def _normed_inputs() -> dict[str, torch.Tensor]:
    x = torch.randn(M, D)
    norm_weight = torch.rand(D) + 0.5
    normed, rstd = kernels.rms_norm_stats_ref(x, norm_weight, 1e-6)
    return dict(x=x, normed=normed, rstd=rstd, norm_weight=norm_weight)


def _qkv_inputs(qk_norm: bool) -> dict:
    args = dict(_normed_inputs(), qkv_weight=torch.randn(QKV, D), positions=torch.arange(M),
                frequencies=ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM))
    if qk_norm:
        args.update(q_norm_weight=torch.rand(HEAD_DIM) + 0.5, k_norm_weight=torch.rand(HEAD_DIM) + 0.5,
                    num_heads=HEADS)
    else:
        args.update(bias=torch.randn(QKV))
    return args


#: op name -> (the op, its valid keyword arguments)
OPS = {
    "rms_norm_stats": (ops.rms_norm_stats, lambda: dict(x=torch.randn(M, D), norm_weight=torch.rand(D) + 0.5,
                                                        eps=1e-6)),
    "out_proj_residual_rms": (ops.out_proj_residual_rms, lambda: dict(
        inp=torch.randn(M, FFN), weight=torch.randn(D, FFN), residual=torch.randn(M, D),
        norm_weight=torch.rand(D) + 0.5, eps=1e-6)),
    "linear_post_norm_residual_rms": (ops.linear_post_norm_residual_rms, lambda: dict(
        inp=torch.randn(M, FFN), weight=torch.randn(D, FFN), residual=torch.randn(M, D),
        post_norm_weight=torch.rand(D) + 0.5, norm_weight=torch.rand(D) + 0.5, eps=1e-6)),
    "linear_post_norm_residual_rms_last": (ops.linear_post_norm_residual_rms, lambda: dict(  # no norm next
        inp=torch.randn(M, FFN), weight=torch.randn(D, FFN), residual=torch.randn(M, D),
        post_norm_weight=torch.rand(D) + 0.5, norm_weight=None, eps=1e-6)),
    "rms_qkv_rope": (ops.rms_qkv_rope, lambda: _qkv_inputs(False)),
    "qkv_norm_rope": (ops.qkv_norm_rope, lambda: dict(
        x=torch.randn(M, D), qkv_weight=torch.randn(QKV, D), positions=torch.arange(M),
        frequencies=ops.rope_frequencies(HEADS, KV_HEADS, HEAD_DIM), q_norm_weight=torch.rand(HEADS * HEAD_DIM) + 0.5,
        k_norm_weight=torch.rand(KV_HEADS * HEAD_DIM) + 0.5, eps=1e-6)),
    "gate_up_swiglu": (ops.gate_up_swiglu, lambda: dict(x=torch.randn(M, D), gate_up_weight=torch.randn(2 * FFN, D))),
    "rms_qkv_rope_qk_norm": (ops.rms_qkv_rope, lambda: _qkv_inputs(True)),
    "rms_gate_up_swiglu": (ops.rms_gate_up_swiglu, lambda: dict(_normed_inputs(),
                                                                gate_up_weight=torch.randn(2 * FFN, D))),
    "swiglu_mlp_residual_rms": (ops.swiglu_mlp_residual_rms, lambda: dict(
        _normed_inputs(), gate_up_weight=torch.randn(2 * FFN, D), down_weight=torch.randn(D, FFN),
        next_norm_weight=torch.rand(D) + 0.5, eps=1e-6)),
    "rms_linear": (ops.rms_linear, lambda: dict(_normed_inputs(), weight=torch.randn(VOCAB, D))),
    "rms_lm_head_cross_entropy": (ops.rms_lm_head_cross_entropy, lambda: dict(
        _normed_inputs(), lm_head_weight=torch.randn(VOCAB, D), target=torch.randint(0, VOCAB, (M,)))),
    "embedding": (ops.embedding, lambda: dict(ids=torch.randint(0, VOCAB, (2, 3)), weight=torch.randn(VOCAB, D))),
    "fp8_linear": (ops.fp8_linear, lambda: dict(x=torch.randn(M, D), weight=torch.randn(FFN, D))),
    "interleave_gate_up": (ops.interleave_gate_up, lambda: dict(gate_weight=torch.randn(FFN, D),
                                                                up_weight=torch.randn(FFN, D))),
    "split_gate_up": (ops.split_gate_up, lambda: dict(gate_up_weight=torch.randn(2 * FFN, D))),
    "rope_pairs_from_half_split": (ops.rope_pairs_from_half_split, lambda: dict(weight=torch.randn(QKV, D),
                                                                                head_dim=HEAD_DIM)),
    "rope_half_split_from_pairs": (ops.rope_half_split_from_pairs, lambda: dict(weight=torch.randn(QKV, D),
                                                                                head_dim=HEAD_DIM)),
    "rope_frequencies": (ops.rope_frequencies, lambda: dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                                            inv_freq=torch.rand(HEAD_DIM // 2))),
}


def _float16(t):  # a float dtype other than the reference argument's float32
    return t.half() if t.dtype.is_floating_point else None


def _narrow_dtype(t):
    return t.to(torch.int16) if not t.dtype.is_floating_point else t.to(torch.int32)


def _extra_column(t):
    return torch.cat((t, t[..., :1]), dim=-1)


MUTATIONS = {
    "not_a_tensor": lambda t: t.tolist(),
    "dtype": _narrow_dtype,
    "float16": _float16,
    "extra_column": _extra_column,
    "extra_dim": lambda t: t[None],
    "device": lambda t: t.to("meta"),
}

#: (op, argument, mutation) the op accepts: a result, not an error
VALID = {
    # vectors need not share the activations' float dtype; an op that copies or permutes takes any dtype
    *((op, arg, "float16") for op in OPS for arg in ("norm_weight", "next_norm_weight", "post_norm_weight",
                                                      "q_norm_weight", "k_norm_weight", "inv_freq", "bias")),
    *(("split_gate_up", "gate_up_weight", m) for m in ("dtype", "float16", "extra_column", "extra_dim", "device")),
    *((op, "weight", m) for op in ("rope_pairs_from_half_split", "rope_half_split_from_pairs")
      for m in ("dtype", "float16", "extra_column", "extra_dim", "device")),
    *(("rope_frequencies", "inv_freq", m) for m in ("dtype", "device")),
    *((op, arg, "float16") for op, arg in (("rms_norm_stats", "x"), ("embedding", "weight"))),  # no other matrix
    *(("embedding", "ids", m) for m in ("extra_column", "extra_dim")),  # ids of any shape
    ("embedding", "weight", "extra_column"),  # a wider table
    ("rms_qkv_rope", "positions", "float16"),  # positions may be float
    ("rms_qkv_rope_qk_norm", "positions", "float16"),
    ("qkv_norm_rope", "positions", "float16"),
}


def _cases():
    for op, (_, make) in OPS.items():
        for arg, value in make().items():
            if not isinstance(value, torch.Tensor):
                continue
            for mutation, mutate in MUTATIONS.items():
                if (op, arg, mutation) in VALID or mutate(value) is None:
                    continue
                yield pytest.param(op, arg, mutation, id=f"{op}-{arg}-{mutation}")


def _named(message: str) -> tuple[str, set[str], set[str]]:
    """(the error's subject, the arguments it compares against: ``that of x``, ``x.shape``, ``the shape of x``,
    the words before ``features`` in a shape, ``[x features]``, which may be arguments)."""
    subject = message.split(":", 1)[0].strip()
    body = message.split(":", 1)[1] if ":" in message else ""
    compared = set(re.findall(r"\b(?:that|shape) of (\w+)", body)) | set(re.findall(r"\b(\w+)\.shape\b", body))
    return subject, compared, set(re.findall(r"\b(\w+) features\b", body))


def test_every_public_op_with_tensors_is_swept():
    public = {name for name in ops.__all__ if callable(getattr(ops, name)) and name != "LowRank"}
    assert public == {fn.__name__ for fn, _ in OPS.values()}


@pytest.mark.parametrize("op, arg, mutation", list(_cases()))
def test_a_bad_tensor_argument_is_named(op, arg, mutation):
    fn, make = OPS[op]
    params = set(inspect.signature(fn).parameters)
    args = make()
    fn(**make())  # the valid call runs
    args[arg] = MUTATIONS[mutation](args[arg])
    with torch.no_grad(), pytest.raises((TypeError, ValueError)) as raised:
        fn(**args)
    subject, compared, features_of = _named(str(raised.value))
    assert subject in params, f"{op}: the error's subject {subject!r} is not an argument: {raised.value}"
    assert compared <= params, f"{op}: the error refers to {compared - params}, not arguments: {raised.value}"
    assert arg in {subject} | compared | features_of, f"{op}: {arg} ({mutation}) is not named: {raised.value}"


#: (op, its low-rank argument, the update's in and out features)
LOW_RANK = [("out_proj_residual_rms", "low_rank", FFN, D), ("linear_post_norm_residual_rms", "low_rank", FFN, D),
            ("rms_qkv_rope", "low_rank", D, QKV), ("qkv_norm_rope", "low_rank", D, QKV),
            ("gate_up_swiglu", "low_rank", D, 2 * FFN),
            ("rms_gate_up_swiglu", "low_rank", D, 2 * FFN), ("swiglu_mlp_residual_rms", "gate_up_low_rank", D, 2 * FFN),
            ("swiglu_mlp_residual_rms", "down_low_rank", FFN, D)]


@pytest.mark.parametrize("field", ["a", "b"])
@pytest.mark.parametrize("mutation", ["not_a_tensor", "float16", "extra_column", "device"])
@pytest.mark.parametrize("op, arg, fan_in, fan_out", LOW_RANK, ids=[f"{op}-{arg}" for op, arg, *_ in LOW_RANK])
def test_a_bad_low_rank_factor_is_named(op, arg, fan_in, fan_out, mutation, field):
    """``low_rank.a`` / ``.b``, compared against an argument of the op called."""
    fn, make = OPS[op]
    factors = dict(a=torch.randn(4, fan_in), b=torch.randn(fan_out, 4))
    fn(**make(), **{arg: ops.LowRank(**factors, scale=0.5)})  # the valid call runs
    factors[field] = MUTATIONS[mutation](factors[field])
    with torch.no_grad(), pytest.raises((TypeError, ValueError)) as raised:
        fn(**make(), **{arg: ops.LowRank(**factors, scale=0.5)})
    subject, compared, _ = _named(str(raised.value))
    assert subject == f"{arg}.{field}", raised.value
    assert compared <= set(inspect.signature(fn).parameters), raised.value


@pytest.mark.parametrize("grad", [True, False], ids=["training", "no_grad"])
@pytest.mark.parametrize("activation, error", [("gelu", ValueError), ("GELU_TANH", ValueError), ("swiglu", ValueError),
                                               (None, TypeError), (1, TypeError)])
@pytest.mark.parametrize("op", ["rms_gate_up_swiglu", "swiglu_mlp_residual_rms"])
def test_a_bad_activation_is_named_with_the_allowed_values(op, activation, error, grad):
    """``activation`` is checked before anything runs, in training and under ``no_grad`` alike."""
    fn, make = OPS[op]
    for valid in ("silu", "gelu_tanh"):
        fn(**make(), activation=valid)
    with torch.set_grad_enabled(grad), pytest.raises(error) as raised:
        fn(**make(), activation=activation)
    assert str(raised.value) == f"activation: expected 'silu' or 'gelu_tanh', got {activation!r}"
    assert "activation" in inspect.signature(fn).parameters


def test_out_proj_residual_rms_names_a_residual_of_another_dtype():
    args = OPS["out_proj_residual_rms"][1]()
    with pytest.raises(ValueError, match=r"^residual: expected dtype torch.float32 \(that of inp\), got torch.float16"):
        ops.out_proj_residual_rms(**dict(args, residual=args["residual"].half()))
    with pytest.raises(ValueError, match=r"^weight: expected device cpu \(that of inp\), got meta"):
        ops.out_proj_residual_rms(**dict(args, weight=args["weight"].to("meta")))


# --------------------------------------------------------------------------------------------------
# the LM head's softcap: None or a positive finite float (Gemma 2's final_logit_softcapping)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("softcap, error", [
    (0.0, ValueError), (-30.0, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
    ("30", TypeError), (True, TypeError), (torch.tensor(30.0), TypeError)], ids=repr)
@pytest.mark.parametrize("op", ["rms_linear", "rms_lm_head_cross_entropy"])
def test_a_bad_softcap_is_named(op, softcap, error):
    """Refused before any GEMM runs, with or without gradients; a positive int or float is taken."""
    fn, make = OPS[op]
    for valid in (30.0, 30, None):
        fn(**make(), softcap=valid)
    message = rf"^softcap: expected None or a positive finite float, got {re.escape(repr(softcap))}$"
    for grad in (False, True):
        args = make()
        args["x"].requires_grad_(grad)
        with pytest.raises(error, match=message):
            fn(**args, softcap=softcap)


# --------------------------------------------------------------------------------------------------
# embedding's padding_idx: None or an int in [-vocab, vocab), as F.embedding takes it
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("padding_idx", [None, 0, 3, VOCAB - 1, -1, -VOCAB])
def test_embedding_padding_idx_as_torch_takes_it(padding_idx):
    ids = torch.tensor([[0, 3, VOCAB - 1], [1, 3, 0]])
    weight = torch.randn(VOCAB, D, dtype=torch.float64, requires_grad=True)
    want_weight = weight.detach().clone().requires_grad_()
    out = ops.embedding(ids, weight, padding_idx)
    want = torch.nn.functional.embedding(ids, want_weight, padding_idx)
    torch.testing.assert_close(out, want)
    grad = torch.randn_like(out)
    out.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(weight.grad, want_weight.grad)


@pytest.mark.parametrize("padding_idx, error, match", [
    ("0", TypeError, r"padding_idx: expected None or an int, got '0'"),
    (2.0, TypeError, r"padding_idx: expected None or an int, got 2.0"),
    (True, TypeError, r"padding_idx: expected None or an int, got True"),
    (torch.tensor(1), TypeError, r"padding_idx: expected None or an int, got tensor\(1\)"),
    (VOCAB, ValueError, rf"padding_idx: expected an index in \[-{VOCAB}, {VOCAB}\), got {VOCAB}"),
    (-VOCAB - 1, ValueError, rf"padding_idx: expected an index in \[-{VOCAB}, {VOCAB}\), got {-VOCAB - 1}"),
])
def test_embedding_refuses_a_bad_padding_idx(padding_idx, error, match):
    ids, weight = torch.tensor([0, 1]), torch.randn(VOCAB, D, requires_grad=True)
    with pytest.raises(error, match=match):
        ops.embedding(ids, weight, padding_idx)
