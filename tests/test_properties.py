"""Property-based tests (hypothesis) of codagen.execute and the ops, over random shapes (0 and odd sizes
included), dtypes, layouts and programs, valid and invalid.

Valid inputs: results match naive float64 math written here (an IR evaluator independent of the reference
backend's; torch's cross-entropy and embedding). Invalid inputs: the error is a ``ProgramError``,
``ValueError`` or ``TypeError`` whose message names the argument, never an error from deep inside.
Derandomized (the same cases every run) and bounded: the ``codagen`` profile below.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import codagen  # noqa: E402
from codagen import ops  # noqa: E402
from codagen.bench.kernels import random_inputs  # noqa: E402
from codagen.epilogue import finish, library  # noqa: E402
from codagen.epilogue.ir import (  # noqa: E402
    Accumulator,
    Binary,
    ColPartial,
    ColVector,
    Constant,
    Gemm,
    Program,
    ProgramError,
    RowPartial,
    RowVector,
    Store,
    Unary,
)
from codagen.ops import kernels  # noqa: E402

settings.register_profile("codagen", derandomize=True, deadline=None, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("codagen")

SIZES = st.sampled_from([0, 1, 2, 3, 5, 8, 13, 33])
CLEAN_ERRORS = (ProgramError, ValueError, TypeError)


# --------------------------------------------------------------------------------------------------
# random epilogue programs, and a naive float64 evaluator of them
# --------------------------------------------------------------------------------------------------
_UNARY = {"neg": torch.neg, "exp": torch.exp, "sigmoid": torch.sigmoid, "silu": F.silu, "square": torch.square}
_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "max": torch.maximum}


def _expressions(depth: int):
    leaves = st.one_of(st.just(Accumulator()), st.just(RowVector("r")), st.just(ColVector("c")),
                       st.floats(-2, 2, allow_nan=False, width=32).map(Constant))
    if depth == 0:
        return leaves
    inner = _expressions(depth - 1)
    return st.one_of(leaves, st.builds(Unary, st.sampled_from(sorted(_UNARY)), inner),
                     st.builds(Binary, st.sampled_from(sorted(_BINARY)), inner, inner))


@st.composite
def programs(draw) -> Program:
    """A program over ``acc`` (always used), a row vector ``r`` and a column vector ``c``: a store and,
    sometimes, a row partial (sum or logsumexp) and a column partial."""
    value = draw(_expressions(2))
    value = Binary(draw(st.sampled_from(["add", "mul"])), Accumulator(), value)  # every program reads acc
    outputs = [Store("out", value, dtype=draw(st.sampled_from(["float32", "input"])))]
    if draw(st.booleans()):
        outputs.append(RowPartial("row_sums", draw(_expressions(1)) * Accumulator(),
                                  draw(st.sampled_from(["sum", "logsumexp"]))))
    if draw(st.booleans()):
        outputs.append(ColPartial("col_sums", draw(_expressions(1)) + Accumulator()))
    gemm = draw(st.sampled_from([Gemm.linear(), Gemm.input_grad(), Gemm.weight_grad()]))
    return Program("random", gemm, tuple(outputs))


def _naive(e, acc: torch.Tensor, r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    if isinstance(e, Accumulator):
        return acc
    if isinstance(e, RowVector):
        return r[:, None]
    if isinstance(e, ColVector):
        return c[None, :]
    if isinstance(e, Constant):
        return torch.tensor(e.value, dtype=torch.float64)
    if isinstance(e, Unary):
        return _UNARY[e.op](_naive(e.x, acc, r, c))
    return _BINARY[e.op](_naive(e.a, acc, r, c), _naive(e.b, acc, r, c))


def _check_random_program(program: Program, m: int, n: int, k: int, dtype: torch.dtype, backend: str) -> None:
    a, b, tensors = random_inputs(program, m, n, k, dtype, "cpu")
    tensors = {name: tensors[name] for name in program.inputs}
    out = codagen.execute(program, a, b, backend=backend, **tensors)
    a64 = a.double() if program.gemm.a_layout == "mk" else a.double().t()
    b64 = b.double().t() if program.gemm.b_layout == "nk" else b.double()
    acc = a64 @ b64
    r = tensors["r"].double() if "r" in tensors else None
    c = tensors["c"].double() if "c" in tensors else None
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-3, atol=2e-3)
    for o in program.outputs:
        want = _naive(o.value, acc, r, c).expand(m, n)
        got = out[o.name]
        if isinstance(o, Store):
            assert got.dtype == (dtype if o.dtype == "input" else torch.float32)
            want = want.to(got.dtype).double()  # the store rounds once
            got = got.double()
        elif isinstance(o, RowPartial):
            got = (finish.sum_row_partials(got) if o.reduction == "sum" else finish.logsumexp_from_partials(got))
            want = want.sum(1) if o.reduction == "sum" else torch.logsumexp(want, 1)
            if n == 0:  # no column: a sum of none is 0, a logsumexp of none -inf
                want = torch.full((m,), 0.0 if o.reduction == "sum" else -math.inf, dtype=torch.float64)
        else:
            got, want = finish.sum_col_partials(got), want.sum(0)
        torch.testing.assert_close(got.double(), want, equal_nan=True, **tol)


@settings(max_examples=300)
@given(programs(), SIZES, SIZES, SIZES, st.sampled_from([torch.float32, torch.float64]))
def test_random_programs_on_the_reference_backend(program, m, n, k, dtype):
    _check_random_program(program, m, n, k, dtype, "reference")


@settings(max_examples=20)
@given(programs(), st.sampled_from([1, 5, 33]), st.sampled_from([3, 40]), st.sampled_from([0, 7]))
def test_random_programs_on_the_triton_interpreter(program, m, n, k):
    """A few tiny programs through the generated Triton kernel (interpreter), fp32."""
    _check_random_program(program, m, n, k, torch.float32, "triton")


# --------------------------------------------------------------------------------------------------
# library programs through execute, with valid and invalid tensors
# --------------------------------------------------------------------------------------------------
LIBRARY = {
    "linear": library.linear(), "input_grad": library.input_grad(), "rms_linear": library.rms_linear(),
    "residual_rms_stats": library.residual_rms_stats(), "rms_gate_up_swiglu": library.rms_gate_up_swiglu(),
    "rms_qkv_rope": library.rms_qkv_rope(), "rms_lm_head_cross_entropy": library.rms_lm_head_cross_entropy(),
    "rms_lm_head_cross_entropy_backward": library.rms_lm_head_cross_entropy_backward(),
    "rms_norm_backward": library.rms_norm_backward(), "rms_norm_backward_accumulate":
    library.rms_norm_backward("accumulate"), "swiglu_backward": library.swiglu_backward(),
    "weight_grad": library.weight_grad(), "weight_grad_accumulate": library.weight_grad(accumulate=True),
}
MUTATIONS = ("none", "dtype", "shape", "strides", "missing", "unexpected", "device", "not_a_tensor")


def _grown(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` one element longer along ``dim`` (a 0-d tensor becomes two elements)."""
    if t.dim() == 0:
        return t.expand(2).clone()
    extra = list(t.shape)
    extra[dim] = 1
    return torch.cat((t, torch.zeros(extra, dtype=t.dtype)), dim=dim)


def _mutate(kind: str, name: str, tensors: dict, a: torch.Tensor, b: torch.Tensor, gemm: Gemm):
    """Apply one invalid change to the argument ``name`` ("a", "b" or a named tensor)."""
    args = {"a": a, "b": b, **tensors}
    t = args[name]
    if kind == "dtype":
        args[name] = t.to(torch.int32) if t.dtype.is_floating_point else t.to(torch.float32)
    elif kind == "shape":  # a and b: a longer K (M and N are free); the others: one more row
        k_dim = {"a": int(gemm.a_layout == "mk"), "b": int(gemm.b_layout == "nk")}.get(name, 0)
        args[name] = _grown(t, k_dim)
    elif kind == "strides":
        wide = torch.stack((t, t), dim=-1)  # every element followed by a copy: inner stride 2
        args[name] = wide[..., 0]
    elif kind == "missing":
        del args[name]
    elif kind == "unexpected":
        args["unexpected_input"] = t
    elif kind == "device":
        args[name] = t.to("meta")
    elif kind == "not_a_tensor":
        args[name] = t.tolist()
    return args


@settings(max_examples=250)
@given(st.sampled_from(sorted(LIBRARY)), st.sampled_from(MUTATIONS), SIZES, st.sampled_from([0, 2, 6, 34]), SIZES,
       st.sampled_from([torch.float16, torch.float32, torch.float64]), st.data())
def test_library_programs_through_execute(name, mutation, m, n, k, dtype, data):
    program = LIBRARY[name]
    a, b, tensors = random_inputs(program, m, n, k, dtype, "cpu")
    if mutation == "none":
        out = codagen.execute(program, a, b, **tensors)
        for o in program.outputs:
            if isinstance(o, Store):
                assert out[o.name].shape == (m, o.value.width.columns(n)), o.name
                if o.accumulate:
                    assert out[o.name] is tensors[o.name]
        return
    names = ["a", "b", *tensors]
    if mutation in ("missing", "unexpected"):
        names = [n for n in names if n not in ("a", "b")] or names
    target = data.draw(st.sampled_from(names))
    if mutation in ("missing",) and target in ("a", "b"):
        return  # a and b are positional
    if mutation == "strides" and (tensors.get(target, a if target == "a" else b).numel() <= 1):
        return  # a one-element view is contiguous whatever its strides
    args = _mutate(mutation, target, tensors, a, b, program.gemm)
    with pytest.raises(CLEAN_ERRORS) as error:
        codagen.execute(program, args.pop("a"), args.pop("b"), **args)
    expected = "unexpected_input" if mutation == "unexpected" else target
    message = str(error.value)
    assert expected in message or (target in ("a", "b") and ("a and b" in message or "inner dimensions" in message)), \
        message


@settings(max_examples=20)
@given(st.sampled_from(["linear", "rms_linear", 7, None, library.linear]), SIZES)
def test_execute_refuses_what_is_not_a_program(program, m):
    with pytest.raises(TypeError, match="program: expected a codagen.Program"):
        codagen.execute(program, torch.randn(m, 4), torch.randn(3, 4))


# --------------------------------------------------------------------------------------------------
# the ops: cross-entropy and embedding against torch in float64
# --------------------------------------------------------------------------------------------------
@settings(max_examples=60)
@given(st.integers(0, 7), st.integers(1, 9), st.integers(1, 13), st.sampled_from(["mean", "sum"]),
       st.sampled_from(["valid", "too_large", "negative"]), st.booleans(), st.data())
def test_cross_entropy_against_torch(m, d, vocab, reduction, targets, grad, data):
    x = torch.randn(m, d, dtype=torch.float64, requires_grad=True)
    norm_weight = (1 + 0.2 * torch.randn(d, dtype=torch.float64)).requires_grad_()
    head = (0.5 * torch.randn(vocab, d, dtype=torch.float64)).requires_grad_()
    target = torch.tensor(data.draw(st.lists(st.one_of(st.integers(0, vocab - 1), st.just(-100)), min_size=m,
                                             max_size=m)), dtype=torch.long)
    normed, rstd = kernels.rms_norm_stats_ref(x.detach(), norm_weight.detach(), 1e-6)
    if targets != "valid" and m:
        target[data.draw(st.integers(0, m - 1))] = vocab if targets == "too_large" else -1
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=r"target: expected values in \[0, "):
            ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, target, reduction=reduction)
        return
    with torch.set_grad_enabled(grad):
        loss = ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, head, target, reduction=reduction)
    logits = F.rms_norm(x, (d,), norm_weight, 1e-6) @ head.t()
    want = F.cross_entropy(logits, target, reduction=reduction) if m else logits.new_tensor(
        math.nan if reduction == "mean" else 0.0)  # torch: nan (mean) or 0 (sum) over no token
    torch.testing.assert_close(loss, want.detach(), equal_nan=True)
    if not grad:
        return
    got = torch.autograd.grad(loss, (x, norm_weight, head))
    if not bool((target != -100).any()):  # nothing counted: zero gradients (torch's, where it has any)
        assert all(torch.equal(g, torch.zeros_like(g)) for g in got)
        return
    for g, w in zip(got, torch.autograd.grad(want, (x, norm_weight, head))):
        torch.testing.assert_close(g, w)


@settings(max_examples=40)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=3), st.integers(1, 9), st.integers(1, 5),
       st.sampled_from([torch.int32, torch.int64, torch.int16, torch.float32]), st.sampled_from([None, 0, -1]),
       st.sampled_from(["valid", "too_large", "negative"]), st.data())
def test_embedding_against_torch(shape, vocab, features, dtype, padding_idx, ids_kind, data):
    ids = torch.randint(0, vocab, shape)
    weight = torch.randn(vocab, features, dtype=torch.float64, requires_grad=True)
    if ids_kind != "valid" and ids.numel():
        ids.view(-1)[data.draw(st.integers(0, ids.numel() - 1))] = vocab if ids_kind == "too_large" else -1
    ids = ids.to(dtype)
    if dtype not in (torch.int32, torch.int64):
        with pytest.raises(ValueError, match="ids: expected an int32 or int64"):
            ops.embedding(ids, weight, padding_idx)
        return
    if ids_kind != "valid" and ids.numel():
        with pytest.raises(ValueError, match=rf"ids: expected values in \[0, {vocab}\)"):
            ops.embedding(ids, weight, padding_idx)
        return
    out = ops.embedding(ids, weight, padding_idx)
    want = F.embedding(ids, weight, padding_idx)
    torch.testing.assert_close(out, want)
    grad_out = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, weight, grad_out)[0],
                               torch.autograd.grad(want, weight, grad_out)[0])
