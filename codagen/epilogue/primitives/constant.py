"""``Constant``: a finite number (what ``acc * 0.5`` makes of ``0.5``)."""
from __future__ import annotations

import math

import torch

from ..core import Example, Expr, Gemm, Program, ProgramError, Store, primitive
from .accumulator import Accumulator


def _float(value: float) -> str:
    return repr(value) if math.isfinite(value) else f"float('{value!r}')"


@primitive
class Constant(Expr):
    value: float

    def __post_init__(self):
        if not math.isfinite(self.value):
            raise ProgramError(f"Constant must be finite, got {self.value!r}")

    @property
    def kind(self) -> str:
        return "scalar"

    def render(self, show) -> str:
        return repr(self.value)

    def reference(self, ev):
        return torch.tensor(self.value, dtype=ev.dtype, device=ev.device)

    def emit_persistent(self, em) -> str:
        name = em.fresh("const")
        em.emit(f"{name} = tl.full([], {self.value!r}, tl.float32)")
        return name

    def emit_pingpong(self, em) -> None:
        em.full[self] = _float(self.value)

    @classmethod
    def examples(cls) -> list[Example]:
        return [Example(Program("affine", Gemm.linear(), (Store("out", Accumulator() * 0.5 + 1.25),)),
                        lambda acc, t: {"out": acc * 0.5 + 1.25})]
