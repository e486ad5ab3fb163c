"""``ScalarInput``: a scalar read from a one-element device tensor (no host synchronisation)."""
from __future__ import annotations

import torch

from ..core import Example, Expr, Gemm, Program, ProgramError, Store, check_name, primitive
from .accumulator import Accumulator


@primitive
class ScalarInput(Expr):
    """A scalar read from a one-element device tensor (no host synchronisation)."""
    name: str
    is_input = True

    def __post_init__(self):
        check_name(self.name, "ScalarInput")

    @property
    def kind(self) -> str:
        return "scalar"

    def render(self, show) -> str:
        return self.name

    def check_tensor(self, name: str, t: torch.Tensor, m: int, n: int) -> None:
        if t.numel() != 1 or not t.dtype.is_floating_point:
            raise ProgramError(f"{name}: expected a one-element floating-point tensor, got shape "
                               f"{tuple(t.shape)} and dtype {t.dtype}")

    def reference(self, ev):
        return ev.tensor(self.name).to(ev.dtype).reshape(())

    def emit_persistent(self, em) -> str:
        em.emit(f"# {self.name}: device scalar (no host sync)")
        em.emit(f"{self.name} = tl.load({self.name}_ptr).to(tl.float32)")
        return self.name

    def emit_pingpong(self, em) -> None:
        em.scalars.append(self)  # loaded once by the consumer
        em.full[self] = self.name

    @classmethod
    def examples(cls) -> list[Example]:
        return [Example(Program("scalar_scale", Gemm.linear(), (Store("out", Accumulator() * cls("scale")),)),
                        lambda acc, t: {"out": acc * t["scale"]})]
