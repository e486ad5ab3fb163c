"""``SwiGLU``: the adjacent-pair map 2 -> 1, ``silu(x[2j]) * x[2j+1]`` (interleaved gate/up columns)."""
from __future__ import annotations

import torch

from ..core import Example, Expr, Gemm, Program, ProgramError, Store, Width, need_tile, primitive
from .accumulator import Accumulator
from .row_vector import RowVector

__all__ = ["SwiGLU", "swiglu_ref"]


def swiglu_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., 0::2]) * x[..., 1::2]``."""
    gate, up = x[..., 0::2], x[..., 1::2]
    return torch.nn.functional.silu(gate) * up


@primitive
class SwiGLU(Expr):
    """Adjacent-pair map 2 -> 1: ``out[j] = silu(x[2j]) * x[2j+1]`` (interleaved gate/up columns)."""
    x: Expr
    pairs = True

    def __post_init__(self):
        need_tile(self.x, "SwiGLU")
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

    def render(self, show) -> str:
        return f"swiglu({show(self.x)})"

    def reference(self, ev):
        return swiglu_ref(ev.value(self.x))

    def emit_persistent(self, em) -> str:
        name = em.fresh("swiglu")
        gate, up = em.pairs_of(self.x)
        em.emit(f"# {em.comment(self)}: silu(gate) * up on pairs (gate, up) = (x[2j], x[2j+1])")
        em.emit(f"{name} = {gate} * {em.sigmoid(gate)} * {up}")
        return name

    def emit_pingpong(self, em) -> None:
        name = em.fresh("swiglu")
        gate, up = em.operand(self.x, self.x.width, True)
        em.emit(f"{name} = {gate} * {em.sigmoid(gate)} * {up}  # {em.comment(self)}: silu(gate) * up")
        em.full[self] = name

    @classmethod
    def examples(cls) -> list[Example]:
        z = Accumulator() * RowVector("rstd")

        def oracle(acc, t):
            z = acc * t["rstd"][:, None]
            gate, up = z[:, 0::2], z[:, 1::2]
            return {"preact": z, "out": gate / (1 + torch.exp(-gate)) * up}
        return [Example(Program("gate_up", Gemm.linear(), (Store("preact", z), Store("out", cls(z)))), oracle)]
