"""The CODA program library: the fused GEMMs of a reparameterized LLaMA block, forward and backward.

Notation (docs/method.md): rows are tokens, weights are in ``nn.Linear`` layout ``W[out, in]``. RMSNorm of
the residual stream ``x`` is split around the GEMMs: the producer stores ``x``, ``h = x * gamma`` and
per-tile partial sums of ``x^2``; ``rstd = rsqrt(mean(x^2) + eps)`` is finished from those; the
consumer GEMM multiplies its accumulator by ``rstd`` (a row scale commutes with ``@ W^T``).

Forward:  F1/F3 :func:`residual_rms_stats`, F2 :func:`rms_gate_up_swiglu`, F4 :func:`rms_qkv_rope`,
          LM head :func:`rms_lm_head_cross_entropy`.
Backward: B2/B6 :func:`rms_norm_backward`, B4 :func:`swiglu_backward`, LM head
          :func:`rms_lm_head_cross_entropy_backward`, B3/B5/B7/B9 :func:`weight_grad`, B8 :func:`input_grad`.
(B1, RoPE backward, is elementwise and not a GEMM: see ``codagen.ops``.)
F2 and B4 take the MLP's gated activation (``activation``, one of :data:`ACTIVATIONS`): ``"silu"`` (SwiGLU,
LLaMA) or ``"gelu_tanh"`` (GeGLU with the tanh approximation of GELU, Gemma 2/3).

The LM-head programs take Gemma 2's final logit soft-cap (``softcap``): the loss, or the logits, of
``y = cap * tanh(z / cap)`` instead of ``z``.

Every function returns the same immutable :class:`Program` on each call.
"""
from __future__ import annotations

import functools
import math

from .ir import (
    Accumulator,
    Binary,
    ColPartial,
    ColVector,
    Expr,
    GeGLU,
    GeGLUBackward,
    Gemm,
    OneHot,
    Program,
    ProgramError,
    Rope,
    RowPartial,
    RowVector,
    ScalarInput,
    SegmentSum,
    Store,
    SwiGLU,
    SwiGLUBackward,
    TileInput,
    Unary,
    Width,
)

__all__ = ["linear", "input_grad", "weight_grad", "rms_linear", "residual_rms_stats", "rms_gate_up_swiglu",
           "rms_qkv_rope", "rms_lm_head_cross_entropy", "rms_lm_head_cross_entropy_backward",
           "rms_norm_backward", "swiglu_backward", "ACTIVATIONS", "PROGRAMS"]

acc = Accumulator()
rstd = RowVector("rstd")

#: the gated MLP activations: name -> (the pair map, its backward, the stem of the programs' names)
_GATED = {"silu": (SwiGLU, SwiGLUBackward, "swiglu"), "gelu_tanh": (GeGLU, GeGLUBackward, "geglu")}
#: the values of the ``activation`` option of :func:`rms_gate_up_swiglu` and :func:`swiglu_backward`
ACTIVATIONS = tuple(_GATED)


def _gated(activation: str):
    """``(pair map, its backward, program stem)`` of ``activation``; a ``ValueError`` naming the values otherwise."""
    if not isinstance(activation, str) or activation not in _GATED:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return _GATED[activation]


def _doc(factory, activation: str) -> str:
    """``factory``'s docstring, its first line (the generated kernels' header) naming the program's pair map."""
    return factory.__doc__ if activation == "silu" else factory.__doc__.replace("SwiGLU", "GeGLU", 1)


@functools.cache
def linear() -> Program:
    """``out = a @ b^T``: a plain ``nn.Linear`` GEMM."""
    return Program("linear", Gemm.linear(), (Store("out", acc),), doc=linear.__doc__)


@functools.cache
def input_grad(residual_grad: bool = False) -> Program:
    """B8: ``grad_input = grad_out @ weight`` (a: grad_out [M, out], b: weight [out, in]).

    ``residual_grad=True`` (program ``input_grad_residual``): ``grad_input = grad_out @ weight + grad_residual``, for
    an input that is also the residual stream (OLMo 2's QKV and gate/up GEMMs read it with no norm between): the
    residual path's gradient joins in the one store. It takes ``input_grad``'s tuned choices.
    """
    if residual_grad:
        return Program("input_grad_residual", Gemm.input_grad(),
                       (Store("grad_input", acc + TileInput("grad_residual")),), doc=input_grad.__doc__,
                       tuning_stand_in=input_grad())
    return Program("input_grad", Gemm.input_grad(), (Store("grad_input", acc),), doc=input_grad.__doc__)


@functools.cache
def weight_grad(accumulate: bool = False, dtype: str = "input") -> Program:
    """B3/B5/B7/B9: ``grad_weight (+)= grad_out^T @ x`` (a: grad_out [tokens, out], b: x [tokens, in]).

    ``accumulate=True`` adds into a given ``grad_weight`` (gradient accumulation, fp32 main grads).
    """
    out = Store("grad_weight", acc, dtype=dtype, accumulate=accumulate)
    return Program("weight_grad", Gemm.weight_grad(), (out,), doc=weight_grad.__doc__)


def _softcap(program: str, softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < math.inf:
        raise ProgramError(f"{program}: softcap must be a positive finite float, got {softcap!r}")
    return float(softcap)


def _soft_capped(z: Expr, softcap: float) -> tuple[Expr, Expr]:
    """``(t, y) = (tanh(z / cap), cap * t)``: the soft-capped logits ``y`` of ``z`` and the ``t`` their
    derivative ``dy/dz = 1 - t^2`` needs."""
    t = Unary("tanh", z * (1.0 / softcap))
    return t, softcap * t


@functools.cache
def rms_linear(softcap: float | None = None, save_preact: bool = True) -> Program:
    """``out = rstd[m] * (a @ b^T) = RMSNorm(x) @ W^T`` when ``a = x * gamma``.

    With ``softcap = cap`` (program ``rms_linear_softcap``; Gemma 2's final logit soft-cap): ``z = rstd[m] *
    (a @ b^T)``, outputs ``out = cap * tanh(z / cap)`` and ``preact = z``, saved for backward (the derivative
    ``1 - tanh(z / cap)^2`` and the RMSNorm-backward statistic ``sum z dz`` need z, which a rounded ``out`` near
    ``+-cap`` does not determine). ``save_preact=False`` (program ``rms_linear_softcap_inference``): ``out``
    alone, for a forward without backward. Without a cap ``out`` is ``z`` and ``save_preact`` changes nothing.
    Both capped programs take ``rms_linear``'s tuned choices until they have their own (``tuning_stand_in``):
    the same GEMM, whose epilogue adds a tanh per element (and a second store for ``preact``).
    """
    z = acc * rstd
    if softcap is None:
        return Program("rms_linear", Gemm.linear(), (Store("out", z),), doc=rms_linear.__doc__)
    _, y = _soft_capped(z, _softcap("rms_linear", softcap))
    if not save_preact:
        return Program("rms_linear_softcap_inference", Gemm.linear(), (Store("out", y),), doc=rms_linear.__doc__,
                       tuning_stand_in=rms_linear())
    return Program("rms_linear_softcap", Gemm.linear(), (Store("out", y), Store("preact", z)),
                   doc=rms_linear.__doc__, tuning_stand_in=rms_linear())


@functools.cache
def residual_rms_stats() -> Program:
    """F1/F3: out-projection (or down-projection) + residual add + RMSNorm statistics + norm weight.

    ``x = a @ b^T + residual``; outputs ``residual_out = x``, ``normed = x * norm_weight[n]``
    (the next GEMM's operand) and ``partial_sumsq[m, t] = sum over tile t of x^2``, finished by
    ``rstd = rsqrt(sum_t partial_sumsq / N + eps)``.
    """
    x = acc + TileInput("residual")
    return Program("residual_rms_stats", Gemm.linear(), (
        Store("residual_out", x),
        Store("normed", x * ColVector("norm_weight")),
        RowPartial("partial_sumsq", Unary("square", x)),
    ), doc=residual_rms_stats.__doc__)


@functools.cache
def rms_gate_up_swiglu(save_preact: bool = True, activation: str = "silu", pre_norm: bool = True) -> Program:
    """F2: rstd-scaled gate/up projection + SwiGLU, weight rows interleaved ``(g0, u0, g1, u1, ...)``.

    ``z = rstd[m] * (a @ b^T)``; outputs ``preact = z`` (saved for backward, [M, 2F]) and
    ``out[m, j] = f(z[m, 2j]) * z[m, 2j+1]`` ([M, F]), with ``f = silu`` (SwiGLU, program
    ``rms_gate_up_swiglu``) or, for ``activation="gelu_tanh"``, ``f(g) = 0.5 g (1 + tanh(sqrt(2/pi)
    (g + 0.044715 g^3)))`` (GeGLU, program ``rms_gate_up_geglu``).
    ``save_preact=False`` (programs ``rms_gate_up_swiglu_inference``, ``rms_gate_up_geglu_inference``): ``out``
    alone, for a forward without backward (prefill, decode), which then writes a third of the bytes.
    A GeGLU program takes its SwiGLU twin's tuned choices until it has its own (the same GEMM and tiles).
    ``pre_norm=False`` (programs ``gate_up_swiglu``, ``gate_up_geglu`` and their ``_inference`` twins): ``z = a @ b^T``
    for an MLP with no norm before it (OLMo 2), taking the normed program's tuned choices (the same GEMM, one
    multiply fewer per element).
    """
    pair_map, _, stem = _gated(activation)
    doc = _doc(rms_gate_up_swiglu, activation)
    if not pre_norm:
        normed_twin = rms_gate_up_swiglu(save_preact, activation)
        act = Store("out", pair_map(acc))
        if not save_preact:
            return Program(f"gate_up_{stem}_inference", Gemm.linear(), (act,), doc=doc, tuning_stand_in=normed_twin)
        return Program(f"gate_up_{stem}", Gemm.linear(), (Store("preact", acc), act), doc=doc,
                       tuning_stand_in=normed_twin)
    z = acc * rstd
    act = Store("out", pair_map(z))
    if not save_preact:
        return Program(f"rms_gate_up_{stem}_inference", Gemm.linear(), (act,), doc=doc,
                       tuning_stand_in=rms_gate_up_swiglu(activation=activation))
    return Program(f"rms_gate_up_{stem}", Gemm.linear(), (Store("preact", z), act), doc=doc,
                   tuning_stand_in=None if activation == "silu" else rms_gate_up_swiglu())


@functools.cache
def rms_qkv_rope(qk_norm_head_dim: int | None = None, qk_norm_eps: float = 1e-6, save_preact: bool = True,
                 bias: bool = False) -> Program:
    """F4: rstd-scaled QKV projection + RoPE on interleaved pairs, optionally with QK-norm before RoPE.

    ``z = rstd[m] * (a @ b^T)``; ``qkv[m, 2j:2j+2] = rotate(y[m, 2j:2j+2], positions[m] * frequencies[j])``.
    ``frequencies`` [N/2] holds each pair's inverse frequency; V's pairs hold 0 (no rotation).
    Without QK-norm ``y = z``.

    With ``bias`` (program ``rms_qkv_rope_bias``, Qwen2's Q/K/V biases): ``z = rstd[m] * (a @ b^T) + bias[n]``
    (``bias`` [N] in the fused weight's row order), rotated with the rest. It takes the plain program's tuned
    choices until it has its own (``tuning_stand_in``): the same GEMM, one vector add more per element.

    With ``qk_norm_head_dim = hd`` (program ``rms_qkv_rope_qk_norm``): per-head RMSNorm of the Q and K
    heads (Qwen3, Gemma 3), each head being an aligned group of ``hd`` columns::

        qk_rstd[m, n] = rsqrt(segment_sum(z^2, hd)[m, n] / hd + qk_norm_eps)     (one value per (row, head))
        y = z * (qk_norm_weight[n] * qk_rstd + qk_passthrough[n])

    ``qk_norm_weight`` [N] is q_norm's weight on every Q head's columns, k_norm's on every K head's and
    0 on V; ``qk_passthrough`` [N] is 0 on Q/K and 1 on V, so V leaves as ``z``. Both in the
    adjacent-pair column order of the fused weight. The output ``preact = z`` [M, N] (before QK-norm
    and RoPE) is saved for backward: the QK-norm backward needs the pre-norm head, and recovering it
    from ``qkv`` would divide by the norm weight. N must be a multiple of ``hd`` and kernels need
    epilogue tiles of whole heads. ``save_preact=False`` (program ``rms_qkv_rope_qk_norm_inference``): ``qkv``
    alone, for a forward without backward.
    """
    z = acc * rstd
    if qk_norm_head_dim is None:
        name, stand_in = "rms_qkv_rope", None
        if bias:
            z, name, stand_in = z + ColVector("bias"), "rms_qkv_rope_bias", rms_qkv_rope()
        return Program(name, Gemm.linear(), (
            Store("qkv", Rope(z, RowVector("positions"), ColVector("frequencies", Width.HALF))),
        ), doc=rms_qkv_rope.__doc__, tuning_stand_in=stand_in)
    if bias:  # the bias would enter before the norm: no model needs it yet
        raise ProgramError("rms_qkv_rope: bias together with QK-norm is not supported")
    hd = qk_norm_head_dim
    if isinstance(hd, bool) or not isinstance(hd, int) or hd < 2 or hd % 2:
        raise ProgramError(f"rms_qkv_rope: qk_norm_head_dim must be an even int >= 2, got {hd!r}")
    if isinstance(qk_norm_eps, bool) or not isinstance(qk_norm_eps, (int, float)) or not qk_norm_eps > 0:
        raise ProgramError(f"rms_qkv_rope: qk_norm_eps must be a positive float, got {qk_norm_eps!r}")
    qk_rstd = Unary("rsqrt", SegmentSum(Unary("square", z), hd) * (1.0 / hd) + float(qk_norm_eps))
    y = z * (ColVector("qk_norm_weight") * qk_rstd + ColVector("qk_passthrough"))
    qkv = Store("qkv", Rope(y, RowVector("positions"), ColVector("frequencies", Width.HALF)))
    if not save_preact:
        return Program("rms_qkv_rope_qk_norm_inference", Gemm.linear(), (qkv,), doc=rms_qkv_rope.__doc__,
                       tuning_stand_in=rms_qkv_rope(hd, qk_norm_eps))
    return Program("rms_qkv_rope_qk_norm", Gemm.linear(), (qkv, Store("preact", z)), doc=rms_qkv_rope.__doc__)


@functools.cache
def rms_lm_head_cross_entropy(softcap: float | None = None) -> Program:
    """LM head + cross-entropy forward, logits never stored.

    ``z = rstd[m] * (a @ b^T)`` (the logits, N = vocab); outputs ``partial_lse[m, t]`` = logsumexp of
    z over tile t, and ``partial_target[m, t]`` = z[m, target[m]] if the target column is in tile t,
    else 0 (selected by the one-hot, not multiplied by it: a -inf logit elsewhere would make it nan).
    Finished: ``loss[m] = logsumexp_t(partial_lse) - sum_t(partial_target)`` for rows whose target is not
    ignore_index (-100 matches no column).

    With ``softcap = cap`` (program ``rms_lm_head_cross_entropy_softcap``): the same of the capped logits
    ``y = cap * tanh(z / cap)`` instead of z. It takes the uncapped program's tuned choices until it has its
    own (``tuning_stand_in``): the same GEMM and outputs, a tanh more per element.
    """
    z = acc * rstd
    name, logits, stand_in = "rms_lm_head_cross_entropy", z, None
    if softcap is not None:
        _, logits = _soft_capped(z, _softcap(name, softcap))
        name, stand_in = f"{name}_softcap", rms_lm_head_cross_entropy()
    return Program(name, Gemm.linear(), (
        RowPartial("partial_lse", logits, "logsumexp"),
        RowPartial("partial_target", Binary("mask", logits, OneHot(RowVector("target", index=True)))),
    ), doc=rms_lm_head_cross_entropy.__doc__, tuning_stand_in=stand_in)


@functools.cache
def rms_lm_head_cross_entropy_backward(softcap: float | None = None) -> Program:
    """LM head + cross-entropy backward: recompute the logits, emit their gradient and sum(z * dz).

    ``z = rstd[m] * (a @ b^T)``; ``dz = (exp(z - lse[m]) - [n == target[m]]) * row_weight[m] * grad_scale``
    where ``row_weight`` is 0 on ignored rows (and 1/#valid for a mean) and ``grad_scale`` is the
    incoming loss gradient (a device scalar). Outputs ``grad_logits = dz`` and
    ``partial_z_dz[m, t] = sum over tile t of z * dz`` (the RMSNorm-backward statistic).

    With ``softcap = cap`` (program ``rms_lm_head_cross_entropy_backward_softcap``): the loss is that of
    ``y = cap * t``, ``t = tanh(z / cap)``, and ``lse[m]`` the logsumexp of y::

        dy = (exp(y - lse[m]) - [n == target[m]]) * row_weight[m] * grad_scale
        dz = dy * (1 - t^2)

    with the same outputs: ``grad_logits = dz`` (the gradient of the GEMM's output z) and the partials of
    ``z * dz`` (z, which the norm feeds, not y). It takes the uncapped program's tuned choices until it has
    its own (``tuning_stand_in``).
    """
    z = acc * rstd
    name, logits, stand_in = "rms_lm_head_cross_entropy_backward", z, None
    if softcap is not None:
        t, logits = _soft_capped(z, _softcap(name, softcap))
        name, stand_in = f"{name}_softcap", rms_lm_head_cross_entropy_backward()
    prob = Unary("exp", logits - RowVector("lse"))
    dz = (prob - OneHot(RowVector("target", index=True))) * RowVector("row_weight") * ScalarInput("grad_scale")
    if softcap is not None:
        dz = dz * (1.0 - t * t)
    return Program(name, Gemm.linear(), (
        Store("grad_logits", dz),
        RowPartial("partial_z_dz", z * dz),
    ), doc=rms_lm_head_cross_entropy_backward.__doc__, tuning_stand_in=stand_in)


@functools.cache
def rms_norm_backward(residual_grad: str = "add") -> Program:
    """B2/B6: ``G = grad_z @ W`` with the RMSNorm backward in its epilogue.

    a: grad_z [M, out] (the gradient of the consumer GEMM's output z), b: W [out, d]. With the saved
    residual stream ``x`` (``residual``), ``c = x * rstd[m]`` and ``s[m] = mean_z_dz[m] = sum_k z dz / d``::

        norm_grad = rstd[m] * (norm_weight[n] * G - c * s[m])
        normed = c * norm_weight[n]          (RMSNorm output, recomputed for grad_W = grad_z^T @ normed)
        partial_grad_norm_weight[t, n] = sum over the rows of M-tile t of G * c

    The residual path's gradient joins in the same store: ``residual_grad="add"`` writes a new
    ``grad_x = grad_residual + norm_grad``; ``"accumulate"`` adds ``norm_grad`` into the given
    ``grad_residual`` in place; ``"none"`` writes a fresh ``grad_x = norm_grad`` (the op that owns the
    norm has no residual-path gradient at hand; autograd adds it elsewhere).
    """
    if residual_grad not in ("add", "accumulate", "none"):
        raise ValueError(f"residual_grad must be 'add', 'accumulate' or 'none', got {residual_grad!r}")
    c = TileInput("residual") * rstd
    gamma = ColVector("norm_weight")
    norm_grad = rstd * (gamma * acc - c * RowVector("mean_z_dz"))
    if residual_grad == "add":
        grad_store = Store("grad_x", TileInput("grad_residual") + norm_grad)
    elif residual_grad == "none":
        grad_store = Store("grad_x", norm_grad)
    else:
        grad_store = Store("grad_residual", norm_grad, accumulate=True)
    return Program("rms_norm_backward", Gemm.input_grad(), (
        grad_store,
        Store("normed", c * gamma),
        ColPartial("partial_grad_norm_weight", acc * c),
    ), doc=rms_norm_backward.__doc__)


@functools.cache
def swiglu_backward(activation: str = "silu") -> Program:
    """B4: ``dy = grad_out @ W_down`` with SwiGLU backward in its epilogue.

    a: grad_out [M, d], b: W_down [d, F]; ``dy`` is [M, F]; ``preact`` [M, 2F] holds interleaved
    ``(g, u)`` saved by F2. SwiGLU (program ``swiglu_backward``), with ``s = sigmoid(g)``:
    ``dg = dy * u * s * (1 + g (1 - s))``, ``du = dy * g * s``. GeGLU (``activation="gelu_tanh"``, program
    ``geglu_backward``), with ``a = 2 sqrt(2/pi) (g + 0.044715 g^3)``, ``s = sigmoid(a)`` (``gelu_tanh(g) = g s``)
    and ``a'(g) = 2 sqrt(2/pi) (1 + 3 * 0.044715 g^2)``: ``dg = dy * u * (s + g s (1 - s) a'(g))``, ``du = dy * g * s``.
    Outputs ``grad_preact`` = interleaved ``(dg, du)`` [M, 2F], ``act = silu(g) * u`` or ``gelu_tanh(g) * u`` [M, F]
    (recomputed for ``grad_W_down = grad_out^T @ act``) and ``partial_z_dz[m, t]`` = sum over tile t
    of ``g dg + u du`` (the RMSNorm-backward statistic of the gate/up GEMM).
    A GeGLU program takes its SwiGLU twin's tuned choices until it has its own (the same GEMM and tiles).
    """
    pair_map, pair_map_backward, stem = _gated(activation)
    preact = TileInput("preact", Width.DOUBLE)
    grad_preact = pair_map_backward(preact, acc)
    stores = (Store("grad_preact", grad_preact), Store("act", pair_map(preact)))
    partial_z_dz = RowPartial("partial_z_dz", preact * grad_preact)
    doc = _doc(swiglu_backward, activation)
    if activation == "silu":
        return Program(f"{stem}_backward", Gemm.input_grad(), (*stores, partial_z_dz), doc=doc)
    # GeGLU's epilogue reduces the row partial before the stores: in SwiGLU's order its untuned Ampere choice (the
    # 128 x 128 tile in quarters) spills on sm_86 and sm_89 (24 bytes per thread: tests/backends/test_compile_matrix.py)
    return Program(f"{stem}_backward", Gemm.input_grad(), (partial_z_dz, *stores), doc=doc,
                   tuning_stand_in=swiglu_backward())


#: name -> factory of every library program (defaults for the ones with options)
PROGRAMS = {f.__name__: f for f in (
    linear, input_grad, weight_grad, rms_linear, residual_rms_stats, rms_gate_up_swiglu, rms_qkv_rope,
    rms_lm_head_cross_entropy, rms_lm_head_cross_entropy_backward, rms_norm_backward, swiglu_backward)}
