"""``Rope``: the adjacent-pair map 2 -> 2 rotating each pair by ``position[m] * frequency[j]``."""
from __future__ import annotations

import torch

from ..core import Example, Expr, Gemm, Program, ProgramError, Store, Width, need_tile, primitive
from .accumulator import Accumulator
from .col_vector import ColVector
from .row_vector import RowVector

__all__ = ["Rope", "rope_ref"]


def rope_ref(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[2j], x[2j+1])`` by ``theta[..., j]``."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = torch.cos(theta), torch.sin(theta)
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def _lines(name: str, even: str, odd: str, cos: str, sin: str, inverse: bool) -> list[str]:
    """The rotation of each pair (even, odd) by theta, or by -theta when ``inverse`` (cos(-t) = cos t,
    sin(-t) = -sin t), in ``tl`` and ``gl`` alike: ``name_even``, ``name_odd``."""
    if inverse:
        first, second = f"{even} * {cos} + {odd} * {sin}", f"{odd} * {cos} - {even} * {sin}"
    else:
        first, second = f"{even} * {cos} - {odd} * {sin}", f"{even} * {sin} + {odd} * {cos}"
    return [f"{name}_even = {first}", f"{name}_odd = {second}"]


@primitive
class Rope(Expr):
    """Adjacent-pair map 2 -> 2: rotate each pair (x[2j], x[2j+1]) by ``theta = position[m] * frequency[j]``::

        y[2j]   = x[2j] * cos(theta) - x[2j+1] * sin(theta)
        y[2j+1] = x[2j] * sin(theta) + x[2j+1] * cos(theta)

    ``inverse=True`` rotates by ``-theta`` (the backward pass). The angle is computed in registers:
    no cos/sin table is read. Columns that must not rotate (V) get frequency 0.
    """
    x: Expr
    positions: RowVector
    frequencies: ColVector
    inverse: bool = False
    pairs = True

    def __post_init__(self):
        need_tile(self.x, "Rope")
        if not isinstance(self.positions, RowVector) or self.positions.index:
            raise ProgramError("Rope.positions must be a float RowVector")
        if not isinstance(self.frequencies, ColVector):
            raise ProgramError("Rope.frequencies must be a ColVector")
        if self.x.width == Width.HALF or self.frequencies.width != self.x.width.halved():
            raise ProgramError(
                f"Rope frequencies have one value per pair: width {self.x.width!r} needs a "
                f"ColVector of width {self.x.width.halved()!r}" if self.x.width != Width.HALF
                else "Rope input must be FULL or DOUBLE width")

    @property
    def kind(self) -> str:
        return "tile"

    @property
    def width(self) -> Width:
        return self.x.width

    def children(self):
        return (self.x, self.positions, self.frequencies)

    def render(self, show) -> str:
        return f"rope({show(self.x)}, {'-' if self.inverse else ''}{self.positions} * {self.frequencies})"

    def reference(self, ev):
        theta = ev.value(self.positions) * ev.value(self.frequencies)
        return rope_ref(ev.value(self.x), -theta if self.inverse else theta)

    def emit_persistent(self, em) -> str:
        name = em.fresh("rope")
        even, odd = em.pairs_of(self.x)
        angle_key = ("angle", em.names[self.positions], em.names[self.frequencies])
        if angle_key not in em.memo:
            theta = em.fresh("theta")
            em.emit(f"# rotation angle of each pair, in registers: theta = {self.positions} * {self.frequencies}")
            em.emit(f"{theta} = {em.names[self.positions]} * {em.names[self.frequencies]}")
            em.emit(f"{theta}_cos, {theta}_sin = cos_sin({theta}, PORTABLE)")
            em.memo[angle_key] = theta
        theta = em.memo[angle_key]
        em.emit(f"# {em.comment(self)}")
        for line in _lines(name, even, odd, f"{theta}_cos", f"{theta}_sin", self.inverse):
            em.emit(line)
        em.pair_form[self] = (f"{name}_even", f"{name}_odd")
        return name

    def emit_pingpong(self, em) -> None:
        name = em.fresh("rope")
        even, odd = em.operand(self.x, self.x.width, True)
        positions = em.operand(self.positions, self.x.width, True)[0]  # in the halves' layout
        frequencies = em.operand(self.frequencies, self.frequencies.width, False)
        key = ("angle", positions, frequencies)
        if key not in em.memo:
            theta = em.fresh("theta")
            em.emit(f"{theta} = {positions} * {frequencies}  # rotation angle of each pair")
            em.emit(f"{theta}_cos, {theta}_sin = cos_sin({theta})")
            em.memo[key] = theta
        cos, sin = f"{em.memo[key]}_cos", f"{em.memo[key]}_sin"
        em.emit(f"# {em.comment(self)}")
        for line in _lines(name, even, odd, cos, sin, self.inverse):
            em.emit(line)
        em.pairs[self] = (f"{name}_even", f"{name}_odd")

    @classmethod
    def examples(cls) -> list[Example]:
        acc, positions, frequencies = Accumulator(), RowVector("positions"), ColVector("frequencies", Width.HALF)

        def rotated(x, theta):
            even, odd = x[:, 0::2], x[:, 1::2]
            return torch.stack((even * torch.cos(theta) - odd * torch.sin(theta),
                                even * torch.sin(theta) + odd * torch.cos(theta)), dim=-1).flatten(1)

        def oracle(acc, t):
            theta = t["positions"][:, None] * t["frequencies"][None, :]
            return {"forward": rotated(acc, theta), "inverse": rotated(acc, -theta)}
        return [Example(Program("rotary", Gemm.linear(), (Store("forward", cls(acc, positions, frequencies)),
                                                          Store("inverse", cls(acc, positions, frequencies, True)))),
                        oracle)]
