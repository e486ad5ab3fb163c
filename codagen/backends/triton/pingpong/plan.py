"""Which programs and tensors the ping-pong schedule takes, its tile shape and its shared memory.

Plain Python (no Gluon), so tuning can weigh the schedule and the generator can lay out its kernel on any
Triton; :mod:`.runtime` holds the Gluon parts that run.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from codagen.epilogue.ir import Program, QuantizedStore, Store, Width

from ..names import kernel_names

__all__ = ["supports", "refusal", "refuses", "shared_memory", "input_slots", "tile_io", "kernel_arguments", "Argument",
           "BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "CONSUMER_WARPS", "OUT_BUFFERS", "PIECE_WIDTHS", "MIN_IN_SLOTS"]

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
STAGES = 4           # A/B ring slots of 32 KiB (3 slots slowed the mainloop by 15-20%: docs/triton.md)
CONSUMER_WARPS = 4   # one warpgroup per consumer
PIECE_WIDTHS = (32, 16)  # epilogue column pieces the configurations offer (KernelConfig.sub_n)
MIN_IN_SLOTS = 2     # per consumer and tile operand: at least pieces p and p + 1 in flight
OUT_BUFFERS = 2      # per consumer and tile output: piece p - 1's stores drain under piece p
GROUP_M = 8          # tile order: GROUP_M M-tiles sweep the N-tiles together
_BARRIERS_BYTES = 2048  # mbarriers, reduction scratch and alignment (an upper bound)


def supports(program: Program) -> str | None:
    """Why the ping-pong generator cannot take ``program`` (None if it can)."""
    if program.gemm.a_layout != "mk":
        return "A must be [M, K] (the weight-gradient layout has no epilogue worth overlapping)"
    if program.gemm.k_scale_group is not None:
        return "its mainloop takes 16-bit operands, not K-group-scaled e4m3 ones"
    if any(isinstance(o, QuantizedStore) for o in program.outputs):
        return "quantized stores (e4m3 with group scales) are written by the persistent kernel only"
    for e in program.expressions():
        if (reason := e.pingpong_refusal()) is not None:
            return reason
    return None


def tile_io(program: Program):
    """(name, width, is_input) of every tile the epilogue moves through shared memory: tile operands,
    the old value of each accumulated store, and tile stores."""
    for name, e in program.inputs.items():
        if e.kind == "tile":
            yield name, e.width, True
    for o in program.outputs:
        if isinstance(o, Store):
            if o.accumulate:
                yield o.name, o.value.width, True
            yield o.name, o.value.width, False


def shared_memory(program: Program, piece_n: int, operand_bytes: int = 2, io_bytes: dict[str, int] | None = None,
                  in_slots: int = MIN_IN_SLOTS) -> int:
    """Bytes of shared memory the kernel allocates: the A/B ring and, per consumer, the rotating piece
    buffers of every tile operand (``in_slots``) and output (``io_bytes``: element size by tensor name,
    default 2)."""
    ring = STAGES * (BLOCK_M + BLOCK_N) * BLOCK_K * operand_bytes
    per_consumer = 0
    for name, width, is_input in tile_io(program):
        slots = in_slots if is_input else OUT_BUFFERS
        per_consumer += slots * BLOCK_M * int(piece_n * width.value) * (io_bytes or {}).get(name, 2)
    return ring + 2 * per_consumer + _BARRIERS_BYTES


def _io_bytes(bound) -> dict[str, int]:
    sizes = {name: bound.tensors[name].element_size() for name, e in bound.program.inputs.items()
             if e.kind == "tile"}
    sizes.update({o.name: torch.empty((), dtype=bound.store_dtype(o)).element_size()
                  for o in bound.program.outputs if isinstance(o, Store)})
    return sizes


def input_slots(bound, piece_n: int, smem_limit: int) -> int:
    """Tile-operand slots per consumer: one per piece (every load of a tile requested when it starts)
    where shared memory allows, else the minimum (pieces p and p + 1 in flight)."""
    pieces = BLOCK_N // piece_n
    need = shared_memory(bound.program, piece_n, bound.a.element_size(), _io_bytes(bound), pieces)
    return pieces if need <= smem_limit else MIN_IN_SLOTS


def refuses(bound, piece_n: int, smem_limit: int) -> str | None:
    """Why the kernel cannot take these tensors with pieces of ``piece_n`` columns (None if it can)."""
    if bound.dtype not in (torch.bfloat16, torch.float16):
        return f"operands must be bfloat16 or float16, got {bound.dtype}"
    need = shared_memory(bound.program, piece_n, bound.a.element_size(), _io_bytes(bound))
    if need > smem_limit:
        return f"needs {need} bytes of shared memory with {piece_n}-column pieces, the GPU has {smem_limit}"
    return None


def refusal(program: Program) -> str | None:
    """Why the ping-pong schedule cannot take ``program`` (None if it can): :func:`supports`, and
    the GEMM's low-rank operand pair (LoRA), which the producer warp does not stream: its TMA ring and
    barriers carry one A/B pair, and the short R loop would need a second ring of its own. The persistent
    schedule runs low-rank programs."""
    if program.gemm.low_rank:
        return "a low-rank operand pair (the producer warp's TMA ring streams one A/B pair)"
    return supports(program)


@dataclass(frozen=True)
class Argument:
    """A kernel parameter after ``a_desc, b_desc``: a TMA descriptor of a tile operand or tile output
    (boxes of [BLOCK_M, PIECE_N * width]) or a pointer (vectors, scalars, partial outputs)."""
    name: str
    tensor: str
    output: bool
    descriptor: bool
    width: Width | None = None
    pointer_type: str = "*fp32"


@functools.cache
def kernel_arguments(program: Program) -> list[Argument]:
    """The generated kernel's parameters between ``b_desc`` and ``M``, in order (also the launch's)."""
    ids = kernel_names(program)
    args = [Argument(f"{ids[name]}_desc", name, False, True, e.width)
            for name, e in program.inputs.items() if e.kind == "tile"]
    args += [Argument(f"{ids[o.name]}_desc", o.name, True, True, o.value.width)
             for o in program.outputs if isinstance(o, Store)]
    for name, e in program.inputs.items():
        if e.kind != "tile":
            args.append(Argument(f"{ids[name]}_ptr", name, False, False,
                                 pointer_type="*i64" if getattr(e, "index", False) else "*fp32"))
    args += [Argument(f"{ids[o.name]}_ptr", o.name, True, False) for o in program.outputs if not isinstance(o, Store)]
    return args
