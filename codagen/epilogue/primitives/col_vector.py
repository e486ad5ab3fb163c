"""``ColVector``: a per-column vector [N*w] broadcast along the tile's rows (norm weight, frequencies)."""
from __future__ import annotations

import torch

from ..core import Example, Expr, Gemm, Program, ProgramError, Store, Width, check_name, check_shape, primitive
from .accumulator import Accumulator


@primitive
class ColVector(Expr):
    """A per-column vector [N*w] broadcast along the tile's rows (norm weight, RoPE frequencies)."""
    name: str
    col_width: Width = Width.FULL
    is_input = True

    def __post_init__(self):
        check_name(self.name, "ColVector")

    @property
    def kind(self) -> str:
        return "col"

    @property
    def width(self) -> Width:
        return self.col_width

    def render(self, show) -> str:
        return f"{self.name}[n]" if self.col_width == Width.FULL else f"{self.name}[n:{self.col_width!r}]"

    def check_tensor(self, name: str, t: torch.Tensor, m: int, n: int) -> None:
        check_shape(name, t, (self.width.columns(n),), f"[{self.width!r}]")
        if not t.dtype.is_floating_point:
            raise ProgramError(f"{name}: expected a floating-point vector, got {t.dtype}")

    def reference(self, ev):
        return ev.tensor(self.name).to(ev.dtype)[None, :]

    def emit_persistent(self, em) -> str:
        w = self.width
        em.emit(f"# {self}: per-column vector")
        em.emit(f"{self.name} = tl.load({self.name}_ptr + {em.cols(w)}, mask={em.col_ok(w)}, "
                f"other=0.0).to(tl.float32)[None, :]")
        return self.name

    def emit_pingpong(self, em) -> None:
        """Loaded a piece ahead, in the layout and form each use needs (``em.col``)."""

    @classmethod
    def examples(cls) -> list[Example]:
        acc = Accumulator()
        return [Example(Program("col_scale", Gemm.linear(), (Store("out", acc * cls("gamma") + cls("beta")),)),
                        lambda acc, t: {"out": acc * t["gamma"][None, :] + t["beta"][None, :]})]
