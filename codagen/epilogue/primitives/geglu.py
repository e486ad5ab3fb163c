"""``GeGLU``: the adjacent-pair map 2 -> 1, ``gelu_tanh(x[2j]) * x[2j+1]`` (interleaved gate/up columns).

``gelu_tanh(g) = g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3))`` (``0.5 (1 + tanh(u)) = sigmoid(2u)``), with the
sigmoid's argument written ``g * (GELU_LINEAR + GELU_CUBIC * g^2)``: a multiply, a multiply-add and a multiply
ahead of the device sigmoid. :func:`gelu_tanh_sigmoid` emits that sigmoid once per gate variable, so a program
holding both GeGLU and its backward on the same pre-activation (``library.swiglu_backward(activation="gelu_tanh")``)
computes it once.
"""
from __future__ import annotations

import math

import torch

from ..core import Example, Gemm, Program, Store, primitive
from ..gated import GatedPair
from .accumulator import Accumulator
from .row_vector import RowVector

__all__ = ["GeGLU", "geglu_ref", "gelu_tanh_sigmoid", "GELU_LINEAR", "GELU_CUBIC"]

#: the sigmoid's argument of gelu_tanh(g) is ``g * (GELU_LINEAR + GELU_CUBIC * g^2)``: 2 sqrt(2/pi) and
#: 2 sqrt(2/pi) * 0.044715
GELU_LINEAR = 2 * math.sqrt(2 / math.pi)
GELU_CUBIC = GELU_LINEAR * 0.044715


def geglu_ref(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., 0::2]) * x[..., 1::2]``."""
    gate, up = x[..., 0::2], x[..., 1::2]
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def gelu_tanh_sigmoid(em, gate: str) -> str:
    """The variable of ``s = sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3))`` for the gate variable ``gate``, emitted
    once per variable (either schedule's emitter): ``gelu_tanh(g) = g * s``."""
    key = ("gelu_tanh_sigmoid", gate)
    if key not in em.memo:
        arg = f"{gate}_gelu_arg"
        em.emit(f"{arg} = {gate} * ({GELU_LINEAR!r} + {GELU_CUBIC!r} * {gate} * {gate})")
        em.memo[key] = em.sigmoid(arg)
    return em.memo[key]


@primitive
class GeGLU(GatedPair):
    """Adjacent-pair map 2 -> 1: ``out[j] = gelu_tanh(x[2j]) * x[2j+1]`` (interleaved gate/up columns), with
    ``gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))``."""
    label = "geglu"
    activation = "gelu_tanh"
    ref = staticmethod(geglu_ref)
    gate_sigmoid = staticmethod(gelu_tanh_sigmoid)

    @classmethod
    def examples(cls) -> list[Example]:
        z = Accumulator() * RowVector("rstd")

        def oracle(acc, t):
            z = acc * t["rstd"][:, None]
            gate, up = z[:, 0::2], z[:, 1::2]
            gelu = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
            return {"preact": z, "out": gelu * up}
        return [Example(Program("gate_up_geglu", Gemm.linear(), (Store("preact", z), Store("out", cls(z)))), oracle)]
