"""``acc``: the fp32 GEMM tile every program starts from."""
from __future__ import annotations

from ..core import Example, Expr, Gemm, Program, Store, Width, primitive


@primitive
class Accumulator(Expr):
    """The fp32 GEMM tile ``acc``."""

    @property
    def kind(self) -> str:
        return "tile"

    @property
    def width(self) -> Width:
        return Width.FULL

    def render(self, show) -> str:
        return "acc"

    def reference(self, ev):
        return ev.acc

    def emit_persistent(self, em) -> str:
        return "acc"

    def emit_pingpong(self, em) -> None:
        em.full[self] = "acc"

    @classmethod
    def examples(cls) -> list[Example]:
        return [Example(Program("plain", Gemm.linear(), (Store("out", cls()),)), lambda acc, t: {"out": acc})]
