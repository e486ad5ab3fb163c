"""``TileInput``: a second operand [M, N*w] loaded tile by tile (residual stream, saved pre-activation)."""
from __future__ import annotations

import torch

from ..core import Example, Expr, Gemm, Program, ProgramError, Store, Width, check_name, check_shape, primitive
from .accumulator import Accumulator


@primitive
class TileInput(Expr):
    """A second operand [M, N*w] loaded tile by tile (residual stream, saved pre-activation)."""
    name: str
    tile_width: Width = Width.FULL
    is_input = True

    def __post_init__(self):
        check_name(self.name, "TileInput")

    @property
    def kind(self) -> str:
        return "tile"

    @property
    def width(self) -> Width:
        return self.tile_width

    def render(self, show) -> str:
        return f"{self.name}[m, n]" if self.tile_width == Width.FULL else f"{self.name}[m, n:{self.tile_width!r}]"

    def check_tensor(self, name: str, t: torch.Tensor, m: int, n: int) -> None:
        check_shape(name, t, (m, self.width.columns(n)), f"[M, {self.width!r}]")
        if not t.dtype.is_floating_point:
            raise ProgramError(f"{name}: expected a floating-point tile operand, got {t.dtype}")

    def reference(self, ev):
        return ev.tensor(self.name).to(ev.dtype)

    def emit_persistent(self, em) -> str:
        w = self.width
        em.emit(f"# {self}: tile operand")
        em.emit("if TMA_EPILOGUE:")
        em.emit(f"    {self.name} = {self.name}_desc.load([off_m, {em.tile_offset(w)}]).to(tl.float32)")
        em.emit("else:")
        em.emit(f"    {self.name} = tl.load({self.name}_ptr + {em.tile_offsets(w)}, mask={em.tile_ok(w)}, "
                f"other=0.0).to(tl.float32)")
        return self.name

    def emit_pingpong(self, em) -> None:
        """Read from its shared-memory slot at the start of the piece (the generator's loads)."""

    @classmethod
    def examples(cls) -> list[Example]:
        acc = Accumulator()
        return [Example(Program("residual_add", Gemm.linear(), (Store("out", acc + cls("residual")),
                                                                 Store("twice", cls("residual") * 2.0))),
                        lambda acc, t: {"out": acc + t["residual"], "twice": 2 * t["residual"]})]
