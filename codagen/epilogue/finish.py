"""Finishing reductions: turn a program's tile-local partials into row or column statistics.

Each is O(#tiles) per row (or column): tiny next to the GEMM that wrote the partials. They reduce in a
fixed order, so results are bitwise reproducible.
"""
from __future__ import annotations

import torch

__all__ = ["rstd_from_partial_sumsq", "logsumexp_from_partials", "sum_row_partials", "sum_col_partials"]


def rstd_from_partial_sumsq(partial_sumsq: torch.Tensor, width: int, eps: float) -> torch.Tensor:
    """``rstd[m] = rsqrt(sum_t partial_sumsq[m, t] / width + eps)`` (float32 [M])."""
    return torch.rsqrt(partial_sumsq.sum(dim=-1) / width + eps)


def logsumexp_from_partials(partial_lse: torch.Tensor) -> torch.Tensor:
    """Merge per-tile log-sum-exps: ``lse[m] = log(sum_t exp(partial_lse[m, t]))``."""
    return torch.logsumexp(partial_lse, dim=-1)


def sum_row_partials(partial: torch.Tensor) -> torch.Tensor:
    """``[M, n_tiles] -> [M]``."""
    return partial.sum(dim=-1)


def sum_col_partials(partial: torch.Tensor) -> torch.Tensor:
    """``[m_tiles, N] -> [N]``."""
    return partial.sum(dim=0)
