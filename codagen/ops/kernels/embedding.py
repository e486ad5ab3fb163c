"""The embedding table's gradient, each vocabulary row's tokens summed in token order.

``grad_weight[v] = sum_{t: ids[t] = v} grad_out[t]`` in fp32: a stable sort of the ids, then one kernel
whose programs each take 8 vocabulary rows by one column block. No atomics: deterministic.
"""
from __future__ import annotations

import torch

from .._checks import stats_dtype
from ._launch import cdiv, dispatcher, launch_kernel, launcher, next_power_of_2, tl, triton

__all__ = ["embedding_backward", "embedding_backward_ref", "embedding_backward_triton"]


@triton.jit
def _embedding_backward_kernel(grad_out_ptr, token_order_ptr, row_start_ptr, grad_weight_ptr, vocab, n_cols,
                               ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (r, c), for each vocabulary row v of its ROWS: ``grad_weight[v, c block] = sum of
    grad_out[t, c block]`` over the tokens t with id v, in ascending t (``token_order`` is a stable sort):
    fp32 sum, one store, zeros for unused rows. ROWS rows per program: most rows have no token or one,
    and a program per row spent more time starting than working."""
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    for r in range(ROWS):
        vocab_row = tl.program_id(0).to(tl.int64) * ROWS + r
        if vocab_row < vocab:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            # a frequent token has many rows: keep several loads in flight
            for i in tl.range(tl.load(row_start_ptr + vocab_row), tl.load(row_start_ptr + vocab_row + 1),
                              num_stages=4):
                token = tl.load(token_order_ptr + i).to(tl.int64)
                acc += tl.load(grad_out_ptr + token * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(grad_weight_ptr + vocab_row * n_cols + cols, acc.to(grad_weight_ptr.dtype.element_ty),
                     mask=mask)


def embedding_backward_ref(grad_out: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``grad_weight[v] = sum_{t: ids[t] = v} grad_out[t]`` [vocab, d], summed in fp32 (fp64 for fp64)."""
    cd = stats_dtype(grad_out.dtype)
    grad_weight = grad_out.new_zeros(vocab, grad_out.shape[1], dtype=cd)
    return grad_weight.index_add_(0, ids.long(), grad_out.to(cd)).to(grad_out.dtype)


@launcher
def embedding_backward_triton(grad_out: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """:func:`embedding_backward_ref` as a stable sort of the ids and one kernel launch that sums each
    vocabulary row's tokens in token order. No atomics: deterministic."""
    tokens, d = grad_out.shape
    grad_weight = torch.empty(vocab, d, dtype=grad_out.dtype, device=grad_out.device)
    if vocab and d:
        sorted_ids, token_order = torch.sort(ids.to(torch.int32), stable=True)
        vocab_rows = torch.arange(vocab + 1, dtype=torch.int32, device=ids.device)
        # [vocab + 1]: row v is [start v, start v+1)
        row_start = torch.searchsorted(sorted_ids, vocab_rows, out_int32=True)
        block, rows = min(next_power_of_2(d), 1024), 8
        launch_kernel(_embedding_backward_kernel, (cdiv(vocab, rows), cdiv(d, block)),
            grad_out, token_order, row_start, grad_weight, vocab, d, ROWS=rows, BLOCK=block)
    return grad_weight


embedding_backward = dispatcher(embedding_backward_ref, embedding_backward_triton)
