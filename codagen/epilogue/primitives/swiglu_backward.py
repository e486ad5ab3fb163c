"""``SwiGLUBackward``: the gradient of ``silu(g) * u`` per pair, (pair, gradient) -> pair."""
from __future__ import annotations

import torch

from ..core import Example, Expr, Gemm, Program, ProgramError, RowPartial, Store, Width, need_tile, primitive
from .accumulator import Accumulator
from .tile_input import TileInput

__all__ = ["SwiGLUBackward", "swiglu_backward_ref"]


def swiglu_backward_ref(preact: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Interleaved ``(dg, du)`` of ``silu(g) * u`` for pairs ``(g, u)`` of ``preact``."""
    gate, up = preact[..., 0::2], preact[..., 1::2]
    sig = torch.sigmoid(gate)
    d_gate = grad * up * sig * (1 + gate * (1 - sig))
    d_up = grad * gate * sig
    return torch.stack((d_gate, d_up), dim=-1).flatten(-2)


def _lines(name: str, dy: str, gate: str, up: str, sig: str) -> list[str]:
    """The formula of one pair form, in ``tl`` and ``gl`` alike: ``name_gate``, ``name_up``."""
    return [f"{name}_gate = {dy} * {up} * {sig} * (1.0 + {gate} * (1.0 - {sig}))",
            f"{name}_up = {dy} * {gate} * {sig}"]


@primitive
class SwiGLUBackward(Expr):
    """Adjacent-pair map (pair + gradient) -> pair: the gradient of ``silu(g) * u``.

    With ``(g, u) = (preact[2j], preact[2j+1])``, ``dy = grad[j]`` and ``s = sigmoid(g)``::

        dg = dy * u * s * (1 + g * (1 - s))      du = dy * g * s

    The result is interleaved ``(dg, du)`` with the width of ``preact`` (twice that of ``grad``).
    """
    preact: Expr
    grad: Expr
    pairs = True

    def __post_init__(self):
        need_tile(self.preact, "SwiGLUBackward(preact)")
        need_tile(self.grad, "SwiGLUBackward(grad)")
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

    def render(self, show) -> str:
        return f"swiglu_backward({show(self.preact)}, {show(self.grad)})"

    def reference(self, ev):
        return swiglu_backward_ref(ev.value(self.preact), ev.value(self.grad))

    def emit_persistent(self, em) -> str:
        name = em.fresh("swiglu_grad")
        dy = em.full(self.grad)
        gate, up = em.pairs_of(self.preact)
        sig = em.sigmoid(gate)
        em.emit(f"# {em.comment(self)}")
        em.emit("#   dg = dy * u * s * (1 + g * (1 - s)),  du = dy * g * s,  s = sigmoid(g); interleaved (dg, du)")
        for line in _lines(name, dy, gate, up, sig):
            em.emit(line)
        em.pair_form[self] = (f"{name}_gate", f"{name}_up")
        return name

    def emit_pingpong(self, em) -> None:
        name = em.fresh("swiglu_grad")
        gate, up = em.operand(self.preact, self.preact.width, True)
        dy = em.operand(self.grad, self.grad.width, False)
        sig = em.sigmoid(gate)
        em.emit(f"# {em.comment(self)}")
        em.emit("#   dg = dy * u * s * (1 + g * (1 - s)),  du = dy * g * s,  s = sigmoid(g)")
        for line in _lines(name, dy, gate, up, sig):
            em.emit(line)
        em.pairs[self] = (f"{name}_gate", f"{name}_up")

    @classmethod
    def examples(cls) -> list[Example]:
        preact = TileInput("preact", Width.DOUBLE)
        grad = cls(preact, Accumulator())

        def oracle(acc, t):
            g, u = t["preact"][:, 0::2], t["preact"][:, 1::2]
            s = 1 / (1 + torch.exp(-g))
            out = torch.stack((acc * u * s * (1 + g * (1 - s)), acc * g * s), dim=-1).flatten(1)
            return {"grad_preact": out, "z_dz": (t["preact"] * out).sum(1)}
        return [Example(Program("swiglu_grad", Gemm.input_grad(), (Store("grad_preact", grad),
                                                                   RowPartial("z_dz", preact * grad))), oracle)]
