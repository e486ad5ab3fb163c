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
import statistics
import sys

import torch
import torch.nn.functional as F

from codagen.backends import execute
from codagen.bench.block import SHAPES, BlockShape, block_providers
from codagen.bench.common import median_ms, timed_rounds, write_results
from codagen.epilogue import library


def speed_of_light_on_triton(s: BlockShape, batch: int, seq: int, device, dtype):
    """``codagen.bench.block.speed_of_light_block`` with codagen's plain GEMM programs instead of cuBLAS."""
    m = batch * seq
    gemms = []
    for n, k in ((s.qkv, s.d), (s.d, s.heads * s.head_dim), (2 * s.f, s.d), (s.d, s.f)):
        gemms.append((torch.randn(m, k, device=device, dtype=dtype), torch.randn(n, k, device=device, dtype=dtype),
                      torch.randn(m, n, device=device, dtype=dtype)))
    q = torch.randn(batch, s.heads, seq, s.head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, s.kv_heads, seq, s.head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    grad_attn = torch.randn_like(q)

    def run():
        for a, w, dy in gemms:
            execute(library.linear(), a, w)
            execute(library.input_grad(), dy, w)
            execute(library.weight_grad(), dy, a)
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=s.kv_heads != s.heads).backward(grad_attn)
    return run


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
                 "speed_of_light_triton": speed_of_light_on_triton(s, 2, 8192, device, torch.bfloat16),
                 "codagen": factories["codagen"]()}
        for step in steps.values():  # build, tune and compile before any timing
            step()
        times = timed_rounds(steps, args.rounds, median_ms)
        sol = statistics.median(times["speed_of_light"])
        for name, rounds in times.items():
            ms = statistics.median(rounds)
            records.append({"suite": "mainloop_share", "shape": shape, "provider": name, "median_ms": ms,
                            "round_ms": rounds, "vs_speed_of_light": ms / sol})
            print(f"{shape:10s} {name:22s} {ms:7.3f} ms  {ms / sol:.3f}x SOL  rounds "
                  + " ".join(f"{r:.3f}" for r in rounds), flush=True)
        del steps
        torch.cuda.empty_cache()
    if args.out:
        write_results("mainloop-share", records, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
