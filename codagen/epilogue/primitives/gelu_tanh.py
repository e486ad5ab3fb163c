"""``GeluTanh``: the tanh approximation of GELU, ``x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))``.

``0.5 (1 + tanh(u)) = sigmoid(2u)``, so the map is one sigmoid of the device math (four instructions on
the GPU) and a few multiply-adds, in both schedules.
"""
from __future__ import annotations

import math

import torch

from ..core import Example, Expr, Gemm, Program, RowPartial, Store, Width, broadcast, primitive
from .accumulator import Accumulator
from .row_vector import RowVector

#: 2 sqrt(2 / pi): the sigmoid's scale of the cubic
_SCALE = 2 * math.sqrt(2 / math.pi)


@primitive
class GeluTanh(Expr):
    """``gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, elementwise (width kept)."""
    x: Expr

    def __post_init__(self):
        broadcast(self.x)

    @property
    def kind(self) -> str:
        return self.x.kind

    @property
    def width(self) -> Width | None:
        return self.x.width

    def children(self):
        return (self.x,)

    def render(self, show) -> str:
        return f"gelu_tanh({show(self.x)})"

    def reference(self, ev):
        return torch.nn.functional.gelu(ev.value(self.x), approximate="tanh")

    @staticmethod
    def formula(em):
        def of(x: str) -> str:
            inner = em.fresh("gelu")
            em.emit(f"{inner} = {_SCALE!r} * ({x} + 0.044715 * {x} * {x} * {x})")
            return f"{x} * {em.sigmoid(inner)}"
        return of

    def emit_persistent(self, em) -> str:
        return em.elementwise(self, (self.x,), self.formula(em))

    def emit_pingpong(self, em) -> None:
        em.elementwise(self, (self.x,), self.formula(em))

    def pingpong_refusal(self) -> str | None:
        return None if self.kind == "tile" else f"computed {self.kind} values ({self}) are not generated"

    @classmethod
    def examples(cls) -> list[Example]:
        z = Accumulator() * RowVector("rstd")

        def gelu(x):
            return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

        def oracle(acc, t):
            z = acc * t["rstd"][:, None]
            return {"out": gelu(z), "sum": gelu(z).sum(1)}
        return [Example(Program("gelu_tanh", Gemm.linear(), (Store("out", cls(z)), RowPartial("sum", cls(z)))),
                        oracle)]
