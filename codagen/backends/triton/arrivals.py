"""Arrival counters: the last program of a group to finish does the group's finishing work, in the same launch.

A decode step is a chain of short kernels, and a finishing pass in a launch of its own (a split-K sum, a
length update, the argmax over chunk maxima) costs a launch for almost no work. Instead each program of
a group stores its part, then arrives at the group's counter; the program that arrives last, seeing every
other part stored, finishes:

    store my partial
    if last_to_arrive(counters_ptr + group, programs_in_group):
        read every partial in a fixed order, finish

``last_to_arrive`` waits for all threads of the program (their stores issued), then one thread adds 1 to
the counter with an acquire-release atomic at GPU scope: the release publishes this program's stores, the
acquire of the last arrival sees those of every earlier one. The last arrival sets the counter back to 0
for the next launch. The partials are read in a fixed order (not in arrival order), so the result does not
depend on which program came last: bitwise the same every run. Partials are read with ``.cg`` loads (L2,
not the SM's L1, which is not coherent with other SMs' stores).

Counters: :func:`counters` gives int32 zeros, one buffer per device and stream, kept for the process (a
captured CUDA graph keeps pointing at it). Launches that share a buffer run one after the other on their
stream, each leaving it zeroed; two streams never share one. A buffer is allocated by a worker thread, outside
the memory pools of CUDA graphs; a first use inside a ``torch.cuda.graph`` capture allocates it in that
graph's pool (its zeroing one memset node of the graph): capture on the stream of the warm-up run to avoid it.
"""
from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

__all__ = ["last_to_arrive", "counters", "MAX_COUNTERS"]

#: counters per buffer: groups one launch may use (a decode GEMM's output tiles, a batch's rows)
MAX_COUNTERS = 1 << 16


@triton.jit
def last_to_arrive(counter_ptr, programs):
    """Arrive at ``counter_ptr`` (a group of ``programs`` programs); true in the group's last arrival only,
    which sees every other program's stores made before its arrival and resets the counter to 0."""
    tl.debug_barrier()  # every thread's stores issued before the release below
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == programs - 1
    if last:
        tl.store(counter_ptr, 0)
    return last


_buffers: dict[tuple, torch.Tensor] = {}


def counters(device: torch.device, count: int) -> torch.Tensor:
    """``count`` zeroed int32 arrival counters for a launch on ``device``'s current stream."""
    if count > MAX_COUNTERS:
        raise ValueError(f"count: at most {MAX_COUNTERS} arrival counters per launch, got {count}")
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buffer = _buffers.get(key)
    if buffer is None:
        if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            buffer = _zeros_from_another_thread(device)
        else:  # (under capture: in the graph's pool, zeroed by a memset node of the graph)
            buffer = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
        _buffers[key] = buffer
    return buffer


def _zeros_from_another_thread(device: torch.device) -> torch.Tensor:
    """The counters allocated and zeroed by a worker thread, out of any memory pool that collects this thread's
    allocations: ``torch.compile``'s CUDA graphs take those of the thread that warms them up into their pool,
    where a tensor kept by this module would be a live allocation they do not own."""
    allocated = []

    def allocate():
        with torch.cuda.device(device):
            allocated.append(torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device))
            torch.cuda.current_stream(device).synchronize()  # zero before any stream of the caller uses it
    worker = threading.Thread(target=allocate, name="codagen-arrival-counters")
    worker.start()
    worker.join()
    return allocated[0]
