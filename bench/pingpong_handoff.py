"""Does a ping-pong kernel hand the tensor cores over before its epilogue? (SASS, no GPU needed.)

A consumer ends its mainloop with ``warpgroup_mma_wait(0)``, frees its last ring slot and arrives on the
other consumer's turn barrier (:func:`codagen.backends.triton.pingpong.runtime.mainloop`); only then may the other
consumer issue its MMAs. In the PTX the epilogue follows those arrives, but ptxas schedules within a
basic block and may hoist epilogue arithmetic above the ``bar.sync`` + ``mbarrier.arrive`` pair, and
every instruction it puts there delays the hand-off, so the other consumer's mainloop waits for this
consumer's epilogue: the two do not overlap.

For every program the ping-pong schedule takes and each piece width that fits, this compiles the
generated kernel for sm_90, disassembles it (``cuobjdump -sass``) and counts, per consumer, the
floating-point instructions between the mainloop's final wgmma wait and the turn hand-off
(:func:`codagen.backends.triton.sass.arithmetic_before_handoff`; ``tests/backends/test_pingpong.py`` checks it too).

The mainloop puts the arrives in a branch of their own, a scheduling boundary, so every kernel counts 0;
without it the LM-head programs, whose epilogues start with arithmetic only, counted 1460-1910
(docs/notes/pingpong-handoff.md).

    python bench/pingpong_handoff.py [program ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from codagen.backends.triton import pingpong, sass  # noqa: E402
from codagen.backends.triton.backend import load_kernel  # noqa: E402
from codagen.epilogue import library  # noqa: E402

SMEM_LIMIT = 232448  # H100/H200 shared memory per block


def programs(names: list[str]):
    if names:
        return [library.PROGRAMS[n]() for n in names]
    return [f() for f in library.PROGRAMS.values()] + [library.rms_norm_backward("accumulate")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("programs", nargs="*", help=f"library programs (default: all): {', '.join(library.PROGRAMS)}")
    args = parser.parse_args()
    for program in programs(args.programs):
        if pingpong.supports(program):
            continue
        kernel = load_kernel(program, dtypes="bf16", arch="sm_90", interpret=False, schedule="pingpong")
        for piece_n in pingpong.PIECE_WIDTHS:
            if pingpong.shared_memory(program, piece_n) > SMEM_LIMIT:
                continue
            slots = pingpong.BLOCK_N // piece_n
            if pingpong.shared_memory(program, piece_n, in_slots=slots) > SMEM_LIMIT:
                slots = pingpong.MIN_IN_SLOTS
            compiled = pingpong.compile_sm90(kernel, program, piece_n, torch.bfloat16, in_slots=slots)
            counts = sass.arithmetic_before_handoff(sass.instructions(compiled.asm["cubin"]))
            flag = "   <- the epilogue delays the hand-off" if max(counts, default=0) > sass.HANDOFF_LIMIT else ""
            print(f"{program.name:38s} {piece_n:2d}-column pieces: {counts}{flag}", flush=True)


if __name__ == "__main__":
    main()
