"""``SwiGLUBackward``: the gradient of ``silu(g) * u`` per pair, (pair, gradient) -> pair."""
from __future__ import annotations

import torch

from ..core import Example, Gemm, Program, RowPartial, Store, Width, primitive
from ..gated import GatedPairBackward
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
class SwiGLUBackward(GatedPairBackward):
    """Adjacent-pair map (pair + gradient) -> pair: the gradient of ``silu(g) * u``.

    With ``(g, u) = (preact[2j], preact[2j+1])``, ``dy = grad[j]`` and ``s = sigmoid(g)``::

        dg = dy * u * s * (1 + g * (1 - s))      du = dy * g * s

    The result is interleaved ``(dg, du)`` with the width of ``preact`` (twice that of ``grad``).
    """
    label = "swiglu_backward"
    formula = "dg = dy * u * s * (1 + g * (1 - s)),  du = dy * g * s,  s = sigmoid(g)"
    ref = staticmethod(swiglu_backward_ref)
    grad_lines = staticmethod(_lines)

    @staticmethod
    def gate_sigmoid(em, gate: str) -> str:
        return em.sigmoid(gate)

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
