"""Finishing reductions: a fused GEMM's tile partials summed into the outputs, one launch each.

- :func:`finish_rstd`: ``rstd[m] = rsqrt(sum_t partial_sumsq[m, t] / width + eps)``;
- :func:`finish_row_mean`: ``out[m] = sum_t partial[m, t] / width`` (``mean_z_dz``);
- :func:`finish_col_sum`: ``out[n] = sum_t partial[t, n]`` rounded once (a norm weight's gradient);
- :func:`finish_cross_entropy`: ``row_loss[m] = logsumexp_t(partial_lse[m, t]) - sum_t partial_target[m, t]``.

The ``_ref`` twins are :mod:`codagen.epilogue.finish`'s; in PyTorch each is two to four launches
(``docs/notes/finishing-kernels.md``).
"""
from __future__ import annotations

import torch

from codagen.epilogue import finish

from ._launch import (
    cdiv,
    dependent_launch,
    dispatcher,
    launch_kernel,
    launcher,
    next_power_of_2,
    tl,
    triton,
)

__all__ = ["finish_rstd", "finish_rstd_ref", "finish_rstd_triton", "finish_row_mean", "finish_row_mean_ref",
           "finish_row_mean_triton", "finish_col_sum", "finish_col_sum_ref", "finish_col_sum_triton",
           "finish_cross_entropy", "finish_cross_entropy_ref", "finish_cross_entropy_triton"]

#: partials one program of a finisher reads a step, and at most this many tiles' partials of an output
_FINISH_ELEMENTS, _FINISH_MAX_TILES = 4096, 64


@triton.jit
def _finish_partials_kernel(partial_ptr, out_ptr, n_out, n_tiles, out_stride, tile_stride, scale, eps,
                            RSQRT: tl.constexpr, OUTS: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr):
    """OUTS outputs per program, TILES partials of each a step: ``out[i] = scale * sum_t partial[i, t]``
    in fp32, then ``rsqrt(out + eps)`` (RSQRT), rounded once to ``out``'s dtype. Row partials [M, tiles]
    come with ``tile_stride = 1``, column partials [tiles, N] with ``out_stride = 1``. ``PDL``: launched as a
    programmatic dependent of the GEMM that wrote the partials (decode rows)."""
    if PDL:  # the next GEMM may launch and prefetch its weight; the partials are visible after gdc_wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    outs = tl.program_id(0) * OUTS + tl.arange(0, OUTS)
    total = tl.zeros([OUTS], dtype=tl.float32)
    for start in range(0, n_tiles, TILES):
        tiles = start + tl.arange(0, TILES)
        mask = (outs < n_out)[:, None] & (tiles < n_tiles)[None, :]
        at = outs.to(tl.int64)[:, None] * out_stride + tiles.to(tl.int64)[None, :] * tile_stride
        total += tl.sum(tl.load(partial_ptr + at, mask=mask, other=0.0), axis=1)
    total = total * scale
    if RSQRT:
        total = 1.0 / tl.sqrt(total + eps)
    tl.store(out_ptr + outs, total.to(out_ptr.dtype.element_ty), mask=outs < n_out)


@triton.jit
def _finish_cross_entropy_kernel(partial_lse_ptr, partial_target_ptr, row_loss_ptr, n_rows, n_tiles,
                                 lse_row_stride, lse_tile_stride, target_row_stride, target_tile_stride,
                                 ROWS: tl.constexpr, TILES: tl.constexpr):
    """ROWS rows per program: ``row_loss = logsumexp_t(partial_lse[m, t]) - sum_t partial_target[m, t]``,
    the logsumexp kept online (running max and sum) over steps of TILES partials."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    running_max = tl.full([ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([ROWS], dtype=tl.float32)
    target = tl.zeros([ROWS], dtype=tl.float32)
    for start in range(0, n_tiles, TILES):
        tiles = start + tl.arange(0, TILES)
        mask = row_ok[:, None] & (tiles < n_tiles)[None, :]
        lse_at = rows.to(tl.int64)[:, None] * lse_row_stride + tiles.to(tl.int64)[None, :] * lse_tile_stride
        partial = tl.load(partial_lse_ptr + lse_at, mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(partial, axis=1))
        # shift = max where finite, else 0: a row of -inf stays -inf and one holding +inf is +inf, not nan
        shift = tl.where(tl.abs(new_max) == float("inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(partial - shift[:, None]), axis=1)
        running_max = new_max
        target_at = (rows.to(tl.int64)[:, None] * target_row_stride
                     + tiles.to(tl.int64)[None, :] * target_tile_stride)
        target += tl.sum(tl.load(partial_target_ptr + target_at, mask=mask, other=0.0).to(tl.float32), axis=1)
    tl.store(row_loss_ptr + rows, running_max + tl.log(running_sum) - target, mask=row_ok)


def finish_rstd_ref(partial_sumsq: torch.Tensor, width: int, eps: float) -> torch.Tensor:
    """``rstd[m] = rsqrt(sum_t partial_sumsq[m, t] / width + eps)``."""
    return finish.rstd_from_partial_sumsq(partial_sumsq, width, eps)


@launcher
def finish_rstd_triton(partial_sumsq: torch.Tensor, width: int, eps: float) -> torch.Tensor:
    return _finish(partial_sumsq, over_rows=False, dtype=torch.float32, scale=1.0 / width, eps=eps, rsqrt=True)


def finish_row_mean_ref(partial: torch.Tensor, width: int) -> torch.Tensor:
    """``out[m] = sum_t partial[m, t] / width`` (``mean_z_dz`` from a program's ``partial_z_dz``)."""
    return finish.sum_row_partials(partial) / width


@launcher
def finish_row_mean_triton(partial: torch.Tensor, width: int) -> torch.Tensor:
    return _finish(partial, over_rows=False, dtype=torch.float32, scale=1.0 / width)


def finish_col_sum_ref(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out[n] = sum_t partial[t, n]`` rounded once to ``dtype`` (a norm weight's gradient from its partials)."""
    return finish.sum_col_partials(partial).to(dtype)


@launcher
def finish_col_sum_triton(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _finish(partial, over_rows=True, dtype=dtype)


def finish_cross_entropy_ref(partial_lse: torch.Tensor, partial_target: torch.Tensor) -> torch.Tensor:
    """``row_loss[m] = logsumexp_t(partial_lse[m, t]) - sum_t partial_target[m, t]`` (the LM head's
    cross-entropy per row from ``rms_lm_head_cross_entropy``'s partials; ignored rows are masked later)."""
    return finish.logsumexp_from_partials(partial_lse) - finish.sum_row_partials(partial_target)


@launcher
def finish_cross_entropy_triton(partial_lse: torch.Tensor, partial_target: torch.Tensor) -> torch.Tensor:
    n_rows, n_tiles = partial_lse.shape
    if partial_target.shape != partial_lse.shape:
        raise ValueError(f"partial_target: expected the shape of partial_lse {tuple(partial_lse.shape)}, got "
                         f"{tuple(partial_target.shape)}")
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=partial_lse.device)
    if n_rows:
        rows, tiles = _finish_step(n_rows, n_tiles)
        launch_kernel(_finish_cross_entropy_kernel, (cdiv(n_rows, rows),),
            partial_lse, partial_target, row_loss, n_rows, n_tiles, *partial_lse.stride(), *partial_target.stride(),
            ROWS=rows, TILES=tiles)
    return row_loss


def _finish_step(n_out: int, n_tiles: int) -> tuple[int, int]:
    """(outputs per program, tiles per step) of a finisher: at most :data:`_FINISH_MAX_TILES` tiles and
    :data:`_FINISH_ELEMENTS` partials a step."""
    tiles = min(next_power_of_2(max(n_tiles, 1)), _FINISH_MAX_TILES)
    return min(next_power_of_2(n_out), _FINISH_ELEMENTS // tiles), tiles


def _finish(partial: torch.Tensor, *, over_rows: bool, dtype: torch.dtype, scale: float = 1.0, eps: float = 0.0,
            rsqrt: bool = False) -> torch.Tensor:
    """One launch of the finisher over fp32 ``partial``: a sum along its rows (``over_rows``: the tiles are
    rows, one output per column) or along its columns (one output per row)."""
    n_tiles, n_out = partial.shape if over_rows else partial.shape[::-1]
    tile_stride, out_stride = partial.stride() if over_rows else partial.stride()[::-1]
    out = torch.empty(n_out, dtype=dtype, device=partial.device)
    if n_out:
        outs, tiles = _finish_step(n_out, n_tiles)
        # a row finisher (one output per row) of a decode-sized GEMM launches as its dependent; a column finisher's
        # outputs are columns, not the GEMM's rows. (False for CPU tensors: the interpreter.)
        pdl = not over_rows and dependent_launch.enabled(n_out, partial.device)
        launch_kernel(_finish_partials_kernel, (cdiv(n_out, outs),), partial, out, n_out, n_tiles, out_stride,
                      tile_stride, scale, eps, RSQRT=rsqrt, OUTS=outs, TILES=tiles,
                      **dependent_launch.launch_options(pdl))
    return out


finish_rstd = dispatcher(finish_rstd_ref, finish_rstd_triton)
finish_row_mean = dispatcher(finish_row_mean_ref, finish_row_mean_triton)
finish_col_sum = dispatcher(finish_col_sum_ref, finish_col_sum_triton)
finish_cross_entropy = dispatcher(finish_cross_entropy_ref, finish_cross_entropy_triton)
