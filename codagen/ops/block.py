"""The fused ops of a CODA-reparameterized LLaMA block (everything but attention and the LM-head loss).

Every activation is a contiguous 2-D matrix ``[tokens, features]``. RMSNorm is split around the GEMMs
(docs/method.md section 2): the producer of the residual stream ``x`` returns ``(x, normed = x * gamma, rstd)``
with ``rstd = rsqrt(mean(x^2) + eps)``; ``normed`` and ``rstd`` are non-differentiable. The single
consumer of that norm takes ``(x, normed, rstd, norm_weight)``, multiplies its accumulator by ``rstd``
and, in backward, computes the whole RMSNorm backward for ``x`` and ``norm_weight`` with the row
statistic ``mean_z_dz = sum_k z dz / d`` taken from its own output side (docs/method.md section 3).

Layering: each public function validates its arguments, then calls a ``torch.autograd.Function`` whose
forward and backward are ``torch.library`` custom ops (``codagen::...``) with fake implementations, so
``torch.compile(fullgraph=True)`` sees one opaque node per fused step. The custom ops run library
programs through :func:`codagen.backends.execute` (reference or Triton backend) and finish the
partial reductions inside, so their outputs have static shapes.
"""
from __future__ import annotations

import torch
from torch import Tensor

from codagen.backends import execute
from codagen.epilogue import library

from . import _checks as check
from . import kernels
from ._inductor import register_fake
from ._checks import stats_dtype
from .layouts import kv_heads_of
from .low_rank import LowRank

__all__ = ["rms_norm_stats", "out_proj_residual_rms", "rms_qkv_rope", "rms_gate_up_swiglu",
           "swiglu_mlp_residual_rms", "rms_linear"]


def _stats(x: Tensor, length: int) -> Tensor:
    return x.new_empty(length, dtype=stats_dtype(x.dtype))


# --- the low-rank pair (LoRA, codagen.ops.low_rank) ------------------------------------------------
# Custom ops cannot return None: a gradient that is not computed (a frozen weight's, an absent
# adapter's) comes back as an empty tensor, and the autograd Function hands autograd None instead.
def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    return like.new_empty(0) if t is None else t


def _fake_grad(t: Tensor | None, wanted: bool, like: Tensor) -> Tensor:
    return torch.empty_like(t) if wanted and t is not None else like.new_empty(0)


def _run(program, a: Tensor, b: Tensor, a2: Tensor | None, b2: Tensor | None,
         **tensors: Tensor) -> dict[str, Tensor]:
    """``execute(program, ...)``, with the GEMM's low-rank operand pair ``(a2, b2)`` when ``a2`` is given."""
    if a2 is None:
        return execute(program, a, b, **tensors)
    return execute(program.with_low_rank(), a, b, a2=a2, b2=b2, **tensors)


def _low_rank_operand(inp: Tensor, lora_a: Tensor | None, scale: float) -> Tensor | None:
    """``u = scale * inp @ a^T`` [M, r], the A2 operand of the forward GEMM's low-rank pair (B2 is ``b``)."""
    if lora_a is None:
        return None
    u = inp @ lora_a.t()
    return u if scale == 1.0 else u.mul_(scale)


def _low_rank_grads(grad: Tensor, inp: Tensor, u: Tensor, grad_b_u: Tensor,
                    row_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(grad_a, grad_b)`` of ``out = row_scale * (... + u @ b^T)`` with ``u = scale * inp' @ a^T``:
    ``grad_b = grad^T @ (row_scale * u)`` and ``grad_a = grad_b_u^T @ inp``, where ``grad_b_u = scale *
    grad @ b`` (the backward GEMM's A2 operand) and ``inp = row_scale * inp'`` (a consumer GEMM's
    normalized input ``n``, which includes rstd; a producer's own input with ``row_scale`` None)."""
    if row_scale is not None:
        u = (u * row_scale[:, None]).to(u.dtype)
    return grad_b_u.t() @ inp, grad.t() @ u


def _low_rank_grad_operand(grad: Tensor, lora_b: Tensor | None, scale: float) -> Tensor | None:
    """``scale * grad @ b`` [M, r]: the A2 operand of the input-gradient GEMM (its B2 is ``a``, "kn")."""
    if lora_b is None:
        return None
    g = grad @ lora_b
    return g if scale == 1.0 else g.mul_(scale)


def _lora_args(low_rank: LowRank | None) -> tuple[Tensor | None, Tensor | None, float]:
    return (None, None, 1.0) if low_rank is None else (low_rank.a, low_rank.b, float(low_rank.scale))


def consumer_rms_norm_backward(grad_z: Tensor, weight: Tensor, x: Tensor, rstd: Tensor, norm_weight: Tensor,
                               mean_z_dz: Tensor, grad_residual: Tensor | None = None, *, weight_grad: bool = True,
                               input_grad: bool = True, lora_a: Tensor | None = None, lora_b: Tensor | None = None,
                               lora_u: Tensor | None = None, lora_scale: float = 1.0):
    """B2/B6 + B3/B7: the RMSNorm backward of a consumer GEMM ``z = rstd * ((x * gamma) @ W^T)``.

    One GEMM ``G = grad_z @ W`` whose epilogue writes ``grad_x = [grad_residual +] rstd * (gamma * G - c * mean_z_dz)``
    (``c = x * rstd``), the normalized activation ``n = c * gamma`` and per-tile partials of ``G * c``;
    then the plain GEMM ``grad_W = grad_z^T @ n`` (only with ``weight_grad``) and the finishing sum
    ``grad_gamma = sum_tiles(partials)``.

    With a low-rank update (``lora_a`` [r, d], ``lora_b`` [N, r], ``lora_u = scale * normed @ a^T`` saved
    by the forward) the effective weight is ``W + scale * b @ a``: the GEMM carries the pair
    ``(scale * grad_z @ b, a)``, so ``G`` and everything in the epilogue include the update, and
    ``grad_a``, ``grad_b`` come from ``n`` and ``rstd * u`` (:func:`_low_rank_grads`).

    Without ``input_grad`` (neither ``x`` nor the norm weight needs a gradient: the first block of a model
    with frozen embeddings and norms) and without ``weight_grad`` no GEMM over ``W`` runs: the low-rank
    gradients need only ``grad_a = ((g_b * rstd)^T @ x) * gamma``, which equals ``g_b^T @ n``.
    Returns ``(grad_x, grad_norm_weight, grad_weight, grad_lora_a, grad_lora_b)``, None where not computed.
    """
    if not (input_grad or weight_grad):
        if lora_a is None:
            return None, None, None, None, None
        grad_b_u = _low_rank_grad_operand(grad_z, lora_b, lora_scale)
        grad_lora_a = ((grad_b_u * rstd[:, None]).to(x.dtype).t() @ x) * norm_weight.to(x.dtype)
        grad_lora_b = _low_rank_grads(grad_z, x, lora_u, grad_b_u, rstd)[1]
        return None, None, None, grad_lora_a, grad_lora_b
    tensors = dict(residual=x, rstd=rstd, norm_weight=norm_weight, mean_z_dz=mean_z_dz)
    if grad_residual is None:
        program = library.rms_norm_backward("none")
    else:
        program = library.rms_norm_backward("add")
        tensors["grad_residual"] = grad_residual
    grad_b_u = _low_rank_grad_operand(grad_z, lora_b, lora_scale)
    out = _run(program, grad_z, weight, grad_b_u, lora_a, **tensors)
    grad_norm_weight = kernels.finish_col_sum(out.pop("partial_grad_norm_weight"), norm_weight.dtype)
    n = out.pop("normed")
    grad_weight = execute(library.weight_grad(), grad_z, n)["grad_weight"] if weight_grad else None
    grad_lora_a = grad_lora_b = None
    if lora_a is not None:
        grad_lora_a, grad_lora_b = _low_rank_grads(grad_z, n, lora_u, grad_b_u, rstd)
    return out["grad_x"], grad_norm_weight, grad_weight, grad_lora_a, grad_lora_b


# ==================================================================================================
# rms_norm_stats: the first block's norm (no producer GEMM)
# ==================================================================================================
@torch.library.custom_op("codagen::rms_norm_stats", mutates_args=())
def _rms_norm_stats_op(x: Tensor, norm_weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return kernels.rms_norm_stats(x, norm_weight, eps)


@register_fake(_rms_norm_stats_op)
def _(x, norm_weight, eps):
    return torch.empty_like(x), _stats(x, x.shape[0])


def rms_norm_stats(x: Tensor, norm_weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """RMSNorm statistics without a GEMM: ``normed = x * norm_weight`` and ``rstd = rsqrt(mean(x^2) + eps)``.

    For the first block, whose residual stream (the embeddings) no fused GEMM produces. Both outputs
    are non-differentiable: the norm's consumer op owns its backward. ``rstd`` is float32 [M]
    (float64 for float64 ``x``).
    """
    x = check.activation("x", x)
    norm_weight = check.vector("norm_weight", norm_weight, x.shape[1], "[features]", x)
    eps = check.eps(eps)
    return _rms_norm_stats_op(x.detach(), norm_weight.detach(), eps)


# ==================================================================================================
# F1/F3: out-projection + residual + RMSNorm statistics
# ==================================================================================================
@torch.library.custom_op("codagen::out_proj_residual_rms", mutates_args=())
def _out_proj_residual_rms_op(inp: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                              lora_u: Tensor | None, lora_b: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    out = _run(library.residual_rms_stats(), inp, weight, lora_u, lora_b, residual=residual, norm_weight=norm_weight)
    rstd = kernels.finish_rstd(out["partial_sumsq"], residual.shape[1], eps)
    return out["residual_out"], out["normed"], rstd


@register_fake(_out_proj_residual_rms_op)
def _(inp, weight, residual, norm_weight, eps, lora_u, lora_b):
    return torch.empty_like(residual), torch.empty_like(residual), _stats(residual, residual.shape[0])


@torch.library.custom_op("codagen::linear_backward", mutates_args=())
def _linear_backward_op(grad_out: Tensor, inp: Tensor, weight: Tensor, weight_grad: bool, input_grad: bool,
                        lora_a: Tensor | None, lora_b: Tensor | None, lora_u: Tensor | None,
                        lora_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """B8 + B9: ``grad_inp = grad_out @ W_eff`` (with ``input_grad``), ``grad_W = grad_out^T @ inp`` (with
    ``weight_grad``) and the low-rank update's ``(grad_a, grad_b)`` (empty tensors where not computed)."""
    grad_b_u = _low_rank_grad_operand(grad_out, lora_b, lora_scale)
    grad_inp = _run(library.input_grad(), grad_out, weight, grad_b_u, lora_a)["grad_input"] if input_grad else None
    grad_weight = execute(library.weight_grad(), grad_out, inp)["grad_weight"] if weight_grad else None
    grad_lora_a = grad_lora_b = None
    if lora_a is not None:
        grad_lora_a, grad_lora_b = _low_rank_grads(grad_out, inp, lora_u, grad_b_u)
    return (_or_empty(grad_inp, inp), _or_empty(grad_weight, inp), _or_empty(grad_lora_a, inp),
            _or_empty(grad_lora_b, inp))


@register_fake(_linear_backward_op)
def _(grad_out, inp, weight, weight_grad, input_grad, lora_a, lora_b, lora_u, lora_scale):
    return (_fake_grad(inp, input_grad, inp), _fake_grad(weight, weight_grad, inp), _fake_grad(lora_a, True, inp),
            _fake_grad(lora_b, True, inp))


def _linear_backward(ctx, grad: Tensor, inp: Tensor, weight: Tensor, weight_index: int, lora: tuple):
    """``_linear_backward_op`` with the gradients nobody needs skipped (``ctx.needs_input_grad``: a frozen
    weight's, or the input's when it comes from frozen layers); returns ``(grad_inp, grad_weight,
    grad_lora_a, grad_lora_b)`` with None for what is not computed."""
    lora_a, lora_b, lora_u, lora_scale = lora
    weight_grad, input_grad = ctx.needs_input_grad[weight_index], ctx.needs_input_grad[0]
    grad_inp, grad_weight, grad_lora_a, grad_lora_b = _linear_backward_op(
        grad, inp, weight, weight_grad, input_grad, lora_a, lora_b, lora_u, lora_scale)
    present = lora_a is not None
    return (grad_inp if input_grad else None, grad_weight if weight_grad else None, grad_lora_a if present else None,
            grad_lora_b if present else None)


class _OutProjResidualRms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, residual, norm_weight, eps, lora_a, lora_b, lora_scale):
        lora_u = _low_rank_operand(inp, lora_a, lora_scale)
        residual_out, normed, rstd = _out_proj_residual_rms_op(inp, weight, residual, norm_weight, eps, lora_u,
                                                               lora_b)
        ctx.save_for_backward(inp, weight, lora_a, lora_b, lora_u)
        ctx.lora_scale = lora_scale
        ctx.mark_non_differentiable(normed, rstd)
        ctx.set_materialize_grads(False)
        return residual_out, normed, rstd

    @staticmethod
    def backward(ctx, grad_residual_out, _grad_normed, _grad_rstd):
        if grad_residual_out is None:
            return (None,) * 8
        inp, weight, lora_a, lora_b, lora_u = ctx.saved_tensors
        grad = grad_residual_out.contiguous()
        grad_inp, grad_weight, grad_lora_a, grad_lora_b = _linear_backward(
            ctx, grad, inp, weight, 1, (lora_a, lora_b, lora_u, ctx.lora_scale))
        # residual_out = inp @ W^T + residual: the residual's gradient passes through unchanged; the
        # norm weight's gradient belongs to the norm's consumer (ownership rule).
        return grad_inp, grad_weight, grad, None, None, grad_lora_a, grad_lora_b, None


def out_proj_residual_rms(inp: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor,
                          eps: float, *, low_rank: LowRank | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """F1/F3: ``x = inp @ weight^T + residual``; returns ``(x, normed = x * norm_weight, rstd)``.

    One GEMM: the epilogue adds the residual tile, stores ``x`` and ``normed`` and writes per-tile
    partial sums of ``x^2``, finished to ``rstd = rsqrt(sum / d + eps)``. ``normed`` and ``rstd`` are
    non-differentiable (the norm's consumer owns its backward).

    ``low_rank=LowRank(a, b, scale)``: ``weight + scale * b @ a`` (LoRA) in the same GEMM, through its
    low-rank operand pair ``(scale * inp @ a^T, b)``.

    Backward: ``grad_inp = grad_x @ W`` (B8, with the pair ``(scale * grad_x @ b, a)``), ``grad_W = grad_x^T @
    inp`` (B9, skipped when ``weight`` needs no gradient), ``grad_residual = grad_x``; ``grad_b = grad_x^T @ u``,
    ``grad_a = (scale * grad_x @ b)^T @ inp``. Saved: ``inp``, ``weight`` (and ``u`` [M, r]).
    """
    residual = check.activation("residual", residual)
    m, d = residual.shape
    inp = check.activation("inp", inp, rows=m, like=residual)
    weight = check.weight("weight", weight, (d, inp.shape[1]), "[features, inp features]", residual)
    norm_weight = check.vector("norm_weight", norm_weight, d, "[features]", residual)
    low_rank = check.low_rank("low_rank", low_rank, inp.shape[1], d, residual)
    return _OutProjResidualRms.apply(inp, weight, residual, norm_weight.detach(), check.eps(eps),
                                     *_lora_args(low_rank))


# ==================================================================================================
# F4 (+ B1, B2, B3): RMSNorm-scaled QKV projection + RoPE, optionally with QK-norm
# ==================================================================================================
@torch.library.custom_op("codagen::rms_qkv_rope", mutates_args=())
def _rms_qkv_rope_op(normed: Tensor, rstd: Tensor, qkv_weight: Tensor, positions: Tensor,
                     frequencies: Tensor, lora_u: Tensor | None, lora_b: Tensor | None) -> Tensor:
    return _run(library.rms_qkv_rope(), normed, qkv_weight, lora_u, lora_b, rstd=rstd, positions=positions,
                frequencies=frequencies)["qkv"]


@register_fake(_rms_qkv_rope_op)
def _(normed, rstd, qkv_weight, positions, frequencies, lora_u, lora_b):
    return normed.new_empty(normed.shape[0], qkv_weight.shape[0])


def _consumer_backward_outputs(x: Tensor, out: tuple, *extra: Tensor) -> tuple[Tensor, ...]:
    """A consumer backward's ``(grad_x, grad_norm_weight, grad_weight, grad_lora_a, grad_lora_b, *extra)``
    with empty tensors for the gradients not computed (custom ops return tensors only)."""
    return (*(_or_empty(t, x) for t in out), *extra)


def _fake_consumer_grads(x, norm_weight, weight, weight_grad, input_grad, lora_a, lora_b) -> tuple[Tensor, ...]:
    return (_fake_grad(x, input_grad, x), _fake_grad(norm_weight, input_grad, x), _fake_grad(weight, weight_grad, x),
            _fake_grad(lora_a, True, x), _fake_grad(lora_b, True, x))


def _input_grad(ctx) -> bool:
    """Whether a consumer op's backward needs its GEMM over ``W`` for ``x`` (input 0) or the norm weight (3)."""
    return ctx.needs_input_grad[0] or ctx.needs_input_grad[3]


@torch.library.custom_op("codagen::rms_qkv_rope_backward", mutates_args=())
def _rms_qkv_rope_backward_op(grad_blocks: list[Tensor], grad_residual: Tensor | None, qkv: Tensor, x: Tensor,
                              rstd: Tensor, norm_weight: Tensor, qkv_weight: Tensor, positions: Tensor,
                              frequencies: Tensor, weight_grad: bool, input_grad: bool, lora_a: Tensor | None,
                              lora_b: Tensor | None,
                              lora_u: Tensor | None,
                              lora_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grad_z, mean_z_dz = kernels.rope_backward(grad_blocks, qkv, positions, frequencies, x.shape[1])  # B1
    return _consumer_backward_outputs(x, consumer_rms_norm_backward(  # B2, B3
        grad_z, qkv_weight, x, rstd, norm_weight, mean_z_dz, grad_residual, weight_grad=weight_grad,
        input_grad=input_grad, lora_a=lora_a, lora_b=lora_b, lora_u=lora_u, lora_scale=lora_scale))


@register_fake(_rms_qkv_rope_backward_op)
def _(grad_blocks, grad_residual, qkv, x, rstd, norm_weight, qkv_weight, positions, frequencies, weight_grad,
      input_grad, lora_a, lora_b, lora_u, lora_scale):
    return _fake_consumer_grads(x, norm_weight, qkv_weight, weight_grad, input_grad, lora_a, lora_b)


def _consumer_grads(ctx, grads: tuple[Tensor, ...], weight_index: int, lora_a: Tensor | None) -> tuple:
    """``(grad_x, grad_norm_weight, grad_weight, grad_lora_a, grad_lora_b, *rest)`` of a consumer backward
    op, with None for the ones it did not compute (frozen weight, no adapter)."""
    grad_x, grad_norm_weight, grad_weight, grad_lora_a, grad_lora_b, *rest = grads
    present, input_grad = lora_a is not None, _input_grad(ctx)
    return (grad_x if input_grad else None, grad_norm_weight if input_grad else None,
            grad_weight if ctx.needs_input_grad[weight_index] else None,
            grad_lora_a if present else None, grad_lora_b if present else None, *rest)


def _contiguous(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


def _split_outputs(qkv: Tensor, split_sizes: tuple[int, ...] | None) -> tuple[Tensor, ...]:
    """``(qkv,)``, or its column blocks as views: each then gets its own gradient in the backward."""
    return (qkv,) if split_sizes is None else qkv.split(split_sizes, dim=1)


def _grad_blocks(grads: tuple[Tensor | None, ...], split_sizes: tuple[int, ...] | None,
                 like: Tensor) -> list[Tensor] | None:
    """The gradients of the qkv outputs (qkv, or q, k, v) as B1 takes them, in place (its launcher fixes
    any layout its kernel cannot read); an unused output's as zeros; ``None`` when no output has one."""
    if all(g is None for g in grads):
        return None
    widths = split_sizes or (like.shape[1],)
    return [like.new_zeros(like.shape[0], width) if g is None else g for g, width in zip(grads, widths)]


class _RmsQkvRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normed, rstd, norm_weight, qkv_weight, positions, frequencies, split_sizes, lora_a, lora_b,
                lora_scale):
        lora_u = _low_rank_operand(normed, lora_a, lora_scale)
        qkv = _rms_qkv_rope_op(normed, rstd, qkv_weight, positions, frequencies, lora_u, lora_b)
        ctx.save_for_backward(qkv, x, rstd, norm_weight, qkv_weight, positions, frequencies, lora_a, lora_b, lora_u)
        ctx.split_sizes, ctx.lora_scale = split_sizes, lora_scale
        ctx.set_materialize_grads(False)
        return *_split_outputs(qkv, split_sizes), x.view_as(x)

    @staticmethod
    def backward(ctx, *grads):
        *grad_outputs, grad_residual = grads
        qkv, x, rstd, norm_weight, qkv_weight, positions, frequencies, lora_a, lora_b, lora_u = ctx.saved_tensors
        grad_blocks = _grad_blocks(tuple(grad_outputs), ctx.split_sizes, qkv)
        if grad_blocks is None:  # only the residual path carries a gradient
            return (grad_residual,) + (None,) * 10
        grad_x, grad_norm_weight, grad_qkv_weight, grad_lora_a, grad_lora_b = _consumer_grads(
            ctx, _rms_qkv_rope_backward_op(grad_blocks, _contiguous(grad_residual), qkv, x, rstd, norm_weight,
                                           qkv_weight, positions, frequencies, ctx.needs_input_grad[4],
                                           _input_grad(ctx), lora_a, lora_b, lora_u, ctx.lora_scale), 4, lora_a)
        return (grad_x, None, None, grad_norm_weight, grad_qkv_weight, None, None, None, grad_lora_a, grad_lora_b,
                None)


def _qk_norm_columns(q_norm_weight: Tensor, k_norm_weight: Tensor, num_heads: int,
                    num_kv_heads: int) -> tuple[Tensor, Tensor]:
    """The per-column vectors of the QK-norm program (columns ``[Q heads | K heads | V heads]``):
    ``qk_norm_weight`` [N] = q_norm's weight on each Q head, k_norm's on each K head, 0 on V;
    ``qk_passthrough`` [N] = 0 on Q/K, 1 on V."""
    head_dim = q_norm_weight.shape[0]
    v_zeros = q_norm_weight.new_zeros(num_kv_heads * head_dim)
    weight = torch.cat((q_norm_weight.repeat(num_heads), k_norm_weight.repeat(num_kv_heads),
                        v_zeros))
    passthrough = torch.cat((q_norm_weight.new_zeros((num_heads + num_kv_heads) * head_dim), v_zeros + 1))
    return weight, passthrough


@torch.library.custom_op("codagen::rms_qkv_rope_qk_norm", mutates_args=())
def _rms_qkv_rope_qk_norm_op(normed: Tensor, rstd: Tensor, qkv_weight: Tensor, positions: Tensor, frequencies: Tensor,
                             q_norm_weight: Tensor, k_norm_weight: Tensor, num_heads: int,
                             eps: float, lora_u: Tensor | None, lora_b: Tensor | None) -> tuple[Tensor, Tensor]:
    head_dim = q_norm_weight.shape[0]
    qk_norm_weight, qk_passthrough = _qk_norm_columns(
        q_norm_weight, k_norm_weight, num_heads, kv_heads_of(qkv_weight.shape[0], head_dim, num_heads))
    out = _run(library.rms_qkv_rope(head_dim, eps), normed, qkv_weight, lora_u, lora_b, rstd=rstd, positions=positions,
               frequencies=frequencies, qk_norm_weight=qk_norm_weight, qk_passthrough=qk_passthrough)
    return out["qkv"], out["preact"]


@register_fake(_rms_qkv_rope_qk_norm_op)
def _(normed, rstd, qkv_weight, positions, frequencies, q_norm_weight, k_norm_weight, num_heads, eps, lora_u, lora_b):
    shape = (normed.shape[0], qkv_weight.shape[0])
    return normed.new_empty(shape), normed.new_empty(shape)


@torch.library.custom_op("codagen::rms_qkv_rope_qk_norm_backward", mutates_args=())
def _rms_qkv_rope_qk_norm_backward_op(grad_blocks: list[Tensor], grad_residual: Tensor | None, preact: Tensor,
                                      x: Tensor, rstd: Tensor, norm_weight: Tensor,
                                      qkv_weight: Tensor, positions: Tensor, frequencies: Tensor,
                                      q_norm_weight: Tensor, k_norm_weight: Tensor, num_heads: int,
                                      eps: float, weight_grad: bool, input_grad: bool, lora_a: Tensor | None,
                                      lora_b: Tensor | None,
                                      lora_u: Tensor | None, lora_scale: float) -> tuple[Tensor, Tensor, Tensor,
                                                                                         Tensor, Tensor, Tensor,
                                                                                         Tensor]:
    # B1: RoPE backward + the Q/K heads' RMSNorm backward (+ q_norm/k_norm weight gradients)
    grad_z, mean_z_dz, grad_q_norm_weight, grad_k_norm_weight = kernels.rope_qk_norm_backward(
        grad_blocks, preact, positions, frequencies, q_norm_weight, k_norm_weight, num_heads, eps, x.shape[1])
    return _consumer_backward_outputs(x, consumer_rms_norm_backward(  # B2, B3
        grad_z, qkv_weight, x, rstd, norm_weight, mean_z_dz, grad_residual, weight_grad=weight_grad,
        input_grad=input_grad, lora_a=lora_a, lora_b=lora_b, lora_u=lora_u, lora_scale=lora_scale),
        grad_q_norm_weight.to(q_norm_weight.dtype), grad_k_norm_weight.to(k_norm_weight.dtype))


@register_fake(_rms_qkv_rope_qk_norm_backward_op)
def _(grad_blocks, grad_residual, preact, x, rstd, norm_weight, qkv_weight, positions, frequencies, q_norm_weight,
      k_norm_weight, num_heads, eps, weight_grad, input_grad, lora_a, lora_b, lora_u,
      lora_scale):
    return (*_fake_consumer_grads(x, norm_weight, qkv_weight, weight_grad, input_grad, lora_a, lora_b),
            torch.empty_like(q_norm_weight), torch.empty_like(k_norm_weight))


class _RmsQkvRopeQkNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normed, rstd, norm_weight, qkv_weight, positions, frequencies, q_norm_weight, k_norm_weight,
                num_heads, eps, split_sizes, lora_a, lora_b, lora_scale):
        lora_u = _low_rank_operand(normed, lora_a, lora_scale)
        qkv, preact = _rms_qkv_rope_qk_norm_op(normed, rstd, qkv_weight, positions, frequencies, q_norm_weight,
                                               k_norm_weight, num_heads, eps, lora_u, lora_b)
        ctx.save_for_backward(preact, x, rstd, norm_weight, qkv_weight, positions, frequencies, q_norm_weight,
                              k_norm_weight, lora_a, lora_b, lora_u)
        ctx.num_heads, ctx.eps, ctx.split_sizes, ctx.lora_scale = num_heads, eps, split_sizes, lora_scale
        ctx.set_materialize_grads(False)
        return *_split_outputs(qkv, split_sizes), x.view_as(x)

    @staticmethod
    def backward(ctx, *grads):
        *grad_outputs, grad_residual = grads
        *saved, lora_a, lora_b, lora_u = ctx.saved_tensors  # preact first
        grad_blocks = _grad_blocks(tuple(grad_outputs), ctx.split_sizes, saved[0])
        if grad_blocks is None:  # only the residual path carries a gradient
            return (grad_residual,) + (None,) * 14
        grad_x, grad_norm_weight, grad_qkv_weight, grad_lora_a, grad_lora_b, grad_q_norm_weight, grad_k_norm_weight = \
            _consumer_grads(ctx, _rms_qkv_rope_qk_norm_backward_op(
                grad_blocks, _contiguous(grad_residual), *saved, ctx.num_heads, ctx.eps, ctx.needs_input_grad[4],
                _input_grad(ctx), lora_a, lora_b, lora_u, ctx.lora_scale), 4, lora_a)
        return (grad_x, None, None, grad_norm_weight, grad_qkv_weight, None, None, grad_q_norm_weight,
                grad_k_norm_weight, None, None, None, grad_lora_a, grad_lora_b, None)


def rms_qkv_rope(x: Tensor, normed: Tensor, rstd: Tensor, norm_weight: Tensor, qkv_weight: Tensor,
                 positions: Tensor, frequencies: Tensor, q_norm_weight: Tensor | None = None,
                 k_norm_weight: Tensor | None = None, num_heads: int | None = None,
                 qk_norm_eps: float = 1e-6, *, split_sizes: tuple[int, int, int] | None = None,
                 pass_residual: bool = False, low_rank: LowRank | None = None) -> Tensor | tuple[Tensor, ...]:
    """F4: ``qkv = rope(RMSNorm(x) @ qkv_weight^T)`` on adjacent pairs, one GEMM; optionally QK-norm before RoPE.

    ``z = rstd[m] * (normed @ W^T)``; pair ``j`` of row ``m`` rotates by ``positions[m] * frequencies[j]``
    (``frequencies`` [N/2] from :func:`rope_frequencies`; V pairs are 0). Q/K rows of ``qkv_weight``
    must be in the adjacent-pair layout (:func:`rope_pairs_from_half_split`).

    QK-norm (Qwen3, OLMo-2): with ``q_norm_weight`` and ``k_norm_weight`` (both ``[head_dim]``, in the
    same pair order as the Q/K rows: ``rope_pairs_from_half_split(w, head_dim)`` converts Hugging Face's)
    and ``num_heads`` (Q heads; K and V have ``(N / head_dim - num_heads) / 2`` each), every Q and K
    head ``h`` is normalized before RoPE: ``y_h = z_h * rsqrt(mean(z_h^2) + qk_norm_eps) * gamma``
    (``gamma`` = q_norm's or k_norm's weight); V is not. Still one GEMM: the per-head statistic is a
    segmented sum in the epilogue (tiles hold whole heads).

    Backward: B1 rotates ``grad_qkv`` back by ``-theta`` and computes ``mean_z_dz = sum qkv * grad_qkv / d``
    (rotations preserve dot products); with QK-norm B1 also applies each Q/K head's RMSNorm backward
    ``dz_h = rho_h (gamma g_h - zhat_h mean(zhat_h gamma g_h))`` (``rho_h`` its rstd, ``zhat_h = z_h rho_h``,
    ``g`` the un-rotated gradient), takes ``mean_z_dz = sum z dz / d`` with the pre-QK-norm ``z`` and
    writes per-row-block partials of the q_norm/k_norm gradients ``sum g zhat``. B2 is the
    RMSNorm-backward GEMM ``grad_z @ W``; B3 ``grad_W = grad_z^T @ n``.

    ``split_sizes=(q_cols, k_cols, v_cols)`` returns ``q, k, v = qkv.split(split_sizes, dim=1)`` instead of
    ``qkv``: views of the one [M, N] output, each with its own gradient. B1 then reads attention's three
    input gradients where they lie; a split of ``qkv`` made outside the op would have autograd concatenate
    them into one [M, N] gradient first (an extra read and write of it). Each size must be even
    (a RoPE pair never straddles two blocks); with QK-norm they are the heads' column counts.

    ``pass_residual=True`` also returns ``residual`` (last), ``x`` passed through: use it
    as the block's residual (the out-projection's ``residual``). Its gradient then comes back into this
    op's backward and B2 writes ``grad_x = grad_residual + norm_grad`` in its one store, where autograd
    would otherwise add the two paths' ``[M, d]`` gradients in a separate kernel.
    ``low_rank=LowRank(a, b, scale)``: ``qkv_weight + scale * b @ a`` (LoRA; ``b``'s rows in the fused row
    order of ``qkv_weight``) in the same GEMM through its low-rank pair ``(scale * normed @ a^T, b)``, so
    RoPE and QK-norm see the sum; the backward GEMM carries ``(scale * grad_z @ b, a)``.
    ``grad_qkv_weight`` is computed only when ``qkv_weight`` requires a gradient.

    Saved: ``qkv`` (attention keeps it alive anyway), ``x``, ``rstd``; with QK-norm ``preact = z``
    [M, N] instead of ``qkv`` (one extra activation of qkv's size: the norm's backward needs the
    pre-norm heads; ``rho`` is recomputed from it). ``n = RMSNorm(x)`` is recomputed.
    """
    x = check.activation("x", x)
    m, d = x.shape
    normed = check.normed("normed", normed, x)
    rstd = check.rstd("rstd", rstd, x)
    norm_weight = check.vector("norm_weight", norm_weight, d, "[features]", x)
    qkv_weight = check.weight("qkv_weight", qkv_weight, (None, d), "[(heads + 2 kv_heads) * head_dim, features]", x,
                              even_rows=True)
    positions = check.index_vector("positions", positions, m, x, allow_float=True)
    frequencies = check.vector("frequencies", frequencies, qkv_weight.shape[0] // 2, "[qkv features / 2]", x,
                               dtypes=(torch.float32, torch.float64))
    positions = positions.to(stats_dtype(x.dtype))  # angles are computed in fp32 registers
    lora = _lora_args(check.low_rank("low_rank", low_rank, d, qkv_weight.shape[0], x))
    if q_norm_weight is None and k_norm_weight is None:
        if num_heads is not None:
            raise ValueError("num_heads: only used with QK-norm (give q_norm_weight and k_norm_weight too)")
        split_sizes = check.split_sizes("split_sizes", split_sizes, qkv_weight.shape[0])
        out = _RmsQkvRope.apply(x, normed.detach(), rstd.detach(), norm_weight, qkv_weight, positions.detach(),
                                frequencies.detach(), split_sizes, *lora)
        return _outputs(out, pass_residual)
    if q_norm_weight is None or k_norm_weight is None:
        missing = "q_norm_weight" if q_norm_weight is None else "k_norm_weight"
        raise ValueError(f"{missing}: QK-norm needs both q_norm_weight and k_norm_weight, got only one")
    q_norm_weight = check.head_vector("q_norm_weight", q_norm_weight, x)
    head_dim = q_norm_weight.shape[0]
    k_norm_weight = check.vector("k_norm_weight", k_norm_weight, head_dim, "[head_dim] (that of q_norm_weight)", x)
    if num_heads is None:
        raise ValueError("num_heads: QK-norm needs the number of Q heads (to tell Q columns from K columns)")
    num_heads = check.positive_int("num_heads", num_heads)
    rows = qkv_weight.shape[0]
    if rows % head_dim:
        raise ValueError(f"qkv_weight: expected (heads + 2 kv_heads) * head_dim rows with head_dim = {head_dim} "
                         f"(q_norm_weight's length), got shape {tuple(qkv_weight.shape)}")
    kv_rows = rows // head_dim - num_heads
    if kv_rows <= 0 or kv_rows % 2:
        raise ValueError(f"num_heads: qkv_weight holds {rows // head_dim} heads of head_dim {head_dim} = num_heads + "
                         f"2 kv_heads, which num_heads = {num_heads} does not split")
    eps = check.eps(qk_norm_eps, "qk_norm_eps")
    kv_cols = kv_rows // 2 * head_dim
    split_sizes = check.split_sizes("split_sizes", split_sizes, rows, (num_heads * head_dim, kv_cols, kv_cols))
    out = _RmsQkvRopeQkNorm.apply(x, normed.detach(), rstd.detach(), norm_weight, qkv_weight, positions.detach(),
                                  frequencies.detach(), q_norm_weight, k_norm_weight, num_heads, eps, split_sizes,
                                  *lora)
    return _outputs(out, pass_residual)


def _outputs(out: tuple[Tensor, ...], pass_residual: bool):
    """``(qkv | q, k, v[, residual])`` as the caller asked; a lone qkv unwrapped."""
    out = out if pass_residual else out[:-1]
    return out[0] if len(out) == 1 else out


# ==================================================================================================
# F2 standalone: RMSNorm-scaled gate/up projection + SwiGLU
# ==================================================================================================
@torch.library.custom_op("codagen::rms_gate_up_swiglu", mutates_args=())
def _rms_gate_up_swiglu_op(normed: Tensor, rstd: Tensor, gate_up_weight: Tensor, lora_u: Tensor | None,
                           lora_b: Tensor | None) -> tuple[Tensor, Tensor]:
    out = _run(library.rms_gate_up_swiglu(), normed, gate_up_weight, lora_u, lora_b, rstd=rstd)
    return out["out"], out["preact"]


@register_fake(_rms_gate_up_swiglu_op)
def _(normed, rstd, gate_up_weight, lora_u, lora_b):
    m, two_f = normed.shape[0], gate_up_weight.shape[0]
    return normed.new_empty(m, two_f // 2), normed.new_empty(m, two_f)


@torch.library.custom_op("codagen::rms_gate_up_swiglu_backward", mutates_args=())
def _rms_gate_up_swiglu_backward_op(grad_act: Tensor, preact: Tensor, x: Tensor, rstd: Tensor, norm_weight: Tensor,
                                    gate_up_weight: Tensor, weight_grad: bool, input_grad: bool, lora_a: Tensor | None,
                                    lora_b: Tensor | None, lora_u: Tensor | None,
                                    lora_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grad_preact, mean_z_dz = kernels.swiglu_backward(grad_act, preact, x.shape[1])
    return _consumer_backward_outputs(x, consumer_rms_norm_backward(
        grad_preact, gate_up_weight, x, rstd, norm_weight, mean_z_dz, weight_grad=weight_grad, input_grad=input_grad,
        lora_a=lora_a, lora_b=lora_b, lora_u=lora_u, lora_scale=lora_scale))


@register_fake(_rms_gate_up_swiglu_backward_op)
def _(grad_act, preact, x, rstd, norm_weight, gate_up_weight, weight_grad, input_grad, lora_a, lora_b, lora_u,
      lora_scale):
    return _fake_consumer_grads(x, norm_weight, gate_up_weight, weight_grad, input_grad, lora_a, lora_b)


class _RmsGateUpSwiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normed, rstd, norm_weight, gate_up_weight, lora_a, lora_b, lora_scale):
        lora_u = _low_rank_operand(normed, lora_a, lora_scale)
        act, preact = _rms_gate_up_swiglu_op(normed, rstd, gate_up_weight, lora_u, lora_b)
        ctx.save_for_backward(preact, x, rstd, norm_weight, gate_up_weight, lora_a, lora_b, lora_u)
        ctx.lora_scale = lora_scale
        ctx.set_materialize_grads(False)
        return act

    @staticmethod
    def backward(ctx, grad_act):
        if grad_act is None:
            return (None,) * 8
        saved = ctx.saved_tensors
        grad_x, grad_norm_weight, grad_gate_up_weight, grad_lora_a, grad_lora_b = _consumer_grads(
            ctx, _rms_gate_up_swiglu_backward_op(grad_act.contiguous(), *saved[:5], ctx.needs_input_grad[4],
                                                 _input_grad(ctx), *saved[5:], ctx.lora_scale), 4, saved[5])
        return grad_x, None, None, grad_norm_weight, grad_gate_up_weight, grad_lora_a, grad_lora_b, None


def rms_gate_up_swiglu(x: Tensor, normed: Tensor, rstd: Tensor, norm_weight: Tensor, gate_up_weight: Tensor, *,
                       low_rank: LowRank | None = None) -> Tensor:
    """F2: ``act = swiglu(RMSNorm(x) @ gate_up_weight^T)``, rows of ``gate_up_weight`` interleaved ``g0, u0, ...``.

    One GEMM: ``z = rstd[m] * (normed @ W^T)``; stores ``preact = z`` [M, 2F] (saved) and
    ``act[:, j] = silu(z[:, 2j]) * z[:, 2j+1]`` [M, F].

    Backward (standalone, so the SwiGLU backward has no GEMM to live in): one elementwise kernel for
    ``(dg, du)`` and ``mean_z_dz = sum (g dg + u du) / d``, then the RMSNorm-backward GEMM and ``grad_W``.
    Prefer :func:`swiglu_mlp_residual_rms`, which moves the SwiGLU backward into the down-projection's epilogue.
    ``low_rank``: as in :func:`rms_qkv_rope` (``b``'s rows interleaved like ``gate_up_weight``'s).
    Saved: ``preact``, ``x``, ``rstd``.
    """
    x = check.activation("x", x)
    d = x.shape[1]
    normed = check.normed("normed", normed, x)
    rstd = check.rstd("rstd", rstd, x)
    norm_weight = check.vector("norm_weight", norm_weight, d, "[features]", x)
    gate_up_weight = check.weight("gate_up_weight", gate_up_weight, (None, d), "[2 * ffn features, features]", x,
                                  even_rows=True)
    low_rank = check.low_rank("low_rank", low_rank, d, gate_up_weight.shape[0], x)
    return _RmsGateUpSwiglu.apply(x, normed.detach(), rstd.detach(), norm_weight, gate_up_weight,
                                  *_lora_args(low_rank))


# ==================================================================================================
# F2 + F3 (+ B4, B5, B6, B7): the whole SwiGLU MLP with its residual and the next norm's statistics
# ==================================================================================================
# Two autograd nodes, so that ``preact`` [M, 2F] -- the largest activation -- is released as soon as the
# down-projection's backward has used it, before the gate/up backward allocates its outputs:
#   node 1 (F2):  (x, normed, rstd) -> act, preact, x (passed through), mean_z_dz_slot
#   node 2 (F3):  (act, preact, x, mean_z_dz_slot) -> x_out, normed_next, rstd_next       saves preact
# In backward node 2 (B4, B5) hands node 1 three things as gradients of node 1's outputs: grad_preact,
# the residual gradient grad_x_out (the gradient of the passed-through x, joined into B6's store) and
# mean_z_dz, the RMSNorm statistic B4 computes from preact (the gradient of a zero [M] slot output).
@torch.library.custom_op("codagen::swiglu_down_backward", mutates_args=())
def _swiglu_down_backward_op(grad_x_out: Tensor, preact: Tensor, down_weight: Tensor, weight_grad: bool,
                             lora_a: Tensor | None, lora_b: Tensor | None, lora_u: Tensor | None,
                             lora_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """B4 + B5: ``(grad_preact, mean_z_dz, grad_down_weight, grad_lora_a, grad_lora_b)`` (empty where not computed)."""
    # B4: grad_act = grad_x_out @ W_down_eff with the SwiGLU backward in its epilogue (recomputes act for B5)
    grad_b_u = _low_rank_grad_operand(grad_x_out, lora_b, lora_scale)
    b4 = _run(library.swiglu_backward(), grad_x_out, down_weight, grad_b_u, lora_a, preact=preact)
    mean_z_dz = kernels.finish_row_mean(b4["partial_z_dz"], down_weight.shape[0])
    act = b4.pop("act")
    grad_down_weight = execute(library.weight_grad(), grad_x_out, act)["grad_weight"] if weight_grad else None  # B5
    grad_lora_a = grad_lora_b = None
    if lora_a is not None:
        grad_lora_a, grad_lora_b = _low_rank_grads(grad_x_out, act, lora_u, grad_b_u)
    return (b4["grad_preact"], mean_z_dz, _or_empty(grad_down_weight, preact), _or_empty(grad_lora_a, preact),
            _or_empty(grad_lora_b, preact))


@register_fake(_swiglu_down_backward_op)
def _(grad_x_out, preact, down_weight, weight_grad, lora_a, lora_b, lora_u, lora_scale):
    return (torch.empty_like(preact), _stats(grad_x_out, grad_x_out.shape[0]),
            _fake_grad(down_weight, weight_grad, preact), _fake_grad(lora_a, True, preact),
            _fake_grad(lora_b, True, preact))


@torch.library.custom_op("codagen::gate_up_rms_norm_backward", mutates_args=())
def _gate_up_rms_norm_backward_op(grad_preact: Tensor, grad_residual: Tensor, x: Tensor, rstd: Tensor,
                                  norm_weight: Tensor, gate_up_weight: Tensor, mean_z_dz: Tensor, weight_grad: bool,
                                  input_grad: bool, lora_a: Tensor | None, lora_b: Tensor | None, lora_u: Tensor | None,
                                  lora_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """B6 + B7: ``grad_x = grad_residual + norm_grad`` in one store, ``grad_norm_weight``, ``grad_gate_up_weight``
    and the low-rank update's gradients."""
    return _consumer_backward_outputs(x, consumer_rms_norm_backward(
        grad_preact, gate_up_weight, x, rstd, norm_weight, mean_z_dz, grad_residual=grad_residual,
        weight_grad=weight_grad, input_grad=input_grad, lora_a=lora_a, lora_b=lora_b, lora_u=lora_u,
        lora_scale=lora_scale))


@register_fake(_gate_up_rms_norm_backward_op)
def _(grad_preact, grad_residual, x, rstd, norm_weight, gate_up_weight, mean_z_dz, weight_grad, input_grad, lora_a,
      lora_b, lora_u, lora_scale):
    return _fake_consumer_grads(x, norm_weight, gate_up_weight, weight_grad, input_grad, lora_a, lora_b)


class _MlpGateUp(torch.autograd.Function):
    """Node 1: F2. Its backward is B6 + B7; the SwiGLU backward ran in node 2's B4 epilogue."""

    @staticmethod
    def forward(ctx, x, normed, rstd, norm_weight, gate_up_weight, lora_a, lora_b, lora_scale):
        lora_u = _low_rank_operand(normed, lora_a, lora_scale)
        act, preact = _rms_gate_up_swiglu_op(normed, rstd, gate_up_weight, lora_u, lora_b)
        # out of place: torch 2.11's Dynamo hands the gradient of an output an in-place op made here to
        # backward as zeros (pytorch/pytorch#180642; docs/notes/compile.md)
        mean_z_dz_slot = x.new_zeros(x.shape[0], dtype=stats_dtype(x.dtype))
        ctx.save_for_backward(x, rstd, norm_weight, gate_up_weight, lora_a, lora_b, lora_u)
        ctx.lora_scale = lora_scale
        ctx.mark_non_differentiable(act)
        ctx.set_materialize_grads(False)
        return act, preact, x.view_as(x), mean_z_dz_slot

    @staticmethod
    def backward(ctx, _grad_act, grad_preact, grad_residual, mean_z_dz):
        if grad_preact is None:  # only the residual path carries a gradient
            return (grad_residual,) + (None,) * 7
        if mean_z_dz is None or grad_residual is None:
            raise RuntimeError("swiglu_mlp_residual_rms: the gate/up backward needs the down-projection's backward "
                               "(its outputs must only feed that op)")
        x, rstd, norm_weight, gate_up_weight, lora_a, lora_b, lora_u = ctx.saved_tensors
        grad_x, grad_norm_weight, grad_gate_up_weight, grad_lora_a, grad_lora_b = _consumer_grads(
            ctx, _gate_up_rms_norm_backward_op(grad_preact.contiguous(), grad_residual.contiguous(), x, rstd,
                                               norm_weight, gate_up_weight, mean_z_dz.contiguous(),
                                               ctx.needs_input_grad[4], _input_grad(ctx), lora_a, lora_b, lora_u,
                                               ctx.lora_scale),
            4, lora_a)
        return grad_x, None, None, grad_norm_weight, grad_gate_up_weight, grad_lora_a, grad_lora_b, None


class _MlpDownResidualRms(torch.autograd.Function):
    """Node 2: F3. Its backward is B4 (with the SwiGLU backward) + B5; it releases ``preact``."""

    @staticmethod
    def forward(ctx, act, preact, residual, mean_z_dz_slot, down_weight, next_norm_weight, eps, lora_a, lora_b,
                lora_scale):
        lora_u = _low_rank_operand(act, lora_a, lora_scale)
        x_out, normed_next, rstd_next = _out_proj_residual_rms_op(act, down_weight, residual, next_norm_weight, eps,
                                                                  lora_u, lora_b)
        ctx.save_for_backward(preact, down_weight, lora_a, lora_b, lora_u)
        ctx.lora_scale = lora_scale
        ctx.mark_non_differentiable(normed_next, rstd_next)
        ctx.set_materialize_grads(False)
        return x_out, normed_next, rstd_next

    @staticmethod
    def backward(ctx, grad_x_out, _grad_normed_next, _grad_rstd_next):
        if grad_x_out is None:
            return (None,) * 10
        preact, down_weight, lora_a, lora_b, lora_u = ctx.saved_tensors
        grad = grad_x_out.contiguous()
        weight_grad = ctx.needs_input_grad[4]
        grad_preact, mean_z_dz, grad_down_weight, grad_lora_a, grad_lora_b = _swiglu_down_backward_op(
            grad, preact, down_weight, weight_grad, lora_a, lora_b, lora_u, ctx.lora_scale)
        present = lora_a is not None
        return (None, grad_preact, grad, mean_z_dz, grad_down_weight if weight_grad else None, None, None,
                grad_lora_a if present else None, grad_lora_b if present else None, None)


def swiglu_mlp_residual_rms(x: Tensor, normed: Tensor, rstd: Tensor, norm_weight: Tensor, gate_up_weight: Tensor,
                            down_weight: Tensor, next_norm_weight: Tensor, eps: float, *,
                            gate_up_low_rank: LowRank | None = None,
                            down_low_rank: LowRank | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """F2 + F3: ``x_out = x + swiglu(RMSNorm(x) @ gate_up_weight^T) @ down_weight^T``, two GEMMs.

    Returns ``(x_out, normed_next = x_out * next_norm_weight, rstd_next)`` (the latter two
    non-differentiable, for the next norm's consumer). F2 stores ``preact`` [M, 2F] (saved) and ``act``
    [M, F] (freed after F3); F3 adds the residual and writes the next norm's statistics.

    Backward, two autograd nodes: B4 ``grad_act = grad_x_out @ W_down`` with the SwiGLU backward in its
    epilogue (emits ``grad_preact``, recomputes ``act`` and the partials of ``mean_z_dz``); B5
    ``grad_W_down = grad_x_out^T @ act``; then, with ``preact`` already released, B6 the RMSNorm-backward
    GEMM ``grad_preact @ W_gate_up`` writing ``grad_x = grad_x_out + norm_grad`` in one store and B7
    ``grad_W_gate_up = grad_preact^T @ n``.
    ``gate_up_low_rank`` / ``down_low_rank``: LoRA updates of the two weights (:class:`LowRank`; the gate/up
    one with ``b``'s rows interleaved like ``gate_up_weight``'s), each in its GEMM's low-rank pair: F2 and
    B6 as in :func:`rms_gate_up_swiglu`, F3 with ``(scale * act @ a^T, b)``, B4 with ``(scale * grad_x_out @ b,
    a)``. A weight that requires no gradient gets no weight-gradient GEMM (B5, B7).
    Saved: ``preact`` (until B4 has run), ``x``, ``rstd``; ``act`` and ``n = RMSNorm(x)`` are recomputed.
    """
    x = check.activation("x", x)
    d = x.shape[1]
    normed = check.normed("normed", normed, x)
    rstd = check.rstd("rstd", rstd, x)
    norm_weight = check.vector("norm_weight", norm_weight, d, "[features]", x)
    gate_up_weight = check.weight("gate_up_weight", gate_up_weight, (None, d), "[2 * ffn features, features]", x,
                                  even_rows=True)
    ffn = gate_up_weight.shape[0] // 2
    if ffn % 2:  # the down-projection's backward epilogue works on (gate, up) pairs of a width-ffn tile
        raise ValueError(f"gate_up_weight: expected 2 * ffn rows with an even ffn, got shape {tuple(gate_up_weight.shape)}")
    down_weight = check.weight("down_weight", down_weight, (d, ffn), "[features, ffn features]", x)
    next_norm_weight = check.vector("next_norm_weight", next_norm_weight, d, "[features]", x)
    gate_up_low_rank = check.low_rank("gate_up_low_rank", gate_up_low_rank, d, 2 * ffn, x)
    down_low_rank = check.low_rank("down_low_rank", down_low_rank, ffn, d, x)
    act, preact, residual, mean_z_dz_slot = _MlpGateUp.apply(x, normed.detach(), rstd.detach(), norm_weight,
                                                            gate_up_weight, *_lora_args(gate_up_low_rank))
    return _MlpDownResidualRms.apply(act, preact, residual, mean_z_dz_slot, down_weight, next_norm_weight.detach(),
                                     check.eps(eps), *_lora_args(down_low_rank))


# ==================================================================================================
# RMSNorm(x) @ W^T (logits for inference, or any norm consumer without an epilogue op)
# ==================================================================================================
@torch.library.custom_op("codagen::rms_linear", mutates_args=())
def _rms_linear_op(normed: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    return execute(library.rms_linear(), normed, weight, rstd=rstd)["out"]


@register_fake(_rms_linear_op)
def _(normed, rstd, weight):
    return normed.new_empty(normed.shape[0], weight.shape[0])


@torch.library.custom_op("codagen::rms_linear_backward", mutates_args=())
def _rms_linear_backward_op(grad_out: Tensor, out: Tensor, x: Tensor, rstd: Tensor, norm_weight: Tensor,
                            weight: Tensor, weight_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    mean_z_dz = kernels.mean_row_dot(out, grad_out, x.shape[1])
    grad_x, grad_norm_weight, grad_weight, _, _ = consumer_rms_norm_backward(grad_out, weight, x, rstd, norm_weight,
                                                                            mean_z_dz, weight_grad=weight_grad)
    return grad_x, grad_norm_weight, _or_empty(grad_weight, x)


@register_fake(_rms_linear_backward_op)
def _(grad_out, out, x, rstd, norm_weight, weight, weight_grad):
    return torch.empty_like(x), torch.empty_like(norm_weight), _fake_grad(weight, weight_grad, x)


class _RmsLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normed, rstd, norm_weight, weight):
        out = _rms_linear_op(normed, rstd, weight)
        ctx.save_for_backward(out, x, rstd, norm_weight, weight)
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if grad_out is None:
            return (None,) * 5
        weight_grad = ctx.needs_input_grad[4]
        grad_x, grad_norm_weight, grad_weight = _rms_linear_backward_op(grad_out.contiguous(), *ctx.saved_tensors,
                                                                        weight_grad)
        return grad_x, None, None, grad_norm_weight, grad_weight if weight_grad else None


def rms_linear(x: Tensor, normed: Tensor, rstd: Tensor, norm_weight: Tensor, weight: Tensor) -> Tensor:
    """``out = RMSNorm(x) @ weight^T = rstd[m] * (normed @ weight^T)``, one GEMM.

    Backward: ``mean_z_dz = sum out * grad_out / d`` (one row-reduction kernel), then the RMSNorm-backward
    GEMM and ``grad_W``. Saved: ``out``, ``x``, ``rstd``. For training logits use
    :func:`rms_lm_head_cross_entropy`, which never stores them.
    """
    x = check.activation("x", x)
    d = x.shape[1]
    normed = check.normed("normed", normed, x)
    rstd = check.rstd("rstd", rstd, x)
    norm_weight = check.vector("norm_weight", norm_weight, d, "[features]", x)
    weight = check.weight("weight", weight, (None, d), "[out features, features]", x)
    return _RmsLinear.apply(x, normed.detach(), rstd.detach(), norm_weight, weight)
