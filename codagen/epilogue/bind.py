"""Binding tensors to a program: every check a backend relies on, with errors that name the argument.

Backends call :func:`bind` first and may then assume: A and B are 2-D, contiguous, of one float dtype
(:data:`OPERAND_DTYPES`; e4m3 ones without a low-rank pair) and on one device; every named input exists with the
right shape, dtype class and device; accumulated outputs are given; for a low-rank GEMM, ``a2`` and ``b2`` (in
``tensors``) are contiguous 2-D matrices of A's dtype and device with one inner size R >= 1; for K-group scales,
``a_scale`` and ``b_scale`` are contiguous fp32 matrices in their operands' layouts with ``cdiv(K, G)`` groups, and
the operands are e4m3; N is even when the program uses column pairs; the columns of every ``SegmentSum`` value and
``QuantizedStore`` split into whole groups (``N * w`` a multiple of its group).

Every check depends only on the program and each tensor's dtype, device, shape and strides, so a call
signature that passed is remembered and a repeated one (every layer of every step) skips the checks.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import library
from .core import ColPartial, Program, ProgramError, QuantizedStore, RowPartial, Store, check_shape

__all__ = ["BoundProgram", "bind", "OPERAND_DTYPES", "ACTIVATION_DTYPE", "cdiv", "set_poison_outputs", "validations"]

OPERAND_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn)
#: the dtype of ``"input"`` stores where it is not the operands' own: FP8 operands feed bf16 activations
ACTIVATION_DTYPE = {torch.float8_e4m3fn: torch.bfloat16}


#: Fill new outputs with NaN so that an element a kernel forgets to write shows up. A debugging aid:
#: it costs a full write pass per output, so it is off unless CODAGEN_POISON_OUTPUTS=1 (the tests set it).
_poison_outputs = os.environ.get("CODAGEN_POISON_OUTPUTS", "0") == "1"


def set_poison_outputs(enabled: bool) -> None:
    """Turn NaN-poisoning of newly allocated outputs on or off (see ``CODAGEN_POISON_OUTPUTS``)."""
    global _poison_outputs
    _poison_outputs = bool(enabled)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class BoundProgram:
    """A program with validated tensors and the problem size M, N, K."""
    program: Program
    a: torch.Tensor
    b: torch.Tensor
    m: int
    n: int
    k: int
    tensors: dict[str, torch.Tensor]

    @property
    def r(self) -> int:
        """Inner size of the low-rank operand pair (0 without one)."""
        gemm = self.program.gemm
        if not gemm.low_rank:
            return 0
        return self.tensors["b2"].shape[1 if gemm.b_layout == "nk" else 0]

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the GEMM operands."""
        return self.a.dtype

    @property
    def activation_dtype(self) -> torch.dtype:
        """Dtype of ``"input"`` stores: the operands', bf16 for e4m3 ones (:data:`ACTIVATION_DTYPE`)."""
        return ACTIVATION_DTYPE.get(self.a.dtype, self.a.dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """Epilogue arithmetic: float64 for float64 operands (the test oracle), else float32."""
        return torch.float64 if self.a.dtype == torch.float64 else torch.float32

    @property
    def device(self) -> torch.device:
        return self.a.device

    def store_dtype(self, store: Store) -> torch.dtype:
        if store.dtype == "input":
            return self.activation_dtype
        return getattr(torch, store.dtype)

    def output_shape(self, out, block_m: int, block_n: int) -> tuple[int, int]:
        if isinstance(out, Store):
            return (self.m, out.value.width.columns(self.n))
        if isinstance(out, RowPartial):
            return (self.m, cdiv(self.n, block_n))
        if isinstance(out, ColPartial):
            return (cdiv(self.m, block_m), out.value.width.columns(self.n))
        raise TypeError(out)

    def output_specs(self, block_m: int, block_n: int) -> tuple[tuple[str, tuple[int, int] | None, torch.dtype], ...]:
        """``(name, shape, dtype)`` of each output tensor for tiles of ``block_m x block_n``; shape ``None`` for an
        accumulated output (the caller's tensor). The same for every call of one signature: backends keep it."""
        specs = []
        for out in self.program.outputs:
            if isinstance(out, Store) and out.accumulate:
                specs.append((out.name, None, self.tensors[out.name].dtype))
                continue
            if isinstance(out, QuantizedStore):
                columns = out.width.columns(self.n)
                scale = (self.m, columns // out.group) if out.along == "n" else (cdiv(self.m, out.group), columns)
                specs += [(out.name, (self.m, columns), torch.float8_e4m3fn), (out.scale, scale, torch.float32)]
                continue
            dtype = self.store_dtype(out) if isinstance(out, Store) else self.compute_dtype
            specs.append((out.name, self.output_shape(out, block_m, block_n), dtype))
        return tuple(specs)

    def allocate_outputs(self, block_m: int, block_n: int, specs: tuple | None = None) -> dict[str, torch.Tensor]:
        """New output tensors (NaN-poisoned when poisoning is on: see :func:`set_poison_outputs`), as
        ``specs`` (:meth:`output_specs` of these blocks, when the caller kept them) gives them.

        Accumulated outputs are the caller's tensors, returned as given.
        """
        outs = {}
        device = self.device
        for name, shape, dtype in self.output_specs(block_m, block_n) if specs is None else specs:
            if shape is None:
                outs[name] = self.tensors[name]
            else:
                outs[name] = (torch.full(shape, float("nan"), dtype=dtype, device=device) if _poison_outputs
                              else torch.empty(shape, dtype=dtype, device=device))
        return outs


#: call signature (:func:`_signature`) -> (program, m, n, k) of the calls that passed the checks
_validated: dict[tuple, tuple] = {}
_VALIDATED_MAX = 4096  # signatures kept; past it the memo starts afresh (shapes that vary without end)
_validations = 0


def validations() -> int:
    """How many calls of :func:`bind` ran the checks (the others repeated a signature that passed them)."""
    return _validations


def _signature(program: Program, a, b, tensors: dict) -> tuple | None:
    """What the checks read: the program, each tensor's dtype, device, shape and strides; None when an
    argument is not a tensor (the checks then name it)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    signature = [id(program), a.dtype, a.device, a.shape, a.stride(), b.dtype, b.device, b.shape, b.stride()]
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            return None
        signature += (name, t.dtype, t.device, t.shape, t.stride())
    return tuple(signature)


def _tensor(name: str, t, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ProgramError(f"{name}: expected a torch.Tensor ({what}), got {type(t).__name__}")
    return t


def _check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ProgramError(f"{name}: expected a contiguous tensor (row-major, unit inner stride), got strides "
                           f"{tuple(t.stride())} for shape {tuple(t.shape)}; call .contiguous() first")


def bind(program: Program, a: torch.Tensor, b: torch.Tensor, tensors: dict[str, torch.Tensor]) -> BoundProgram:
    """Validate ``a``, ``b`` and the named tensors against ``program``; return the bound problem."""
    signature = _signature(program, a, b, tensors)
    known = _validated.get(signature)
    if known is not None and known[0] is program:  # the id of a collected program can be reused
        return BoundProgram(program, a, b, known[1], known[2], known[3], dict(tensors))
    bound = _check(program, a, b, tensors)
    if signature is not None:
        if len(_validated) >= _VALIDATED_MAX:
            _validated.clear()
        _validated[signature] = (program, bound.m, bound.n, bound.k)
    return bound


def _check(program: Program, a: torch.Tensor, b: torch.Tensor, tensors: dict[str, torch.Tensor]) -> BoundProgram:
    """:func:`bind`'s checks."""
    global _validations
    _validations += 1
    if not isinstance(program, Program):
        named = isinstance(program, str) and callable(getattr(library, program, None))
        raise TypeError(f"program: expected a codagen.Program, got {type(program).__name__} {program!r}; pass "
                        f"codagen.library.{program if named else 'linear'}() or a Program built from the IR")
    a = _tensor("a", a, "GEMM operand A")
    b = _tensor("b", b, "GEMM operand B")
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in OPERAND_DTYPES:
            raise ProgramError(f"{name}: dtype {t.dtype} is not supported; expected one of "
                               f"{[str(d) for d in OPERAND_DTYPES]}")
        if t.dim() != 2:
            raise ProgramError(f"{name}: expected a 2-D matrix, got shape {tuple(t.shape)}")
        _check_contiguous(name, t)
    if a.dtype != b.dtype:
        raise ProgramError(f"a and b must have one dtype, got a: {a.dtype}, b: {b.dtype}")
    if a.device != b.device:
        raise ProgramError(f"a and b must be on one device, got a: {a.device}, b: {b.device}")

    gemm = program.gemm
    m, k = a.shape if gemm.a_layout == "mk" else a.shape[::-1]
    n, k_b = b.shape if gemm.b_layout == "nk" else b.shape[::-1]
    if k != k_b:
        (a_shape, b_shape) = gemm.shapes()
        raise ProgramError(f"{program.name}: inner dimensions differ: a{list(a_shape)} = {tuple(a.shape)} and "
                           f"b{list(b_shape)} = {tuple(b.shape)} give K = {k} and {k_b}")

    inputs = program.inputs
    low_rank = ("a2", "b2") if gemm.low_rank else ()
    operand_tensors = gemm.operand_tensors
    wanted = set(inputs) | set(program.accumulated_outputs()) | set(operand_tensors)
    unexpected = sorted(set(tensors) - wanted)
    if unexpected:
        raise ProgramError(f"{program.name}: unexpected tensor(s) {unexpected}; it takes {sorted(wanted)}")
    missing = sorted(wanted - set(tensors))
    if missing:
        raise ProgramError(f"{program.name}: missing tensor(s) {missing}")

    if program.needs_even_n() and n % 2:
        raise ProgramError(f"{program.name}: pairs of columns (2j, 2j+1) need an even N, got N = {n}")
    for grouped in program.column_groups():
        columns, size = grouped.width.columns(n), grouped.column_group
        if columns % size:
            what = grouped.grouping if isinstance(grouped, QuantizedStore) else f"segment_sum(size={size})"
            raise ProgramError(f"{program.name}: {what} needs whole groups of {size} "
                               f"columns, got {columns} columns (N = {n}, width {grouped.width!r})")

    if low_rank:
        if a.dtype in ACTIVATION_DTYPE:
            raise ProgramError(f"{program.name}: a low-rank operand pair with {a.dtype} operands is not supported")
        _check_low_rank(program, tensors["a2"], tensors["b2"], a, m, n)
    if gemm.k_scale_group is not None:
        _check_k_group_scales(program, tensors["a_scale"], tensors["b_scale"], a, m, n, k)
    for name, t in tensors.items():
        if name in operand_tensors:
            continue
        _tensor(name, t, "program input")
        if t.device != a.device:
            raise ProgramError(f"{name}: expected device {a.device} (that of a), got {t.device}")
        spec = inputs.get(name)
        if spec is not None:
            spec.check_tensor(name, t, m, n)
        else:  # accumulated output
            store = next(o for o in program.outputs if o.name == name)
            check_shape(name, t, (m, store.value.width.columns(n)), f"[M, {store.value.width!r}] (accumulated output)")
            if not t.dtype.is_floating_point:
                raise ProgramError(f"{name}: expected a floating-point output to accumulate into, got {t.dtype}")
        if t.dim() > 0:
            _check_contiguous(name, t)
    return BoundProgram(program, a, b, m, n, k, dict(tensors))


def _check_k_group_scales(program: Program, a_scale, b_scale, a: torch.Tensor, m: int, n: int, k: int) -> None:
    """K-group scales (``Gemm.k_scale_group``): e4m3 operands, fp32 scales in their operand's layout with K in
    ``cdiv(K, G)`` groups (and N in ``cdiv(N, G)`` blocks for ``b_scale_block``)."""
    gemm = program.gemm
    group = gemm.k_scale_group
    if a.dtype != torch.float8_e4m3fn:
        raise ProgramError(f"{program.name}: K-group scales (k_scale_group={group}) scale float8_e4m3fn operands, "
                           f"got {a.dtype}")
    groups = cdiv(k, group)
    a_shape, b_shape = gemm.shapes(m, cdiv(n, group) if gemm.b_scale_block else n, groups)
    a_desc, b_desc = gemm.shapes("M", f"cdiv(N, {group})" if gemm.b_scale_block else "N", f"cdiv(K, {group})")
    for name, t, shape, desc in (("a_scale", a_scale, a_shape, a_desc), ("b_scale", b_scale, b_shape, b_desc)):
        _tensor(name, t, "K-group scales")
        if t.dtype != torch.float32:
            raise ProgramError(f"{name}: expected float32 K-group scales, got {t.dtype}")
        if t.device != a.device:
            raise ProgramError(f"{name}: expected device {a.device} (that of a), got {t.device}")
        check_shape(name, t, shape, f"[{', '.join(desc)}] (K = {k})")
        _check_contiguous(name, t)


def _check_low_rank(program: Program, a2, b2, a: torch.Tensor, m: int, n: int) -> None:
    """The low-rank pair: A2 [M, R] ("mk") or [R, M] ("km"), B2 [N, R] ("nk") or [R, N] ("kn")."""
    gemm = program.gemm
    for name, t in (("a2", a2), ("b2", b2)):
        _tensor(name, t, "low-rank GEMM operand")
        if t.dtype != a.dtype:
            raise ProgramError(f"{name}: expected dtype {a.dtype} (that of a), got {t.dtype}")
        if t.device != a.device:
            raise ProgramError(f"{name}: expected device {a.device} (that of a), got {t.device}")
        if t.dim() != 2:
            raise ProgramError(f"{name}: expected a 2-D matrix, got shape {tuple(t.shape)}")
        _check_contiguous(name, t)
    r = b2.shape[1] if gemm.b_layout == "nk" else b2.shape[0]
    a_shape, b_shape = gemm.shapes(m, n, r)
    a_desc, b_desc = gemm.shapes("M", "N", "R")
    if r < 1:
        raise ProgramError(f"b2: expected a rank R >= 1, got shape {tuple(b2.shape)}")
    check_shape("b2", b2, b_shape, f"[{', '.join(b_desc)}]")
    check_shape("a2", a2, a_shape, f"[{', '.join(a_desc)}] (R = {r} from b2)")
