"""Epilogue programs: one GEMM + a dataflow graph of epilogue primitives + declared outputs.

A program describes what happens to each fp32 accumulator tile of ``acc = op(A) @ op(B)`` *before* it
leaves the chip. It is plain, immutable data: expressions are frozen dataclasses that compare and
hash by value, so a program can key a compile cache and be printed as math.

Widths. Every tile-valued expression has a width relative to the GEMM's N: ``HALF`` (N/2 columns),
``FULL`` (N) or ``DOUBLE`` (2N). A tile of the accumulator with BN columns carries BN/2, BN or 2*BN
columns of such a value, so every value of one tile covers the same output rows and the same
column *pairs*. Adjacent-pair maps change width: SwiGLU takes pairs (2j, 2j+1) to one column
(FULL -> HALF), its backward takes a pair plus one gradient column back to a pair (DOUBLE + FULL ->
DOUBLE), RoPE rotates each pair in place (width kept).

The closed set of primitives:

====================  ==============================================================================
vector loads          ``RowVector`` [M] (rstd, targets, positions), ``ColVector`` [N*w] (norm weight,
                      frequencies), ``ScalarInput`` (a device tensor with one element, no host sync)
tile loads            ``TileInput`` [M, N*w] (residual, saved pre-activation)
elementwise maps      ``Unary`` (neg, exp, log, sigmoid, silu, square, rsqrt), ``Binary`` (add, sub, mul,
                      div, max), ``Constant``, ``OneHot`` (column == index[row])
adjacent-pair maps    ``SwiGLU`` (2 -> 1), ``SwiGLUBackward`` (pair + grad -> pair), ``Rope`` (2 -> 2)
segmented reductions  ``SegmentSum``: per row, the sum over each aligned group of ``size`` adjacent
                      columns, broadcast back onto the group (per-head statistics: QK-norm); a
                      group never straddles a tile, so backends need tile widths that are multiples
                      of ``size``
partial reductions    ``RowPartial`` along N: one fp32 per (row, N-tile), sum or logsumexp;
                      ``ColPartial`` along M: one fp32 per (M-tile, column), sum
stores                ``Store`` main/extra outputs, each with its dtype; ``accumulate=True`` adds
                      into a caller-given tensor (gradient accumulation)
====================  ==============================================================================

Reductions are tile-local partials; the library finishes them (``codagen.epilogue.finish``) with an
O(#tiles)-per-row pass, so no GEMM needs cross-tile communication and results are deterministic.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
from dataclasses import dataclass, field
from typing import Mapping, Union

__all__ = [
    "Width", "Gemm", "Expr", "Accumulator", "RowVector", "ColVector", "ScalarInput", "TileInput",
    "Constant", "Unary", "Binary", "OneHot", "SwiGLU", "SwiGLUBackward", "Rope",
    "SegmentSum", "Store", "RowPartial", "ColPartial", "Output", "Program", "ProgramError",
    "UNARY_OPS", "BINARY_OPS", "STORE_DTYPES",
]


class ProgramError(ValueError):
    """A program (or the tensors bound to it) is malformed; the message names the culprit."""


class Width(enum.Enum):
    """Columns of a tile value relative to the GEMM's N."""
    HALF = 0.5
    FULL = 1
    DOUBLE = 2

    def columns(self, n: int) -> int:
        return int(n * self.value)

    def halved(self) -> "Width":
        return {Width.FULL: Width.HALF, Width.DOUBLE: Width.FULL}[self]

    def doubled(self) -> "Width":
        return {Width.HALF: Width.FULL, Width.FULL: Width.DOUBLE}[self]

    def __repr__(self) -> str:
        return {Width.HALF: "N/2", Width.FULL: "N", Width.DOUBLE: "2N"}[self]


# --------------------------------------------------------------------------------------------------
# The GEMM
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gemm:
    """``acc[M, N] = op(A) @ op(B)`` with fp32 accumulation; with ``low_rank``, ``+ op(A2) @ op(B2)``.

    ``a_layout``: ``"mk"`` (A is [M, K]) or ``"km"`` (A is [K, M], used transposed).
    ``b_layout``: ``"nk"`` (B is [N, K], ``nn.Linear`` weight layout, used transposed) or ``"kn"``.
    The three forms training needs have names: ``Gemm.linear()`` ``X @ W^T`` (forward),
    ``Gemm.input_grad()`` ``dY @ W`` and ``Gemm.weight_grad()`` ``dY^T @ X``.

    ``low_rank=True`` adds a second operand pair of small inner size R in the same layouts (A2 is
    [M, R] or [R, M], B2 [N, R] or [R, N]): after its K loop the mainloop runs a short loop over R, so
    a rank-R weight update ``W + B2 A2``-style (LoRA) joins the accumulator before the epilogue.
    """
    a_layout: str = "mk"
    b_layout: str = "nk"
    low_rank: bool = False

    def __post_init__(self):
        if self.a_layout not in ("mk", "km"):
            raise ProgramError(f"Gemm.a_layout must be 'mk' or 'km', got {self.a_layout!r}")
        if self.b_layout not in ("nk", "kn"):
            raise ProgramError(f"Gemm.b_layout must be 'nk' or 'kn', got {self.b_layout!r}")
        if not isinstance(self.low_rank, bool):
            raise ProgramError(f"Gemm.low_rank must be a bool, got {self.low_rank!r}")

    @staticmethod
    def linear() -> "Gemm":
        return Gemm("mk", "nk")

    @staticmethod
    def input_grad() -> "Gemm":
        return Gemm("mk", "kn")

    @staticmethod
    def weight_grad() -> "Gemm":
        return Gemm("km", "kn")

    def shapes(self, m: int | str = "M", n: int | str = "N", k: int | str = "K"):
        """Expected shapes of A and B (of A2 and B2 with ``k = R``)."""
        a = (m, k) if self.a_layout == "mk" else (k, m)
        b = (n, k) if self.b_layout == "nk" else (k, n)
        return a, b

    def __repr__(self) -> str:
        def term(a_name: str, b_name: str, k: str) -> str:
            a = f"{a_name}[M, {k}]" if self.a_layout == "mk" else f"{a_name}[{k}, M]^T"
            b = f"{b_name}[N, {k}]^T" if self.b_layout == "nk" else f"{b_name}[{k}, N]"
            return f"{a} @ {b}"
        low_rank = f" + {term('a2', 'b2', 'R')}" if self.low_rank else ""
        return f"acc[M, N] = {term('a', 'b', 'K')}{low_rank}"


# --------------------------------------------------------------------------------------------------
# Expressions
# --------------------------------------------------------------------------------------------------
UNARY_OPS = ("neg", "exp", "log", "sigmoid", "silu", "square", "rsqrt")
BINARY_OPS = ("add", "sub", "mul", "div", "max")
_BINARY_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/"}

Operand = Union["Expr", float, int]


def _expr(value: Operand) -> "Expr":
    if isinstance(value, Expr):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Constant(float(value))
    raise ProgramError(f"expected an epilogue expression or a number, got {type(value).__name__}")


class Expr:
    """Base of epilogue expressions. Arithmetic operators build ``Binary``/``Unary`` nodes."""
    __slots__ = ()

    #: ``"tile"`` (has a width), ``"row"`` [M], ``"col"`` [N*w], ``"scalar"``
    @property
    def kind(self) -> str:
        raise NotImplementedError

    @property
    def width(self) -> Width | None:
        """Width of a tile or column value; None for rows and scalars."""
        return None

    def children(self) -> tuple["Expr", ...]:
        return ()

    def __add__(self, other: Operand) -> "Binary":
        return Binary("add", self, _expr(other))

    def __radd__(self, other: Operand) -> "Binary":
        return Binary("add", _expr(other), self)

    def __sub__(self, other: Operand) -> "Binary":
        return Binary("sub", self, _expr(other))

    def __rsub__(self, other: Operand) -> "Binary":
        return Binary("sub", _expr(other), self)

    def __mul__(self, other: Operand) -> "Binary":
        return Binary("mul", self, _expr(other))

    def __rmul__(self, other: Operand) -> "Binary":
        return Binary("mul", _expr(other), self)

    def __truediv__(self, other: Operand) -> "Binary":
        return Binary("div", self, _expr(other))

    def __rtruediv__(self, other: Operand) -> "Binary":
        return Binary("div", _expr(other), self)

    def __neg__(self) -> "Unary":
        return Unary("neg", self)


def _node(cls):
    """A frozen dataclass whose hash is computed once.

    Expressions nest, and the generated ``__hash__`` hashes the whole subtree; programs look
    expressions up in dicts while walking them, which without the memo is quadratic in their size.
    """
    cls = dataclass(frozen=True, eq=True)(cls)
    subtree_hash = cls.__hash__

    def __hash__(self):
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = subtree_hash(self)
            object.__setattr__(self, "_hash", value)
            return value

    cls.__hash__ = __hash__
    return cls


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ProgramError(f"{what} name must be a Python identifier, got {name!r}")


@_node
class Accumulator(Expr):
    """The fp32 GEMM tile ``acc``."""

    @property
    def kind(self) -> str:
        return "tile"

    @property
    def width(self) -> Width:
        return Width.FULL

    def __str__(self) -> str:
        return "acc"


@_node
class RowVector(Expr):
    """A per-row vector [M] broadcast along the tile's columns.

    ``index=True`` marks an integer vector (cross-entropy targets) usable only by ``OneHot``.
    """
    name: str
    index: bool = False

    def __post_init__(self):
        _check_name(self.name, "RowVector")

    @property
    def kind(self) -> str:
        return "row"

    def __str__(self) -> str:
        return f"{self.name}[m]"


@_node
class ColVector(Expr):
    """A per-column vector [N*w] broadcast along the tile's rows (norm weight, RoPE frequencies)."""
    name: str
    col_width: Width = Width.FULL

    def __post_init__(self):
        _check_name(self.name, "ColVector")

    @property
    def kind(self) -> str:
        return "col"

    @property
    def width(self) -> Width:
        return self.col_width

    def __str__(self) -> str:
        return f"{self.name}[n]" if self.col_width == Width.FULL else f"{self.name}[n:{self.col_width!r}]"


@_node
class ScalarInput(Expr):
    """A scalar read from a one-element device tensor (no host synchronisation)."""
    name: str

    def __post_init__(self):
        _check_name(self.name, "ScalarInput")

    @property
    def kind(self) -> str:
        return "scalar"

    def __str__(self) -> str:
        return self.name


@_node
class TileInput(Expr):
    """A second operand [M, N*w] loaded tile by tile (residual stream, saved pre-activation)."""
    name: str
    tile_width: Width = Width.FULL

    def __post_init__(self):
        _check_name(self.name, "TileInput")

    @property
    def kind(self) -> str:
        return "tile"

    @property
    def width(self) -> Width:
        return self.tile_width

    def __str__(self) -> str:
        return f"{self.name}[m, n]" if self.tile_width == Width.FULL else f"{self.name}[m, n:{self.tile_width!r}]"


@_node
class Constant(Expr):
    value: float

    def __post_init__(self):
        if not math.isfinite(self.value):
            raise ProgramError(f"Constant must be finite, got {self.value!r}")

    @property
    def kind(self) -> str:
        return "scalar"

    def __str__(self) -> str:
        return repr(self.value)


def _broadcast(*operands: Expr) -> tuple[str, Width | None]:
    """Kind and width of an elementwise result; raises on incompatible operands."""
    widths = {o.width for o in operands if o.kind in ("tile", "col")}
    if len(widths) > 1:
        shown = ", ".join(f"{o} ({o.width!r})" for o in operands if o.kind in ("tile", "col"))
        raise ProgramError(f"elementwise operands have different widths: {shown}")
    if any(isinstance(o, RowVector) and o.index for o in operands):
        raise ProgramError("an index RowVector can only feed OneHot, not arithmetic")
    kinds = {o.kind for o in operands}
    if "tile" in kinds or ("row" in kinds and "col" in kinds):
        return "tile", (widths.pop() if widths else Width.FULL)
    for k in ("row", "col"):
        if k in kinds:
            return k, (widths.pop() if widths else None)
    return "scalar", None


@_node
class Unary(Expr):
    op: str
    x: Expr

    def __post_init__(self):
        if self.op not in UNARY_OPS:
            raise ProgramError(f"unknown unary op {self.op!r}; expected one of {UNARY_OPS}")
        _broadcast(self.x)

    @property
    def kind(self) -> str:
        return self.x.kind

    @property
    def width(self) -> Width | None:
        return self.x.width

    def children(self):
        return (self.x,)

    def __str__(self) -> str:
        return _render(self, str)


@_node
class Binary(Expr):
    op: str
    a: Expr
    b: Expr

    def __post_init__(self):
        if self.op not in BINARY_OPS:
            raise ProgramError(f"unknown binary op {self.op!r}; expected one of {BINARY_OPS}")
        _broadcast(self.a, self.b)

    @functools.cached_property
    def kind(self) -> str:
        return _broadcast(self.a, self.b)[0]

    @functools.cached_property
    def width(self) -> Width | None:
        return _broadcast(self.a, self.b)[1]

    def children(self):
        return (self.a, self.b)

    def __str__(self) -> str:
        return _render(self, str)


@_node
class OneHot(Expr):
    """1.0 where the tile's global column index equals ``index[row]``, else 0.0 (FULL width).

    Picks the target logit for cross-entropy; an index outside [0, N) (ignore_index = -100) gives
    an all-zero row.
    """
    index: RowVector

    def __post_init__(self):
        if not (isinstance(self.index, RowVector) and self.index.index):
            raise ProgramError("OneHot needs a RowVector(..., index=True)")

    @property
    def kind(self) -> str:
        return "tile"

    @property
    def width(self) -> Width:
        return Width.FULL

    def children(self):
        return (self.index,)

    def __str__(self) -> str:
        return f"[n == {self.index}]"


def _need_pairs(x: Expr, what: str) -> None:
    if x.kind != "tile":
        raise ProgramError(f"{what} needs a tile value, got {x} ({x.kind})")


@_node
class SwiGLU(Expr):
    """Adjacent-pair map 2 -> 1: ``out[j] = silu(x[2j]) * x[2j+1]`` (interleaved gate/up columns)."""
    x: Expr

    def __post_init__(self):
        _need_pairs(self.x, "SwiGLU")
        if self.x.width == Width.HALF:
            raise ProgramError("SwiGLU input must be FULL or DOUBLE width (it halves the width)")

    @property
    def kind(self) -> str:
        return "tile"

    @property
    def width(self) -> Width:
        return self.x.width.halved()

    def children(self):
        return (self.x,)

    def __str__(self) -> str:
        return _render(self, str)


@_node
class SwiGLUBackward(Expr):
    """Adjacent-pair map (pair + gradient) -> pair: the gradient of ``silu(g) * u``.

    With ``(g, u) = (preact[2j], preact[2j+1])``, ``dy = grad[j]`` and ``s = sigmoid(g)``::

        dg = dy * u * s * (1 + g * (1 - s))      du = dy * g * s

    The result is interleaved ``(dg, du)`` with the width of ``preact`` (twice that of ``grad``).
    """
    preact: Expr
    grad: Expr

    def __post_init__(self):
        _need_pairs(self.preact, "SwiGLUBackward(preact)")
        _need_pairs(self.grad, "SwiGLUBackward(grad)")
        if self.preact.width == Width.HALF or self.preact.width.halved() != self.grad.width:
            raise ProgramError(
                f"SwiGLUBackward needs preact twice as wide as grad, got {self.preact.width!r} and {self.grad.width!r}")

    @property
    def kind(self) -> str:
        return "tile"

    @property
    def width(self) -> Width:
        return self.preact.width

    def children(self):
        return (self.preact, self.grad)

    def __str__(self) -> str:
        return _render(self, str)


@_node
class Rope(Expr):
    """Adjacent-pair map 2 -> 2: rotate each pair (x[2j], x[2j+1]) by ``theta = position[m] * frequency[j]``::

        y[2j]   = x[2j] * cos(theta) - x[2j+1] * sin(theta)
        y[2j+1] = x[2j] * sin(theta) + x[2j+1] * cos(theta)

    ``inverse=True`` rotates by ``-theta`` (the backward pass). The angle is computed in registers:
    no cos/sin table is read. Columns that must not rotate (V) get frequency 0.
    """
    x: Expr
    positions: RowVector
    frequencies: ColVector
    inverse: bool = False

    def __post_init__(self):
        _need_pairs(self.x, "Rope")
        if not isinstance(self.positions, RowVector) or self.positions.index:
            raise ProgramError("Rope.positions must be a float RowVector")
        if not isinstance(self.frequencies, ColVector):
            raise ProgramError("Rope.frequencies must be a ColVector")
        if self.x.width == Width.HALF or self.frequencies.width != self.x.width.halved():
            raise ProgramError(
                f"Rope frequencies have one value per pair: width {self.x.width!r} needs a "
                f"ColVector of width {self.x.width.halved()!r}" if self.x.width != Width.HALF
                else "Rope input must be FULL or DOUBLE width")

    @property
    def kind(self) -> str:
        return "tile"

    @property
    def width(self) -> Width:
        return self.x.width

    def children(self):
        return (self.x, self.positions, self.frequencies)

    def __str__(self) -> str:
        return _render(self, str)


@_node
class SegmentSum(Expr):
    """Tile-local segmented row sum: columns form aligned groups of ``size`` adjacent columns
    ``[g * size, (g + 1) * size)``, and every column gets its group's sum::

        out[m, n] = sum over n' with n' // size == n // size of x[m, n']

    The width is kept. With ``size = head_dim`` on a QKV tile it is a per-(row, head) statistic
    broadcast back onto the head's columns (QK-norm's sum of squares). A group must lie inside one
    tile: backends use tiles whose width (of ``x``'s columns) is a multiple of ``size``, and binding
    needs ``N * w`` to be a multiple of ``size`` (no group straddles the matrix edge). ``size`` is
    even, so a group is ``size / 2`` whole column pairs.
    """
    x: Expr
    size: int

    def __post_init__(self):
        if self.x.kind != "tile":
            raise ProgramError(f"SegmentSum needs a tile value, got {self.x} ({self.x.kind})")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 2 or self.size % 2:
            raise ProgramError(f"SegmentSum.size must be an even int >= 2 (whole column pairs), got {self.size!r}")

    @property
    def kind(self) -> str:
        return "tile"

    @property
    def width(self) -> Width:
        return self.x.width

    def children(self):
        return (self.x,)

    def __str__(self) -> str:
        return _render(self, str)


# --------------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------------
#: ``"input"`` = the dtype of operand A; explicit float dtypes by name.
STORE_DTYPES = ("input", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Store:
    """Write a tile value to output ``name`` [M, N*w].

    ``accumulate=True``: ``name += value``, into a tensor the caller passes (its dtype is kept);
    used for in-place gradient accumulation. Otherwise the backend allocates the output in ``dtype``.
    """
    name: str
    value: Expr
    dtype: str = "input"
    accumulate: bool = False

    def __post_init__(self):
        _check_name(self.name, "Store")
        if self.value.kind != "tile":
            raise ProgramError(f"Store {self.name!r} needs a tile value, got {self.value} ({self.value.kind})")
        if self.dtype not in STORE_DTYPES:
            raise ProgramError(f"Store {self.name!r}: dtype must be one of {STORE_DTYPES}, got {self.dtype!r}")

    def describe(self, value: str) -> str:
        arrow = "+=" if self.accumulate else "<-"
        dtype = "" if self.accumulate else f"  ({self.dtype})"
        cols = "n" if self.value.width == Width.FULL else f"n:{self.value.width!r}"
        return f"{self.name}[m, {cols}] {arrow} {value}{dtype}"

    def __str__(self) -> str:
        return self.describe(str(self.value))


@dataclass(frozen=True)
class RowPartial:
    """Tile-local reduction along N: output ``name`` [M, n_tiles] in fp32, one value per (row, N-tile).

    ``reduction="sum"``: sum over the tile's valid columns. ``"logsumexp"``: online max + sum-exp,
    stored as ``max + log(sum exp(x - max))``; partials merge with a logsumexp over tiles.
    Columns past the matrix edge are excluded. ``n_tiles`` is chosen by the backend.
    """
    name: str
    value: Expr
    reduction: str = "sum"

    def __post_init__(self):
        _check_name(self.name, "RowPartial")
        if self.value.kind != "tile":
            raise ProgramError(f"RowPartial {self.name!r} needs a tile value, got {self.value} ({self.value.kind})")
        if self.reduction not in ("sum", "logsumexp"):
            raise ProgramError(f"RowPartial {self.name!r}: reduction must be 'sum' or 'logsumexp', got {self.reduction!r}")

    def describe(self, value: str) -> str:
        return f"{self.name}[m, tile_n] <- {self.reduction}_n({value})  (float32 partial)"

    def __str__(self) -> str:
        return self.describe(str(self.value))


@dataclass(frozen=True)
class ColPartial:
    """Tile-local sum along M: output ``name`` [m_tiles, N*w] in fp32, one value per (M-tile, column).

    Rows past the matrix edge are excluded. ``m_tiles`` is chosen by the backend.
    """
    name: str
    value: Expr

    def __post_init__(self):
        _check_name(self.name, "ColPartial")
        if self.value.kind != "tile":
            raise ProgramError(f"ColPartial {self.name!r} needs a tile value, got {self.value} ({self.value.kind})")

    def describe(self, value: str) -> str:
        return f"{self.name}[tile_m, n] <- sum_m({value})  (float32 partial)"

    def __str__(self) -> str:
        return self.describe(str(self.value))


Output = Union[Store, RowPartial, ColPartial]


def _render(e: Expr, show) -> str:
    """``str(e)`` with each child printed by ``show`` (which may substitute a name)."""
    if isinstance(e, Unary):
        return f"-({show(e.x)})" if e.op == "neg" else f"{e.op}({show(e.x)})"
    if isinstance(e, Binary):
        if e.op in _BINARY_SYMBOL:
            return f"({show(e.a)} {_BINARY_SYMBOL[e.op]} {show(e.b)})"
        return f"{e.op}({show(e.a)}, {show(e.b)})"
    if isinstance(e, SwiGLU):
        return f"swiglu({show(e.x)})"
    if isinstance(e, SwiGLUBackward):
        return f"swiglu_backward({show(e.preact)}, {show(e.grad)})"
    if isinstance(e, Rope):
        return f"rope({show(e.x)}, {'-' if e.inverse else ''}{e.positions} * {e.frequencies})"
    if isinstance(e, SegmentSum):
        return f"segment_sum({show(e.x)}, size={e.size})"
    return str(e)


# --------------------------------------------------------------------------------------------------
# Program
# --------------------------------------------------------------------------------------------------
def _walk(expr: Expr, seen: dict[Expr, None]) -> None:
    """Post-order DFS: children before parents, each expression once."""
    if expr in seen:
        return
    for child in expr.children():
        _walk(child, seen)
    seen[expr] = None


@dataclass(frozen=True)
class Program:
    """One GEMM, its epilogue expressions, and the outputs they feed.

    >>> acc, rstd = Accumulator(), RowVector("rstd")
    >>> z = acc * rstd
    >>> p = Program("gate_up_swiglu", Gemm.linear(), (Store("preact", z), Store("out", SwiGLU(z))))
    """
    name: str
    gemm: Gemm
    outputs: tuple[Output, ...]
    doc: str = field(default="", compare=False)

    def __post_init__(self):
        _check_name(self.name, "Program")
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if not self.outputs:
            raise ProgramError(f"program {self.name!r} has no outputs")
        names = [o.name for o in self.outputs]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ProgramError(f"program {self.name!r}: output names repeat: {sorted(dup)}")
        inputs = self.inputs
        clash = set(inputs) & set(names)
        if clash:
            raise ProgramError(f"program {self.name!r}: names used for both an input and an output: {sorted(clash)}")
        if {"a", "b", "a2", "b2"} & (set(inputs) | set(names)):
            raise ProgramError(f"program {self.name!r}: 'a', 'b', 'a2' and 'b2' are reserved for the GEMM operands")

    # -- structure (computed once: a program is immutable, and kernels launch it many times) ---------
    def expressions(self) -> tuple[Expr, ...]:
        """Every expression in evaluation order (operands before their users)."""
        return self._expressions

    @functools.cached_property
    def _expressions(self) -> tuple[Expr, ...]:
        seen: dict[Expr, None] = {}
        for out in self.outputs:
            _walk(out.value, seen)
        return tuple(seen)

    @functools.cached_property
    def inputs(self) -> Mapping[str, Expr]:
        """Named inputs (RowVector, ColVector, ScalarInput, TileInput) in first-use order."""
        found: dict[str, Expr] = {}
        for e in self.expressions():
            if isinstance(e, (RowVector, ColVector, ScalarInput, TileInput)):
                if e.name in found and found[e.name] != e:
                    raise ProgramError(
                        f"program {self.name!r}: input {e.name!r} is declared twice differently: {found[e.name]!r} and {e!r}")
                found[e.name] = e
        return types.MappingProxyType(found)

    @functools.cached_property
    def _accumulated_outputs(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.outputs if isinstance(o, Store) and o.accumulate)

    def accumulated_outputs(self) -> list[str]:
        return list(self._accumulated_outputs)

    @functools.cached_property
    def _has_pairs(self) -> bool:
        return any(isinstance(e, (SwiGLU, SwiGLUBackward, Rope)) for e in self.expressions())

    def has_pairs(self) -> bool:
        return self._has_pairs

    @functools.cached_property
    def _segment_sums(self) -> tuple["SegmentSum", ...]:
        return tuple(e for e in self.expressions() if isinstance(e, SegmentSum))

    def segment_sums(self) -> tuple["SegmentSum", ...]:
        """The program's ``SegmentSum`` expressions: each needs tile widths that are multiples of its size."""
        return self._segment_sums

    @functools.cached_property
    def _needs_even_n(self) -> bool:
        return self._has_pairs or any(e.width == Width.HALF for e in self.expressions() if e.kind in ("tile", "col"))

    def needs_even_n(self) -> bool:
        """Whether column pairs (2j, 2j+1) or half-width values appear, so N must be even."""
        return self._needs_even_n

    def shared_expressions(self) -> list[Expr]:
        """Compound expressions used more than once (named once in the printout, computed once by kernels)."""
        uses: dict[Expr, int] = {}
        for e in self.expressions():
            for child in e.children():
                uses[child] = uses.get(child, 0) + 1
        for out in self.outputs:
            uses[out.value] = uses.get(out.value, 0) + 1
        return [e for e in self.expressions() if uses.get(e, 0) > 1 and e.children()]

    def __str__(self) -> str:
        """The program as math: shared subexpressions become named lines ``t0 = ...``."""
        names: dict[Expr, str] = {}

        def show(e: Expr) -> str:
            if e in names:
                return names[e]
            if not e.children():
                return str(e)
            # Render with children replaced by their names: rebuild a shallow printout.
            return _render(e, show)

        lines = [f"program {self.name}:", f"  {self.gemm!r}"]
        for i, e in enumerate(self.shared_expressions()):
            lines.append(f"  t{i} = {show(e)}")
            names[e] = f"t{i}"
        for out in self.outputs:
            lines.append("  " + out.describe(show(out.value)))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Program {self.name}: {len(self.outputs)} outputs, inputs {list(self.inputs)}>"

    def with_low_rank(self) -> "Program":
        """The same program with the GEMM's low-rank operand pair (``Gemm.low_rank``)."""
        return _with_low_rank(self)

    def renamed(self, names: Mapping[str, str]) -> "Program":
        """The same program with inputs and outputs renamed by ``names`` (old -> new; absent ones kept)."""
        memo: dict[Expr, Expr] = {}
        outputs = tuple(dataclasses.replace(o, name=names.get(o.name, o.name), value=_renamed(o.value, names, memo))
                        for o in self.outputs)
        return Program(self.name, self.gemm, outputs, doc=self.doc)


def _renamed(e: Expr, names: Mapping[str, str], memo: dict[Expr, Expr]) -> Expr:
    """``e`` with every named input renamed by ``names`` (shared subexpressions stay shared)."""
    if e not in memo:
        changes = {f.name: _renamed(getattr(e, f.name), names, memo) for f in dataclasses.fields(e)
                   if isinstance(getattr(e, f.name), Expr)}
        if isinstance(getattr(e, "name", None), str) and e.name in names:
            changes["name"] = names[e.name]
        memo[e] = dataclasses.replace(e, **changes) if changes else e
    return memo[e]


@functools.cache
def _with_low_rank(program: Program) -> Program:
    gemm = Gemm(program.gemm.a_layout, program.gemm.b_layout, low_rank=True)
    return Program(program.name, gemm, program.outputs, doc=program.doc)
