"""What the gated activations share: ``act(g) * u`` on adjacent pairs ``(g, u) = (x[2j], x[2j+1])``, and its gradient.

Each activation is written ``act(g) = g * s(g)`` with a sigmoid ``s`` (SiLU: ``sigmoid(g)``; GELU-tanh:
``sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3))``). A gated primitive subclasses :class:`GatedPair` (2 -> 1) or
:class:`GatedPairBackward` (pair + gradient -> pair) and gives its name, its float64 twin, the device code of ``s``
(``gate_sigmoid``) and, for the backward, the formula of ``(dg, du)``; the node, its validation, widths and both
schedules' emission are here. These bases are not primitives themselves (no ``@primitive``): the primitives are
``SwiGLU``, ``GeGLU`` and their backwards in :mod:`codagen.epilogue.primitives`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .core import Expr, ProgramError, Width, need_tile

__all__ = ["GatedPair", "GatedPairBackward"]


@dataclass(frozen=True, eq=True)
class GatedPair(Expr):
    """Adjacent-pair map 2 -> 1: ``out[j] = act(x[2j]) * x[2j+1]`` (interleaved gate/up columns)."""
    x: Expr
    pairs = True
    label: ClassVar[str]  # the printed and emitted name: "swiglu"
    activation: ClassVar[str]  # the activation's name in the kernels' comments: "silu"

    @staticmethod
    def ref(x: torch.Tensor) -> torch.Tensor:  # the float64 twin, of the whole [.., 2n] input
        raise NotImplementedError

    @staticmethod
    def gate_sigmoid(em, gate: str) -> str:  # the variable (or expression) of s(gate), emitted through em
        raise NotImplementedError

    def __post_init__(self):
        name = type(self).__name__
        need_tile(self.x, name)
        if self.x.width == Width.HALF:
            raise ProgramError(f"{name} input must be FULL or DOUBLE width (it halves the width)")

    @property
    def kind(self) -> str:
        return "tile"

    @property
    def width(self) -> Width:
        return self.x.width.halved()

    def children(self):
        return (self.x,)

    def render(self, show) -> str:
        return f"{self.label}({show(self.x)})"

    def reference(self, ev):
        return self.ref(ev.value(self.x))

    def emit_persistent(self, em) -> str:
        name = em.fresh(self.label)
        gate, up = em.pairs_of(self.x)
        em.emit(f"# {em.comment(self)}: {self.activation}(gate) * up on pairs (gate, up) = (x[2j], x[2j+1])")
        sig = self.gate_sigmoid(em, gate)
        em.emit(f"{name} = {gate} * {sig} * {up}")
        return name

    def emit_pingpong(self, em) -> None:
        name = em.fresh(self.label)
        gate, up = em.operand(self.x, self.x.width, True)
        sig = self.gate_sigmoid(em, gate)
        em.emit(f"{name} = {gate} * {sig} * {up}  # {em.comment(self)}: {self.activation}(gate) * up")
        em.full[self] = name


@dataclass(frozen=True, eq=True)
class GatedPairBackward(Expr):
    """Adjacent-pair map (pair + gradient) -> pair: the gradient of ``act(g) * u``, interleaved ``(dg, du)`` with the
    width of ``preact`` (twice that of ``grad``): ``dg = dy * u * act'(g)``, ``du = dy * act(g) = dy * g * s``."""
    preact: Expr
    grad: Expr
    pairs = True
    label: ClassVar[str]  # "swiglu_backward"; its variables are named "swiglu_grad"
    formula: ClassVar[str]  # the math of (dg, du), for the kernels' comments

    @staticmethod
    def ref(preact: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:  # the float64 twin
        raise NotImplementedError

    @staticmethod
    def gate_sigmoid(em, gate: str) -> str:
        raise NotImplementedError

    @staticmethod
    def grad_lines(name: str, dy: str, gate: str, up: str, sig: str) -> list[str]:
        """The code of ``name_gate`` (dg) and ``name_up`` (du), in ``tl`` and ``gl`` alike."""
        raise NotImplementedError

    def __post_init__(self):
        name = type(self).__name__
        need_tile(self.preact, f"{name}(preact)")
        need_tile(self.grad, f"{name}(grad)")
        if self.preact.width == Width.HALF or self.preact.width.halved() != self.grad.width:
            raise ProgramError(
                f"{name} needs preact twice as wide as grad, got {self.preact.width!r} and {self.grad.width!r}")

    @property
    def kind(self) -> str:
        return "tile"

    @property
    def width(self) -> Width:
        return self.preact.width

    def children(self):
        return (self.preact, self.grad)

    def render(self, show) -> str:
        return f"{self.label}({show(self.preact)}, {show(self.grad)})"

    def reference(self, ev):
        return self.ref(ev.value(self.preact), ev.value(self.grad))

    def emit_persistent(self, em) -> str:
        name = em.fresh(self.label.replace("_backward", "_grad"))
        dy = em.full(self.grad)
        gate, up = em.pairs_of(self.preact)
        sig = self.gate_sigmoid(em, gate)
        em.emit(f"# {em.comment(self)}")
        em.emit(f"#   {self.formula}; interleaved (dg, du)")
        for line in self.grad_lines(name, dy, gate, up, sig):
            em.emit(line)
        em.pair_form[self] = (f"{name}_gate", f"{name}_up")
        return name

    def emit_pingpong(self, em) -> None:
        name = em.fresh(self.label.replace("_backward", "_grad"))
        gate, up = em.operand(self.preact, self.preact.width, True)
        dy = em.operand(self.grad, self.grad.width, False)
        sig = self.gate_sigmoid(em, gate)
        em.emit(f"# {em.comment(self)}")
        em.emit(f"#   {self.formula}")
        for line in self.grad_lines(name, dy, gate, up, sig):
            em.emit(line)
        em.pairs[self] = (f"{name}_gate", f"{name}_up")
