"""A decode step's greedy token: each row's argmax of the LM head's logits into the step's buffers, one launch.

For logits ``z`` [batch, vocab], the token buffers ``tokens`` [batch, 1], ``generated`` [batch, max_len] and the
step counter ``s = step_index[0]`` (read on the device):

- ``t[b] = argmax_v z[b, v]``, the first maximal index, NaN the greatest value (``torch.argmax``: the first
  NaN of a row wins; a row of -inf gives 0);
- ``tokens[b, 0] = t[b]`` (the next step's input), ``generated[b, s] = t[b]``;
- ``step_index[0] = s + 1``, once.

In PyTorch that is about eight launches (the argmax, spread over the SMs in two passes, and three
bookkeeping ops), each a few microseconds of a CUDA-graph-replayed step that does little else. Here it is
one: program ``(b, c)`` reduces chunk ``c`` of row ``b`` (:data:`CHUNK` columns, so a 128k-token row spreads
over ~32 SMs; one block per row would read 256 KB alone, ~35 us) to its (max, first index) and stores that
pair to fp32 / int32 partials. The last of a row's programs to arrive at the row's counter
(:func:`codagen.backends.triton.arrivals.last_to_arrive`) reduces the row's partials and writes the row's
token; the last row to finish advances ``step_index``. Every finisher reads ``s`` before it arrives at that
last counter, so all of them see the old value.

The partials are reduced in chunk order, not arrival order, with ties to the lowest chunk: the result is the
first maximal index whichever program arrives last, bitwise the same every run. fp16 and bf16 values are
exact in fp32, so the partials compare as the logits do.
"""
from __future__ import annotations

import torch

from ._launch import arrivals, cdiv, dispatcher, last_to_arrive, launch_kernel, launcher, next_power_of_2, tl, triton

__all__ = ["greedy_append", "greedy_append_ref", "greedy_append_triton", "CHUNK"]

#: columns of a row one program reduces: 4 warps x 32 values per thread
CHUNK = 4096


@triton.jit
def _first_max(values, indices, none):
    """The greatest of ``values`` and the least of ``indices`` where it occurs, NaN the greatest value
    (torch.argmax's order). ``none``: an index above every real one. Three native reductions rather than one
    with a (value, index) combine, which the interpreter (the CPU tests) runs some thirty times slower."""
    is_nan = values != values
    first_nan = tl.min(tl.where(is_nan, indices, none), axis=0)
    largest = tl.max(tl.where(is_nan, float("-inf"), values), axis=0)
    first_largest = tl.min(tl.where(values == largest, indices, none), axis=0)
    has_nan = first_nan < none
    return tl.where(has_nan, float("nan"), largest), tl.where(has_nan, first_nan, first_largest)


@triton.jit
def _greedy_append_kernel(logits_ptr, tokens_ptr, generated_ptr, step_ptr, chunk_max_ptr, chunk_argmax_ptr,
                          counters_ptr, logits_row_stride, tokens_row_stride, vocab, max_len,
                          CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """Program (b, c): columns ``[c * CHUNK, (c + 1) * CHUNK)`` of row ``b`` to the chunk's (max, first index);
    the row's last arrival reduces its chunks to the token and writes it; the last row advances the step.
    ``CHUNKS``: the row's chunks (the grid's second axis) rounded up to a power of two."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    batch, chunks = tl.num_programs(0), tl.num_programs(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    # the tail's masked columns are -inf: they tie a row of -inf only, and lose that tie (higher index)
    logits = tl.load(logits_ptr + row.to(tl.int64) * logits_row_stride + cols, mask=cols < vocab,
                     other=float("-inf")).to(tl.float32)
    chunk_max, chunk_argmax = _first_max(logits, cols, vocab)
    partial = row * chunks + chunk
    tl.store(chunk_max_ptr + partial, chunk_max)
    tl.store(chunk_argmax_ptr + partial, chunk_argmax)

    if last_to_arrive(counters_ptr + row, chunks):
        # other programs' partials: from L2 (.cg), not this SM's L1. Each chunk's index is above every index
        # of the chunks before it, so the least index of the row's max is the first chunk's that holds it.
        at = tl.arange(0, CHUNKS)
        in_row = at < chunks
        row_max = tl.load(chunk_max_ptr + row * chunks + at, mask=in_row, other=float("-inf"), cache_modifier=".cg")
        row_argmax = tl.load(chunk_argmax_ptr + row * chunks + at, mask=in_row, other=vocab, cache_modifier=".cg")
        token = _first_max(row_max, row_argmax, vocab)[1].to(tl.int64)
        step = tl.load(step_ptr)  # before the arrival below: the last row's increment comes after every read
        tl.store(tokens_ptr + row * tokens_row_stride, token)
        tl.store(generated_ptr + row.to(tl.int64) * max_len + step, token, mask=(step >= 0) & (step < max_len))
        if last_to_arrive(counters_ptr + batch, batch):
            tl.store(step_ptr, step + 1)


def _check_append(logits: torch.Tensor, tokens: torch.Tensor, generated: torch.Tensor,
                  step_index: torch.Tensor) -> None:
    """Refuse, naming the argument, what the append cannot take (before any launch)."""
    if logits.dim() != 2 or 0 in logits.shape or not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating-point [batch, vocab] tensor with batch, vocab >= 1, got shape "
                         f"{tuple(logits.shape)} of {logits.dtype}")
    batch, max_len = logits.shape[0], generated.shape[1] if generated.dim() == 2 else -1
    for name, t, shape, desc in (("tokens", tokens, (batch, 1), "[batch, 1]"),
                                 ("generated", generated, (batch, max_len), "[batch, max_len]"),
                                 ("step_index", step_index, (1,), "[1]")):
        if tuple(t.shape) != shape or t.dtype != torch.int64:
            raise ValueError(f"{name}: expected a torch.int64 tensor of shape {desc} (batch {batch}, that of "
                             f"logits), got shape {tuple(t.shape)} of {t.dtype}")
    for name, t in (("tokens", tokens), ("generated", generated), ("step_index", step_index)):
        if t.device != logits.device:
            raise ValueError(f"{name}: expected device {logits.device} (that of logits), got {t.device}")
    if not generated.is_contiguous():
        raise ValueError(f"generated: expected a contiguous tensor, got strides {tuple(generated.stride())} for "
                         f"shape {tuple(generated.shape)}")


def greedy_append_ref(logits: torch.Tensor, tokens: torch.Tensor, generated: torch.Tensor,
                      step_index: torch.Tensor) -> None:
    """Each row's greedy token ``logits[b].argmax()`` (the first maximal index; NaN the greatest) into
    ``tokens[b, 0]`` and ``generated[b, step_index]``, then ``step_index += 1``. ``logits`` [batch, vocab],
    ``tokens`` [batch, 1], ``generated`` [batch, max_len] (contiguous) and ``step_index`` [1] int64."""
    _check_append(logits, tokens, generated, step_index)
    tokens.copy_(logits.argmax(-1, keepdim=True))
    generated.index_copy_(1, step_index, tokens)
    step_index.add_(1)


@launcher
def greedy_append_triton(logits: torch.Tensor, tokens: torch.Tensor, generated: torch.Tensor,
                         step_index: torch.Tensor) -> None:
    """:func:`greedy_append_ref` as one kernel launch (fp16/bf16/fp32 logits with unit column stride, any row
    stride: ``logits[:, -1]`` of a [batch, seq, vocab] tensor); ``step_index`` read and advanced on the device
    (no host sync: capturable in a CUDA graph). A step past ``max_len`` advances ``step_index`` and writes
    ``tokens`` but drops the write to ``generated`` (``index_copy_`` raises)."""
    _check_append(logits, tokens, generated, step_index)
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"logits: expected torch.float16, torch.bfloat16 or torch.float32 (exact in the fp32 "
                         f"partials), got {logits.dtype}")
    batch, vocab = logits.shape
    if batch >= arrivals.MAX_COUNTERS:  # an arrival counter per row and one for the step
        raise ValueError(f"logits: at most {arrivals.MAX_COUNTERS - 1} rows, got {batch}")
    if logits.stride(1) != 1 and vocab > 1:
        raise ValueError(f"logits: expected column stride 1 (any row stride), got strides {tuple(logits.stride())}")
    chunks = cdiv(vocab, CHUNK)
    chunk_max = torch.empty(batch, chunks, dtype=torch.float32, device=logits.device)
    chunk_argmax = torch.empty(batch, chunks, dtype=torch.int32, device=logits.device)
    # counters 0..batch-1: each row's chunks; counter batch: the rows, for the step
    launch_kernel(_greedy_append_kernel, (batch, chunks),
        logits, tokens, generated, step_index, chunk_max, chunk_argmax, arrivals.counters(logits.device, batch + 1),
        logits.stride(0), tokens.stride(0), vocab, generated.shape[1], CHUNK=CHUNK, CHUNKS=next_power_of_2(chunks))


greedy_append = dispatcher(greedy_append_ref, greedy_append_triton)
