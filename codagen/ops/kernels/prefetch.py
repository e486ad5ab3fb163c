"""Bring the first ``max_bytes`` of a tensor into L2, one launch: a hint for the kernel that reads them next.

A batch-1 decode step alternates kernels that stream a weight at the copy rate with kernels that leave
the memory system mostly idle (attention reads a layer's KV cache at a fifth of the copy rate: its
programs are few). A prefetch launched beside such a kernel (on another stream) lets the next GEMM find
its weight in L2. For the first ``max_bytes`` of the tensor's storage:

- ``l2_prefetch_triton``: each thread issues one ``cp.async.bulk.prefetch.L2.global`` of ``CHUNK`` bytes
  (the TMA unit fetches them; no register, no shared memory, nothing waits);
- ``l2_prefetch_ref``: nothing (a prefetch changes no value).

The tensor must be contiguous; its bytes past the last multiple of 16 are not prefetched (the bulk
prefetch moves 16-byte multiples from 16-byte aligned addresses).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from ._launch import cdiv, dispatcher, launch_kernel, launcher, tl, triton

__all__ = ["l2_prefetch", "l2_prefetch_ref", "l2_prefetch_triton", "l2_prefetch_beside"]

#: bytes per bulk prefetch (one thread's)
CHUNK = 4096
#: bulk prefetches per program and step (one per thread of one warp): small programs, many SMs' TMA units
LANES = 32


@triton.jit
def prefetch_share(base_ptr, n_bytes, part, parts, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Program ``part`` of ``parts``: the ``CHUNK``-byte chunks ``part * LANES + j``, ``(part + parts) * LANES
    + j``, ... (``j < LANES``) of the ``n_bytes`` (a multiple of 16) from the byte pointer ``base_ptr``, one
    bulk prefetch per chunk and thread. Nothing waits for them: the program may exit while L2 fills."""
    for first in range(part * LANES, tl.cdiv(n_bytes, CHUNK), parts * LANES):
        start = (first + tl.arange(0, LANES)).to(tl.int64) * CHUNK
        size = tl.minimum(n_bytes - start, CHUNK)
        inside = size > 0
        # a lane past the end prefetches the first 16 bytes again (in bounds; a repeat costs nothing)
        address = tl.where(inside, base_ptr + start, base_ptr)
        size = tl.where(inside, size, 16).to(tl.int32)
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // dummy $0", "=r,l,r",
                                  [address, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(base_ptr, n_bytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Program p: its :func:`prefetch_share` of the ``n_bytes`` from ``base_ptr``."""
    prefetch_share(base_ptr, n_bytes, tl.program_id(0), tl.num_programs(0), CHUNK, LANES)


def bytes_to_prefetch(t: torch.Tensor, max_bytes: int | None) -> int:
    """The bytes of ``t`` to prefetch: its first ``max_bytes`` (all of it for ``None``), rounded down to 16;
    refuses, naming the argument, what cannot be prefetched."""
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"max_bytes: expected None or an int >= 0, got {max_bytes!r}")
    if not t.is_contiguous():
        raise ValueError(f"t: expected a contiguous tensor, got strides {tuple(t.stride())} for shape "
                         f"{tuple(t.shape)}")
    n_bytes = t.numel() * t.element_size()
    return (n_bytes if max_bytes is None else min(n_bytes, max_bytes)) // 16 * 16


def l2_prefetch_ref(t: torch.Tensor, max_bytes: int | None = None) -> None:
    """Prefetch the first ``max_bytes`` of ``t`` (all of it for ``None``) into L2: no value changes, so nothing."""
    bytes_to_prefetch(t, max_bytes)


@launcher
def l2_prefetch_triton(t: torch.Tensor, max_bytes: int | None = None) -> None:
    """:func:`l2_prefetch_ref` on the GPU, one launch."""
    n_bytes = bytes_to_prefetch(t, max_bytes)
    if n_bytes:
        launch_kernel(_l2_prefetch_kernel, (cdiv(n_bytes, CHUNK * LANES),), t.view(-1).view(torch.uint8), n_bytes,
                      CHUNK=CHUNK, LANES=LANES, num_warps=max(LANES // 32, 1))


l2_prefetch = dispatcher(l2_prefetch_ref, l2_prefetch_triton)


# device -> the stream prefetches run on beside the current stream
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def l2_prefetch_beside(tensors: Sequence[torch.Tensor], max_bytes: int) -> Iterator[None]:
    """Prefetch the first ``max_bytes`` of ``tensors`` taken in order (:func:`l2_prefetch`, one launch per
    tensor) on a side stream while the body's kernels run on the current stream, which waits for the side
    stream at exit. In a CUDA graph capture that is a fork and a join: the prefetch runs concurrently with
    the body's kernels and the first kernel after the block waits for both."""
    device = tensors[0].device
    current = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        left = max_bytes
        for t in tensors:
            l2_prefetch(t, left)
            left = max(left - t.numel() * t.element_size(), 0)
    try:
        yield
    finally:
        current.wait_stream(side)
