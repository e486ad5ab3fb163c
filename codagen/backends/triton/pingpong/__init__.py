"""The ping-pong schedule (sm_90, Gluon): two consumer warpgroups alternate tiles, so one's epilogue
overlaps the other's mainloop.

:mod:`.plan` (which programs and tensors it takes, its shared memory) and :mod:`.generator` (a program's
Gluon source) are plain Python. :mod:`.runtime`, the fixed Gluon parts every generated kernel imports from
this package, and the launch exist on the Triton releases whose Gluon the kernels are written against
(:mod:`..gluon_support`); elsewhere ``RUNTIME`` is False and the schedule is not offered.
"""
from ..gluon_support import pingpong_unsupported
from .generator import GENERATOR_VERSION, generate
from .plan import (
    BLOCK_K,
    BLOCK_M,
    BLOCK_N,
    CONSUMER_WARPS,
    MIN_IN_SLOTS,
    PIECE_WIDTHS,
    STAGES,
    Argument,
    input_slots,
    kernel_arguments,
    refusal,
    refuses,
    shared_memory,
    supports,
    tile_io,
)

RUNTIME = pingpong_unsupported() is None
if RUNTIME:
    from .runtime import (
        BK,
        BM,
        BN,
        OUT_BUFFERS,
        RING,
        column_pieces,
        compile_sm90,
        cos_sin,
        launch,
        mainloop,
        merge_logsumexp,
        producer,
        sigmoid,
        tile_coords,
    )

__all__ = ["generate", "GENERATOR_VERSION", "supports", "refusal", "refuses", "shared_memory", "input_slots",
           "tile_io", "kernel_arguments", "Argument", "BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "CONSUMER_WARPS",
           "PIECE_WIDTHS", "MIN_IN_SLOTS", "RUNTIME"]
if RUNTIME:
    __all__ += ["launch", "compile_sm90", "BM", "BN", "BK", "RING", "OUT_BUFFERS", "producer", "mainloop",
                "tile_coords", "column_pieces", "sigmoid", "cos_sin", "merge_logsumexp"]
