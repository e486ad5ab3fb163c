"""Reference backend: executes any epilogue program with whole-tensor PyTorch ops.

It is the oracle for the Triton backend and the default where no GPU backend applies. Arithmetic runs
in float32 (float64 for float64 operands); outputs are cast to their declared dtypes. Partial
reductions are cut into the same tiles a kernel would use (``block_m`` x ``block_n``), so their
layout matches a kernel's and the library's finishing reductions serve both.
"""
from __future__ import annotations

from typing import Mapping

import torch

from codagen.epilogue.bind import BoundProgram, cdiv
from codagen.epilogue.ir import (Accumulator, Binary, ColPartial, ColVector, Constant, Expr, OneHot, Program, Rope,
                                 RowPartial, RowVector, ScalarInput, SegmentSum, Store, SwiGLU, SwiGLUBackward,
                                 TileInput, Unary)

__all__ = ["ReferenceBackend", "evaluate_epilogue", "swiglu_ref", "swiglu_backward_ref", "rope_ref", "segment_sum_ref"]


def swiglu_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., 0::2]) * x[..., 1::2]``."""
    gate, up = x[..., 0::2], x[..., 1::2]
    return torch.nn.functional.silu(gate) * up


def swiglu_backward_ref(preact: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Interleaved ``(dg, du)`` of ``silu(g) * u`` for pairs ``(g, u)`` of ``preact``."""
    gate, up = preact[..., 0::2], preact[..., 1::2]
    sig = torch.sigmoid(gate)
    d_gate = grad * up * sig * (1 + gate * (1 - sig))
    d_up = grad * gate * sig
    return torch.stack((d_gate, d_up), dim=-1).flatten(-2)


def rope_ref(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[2j], x[2j+1])`` by ``theta[..., j]``."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = torch.cos(theta), torch.sin(theta)
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def segment_sum_ref(x: torch.Tensor, size: int) -> torch.Tensor:
    """Each column gets the sum of its aligned group of ``size`` adjacent columns (``x.shape[-1] % size == 0``)."""
    groups = x.unflatten(-1, (-1, size))
    return groups.sum(-1, keepdim=True).expand(groups.shape).flatten(-2)


_UNARY = {
    "neg": torch.neg, "exp": torch.exp, "log": torch.log, "sigmoid": torch.sigmoid,
    "silu": torch.nn.functional.silu, "square": torch.square, "rsqrt": torch.rsqrt,
}
_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "max": torch.maximum}


def evaluate_epilogue(program: Program, acc: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> dict[Expr, torch.Tensor]:
    """Every expression of ``program`` on a whole GEMM output ``acc`` [M, N], in ``acc``'s dtype.

    Row vectors come out as [M, 1], column vectors as [1, N*w], tiles as [M, N*w]. Plain PyTorch ops,
    so it also serves as the unfused (eager / torch.compile) epilogue in the kernel benchmark.
    """
    cd, device, n = acc.dtype, acc.device, acc.shape[1]
    values: dict[Expr, torch.Tensor] = {}
    for e in program.expressions():
        if isinstance(e, Accumulator):
            v = acc
        elif isinstance(e, RowVector):
            v = tensors[e.name][:, None] if e.index else tensors[e.name].to(cd)[:, None]
        elif isinstance(e, ColVector):
            v = tensors[e.name].to(cd)[None, :]
        elif isinstance(e, ScalarInput):
            v = tensors[e.name].to(cd).reshape(())
        elif isinstance(e, TileInput):
            v = tensors[e.name].to(cd)
        elif isinstance(e, Constant):
            v = torch.tensor(e.value, dtype=cd, device=device)
        elif isinstance(e, Unary):
            v = _UNARY[e.op](values[e.x])
        elif isinstance(e, Binary):
            v = _BINARY[e.op](values[e.a], values[e.b])
        elif isinstance(e, OneHot):
            v = (torch.arange(n, device=device)[None, :] == values[e.index]).to(cd)
        elif isinstance(e, SwiGLU):
            v = swiglu_ref(values[e.x])
        elif isinstance(e, SwiGLUBackward):
            v = swiglu_backward_ref(values[e.preact], values[e.grad])
        elif isinstance(e, Rope):
            theta = values[e.positions] * values[e.frequencies]
            v = rope_ref(values[e.x], -theta if e.inverse else theta)
        elif isinstance(e, SegmentSum):
            v = segment_sum_ref(values[e.x].expand(acc.shape[0], e.width.columns(n)), e.size)
        else:  # pragma: no cover - the IR is a closed set
            raise TypeError(f"reference backend cannot evaluate {type(e).__name__}")
        values[e] = v
    return values


class ReferenceBackend:
    """Whole-tensor evaluation. ``block_m``/``block_n`` only set the tiling of partial reductions."""
    name = "reference"

    def __init__(self, block_m: int = 128, block_n: int = 128):
        if block_n % 2:
            raise ValueError(f"block_n must be even (column pairs never straddle tiles), got {block_n}")
        self.block_m, self.block_n = block_m, block_n

    def run(self, bound: BoundProgram) -> dict[str, torch.Tensor]:
        outs = bound.allocate_outputs(self.block_m, self.block_n)
        if bound.m == 0 or bound.n == 0:
            return outs
        values = self._evaluate(bound)
        for out in bound.program.outputs:
            value = values[out.value]
            width = out.value.width.columns(bound.n)
            value = value.expand(bound.m, width)
            if isinstance(out, Store):
                target = outs[out.name]
                target.copy_(target.to(value.dtype) + value if out.accumulate else value)
            elif isinstance(out, RowPartial):
                outs[out.name].copy_(self._row_partial(value, out.reduction, out.value.width.columns(self.block_n)))
            elif isinstance(out, ColPartial):
                outs[out.name].copy_(self._col_partial(value))
        return outs

    # -- evaluation ----------------------------------------------------------------------------------
    def _evaluate(self, bound: BoundProgram) -> dict[Expr, torch.Tensor]:
        cd = bound.compute_dtype
        a = bound.a if bound.program.gemm.a_layout == "mk" else bound.a.t()
        b = bound.b.t() if bound.program.gemm.b_layout == "nk" else bound.b
        acc = a.to(cd) @ b.to(cd)
        if bound.program.gemm.low_rank:
            a2, b2 = bound.tensors["a2"], bound.tensors["b2"]
            a2 = a2 if bound.program.gemm.a_layout == "mk" else a2.t()
            b2 = b2.t() if bound.program.gemm.b_layout == "nk" else b2
            acc = acc + a2.to(cd) @ b2.to(cd)
        return evaluate_epilogue(bound.program, acc, bound.tensors)

    @staticmethod
    def _row_partial(value: torch.Tensor, reduction: str, tile_cols: int) -> torch.Tensor:
        m, cols = value.shape
        tiles = cdiv(cols, tile_cols)
        fill = 0.0 if reduction == "sum" else float("-inf")
        padded = value.new_full((m, tiles * tile_cols), fill)
        padded[:, :cols] = value
        padded = padded.view(m, tiles, tile_cols)
        return padded.sum(-1) if reduction == "sum" else torch.logsumexp(padded, dim=-1)

    def _col_partial(self, value: torch.Tensor) -> torch.Tensor:
        m, cols = value.shape
        tiles = cdiv(m, self.block_m)
        padded = value.new_zeros((tiles * self.block_m, cols))
        padded[:m] = value
        return padded.view(tiles, self.block_m, cols).sum(1)
