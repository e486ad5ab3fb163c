"""Every ``codagen::`` custom op passes ``torch.library.opcheck`` (schema, fake, AOT dispatch) on the
arguments the public ops really pass it: one forward and backward of each public op, recorded."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from codagen import ops
from codagen.backends import use_backend
from codagen.ops import LowRank

M, D, HEADS, KV_HEADS, HD, FFN, VOCAB = 6, 16, 2, 1, 8, 16, 24
QKV = (HEADS + 2 * KV_HEADS) * HD


def codagen_ops() -> list[str]:
    return sorted(name for name in dir(torch.ops.codagen)
                  if isinstance(getattr(torch.ops.codagen, name), torch._ops.OpOverloadPacket))


class _Recorder(TorchDispatchMode):
    """The first call of each ``codagen::`` op, its arguments detached and cloned."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "codagen" and func.name() not in self.calls:
            def copy(a):
                if isinstance(a, torch.Tensor):
                    return a.detach().clone()
                return [copy(t) for t in a] if isinstance(a, (list, tuple)) else a
            self.calls[func.__name__.split(".")[0]] = (func, copy(args), copy(kwargs))
        return func(*args, **kwargs)


def _leaf(*shape, scale=1.0):
    return (scale * torch.randn(*shape, dtype=torch.float64)).requires_grad_()


def _every_public_op():
    """One forward and backward through each public op (LoRA on the GEMM ops, so their optional
    low-rank arguments are tensors; the MLP ops with either activation, so their string argument takes both; the
    FP8 linear in fp32, the widest dtype it takes)."""
    x, gamma = _leaf(M, D), _leaf(D)
    lora = lambda n, k: LowRank(_leaf(2, k, scale=0.3), _leaf(n, 2, scale=0.3), 0.5)  # noqa: E731
    positions, freqs = torch.arange(M).double(), ops.rope_frequencies(HEADS, KV_HEADS, HD).double()
    normed, rstd = ops.rms_norm_stats(x, gamma, 1e-6)
    q, k, v, residual = ops.rms_qkv_rope(x, normed, rstd, gamma, _leaf(QKV, D, scale=0.2), positions, freqs,
                                         split_sizes=(HEADS * HD, KV_HEADS * HD, KV_HEADS * HD), pass_residual=True,
                                         low_rank=lora(QKV, D), bias=_leaf(QKV))
    qk = ops.rms_qkv_rope(x, normed, rstd, gamma, _leaf(QKV, D, scale=0.2), positions, freqs, _leaf(HD), _leaf(HD),
                          num_heads=HEADS)
    h, normed, rstd = ops.out_proj_residual_rms(q.contiguous(), _leaf(D, HEADS * HD, scale=0.2), residual, gamma, 1e-6,
                                                low_rank=lora(D, HEADS * HD))
    post_normed, *_ = ops.linear_post_norm_residual_rms(q.contiguous(), _leaf(D, HEADS * HD, scale=0.2), residual,
                                                        _leaf(D), gamma, 1e-6, low_rank=lora(D, HEADS * HD))
    act = ops.rms_gate_up_swiglu(h, normed, rstd, gamma, _leaf(2 * FFN, D, scale=0.2))
    # OLMo 2's block: no norm before the QKV and gate/up GEMMs, QK-norm over the projections, no norm after
    olmo_q, olmo_k, olmo_v = ops.qkv_norm_rope(x, _leaf(QKV, D, scale=0.2), positions, freqs, _leaf(HEADS * HD),
                                               _leaf(KV_HEADS * HD), 1e-6, split_sizes=(HEADS * HD, KV_HEADS * HD,
                                                                                       KV_HEADS * HD),
                                               low_rank=lora(QKV, D))
    olmo_x, *_ = ops.linear_post_norm_residual_rms(olmo_q.contiguous(), _leaf(D, HEADS * HD, scale=0.2), x, _leaf(D),
                                                   None, 1e-6)
    olmo_act = ops.gate_up_swiglu(olmo_x, _leaf(2 * FFN, D, scale=0.2), low_rank=lora(2 * FFN, D))
    h, normed, rstd = ops.swiglu_mlp_residual_rms(h, normed, rstd, gamma, _leaf(2 * FFN, D, scale=0.2),
                                                  _leaf(D, FFN, scale=0.2), gamma, 1e-6,
                                                  down_low_rank=lora(D, FFN), activation="gelu_tanh")
    head = _leaf(VOCAB, D, scale=0.2)
    logits = ops.rms_linear(h, normed, rstd, gamma, head)
    capped = ops.rms_linear(h, normed, rstd, gamma, head, softcap=2.0)
    loss = ops.rms_lm_head_cross_entropy(h, normed, rstd, gamma, head, torch.randint(0, VOCAB, (M,)))
    with torch.no_grad():  # the forwards without the tensors backward would need
        eval_loss = ops.rms_lm_head_cross_entropy(h, normed, rstd, gamma, head, torch.randint(0, VOCAB, (M,)))
        ops.rms_gate_up_swiglu(h, normed, rstd, gamma, _leaf(2 * FFN, D, scale=0.2), low_rank=lora(2 * FFN, D),
                               activation="gelu_tanh")
        ops.rms_qkv_rope(x, normed, rstd, gamma, _leaf(QKV, D, scale=0.2), positions, freqs, _leaf(HD), _leaf(HD),
                         num_heads=HEADS)
        ops.qkv_norm_rope(x, _leaf(QKV, D, scale=0.2), positions, freqs, _leaf(HEADS * HD), _leaf(KV_HEADS * HD), 1e-6)
        ops.gate_up_swiglu(x, _leaf(2 * FFN, D, scale=0.2), activation="gelu_tanh")
    embedded = ops.embedding(torch.randint(0, VOCAB, (M,)), _leaf(VOCAB, D), padding_idx=0)
    fp8 = ops.fp8_linear(_leaf(M, D).float().detach().requires_grad_(), _leaf(FFN, D).float().detach().requires_grad_())
    fp8_block = _fp8_block()
    total = (loss + eval_loss + logits.sum() + capped.sum() + act.sum() + qk.sum() + k.sum() + v.sum()
             + embedded.sum() + post_normed.sum() + olmo_k.sum() + olmo_v.sum() + olmo_act.sum() + fp8.double().sum()
             + fp8_block.double())
    total.backward()


def _fp8_block():
    """The block ops with ``fp8=True``, in bf16 at a width of whole 128-column groups, so that the producers hand on
    ``normed`` in e4m3 and the consumers take it (with QK-norm, and without autograd too); the block's loss."""
    d = 128

    def bf16(*shape, scale=1.0):
        return _leaf(*shape, scale=scale).to(torch.bfloat16).detach().requires_grad_()
    x, gamma = bf16(M, d), bf16(d)
    positions, freqs = torch.arange(M).float(), ops.rope_frequencies(HEADS, KV_HEADS, HD)
    normed, rstd = ops.rms_norm_stats(x, gamma, 1e-6)
    q, k, v, residual = ops.rms_qkv_rope(x, normed, rstd, gamma, bf16(QKV, d, scale=0.1), positions, freqs,
                                         split_sizes=(HEADS * HD, KV_HEADS * HD, KV_HEADS * HD), pass_residual=True,
                                         fp8=True)
    h, normed, rstd = ops.out_proj_residual_rms(q.contiguous(), bf16(d, HEADS * HD, scale=0.2), residual, gamma, 1e-6,
                                                fp8=True)
    qk = ops.rms_qkv_rope(h, normed, rstd, gamma, bf16(QKV, d, scale=0.1), positions, freqs, bf16(HD), bf16(HD),
                          num_heads=HEADS, fp8=True)
    out, *_ = ops.swiglu_mlp_residual_rms(h, normed, rstd, gamma, bf16(2 * FFN, d, scale=0.1),
                                          bf16(d, FFN, scale=0.2), gamma, 1e-6, fp8=True)
    with torch.no_grad():
        ops.swiglu_mlp_residual_rms(h, normed, rstd, gamma, bf16(2 * FFN, d, scale=0.1), bf16(d, FFN, scale=0.2),
                                    gamma, 1e-6, fp8=True)
        ops.rms_qkv_rope(h, normed, rstd, gamma, bf16(QKV, d, scale=0.1), positions, freqs, bf16(HD), bf16(HD),
                         num_heads=HEADS, fp8=True)
    return out.float().sum() + qk.float().sum() + k.float().sum() + v.float().sum()


@pytest.fixture(scope="module")
def recorded_calls():
    recorder = _Recorder()
    with use_backend("reference"), recorder:
        _every_public_op()
    return recorder.calls


def test_every_codagen_op_is_exercised(recorded_calls):
    assert sorted(recorded_calls) == codagen_ops()


@pytest.mark.parametrize("name", codagen_ops())
def test_opcheck(recorded_calls, name):
    op, args, kwargs = recorded_calls[name]
    torch.library.opcheck(op, args, kwargs)
