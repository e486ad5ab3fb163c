"""The frame of epilogue programs: widths, the GEMM, the expression base, outputs and ``Program``.

Nothing here names a primitive: every expression node (``codagen.epilogue.primitives``) is one class
registered with :func:`primitive`, and a program asks its nodes what it needs (their children, whether
they are named inputs, whether they pair columns, how their columns group). The IR as users import it
is :mod:`codagen.epilogue.ir`.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Union

import torch

__all__ = [
    "Width", "Gemm", "Expr", "Store", "QuantizedStore", "RowPartial", "ColPartial", "Output", "Program",
    "ProgramError", "STORE_DTYPES", "E4M3_MAX", "AMAX_FLOOR", "quantize_groups_ref", "is_group_size", "PRIMITIVES",
    "primitive", "as_expr", "broadcast", "need_tile", "check_name", "check_shape", "Example"
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

    def halved(self) -> Width:
        return {Width.FULL: Width.HALF, Width.DOUBLE: Width.FULL}[self]

    def doubled(self) -> Width:
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

    ``k_scale_group=G`` scales both operands per aligned group of G along K (FP8's blockwise scaling):
    ``acc = sum over groups g of (A[:, g] @ B[g, :]) * a_scale[m, g] * b_scale[n, g]``, each group's product
    scaled in fp32 as the K loop passes it. The scales (fp32) have their operand's layout with K divided into
    ``cdiv(K, G)`` groups: ``a_scale`` [M, K/G] ("mk") or [K/G, M] ("km"), one per row and group (1 x G, what a
    :class:`QuantizedStore` of group G writes); ``b_scale`` [N, K/G] ("nk") or [K/G, N] ("kn"), or with
    ``b_scale_block=True`` one per G x G block of B, [N/G, K/G] or [K/G, N/G] (a weight's scales, DeepSeek-V3's
    recipe: one scale serves the forward's ``x @ W^T`` and the input gradient's ``dY @ W``, and it is a scalar per
    K tile, where per-column scales cost a register per accumulator column).
    """
    a_layout: str = "mk"
    b_layout: str = "nk"
    low_rank: bool = False
    k_scale_group: int | None = None
    b_scale_block: bool = False

    def __post_init__(self):
        if self.a_layout not in ("mk", "km"):
            raise ProgramError(f"Gemm.a_layout must be 'mk' or 'km', got {self.a_layout!r}")
        if self.b_layout not in ("nk", "kn"):
            raise ProgramError(f"Gemm.b_layout must be 'nk' or 'kn', got {self.b_layout!r}")
        if not isinstance(self.low_rank, bool):
            raise ProgramError(f"Gemm.low_rank must be a bool, got {self.low_rank!r}")
        group = self.k_scale_group
        if group is not None and not is_group_size(group):
            raise ProgramError(f"Gemm.k_scale_group must be None or a power of two >= 16 (whole K tiles of the "
                               f"mainloop), got {group!r}")
        if group is not None and self.low_rank:
            raise ProgramError("Gemm: K-group scales with a low-rank operand pair are not supported")
        if self.b_scale_block and group is None:
            raise ProgramError("Gemm.b_scale_block needs k_scale_group (the block is k_scale_group x k_scale_group)")

    @staticmethod
    def linear() -> Gemm:
        return Gemm("mk", "nk")

    @staticmethod
    def input_grad() -> Gemm:
        return Gemm("mk", "kn")

    @staticmethod
    def weight_grad() -> Gemm:
        return Gemm("km", "kn")

    def shapes(self, m: int | str = "M", n: int | str = "N", k: int | str = "K"):
        """Expected shapes of A and B (of A2 and B2 with ``k = R``; of a_scale and b_scale with ``k = K/G``)."""
        a = (m, k) if self.a_layout == "mk" else (k, m)
        b = (n, k) if self.b_layout == "nk" else (k, n)
        return a, b

    @property
    def operand_tensors(self) -> tuple[str, ...]:
        """The GEMM's named tensors besides A and B: the low-rank pair, or the K-group scales."""
        if self.low_rank:
            return ("a2", "b2")
        if self.k_scale_group is not None:
            return ("a_scale", "b_scale")
        return ()

    def __repr__(self) -> str:
        def term(a_name: str, b_name: str, k: str) -> str:
            a = f"{a_name}[M, {k}]" if self.a_layout == "mk" else f"{a_name}[{k}, M]^T"
            b = f"{b_name}[N, {k}]^T" if self.b_layout == "nk" else f"{b_name}[{k}, N]"
            return f"{a} @ {b}"
        low_rank = f" + {term('a2', 'b2', 'R')}" if self.low_rank else ""
        if self.k_scale_group is not None:
            group = self.k_scale_group
            b_scale = f"b_scale[n / {group}, g]" if self.b_scale_block else "b_scale[n, g]"
            return (f"acc[M, N] = sum_g {term('a', 'b', f'g:{group}')} * a_scale[m, g] * {b_scale}  "
                    f"(K in groups g of {group})")
        return f"acc[M, N] = {term('a', 'b', 'K')}{low_rank}"


# --------------------------------------------------------------------------------------------------
# Expressions
# --------------------------------------------------------------------------------------------------
#: every primitive by class name, in registration order (``@primitive``)
PRIMITIVES: dict[str, type] = {}

Operand = Union["Expr", float, int]


def as_expr(value: Operand) -> Expr:
    """``value`` as an expression: numbers become ``Constant``."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return PRIMITIVES["Constant"](float(value))
    raise ProgramError(f"expected an epilogue expression or a number, got {type(value).__name__}")


class Expr:
    """Base of epilogue expressions: a primitive (``codagen.epilogue.primitives``) and its operands.

    A primitive class carries, in its own file: the node and its validation (``__post_init__``), its
    printed form (:meth:`render`), its reference semantics (:meth:`reference`), its code in the
    persistent ``tl`` kernel (:meth:`emit_persistent`) and in the ping-pong Gluon kernel
    (:meth:`emit_pingpong`, or :meth:`pingpong_refusal`), its tile constraints (:attr:`pairs`,
    :attr:`column_group`) and a few example programs (:meth:`examples`). Arithmetic operators build
    ``Binary``/``Unary`` nodes.
    """
    __slots__ = ()

    #: a named input (a tensor the caller passes): it has ``name`` and :meth:`check_tensor`
    is_input = False
    #: uses adjacent column pairs (2j, 2j+1): N must be even and tiles never split a pair
    pairs = False

    #: ``"tile"`` (has a width), ``"row"`` [M], ``"col"`` [N*w], ``"scalar"``
    @property
    def kind(self) -> str:
        raise NotImplementedError

    @property
    def width(self) -> Width | None:
        """Width of a tile or column value; None for rows and scalars."""
        return None

    @property
    def column_group(self) -> int | None:
        """Columns that must lie in one tile together (aligned groups of this many), or None."""
        return None

    def children(self) -> tuple[Expr, ...]:
        return ()

    # -- what every primitive defines ---------------------------------------------------------------
    def render(self, show: Callable[[Expr], str]) -> str:
        """The printed form, each child printed by ``show`` (which may substitute a name)."""
        raise NotImplementedError

    def reference(self, ev) -> torch.Tensor:
        """The value on whole tensors (``codagen.backends.reference``): ``ev.value(child)`` of the children,
        ``ev.tensor(name)``, ``ev.dtype``, ``ev.device``, ``ev.m``, ``ev.n``."""
        raise NotImplementedError

    def emit_persistent(self, em) -> str:
        """Emit the ``tl`` code of this value through ``em`` (the persistent generator's emitter:
        ``codagen.backends.triton.persistent``); return its variable."""
        raise NotImplementedError

    def emit_pingpong(self, em) -> None:
        """Emit the Gluon code of this value through ``em`` (the ping-pong generator's emitter), recording
        its variable (``em.full[self]``) or its (even, odd) halves (``em.pairs[self]``)."""
        raise NotImplementedError

    def pingpong_refusal(self) -> str | None:
        """Why the ping-pong schedule cannot compute this value (None if it can)."""
        return None

    @classmethod
    def examples(cls) -> list[Example]:
        """Small programs using this primitive, each with its float64 meaning (the shared tests run them)."""
        return []

    def __str__(self) -> str:
        return self.render(str)

    def __add__(self, other: Operand) -> Expr:
        return PRIMITIVES["Binary"]("add", self, as_expr(other))

    def __radd__(self, other: Operand) -> Expr:
        return PRIMITIVES["Binary"]("add", as_expr(other), self)

    def __sub__(self, other: Operand) -> Expr:
        return PRIMITIVES["Binary"]("sub", self, as_expr(other))

    def __rsub__(self, other: Operand) -> Expr:
        return PRIMITIVES["Binary"]("sub", as_expr(other), self)

    def __mul__(self, other: Operand) -> Expr:
        return PRIMITIVES["Binary"]("mul", self, as_expr(other))

    def __rmul__(self, other: Operand) -> Expr:
        return PRIMITIVES["Binary"]("mul", as_expr(other), self)

    def __truediv__(self, other: Operand) -> Expr:
        return PRIMITIVES["Binary"]("div", self, as_expr(other))

    def __rtruediv__(self, other: Operand) -> Expr:
        return PRIMITIVES["Binary"]("div", as_expr(other), self)

    def __neg__(self) -> Expr:
        return PRIMITIVES["Unary"]("neg", self)


def primitive(cls):
    """Register an expression class as a primitive: a frozen dataclass whose hash is computed once.

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
    if cls.__name__ in PRIMITIVES:
        raise TypeError(f"a primitive named {cls.__name__} is registered already")
    PRIMITIVES[cls.__name__] = cls
    return cls


def is_group_size(value) -> bool:
    """Whether ``value`` is a size of FP8 scale groups: an int power of two >= 16 (a group holds whole K tiles of
    the mainloop's dot, and its columns are whole pairs)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 16 and not value & (value - 1)


def check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ProgramError(f"{what} name must be a Python identifier, got {name!r}")


def check_shape(name: str, t: torch.Tensor, shape: tuple, desc: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ProgramError(f"{name}: expected shape {desc} = {tuple(shape)}, got {tuple(t.shape)}")


def broadcast(*operands: Expr) -> tuple[str, Width | None]:
    """Kind and width of an elementwise result; raises on incompatible operands."""
    widths = {o.width for o in operands if o.kind in ("tile", "col")}
    if len(widths) > 1:
        shown = ", ".join(f"{o} ({o.width!r})" for o in operands if o.kind in ("tile", "col"))
        raise ProgramError(f"elementwise operands have different widths: {shown}")
    if any(o.is_input and getattr(o, "index", False) is True for o in operands):
        raise ProgramError("an index RowVector can only feed OneHot, not arithmetic")
    kinds = {o.kind for o in operands}
    if "tile" in kinds or ("row" in kinds and "col" in kinds):
        return "tile", (widths.pop() if widths else Width.FULL)
    for k in ("row", "col"):
        if k in kinds:
            return k, (widths.pop() if widths else None)
    return "scalar", None


def need_tile(x: Expr, what: str) -> None:
    if x.kind != "tile":
        raise ProgramError(f"{what} needs a tile value, got {x} ({x.kind})")


class Example(NamedTuple):
    """A program that uses a primitive, and its meaning in float64: ``oracle(acc, tensors)`` gives each
    output from the float64 accumulator ``acc`` [M, N] and inputs: a Store's [M, N*w] tile, a sum
    RowPartial's [M] row sums. ``n``: a GEMM N the program takes (a multiple of its column groups)."""
    program: Program
    oracle: Callable[[torch.Tensor, dict], dict]
    n: int = 64



# --------------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------------
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
        check_name(self.name, "Store")
        if self.value.kind != "tile":
            raise ProgramError(f"Store {self.name!r} needs a tile value, got {self.value} ({self.value.kind})")
        if self.dtype not in STORE_DTYPES:
            raise ProgramError(f"Store {self.name!r}: dtype must be one of {STORE_DTYPES}, got {self.dtype!r}")

    @property
    def names(self) -> tuple[str, ...]:
        """The tensors this output writes."""
        return (self.name,)

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
        check_name(self.name, "RowPartial")
        if self.value.kind != "tile":
            raise ProgramError(f"RowPartial {self.name!r} needs a tile value, got {self.value} ({self.value.kind})")
        if self.reduction not in ("sum", "logsumexp"):
            raise ProgramError(f"RowPartial {self.name!r}: reduction must be 'sum' or 'logsumexp', "
                               f"got {self.reduction!r}")

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

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
        check_name(self.name, "ColPartial")
        if self.value.kind != "tile":
            raise ProgramError(f"ColPartial {self.name!r} needs a tile value, got {self.value} ({self.value.kind})")

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    def describe(self, value: str) -> str:
        return f"{self.name}[tile_m, n] <- sum_m({value})  (float32 partial)"

    def __str__(self) -> str:
        return self.describe(str(self.value))


#: e4m3's largest finite value, and the floor of a group's amax (an all-zero group gets a finite scale)
E4M3_MAX, AMAX_FLOOR = 448.0, 1e-12


def quantize_groups_ref(x: torch.Tensor, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``x`` [M, K] in groups of ``rows x columns`` elements (a :class:`QuantizedStore`'s along N
    are ``1 x group``, along M ``group x 1``): ``q`` float8_e4m3fn [M, K], ``scale`` fp32 [cdiv(M, rows), cdiv(K,
    columns)]; a last, partial group takes the elements there are. The divisions run in float64, so both are
    correctly rounded to fp32 (as a kernel's ``div_rn`` is); the product ``x * (448 / amax)`` is rounded to ``x``'s
    dtype (fp32 in the epilogue) before the cast."""
    m, k = x.shape
    row_groups, column_groups = -(-m // rows), -(-k // columns)
    padded = x.new_zeros(row_groups * rows, column_groups * columns)  # zeros leave every amax as it is
    padded[:m, :k] = x
    groups = padded.view(row_groups, rows, column_groups, columns)
    amax = groups.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR).double()
    inv_scale, scale = (E4M3_MAX / amax).to(x.dtype), (amax / E4M3_MAX).float()
    q = (groups * inv_scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view_as(padded)[:m, :k]
    return q.to(torch.float8_e4m3fn), scale


@dataclass(frozen=True)
class QuantizedStore:
    """Write a tile value to output ``name`` [M, N*w] in e4m3, with one dequantization factor per aligned group of
    ``group`` elements in output ``scale`` (fp32, default name ``<name>_scale``)::

        amax        = max(max over the group of |v[m, n]|, 1e-12)
        scale[g]    = amax / 448,   name[m, n] = e4m3(clamp(v[m, n] * (448 / amax), -448, 448))

    rounded to nearest even, both divisions correctly rounded (:func:`quantize_groups_ref`). Each group's
    largest element lands on 448, e4m3's largest finite value.

    ``along="n"``: a group is ``group`` columns of one row, ``scale`` [M, N*w / group], and ``N * w`` a multiple of
    the group; the activation operand of the next GEMM, whose K is these columns. ``along="m"``: a group is
    ``group`` rows of one column, ``scale`` [cdiv(M, group), N*w] (a last, partial group takes the rows there are);
    an operand of a weight gradient, whose K is these rows (the tokens).

    A group lies inside one tile (:attr:`column_group` or :attr:`row_group`), so the store needs nothing from other
    tiles: its output is the ``group``-blockwise-scaled operand of a GEMM with ``Gemm(k_scale_group=group)``. One
    scale per whole row would need the row's amax before any element is rounded, which a tile does not have
    (``docs/notes/fp8-quantizing-epilogue.md``).
    """
    name: str
    value: Expr
    scale: str = ""
    group: int = 128
    along: str = "n"

    def __post_init__(self):
        check_name(self.name, "QuantizedStore")
        if not self.scale:
            object.__setattr__(self, "scale", f"{self.name}_scale")
        check_name(self.scale, "QuantizedStore scale")
        if self.value.kind != "tile":
            raise ProgramError(f"QuantizedStore {self.name!r} needs a tile value, got {self.value} ({self.value.kind})")
        if not is_group_size(self.group):
            raise ProgramError(f"QuantizedStore {self.name!r}: group must be a power of two >= 16, got {self.group!r}")
        if self.along not in ("n", "m"):
            raise ProgramError(f"QuantizedStore {self.name!r}: along must be 'n' (groups of columns) or 'm' (groups "
                               f"of rows), got {self.along!r}")

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, self.scale)

    @property
    def width(self) -> Width:
        return self.value.width

    @property
    def column_group(self) -> int | None:
        """Columns that lie in one tile together: the group along N (None along M)."""
        return self.group if self.along == "n" else None

    @property
    def row_group(self) -> int | None:
        """Rows that lie in one tile together: the group along M (None along N)."""
        return self.group if self.along == "m" else None

    @property
    def grouping(self) -> str:
        """The store and its groups, as errors name them."""
        unit = "columns" if self.along == "n" else "rows"
        return f"the quantized store {self.name!r} (scales per {self.group} {unit})"

    def quantized(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes, scale)`` of the store for its whole value [M, N*w] (the reference backend's)."""
        return quantize_groups_ref(value, *((1, self.group) if self.along == "n" else (self.group, 1)))

    def describe(self, value: str) -> str:
        cols = "n" if self.value.width == Width.FULL else f"n:{self.value.width!r}"
        scale = f"[m, n / {self.group}]" if self.along == "n" else f"[m / {self.group}, {cols}]"
        unit = "columns" if self.along == "n" else "rows"
        return (f"{self.name}[m, {cols}], {self.scale}{scale} <- e4m3 of {value}, scaled per {self.group} {unit}")

    def __str__(self) -> str:
        return self.describe(str(self.value))


Output = Store | QuantizedStore | RowPartial | ColPartial


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

    >>> from codagen.epilogue.ir import Accumulator, RowVector, SwiGLU
    >>> acc, rstd = Accumulator(), RowVector("rstd")
    >>> z = acc * rstd
    >>> p = Program("gate_up_swiglu", Gemm.linear(), (Store("preact", z), Store("out", SwiGLU(z))))
    """
    name: str
    gemm: Gemm
    outputs: tuple[Output, ...]
    doc: str = field(default="", compare=False)
    #: a program whose tuned choices stand in for this one's until it has its own: the same GEMM with a like
    #: epilogue (an inference program's training twin, which also stores what backward needs; a GeGLU program's
    #: SwiGLU twin or a soft-capped LM-head program's uncapped twin, a few instructions more per element)
    tuning_stand_in: Program | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        check_name(self.name, "Program")
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if not self.outputs:
            raise ProgramError(f"program {self.name!r} has no outputs")
        names = self.output_tensors
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ProgramError(f"program {self.name!r}: output names repeat: {sorted(dup)}")
        inputs = self.inputs
        clash = set(inputs) & set(names)
        if clash:
            raise ProgramError(f"program {self.name!r}: names used for both an input and an output: {sorted(clash)}")
        if {"a", "b", "a2", "b2"} & (set(inputs) | set(names)):
            raise ProgramError(f"program {self.name!r}: 'a', 'b', 'a2' and 'b2' are reserved for the GEMM operands")
        if set(self.gemm.operand_tensors) & (set(inputs) | set(names)):
            raise ProgramError(f"program {self.name!r}: {list(self.gemm.operand_tensors)} are the GEMM's K-group "
                               f"scales; an input or output takes one of those names")

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
            if e.is_input:
                if e.name in found and found[e.name] != e:
                    raise ProgramError(
                        f"program {self.name!r}: input {e.name!r} is declared twice differently: {found[e.name]!r} "
                        f"and {e!r}")
                found[e.name] = e
        return types.MappingProxyType(found)

    @functools.cached_property
    def output_tensors(self) -> tuple[str, ...]:
        """Every tensor the outputs write, in order (a ``QuantizedStore`` writes its codes, then its scales)."""
        return tuple(name for o in self.outputs for name in o.names)

    @functools.cached_property
    def quantized_codes(self) -> tuple[str, ...]:
        """The e4m3 outputs: each ``QuantizedStore``'s codes."""
        return tuple(o.name for o in self.outputs if isinstance(o, QuantizedStore))

    @functools.cached_property
    def _accumulated_outputs(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.outputs if isinstance(o, Store) and o.accumulate)

    def accumulated_outputs(self) -> list[str]:
        return list(self._accumulated_outputs)

    @functools.cached_property
    def _has_pairs(self) -> bool:
        return any(e.pairs for e in self.expressions())

    def has_pairs(self) -> bool:
        return self._has_pairs

    @functools.cached_property
    def _column_groups(self) -> tuple[Expr | QuantizedStore, ...]:
        return (tuple(e for e in self.expressions() if e.column_group is not None)
                + tuple(o for o in self.outputs if isinstance(o, QuantizedStore) and o.column_group is not None))

    def row_groups(self) -> tuple[QuantizedStore, ...]:
        """The outputs whose rows group (a ``QuantizedStore`` along M): each needs tiles of a multiple of its group
        of rows."""
        return tuple(o for o in self.outputs if isinstance(o, QuantizedStore) and o.row_group is not None)

    def column_groups(self) -> tuple[Expr | QuantizedStore, ...]:
        """The expressions and outputs whose columns group (``column_group`` adjacent columns: a ``SegmentSum``'s,
        a ``QuantizedStore``'s scale groups): each needs tile widths that are multiples of its group, and
        ``N * w`` one."""
        return self._column_groups

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
            return e.render(show)

        lines = [f"program {self.name}:", f"  {self.gemm!r}"]
        for i, e in enumerate(self.shared_expressions()):
            lines.append(f"  t{i} = {show(e)}")
            names[e] = f"t{i}"
        for out in self.outputs:
            lines.append("  " + out.describe(show(out.value)))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Program {self.name}: {len(self.outputs)} outputs, inputs {list(self.inputs)}>"

    def with_low_rank(self) -> Program:
        """The same program with the GEMM's low-rank operand pair (``Gemm.low_rank``)."""
        return _with_low_rank(self)

    def with_rowwise_scales(self) -> Program:
        """The same program on a rowwise-scaled GEMM (FP8's ``rowwise`` recipe: e4m3 operands, one dequantization
        factor per row of the output and one per column): every use of ``acc`` becomes ``acc * a_scale[m] *
        b_scale[n]`` (``a_scale`` [M], ``b_scale`` [N]), before any other epilogue work. Named ``<name>_rowwise``;
        it has no tuned choices of its own yet."""
        return _with_rowwise_scales(self)

    def with_blockwise_scales(self, group: int = 128, b_block: bool = False) -> Program:
        """The same program on a GEMM whose operands are scaled per aligned group of ``group`` along K (FP8's
        blockwise recipe, ``Gemm.k_scale_group``; ``b_block``: B's scales per ``group x group`` block,
        ``Gemm.b_scale_block``): the epilogue sees the dequantized product. Named ``<name>_blockwise``; it has no
        tuned choices of its own yet."""
        return _with_blockwise_scales(self, group, b_block)

    def with_quantized_store(self, name: str, along: str, group: int = 128) -> Program:
        """The same program with its ``Store`` ``name`` written in e4m3 with scales per ``group`` along ``along``
        (:class:`QuantizedStore`: codes ``name``, scales ``<name>_scale``), for a GEMM that reads the output as its
        FP8 operand. Named ``<program>_<name>_e4m3``; it has no tuned choices of its own yet."""
        return _with_quantized_store(self, name, along, group)

    def renamed(self, names: Mapping[str, str]) -> Program:
        """The same program with inputs and outputs renamed by ``names`` (old -> new; absent ones kept)."""
        memo = {e: dataclasses.replace(e, name=names[e.name]) for e in self.inputs.values() if e.name in names}
        outputs = tuple(dataclasses.replace(o, name=names.get(o.name, o.name), value=_substituted(o.value, memo),
                                            **({"scale": names.get(o.scale, o.scale)} if isinstance(o, QuantizedStore)
                                               else {}))
                        for o in self.outputs)
        stand_in = self.tuning_stand_in
        return Program(self.name, self.gemm, outputs, doc=self.doc,
                       tuning_stand_in=None if stand_in is None else stand_in.renamed(names))


@functools.cache
def _with_rowwise_scales(program: Program) -> Program:
    # the primitives build on this module: their classes by their registered names
    accumulator, row_vector, col_vector = (PRIMITIVES[name] for name in ("Accumulator", "RowVector", "ColVector"))
    if program.gemm.low_rank:
        raise ProgramError(f"{program.name}: rowwise scales with a low-rank operand pair are not supported")
    if program.gemm.k_scale_group is not None:
        raise ProgramError(f"{program.name}: the GEMM has K-group scales already; rowwise scales are the other recipe")
    if {"a_scale", "b_scale"} & set(program.inputs):
        raise ProgramError(f"{program.name}: 'a_scale' and 'b_scale' are the rowwise scales; the program already "
                           f"takes an input of that name")
    acc = accumulator()
    scaled = acc * row_vector("a_scale") * col_vector("b_scale")
    memo: dict[Expr, Expr] = {acc: scaled}
    outputs = tuple(dataclasses.replace(o, value=_substituted(o.value, memo)) for o in program.outputs)
    return Program(f"{program.name}_rowwise", program.gemm, outputs, doc=program.doc)


@functools.cache
def _with_blockwise_scales(program: Program, group: int, b_block: bool) -> Program:
    gemm = program.gemm
    if gemm.k_scale_group is not None:
        raise ProgramError(f"{program.name}: the GEMM has K-group scales already")
    if {"a_scale", "b_scale"} & set(program.inputs):
        raise ProgramError(f"{program.name}: the program scales its accumulator rowwise already ('a_scale' and "
                           f"'b_scale' are its inputs)")
    scaled = Gemm(gemm.a_layout, gemm.b_layout, gemm.low_rank, k_scale_group=group, b_scale_block=b_block)
    return Program(f"{program.name}_blockwise", scaled, program.outputs, doc=program.doc)


@functools.cache
def _with_quantized_store(program: Program, name: str, along: str, group: int) -> Program:
    stores = [o for o in program.outputs if isinstance(o, Store) and o.name == name]
    if not stores or stores[0].accumulate:
        plain = [o.name for o in program.outputs if isinstance(o, Store) and not o.accumulate]
        raise ProgramError(f"{program.name}: no store {name!r} to quantize (its stores: {plain})")
    quantized = QuantizedStore(name, stores[0].value, group=group, along=along)
    outputs = tuple(quantized if o is stores[0] else o for o in program.outputs)
    return Program(f"{program.name}_{name}_e4m3", program.gemm, outputs, doc=program.doc)


def _substituted(e: Expr, memo: dict[Expr, Expr]) -> Expr:
    """``e`` with the subexpressions ``memo`` maps replaced (renamed inputs, a scaled accumulator), and every
    expression above them rebuilt; shared subexpressions stay shared."""
    if e not in memo:
        changes = {f.name: _substituted(getattr(e, f.name), memo) for f in dataclasses.fields(e)
                   if isinstance(getattr(e, f.name), Expr)}
        memo[e] = dataclasses.replace(e, **changes) if changes else e
    return memo[e]


@functools.cache
def _with_low_rank(program: Program) -> Program:
    gemm = dataclasses.replace(program.gemm, low_rank=True)
    stand_in = program.tuning_stand_in
    return Program(program.name, gemm, program.outputs, doc=program.doc,
                   tuning_stand_in=None if stand_in is None else stand_in.with_low_rank())
