"""``SwiGLU``: the adjacent-pair map 2 -> 1, ``silu(x[2j]) * x[2j+1]`` (interleaved gate/up columns)."""
from __future__ import annotations

import torch

from ..core import Example, Gemm, Program, Store, primitive
from ..gated import GatedPair
from .accumulator import Accumulator
from .row_vector import RowVector

__all__ = ["SwiGLU", "swiglu_ref"]


def swiglu_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., 0::2]) * x[..., 1::2]``."""
    gate, up = x[..., 0::2], x[..., 1::2]
    return torch.nn.functional.silu(gate) * up


@primitive
class SwiGLU(GatedPair):
    """Adjacent-pair map 2 -> 1: ``out[j] = silu(x[2j]) * x[2j+1]`` (interleaved gate/up columns), with
    ``silu(g) = g * sigmoid(g)``."""
    label = "swiglu"
    activation = "silu"
    ref = staticmethod(swiglu_ref)

    @staticmethod
    def gate_sigmoid(em, gate: str) -> str:
        return em.sigmoid(gate)

    @classmethod
    def examples(cls) -> list[Example]:
        z = Accumulator() * RowVector("rstd")

        def oracle(acc, t):
            z = acc * t["rstd"][:, None]
            gate, up = z[:, 0::2], z[:, 1::2]
            return {"preact": z, "out": gate / (1 + torch.exp(-gate)) * up}
        return [Example(Program("gate_up", Gemm.linear(), (Store("preact", z), Store("out", cls(z)))), oracle)]
