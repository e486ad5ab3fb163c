"""How much of codagen's gap to the speed-of-light line is its GEMM mainloop, how much its epilogues? (GPU)

    PYTHONPATH=. python bench/mainloop_share.py [--shapes d2048 llama3-1b] [--rounds 5] [--out DIR]

The speed-of-light line runs a block's GEMMs on cuBLAS and its attention on cuDNN, nothing else. This
runs the same line a second time with every GEMM on codagen's own plain programs (``linear``,
``input_grad``, ``weight_grad``: the Triton mainloop with a bare store, tuned like every program), and
codagen's block, all three in rotated rounds in one process:

``speed_of_light``          cuBLAS GEMMs + SDPA
``speed_of_light_triton``   the same GEMMs on codagen's mainloop + SDPA
``codagen``                 the fused block

At the GPU's power cap a kernel that moves more bytes per FLOP lowers the clock of everything after it,
so per-kernel comparisons inside a step mislead; whole steps do not. The first ratio is what the mainloop
costs, the second what the epilogues (and the row kernels, finishing reductions) add on top.
"""
from __future__ import annotations

import argparse
import sys

import torch

from codagen.backends import execute
from codagen.bench.block import SHAPES, block_providers, speed_of_light_block
from codagen.bench.common import median_ms, ratio_records, timed_rounds, write_results
from codagen.epilogue import library


def codagen_gemms(a: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor) -> None:
    """:func:`codagen.bench.block.cublas_gemms` on codagen's plain programs (the Triton mainloop, bare stores)."""
    execute(library.linear(), a, weight)
    execute(library.input_grad(), grad_out, weight)
    execute(library.weight_grad(), grad_out, a)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["d2048", "llama3-1b"], choices=sorted(SHAPES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    records = []
    for shape in args.shapes:
        s, device = SHAPES[shape], torch.device("cuda")
        factories, _ = block_providers(s, 2, 8192, device, torch.bfloat16)
        steps = {"speed_of_light": factories["speed_of_light"](),
                 "speed_of_light_triton": speed_of_light_block(s, 2, 8192, device, torch.bfloat16, codagen_gemms),
                 "codagen": factories["codagen"]()}
        for step in steps.values():  # build, tune and compile before any timing
            step()
        times = timed_rounds(steps, args.rounds, median_ms)
        records += ratio_records("mainloop_share", shape, times, "speed_of_light")
        del steps
        torch.cuda.empty_cache()
    if args.out:
        write_results("mainloop-share", records, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
