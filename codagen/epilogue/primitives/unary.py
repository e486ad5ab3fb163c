"""``Unary``: an elementwise map of one operand (neg, exp, log, sigmoid, silu, tanh, square, rsqrt).

``tanh(x) = 2 sigmoid(2x) - 1`` on the device: one sigmoid of the device math (four instructions on the GPU),
a multiply and a multiply-add. Its error is absolute, a few fp32 ulps of 1 (so near 0 not small relative to
``tanh(x)``), and it saturates to exactly +-1 (the sigmoid is 0 or 1 there): what a logit soft-cap
``cap * tanh(z / cap)`` needs.
"""
from __future__ import annotations

import torch

from ..core import Example, Expr, Gemm, Program, ProgramError, RowPartial, Store, Width, broadcast, primitive
from .accumulator import Accumulator

UNARY_OPS = ("neg", "exp", "log", "sigmoid", "silu", "tanh", "square", "rsqrt")

_TORCH = {"neg": torch.neg, "exp": torch.exp, "log": torch.log, "sigmoid": torch.sigmoid,
          "silu": torch.nn.functional.silu, "tanh": torch.tanh, "square": torch.square, "rsqrt": torch.rsqrt}
#: the formulas in ``lang`` (``tl`` or ``gl``: the same names and meaning in both); sigmoid, silu and tanh use
#: the emitter's sigmoid (the device math of ``codagen.backends.triton.device_math``)
_FORMULA = {"neg": "-{x}", "exp": "{lang}.exp({x})", "log": "{lang}.log({x})", "square": "{x} * {x}",
            "rsqrt": "{lang}.rsqrt({x})"}


@primitive
class Unary(Expr):
    op: str
    x: Expr

    def __post_init__(self):
        if self.op not in UNARY_OPS:
            raise ProgramError(f"unknown unary op {self.op!r}; expected one of {UNARY_OPS}")
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
        return f"-({show(self.x)})" if self.op == "neg" else f"{self.op}({show(self.x)})"

    def reference(self, ev):
        return _TORCH[self.op](ev.value(self.x))

    def formula(self, em, lang: str):
        def of(x: str) -> str:
            if self.op == "sigmoid":
                return em.sigmoid(x)
            if self.op == "silu":
                return f"{x} * {em.sigmoid(x)}"
            if self.op == "tanh":
                doubled = em.fresh("tanh")
                em.emit(f"{doubled} = 2.0 * {x}")
                return f"2.0 * {em.sigmoid(doubled)} - 1.0"
            return _FORMULA[self.op].format(lang=lang, x=x)
        return of

    def emit_persistent(self, em) -> str:
        return em.elementwise(self, (self.x,), self.formula(em, "tl"))

    def emit_pingpong(self, em) -> None:
        em.elementwise(self, (self.x,), self.formula(em, "gl"))

    def pingpong_refusal(self) -> str | None:
        return None if self.kind == "tile" else f"computed {self.kind} values ({self}) are not generated"

    @classmethod
    def examples(cls) -> list[Example]:
        acc = Accumulator()
        maps = {"neg": torch.neg, "exp": torch.exp, "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu,
                "tanh": torch.tanh, "square": torch.square}
        outputs = tuple(Store(op, cls(op, acc)) for op in maps)
        positive = cls("square", acc) + 0.5  # log and rsqrt of a positive value
        return [
            Example(Program("unary_maps", Gemm.linear(), outputs),
                    lambda acc, t: {op: f(acc) for op, f in maps.items()}),
            Example(Program("unary_positive", Gemm.linear(), (Store("log", cls("log", positive)),
                                                             RowPartial("rsqrt", cls("rsqrt", positive)))),
                    lambda acc, t: {"log": torch.log(acc ** 2 + 0.5), "rsqrt": torch.rsqrt(acc ** 2 + 0.5).sum(1)}),
        ]
