"""Reference backend: executes any epilogue program with whole-tensor PyTorch ops.

It is the oracle for the Triton backend and the default where no GPU backend applies. Arithmetic runs
in float32 (float64 for float64 operands); outputs are cast to their declared dtypes. Partial
reductions are cut into the same tiles a kernel would use (``block_m`` x ``block_n``), so their
layout matches a kernel's and the library's finishing reductions serve both.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from codagen.epilogue.bind import BoundProgram, cdiv
from codagen.epilogue.ir import ColPartial, Expr, Program, QuantizedStore, RowPartial, Store
from codagen.epilogue.primitives.geglu import geglu_ref
from codagen.epilogue.primitives.geglu_backward import geglu_backward_ref
from codagen.epilogue.primitives.rope import rope_ref
from codagen.epilogue.primitives.segment_sum import segment_sum_ref
from codagen.epilogue.primitives.swiglu import swiglu_ref
from codagen.epilogue.primitives.swiglu_backward import swiglu_backward_ref

__all__ = ["ReferenceBackend", "evaluate_epilogue", "swiglu_ref", "swiglu_backward_ref", "geglu_ref",
           "geglu_backward_ref", "rope_ref", "segment_sum_ref"]


class _Values:
    """What a primitive's ``reference`` reads: its operands' values, the named tensors, the accumulator."""

    def __init__(self, acc: torch.Tensor, tensors: Mapping[str, torch.Tensor]):
        self.acc, self.tensors = acc, tensors
        self.dtype, self.device = acc.dtype, acc.device
        self.m, self.n = acc.shape
        self.values: dict[Expr, torch.Tensor] = {}

    def value(self, e: Expr) -> torch.Tensor:
        return self.values[e]

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def evaluate_epilogue(program: Program, acc: torch.Tensor,
                      tensors: Mapping[str, torch.Tensor]) -> dict[Expr, torch.Tensor]:
    """Every expression of ``program`` on a whole GEMM output ``acc`` [M, N], in ``acc``'s dtype.

    Row vectors come out as [M, 1], column vectors as [1, N*w], tiles as [M, N*w]. Plain PyTorch ops
    (each primitive's ``reference``), so it also serves as the unfused (eager / torch.compile) epilogue
    in the kernel benchmark.
    """
    ev = _Values(acc, tensors)
    for e in program.expressions():
        ev.values[e] = e.reference(ev)
    return ev.values


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
            elif isinstance(out, QuantizedStore):
                q, scale = out.quantized(value)
                outs[out.name].copy_(q)
                outs[out.scale].copy_(scale)
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
        group = bound.program.gemm.k_scale_group
        if group is not None:  # each operand times its scales, repeated over their K groups
            gemm = bound.program.gemm
            a_scale = _k_groups_expanded(bound.tensors["a_scale"], 1 if gemm.a_layout == "mk" else 0, group, bound.k)
            b_scale = bound.tensors["b_scale"]
            if gemm.b_scale_block:  # one scale per group x group block: repeated over the block's N indices too
                b_scale = _k_groups_expanded(b_scale, 0 if gemm.b_layout == "nk" else 1, group, bound.n)
            b_scale = _k_groups_expanded(b_scale, 1 if gemm.b_layout == "nk" else 0, group, bound.k)
            a = a.to(cd) * (a_scale if gemm.a_layout == "mk" else a_scale.t()).to(cd)
            b = b.to(cd) * (b_scale.t() if gemm.b_layout == "nk" else b_scale).to(cd)
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


def _k_groups_expanded(scale: torch.Tensor, k_dim: int, group: int, k: int) -> torch.Tensor:
    """K-group scales (K/G along ``k_dim``) repeated over each group's K indices: the operand's own layout."""
    return scale.repeat_interleave(group, dim=k_dim).narrow(k_dim, 0, k)
