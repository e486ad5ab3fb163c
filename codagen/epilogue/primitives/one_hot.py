"""``OneHot``: 1.0 where the tile's column is ``index[row]`` (cross-entropy's target logit)."""
from __future__ import annotations

import torch

from ..core import Example, Expr, Gemm, Program, ProgramError, RowPartial, Store, Width, primitive
from .accumulator import Accumulator
from .row_vector import RowVector


@primitive
class OneHot(Expr):
    """1.0 where the tile's global column index equals ``index[row]``, else 0.0 (FULL width).

    Picks the target logit for cross-entropy as a select's mask, ``Binary("mask", z, OneHot(target))``
    (a product ``z * OneHot(target)`` is nan where a non-target logit is infinite); an index outside
    [0, N) (ignore_index = -100) gives an all-zero row.
    """
    index: RowVector

    def __post_init__(self):
        if not (isinstance(self.index, RowVector) and self.index.index):
            raise ProgramError("OneHot needs a RowVector(..., index=True)")

    @property
    def kind(self) -> str:
        return "tile"

    @property
    def width(self) -> Width:
        return Width.FULL

    def children(self):
        return (self.index,)

    def render(self, show) -> str:
        return f"[n == {self.index}]"

    def reference(self, ev):
        return (torch.arange(ev.n, device=ev.device)[None, :] == ev.value(self.index)).to(ev.dtype)

    def emit_persistent(self, em) -> str:
        name = em.fresh("onehot")
        em.emit(f"# {self}")
        em.emit(f"{name} = tl.where({em.cols(Width.FULL)}[None, :] == {em.names[self.index]}, 1.0, 0.0)")
        return name

    def emit_pingpong(self, em) -> None:
        name = em.fresh("onehot")
        index = em.row(self.index, "P")
        em.emit(f"{name} = gl.where(gl.expand_dims(cols, 0) == {index}, 1.0, 0.0)  # {self}")
        em.full[self] = name

    @classmethod
    def examples(cls) -> list[Example]:
        acc, hot = Accumulator(), cls(RowVector("target", index=True))

        def picked(acc, t):
            hits = torch.arange(acc.shape[1])[None, :] == t["target"][:, None]
            return torch.where(hits, acc, 0.0)
        return [Example(Program("target_logit", Gemm.linear(), (RowPartial("target_logit", acc * hot),
                                                                 Store("masked", acc * hot))),
                        lambda acc, t: {"target_logit": picked(acc, t).sum(1), "masked": picked(acc, t)})]
