"""``Binary``: an elementwise map of two operands (add, sub, mul, div, max, mask), broadcasting rows and columns."""
from __future__ import annotations

import functools

import torch

from ..core import Example, Expr, Gemm, Program, ProgramError, Store, Width, broadcast, primitive
from .accumulator import Accumulator
from .one_hot import OneHot
from .row_vector import RowVector
from .tile_input import TileInput

BINARY_OPS = ("add", "sub", "mul", "div", "max", "mask")

_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_TORCH = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "max": torch.maximum,
          "mask": lambda a, b: torch.where(b != 0, a, 0.0)}
#: the formulas in ``lang`` (``tl`` or ``gl``: the same names and meaning in both; max is ``tl``'s, see
#: :meth:`Binary.formula` for Gluon's)
_FORMULA = {
    "add": "{a} + {b}",
    "sub": "{a} - {b}",
    "mul": "{a} * {b}",
    "div": "{a} / {b}",
    "max": "tl.maximum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",  # torch.maximum propagates NaN
    # a where b is nonzero, else 0: a select, so an infinite a where b is 0 gives 0 (a * b would be nan)
    "mask": "{lang}.where({b} != 0, {a}, 0.0)",
}


@primitive
class Binary(Expr):
    op: str
    a: Expr
    b: Expr

    def __post_init__(self):
        if self.op not in BINARY_OPS:
            raise ProgramError(f"unknown binary op {self.op!r}; expected one of {BINARY_OPS}")
        broadcast(self.a, self.b)

    @functools.cached_property
    def kind(self) -> str:
        return broadcast(self.a, self.b)[0]

    @functools.cached_property
    def width(self) -> Width | None:
        return broadcast(self.a, self.b)[1]

    def children(self):
        return (self.a, self.b)

    def render(self, show) -> str:
        if self.op in _SYMBOL:
            return f"({show(self.a)} {_SYMBOL[self.op]} {show(self.b)})"
        return f"{self.op}({show(self.a)}, {show(self.b)})"

    def reference(self, ev):
        return _TORCH[self.op](ev.value(self.a), ev.value(self.b))

    def formula(self, lang: str):
        if self.op == "max" and lang == "gl":  # Gluon has no PropagateNan: a + b is NaN where either is
            return lambda a, b: f"gl.where(({a} != {a}) | ({b} != {b}), {a} + {b}, gl.maximum({a}, {b}))"
        return lambda a, b: _FORMULA[self.op].format(lang=lang, a=a, b=b)

    def emit_persistent(self, em) -> str:
        return em.elementwise(self, (self.a, self.b), self.formula("tl"))

    def emit_pingpong(self, em) -> None:
        em.elementwise(self, (self.a, self.b), self.formula("gl"))

    def pingpong_refusal(self) -> str | None:
        return None if self.kind == "tile" else f"computed {self.kind} values ({self}) are not generated"

    @classmethod
    def examples(cls) -> list[Example]:
        acc, residual = Accumulator(), TileInput("residual")
        hot = OneHot(RowVector("target", index=True))
        outputs = (Store("sum", acc + residual), Store("difference", acc - residual), Store("product", acc * residual),
                   Store("quotient", acc / (residual * residual + 1.0)), Store("larger", cls("max", acc, residual)),
                   Store("target_only", cls("mask", acc, hot)))

        def target_only(acc, t):
            return torch.where(torch.arange(acc.shape[1])[None, :] == t["target"][:, None], acc, 0.0)
        return [Example(Program("binary_maps", Gemm.linear(), outputs), lambda acc, t: {
            "sum": acc + t["residual"], "difference": acc - t["residual"], "product": acc * t["residual"],
            "quotient": acc / (t["residual"] ** 2 + 1), "larger": torch.maximum(acc, t["residual"]),
            "target_only": target_only(acc, t)})]
