"""``RowVector``: a per-row vector [M] broadcast along the tile's columns (rstd, targets, positions)."""
from __future__ import annotations

import torch

from ..core import Example, Expr, Gemm, Program, ProgramError, RowPartial, Store, check_name, check_shape, primitive
from .accumulator import Accumulator

_INDEX_DTYPES = (torch.int32, torch.int64)


@primitive
class RowVector(Expr):
    """A per-row vector [M] broadcast along the tile's columns.

    ``index=True`` marks an integer vector (cross-entropy targets) usable only by ``OneHot``.
    """
    name: str
    index: bool = False
    is_input = True

    def __post_init__(self):
        check_name(self.name, "RowVector")

    @property
    def kind(self) -> str:
        return "row"

    def render(self, show) -> str:
        return f"{self.name}[m]"

    def check_tensor(self, name: str, t: torch.Tensor, m: int, n: int) -> None:
        check_shape(name, t, (m,), "[M]")
        if self.index and t.dtype not in _INDEX_DTYPES:
            raise ProgramError(f"{name}: expected an integer index vector (int32 or int64), got {t.dtype}")
        if not self.index and not t.dtype.is_floating_point:
            raise ProgramError(f"{name}: expected a floating-point vector, got {t.dtype}")

    def reference(self, ev):
        t = ev.tensor(self.name)
        return t[:, None] if self.index else t.to(ev.dtype)[:, None]

    def emit_persistent(self, em) -> str:
        em.emit(f"# {self.name}[m]: per-row vector" + (" (integer index)" if self.index else ""))
        if self.index:
            em.emit(f"{self.name} = tl.load({self.name}_ptr + rows, mask=row_ok, other=-1)[:, None]")
        else:
            em.emit(f"{self.name} = tl.load({self.name}_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]")
        return self.name

    def emit_pingpong(self, em) -> None:
        """Loaded once per tile by the consumer, in the layout each use needs (``em.row``)."""

    @classmethod
    def examples(cls) -> list[Example]:
        acc, rstd = Accumulator(), cls("rstd")
        return [
            Example(Program("row_scale", Gemm.linear(), (Store("out", acc * rstd),)),
                    lambda acc, t: {"out": acc * t["rstd"][:, None]}),
            Example(Program("row_sum", Gemm.linear(), (RowPartial("total", acc - rstd),)),
                    lambda acc, t: {"total": (acc - t["rstd"][:, None]).sum(1)}),
        ]
