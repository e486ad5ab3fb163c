"""``GeGLUBackward``: the gradient of ``gelu_tanh(g) * u`` per pair, (pair, gradient) -> pair."""
from __future__ import annotations

import math

import torch

from ..core import Example, Gemm, Program, RowPartial, Store, Width, primitive
from ..gated import GatedPairBackward
from .accumulator import Accumulator
from .geglu import GELU_CUBIC, GELU_LINEAR, gelu_tanh_sigmoid
from .tile_input import TileInput

__all__ = ["GeGLUBackward", "geglu_backward_ref"]


def geglu_backward_ref(preact: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Interleaved ``(dg, du)`` of ``gelu_tanh(g) * u`` for pairs ``(g, u)`` of ``preact``."""
    gate, up = preact[..., 0::2], preact[..., 1::2]
    sig = torch.sigmoid(gate * (GELU_LINEAR + GELU_CUBIC * gate * gate))
    d_gelu = sig + sig * (1 - sig) * gate * (GELU_LINEAR + 3 * GELU_CUBIC * gate * gate)
    return torch.stack((grad * up * d_gelu, grad * gate * sig), dim=-1).flatten(-2)


def _lines(name: str, dy: str, gate: str, up: str, sig: str) -> list[str]:
    """The formula of one pair form, in ``tl`` and ``gl`` alike: ``name_gate``, ``name_up``."""
    d_gelu = f"({sig} + {sig} * (1.0 - {sig}) * {gate} * ({GELU_LINEAR!r} + {3 * GELU_CUBIC!r} * {gate} * {gate}))"
    return [f"{name}_gate = {dy} * {up} * {d_gelu}",
            f"{name}_up = {dy} * {gate} * {sig}"]


@primitive
class GeGLUBackward(GatedPairBackward):
    """Adjacent-pair map (pair + gradient) -> pair: the gradient of ``gelu_tanh(g) * u``.

    With ``(g, u) = (preact[2j], preact[2j+1])``, ``dy = grad[j]``, ``k = sqrt(2/pi)``,
    ``a = 2k (g + 0.044715 g^3)`` and ``s = sigmoid(a)`` (so ``gelu_tanh(g) = g s``)::

        gelu_tanh'(g) = s + g s (1 - s) a'(g),   a'(g) = 2k (1 + 3 * 0.044715 g^2)
        dg = dy * u * gelu_tanh'(g)      du = dy * g * s

    The result is interleaved ``(dg, du)`` with the width of ``preact`` (twice that of ``grad``).
    """
    label = "geglu_backward"
    formula = "dg = dy * u * (s + s (1 - s) g a'(g)),  du = dy * g * s,  s = sigmoid(a(g))"
    ref = staticmethod(geglu_backward_ref)
    grad_lines = staticmethod(_lines)
    gate_sigmoid = staticmethod(gelu_tanh_sigmoid)

    @classmethod
    def examples(cls) -> list[Example]:
        preact = TileInput("preact", Width.DOUBLE)
        grad = cls(preact, Accumulator())

        def oracle(acc, t):
            # the tanh form, differentiated independently of the sigmoid form the kernels use
            g, u = t["preact"][:, 0::2], t["preact"][:, 1::2]
            k = math.sqrt(2 / math.pi)
            tanh = torch.tanh(k * (g + 0.044715 * g ** 3))
            gelu = 0.5 * g * (1 + tanh)
            d_gelu = 0.5 * (1 + tanh) + 0.5 * g * (1 - tanh ** 2) * k * (1 + 3 * 0.044715 * g ** 2)
            out = torch.stack((acc * u * d_gelu, acc * gelu), dim=-1).flatten(1)
            return {"grad_preact": out, "z_dz": (t["preact"] * out).sum(1)}
        return [Example(Program("geglu_grad", Gemm.input_grad(), (Store("grad_preact", grad),
                                                                  RowPartial("z_dz", preact * grad))), oracle)]
