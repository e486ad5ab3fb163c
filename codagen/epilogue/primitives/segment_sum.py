"""``SegmentSum``: per row, the sum over each aligned group of adjacent columns, broadcast back onto it."""
from __future__ import annotations

import torch

from ..core import Example, Expr, Gemm, Program, ProgramError, Store, Width, primitive
from .accumulator import Accumulator

__all__ = ["SegmentSum", "segment_sum_ref"]


def segment_sum_ref(x: torch.Tensor, size: int) -> torch.Tensor:
    """Each column gets the sum of its aligned group of ``size`` adjacent columns (``x.shape[-1] % size == 0``)."""
    groups = x.unflatten(-1, (-1, size))
    return groups.sum(-1, keepdim=True).expand(groups.shape).flatten(-2)


@primitive
class SegmentSum(Expr):
    """Tile-local segmented row sum: columns form aligned groups of ``size`` adjacent columns
    ``[g * size, (g + 1) * size)``, and every column gets its group's sum::

        out[m, n] = sum over n' with n' // size == n // size of x[m, n']

    The width is kept. With ``size = head_dim`` on a QKV tile it is a per-(row, head) statistic
    broadcast back onto the head's columns (QK-norm's sum of squares). A group must lie inside one
    tile (:attr:`column_group`): backends use tiles whose width (of ``x``'s columns) is a multiple of
    ``size``, and binding needs ``N * w`` to be a multiple of ``size`` (no group straddles the matrix
    edge). ``size`` is even, so a group is ``size / 2`` whole column pairs.
    """
    x: Expr
    size: int

    def __post_init__(self):
        if self.x.kind != "tile":
            raise ProgramError(f"SegmentSum needs a tile value, got {self.x} ({self.x.kind})")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 2 or self.size % 2:
            raise ProgramError(f"SegmentSum.size must be an even int >= 2 (whole column pairs), got {self.size!r}")

    @property
    def kind(self) -> str:
        return "tile"

    @property
    def width(self) -> Width:
        return self.x.width

    @property
    def column_group(self) -> int:
        return self.size

    def children(self):
        return (self.x,)

    def render(self, show) -> str:
        return f"segment_sum({show(self.x)}, size={self.size})"

    def reference(self, ev):
        return segment_sum_ref(ev.value(self.x).expand(ev.m, self.width.columns(ev.n)), self.size)

    def emit_persistent(self, em) -> str:
        name = em.fresh("segment_sum")
        w, size = self.width, self.size
        cols = em.tile_cols(w)
        groups = f"{cols} // {size}"
        em.emit(f"# {em.comment(self)}: each aligned group of {size} columns sums per row, broadcast back")
        em.emit(f"tl.static_assert({cols} % {size} == 0, \"segment_sum(size={size}): the epilogue "
                f"sub-tile (BLOCK_N / EPILOGUE_SPLIT columns, times the value's width) must hold whole groups "
                f"of {size} columns (whole heads when {size} is head_dim)\")")
        if em.in_pairs(self.x):
            # a group of `size` columns is size/2 pairs: the same [groups, size/2] cut of both halves
            even, odd = em.pair_form[self.x]
            half = size // 2
            em.emit(f"{name}_group = tl.sum(tl.reshape({even}, (BLOCK_M, {groups}, {half})), axis=2) + "
                    f"tl.sum(tl.reshape({odd}, (BLOCK_M, {groups}, {half})), axis=2)")
            em.emit(f"{name}_half = tl.reshape(tl.broadcast_to({name}_group[:, :, None], (BLOCK_M, {groups}, "
                    f"{half})), (BLOCK_M, {cols} // 2))  # both halves of a pair hold the group's sum")
            em.pair_form[self] = (f"{name}_half", f"{name}_half")
        else:
            x = em.full(self.x)
            em.emit(f"{name}_group = tl.sum(tl.reshape({x}, (BLOCK_M, {groups}, {size})), axis=2)")
            em.emit(f"{name} = tl.reshape(tl.broadcast_to({name}_group[:, :, None], (BLOCK_M, {groups}, "
                    f"{size})), (BLOCK_M, {cols}))")
        return name

    def pingpong_refusal(self) -> str | None:
        return "segment sums (QK-norm) need whole heads per piece"

    @classmethod
    def examples(cls) -> list[Example]:
        acc = Accumulator()
        square = acc * acc

        def oracle(acc, t):
            groups = (acc * acc).unflatten(1, (-1, 16))
            return {"head_sumsq": groups.sum(-1, keepdim=True).expand(groups.shape).flatten(1)}
        return [Example(Program("head_sumsq", Gemm.linear(), (Store("head_sumsq", cls(square, 16)),)), oracle)]
