"""Plain GEMMs of the backward (weight gradients, the out-projection's input gradient) on cuBLAS instead
of codagen's Triton kernel: the codagen block timed both ways (GPU, bf16).

    PYTHONPATH=. python bench/plain_gemm_ab.py [--shapes d2048 llama3-1b llama3-8b] [--rounds 5] [--out DIR]

These programs have no epilogue, so nothing is fused into them. The kernel benchmark reads codagen's
weight-gradient kernel at 1.00-1.03x cuBLAS, timed alone with the L2 flushed; inside the d 2048 block
profile the same GEMMs take 9-15% longer than the speed-of-light line's cuBLAS ones. Which holds in a
block? ``execute`` of ``codagen.ops.block`` is wrapped so that ``weight_grad()`` and ``input_grad()`` run
as ``torch.mm`` when asked; the block's step runs both ways in rotating rounds
(``common.timed_rounds``). Also each plain GEMM of the block alone, both ways, timed back to back
(CUDA events, no flush) and with ``median_ms`` (L2 flushed).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import codagen.ops.block as block_ops
from codagen.backends import execute
from codagen.bench.block import SHAPES, block_providers
from codagen.bench.common import environment, median_ms, timed_rounds
from codagen.epilogue import library

ON_CUBLAS = {"enabled": False}


def execute_plain_on_cublas(program, a, b, **tensors):
    if ON_CUBLAS["enabled"] and not tensors:
        if program is library.weight_grad():
            return {"grad_weight": torch.mm(a.t(), b)}
        if program is library.input_grad():
            return {"grad_input": torch.mm(a, b)}
    return execute(program, a, b, **tensors)


def back_to_back_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def gemm_cases(s, m: int):
    """(name, triton fn, cublas fn) for each weight gradient of the block and the out-projection's dA."""
    dev, dt = "cuda", torch.bfloat16
    cases = []
    for name, n, k in (("qkv", s.qkv, s.d), ("o", s.d, s.heads * s.head_dim), ("gate_up", 2 * s.f, s.d),
                       ("down", s.d, s.f)):
        grad_out, inp = torch.randn(m, n, device=dev, dtype=dt), torch.randn(m, k, device=dev, dtype=dt)
        cases.append((f"{name}_weight_grad",
                      lambda g=grad_out, x=inp: execute(library.weight_grad(), g, x),
                      lambda g=grad_out, x=inp: torch.mm(g.t(), x)))
    grad_out = torch.randn(m, s.d, device=dev, dtype=dt)
    weight = torch.randn(s.d, s.heads * s.head_dim, device=dev, dtype=dt)
    cases.append(("o_input_grad", lambda: execute(library.input_grad(), grad_out, weight),
                  lambda: torch.mm(grad_out, weight)))
    return cases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["d2048", "llama3-1b", "llama3-8b"], choices=sorted(SHAPES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    block_ops.execute = execute_plain_on_cublas
    records = []
    for shape in args.shapes:
        s = SHAPES[shape]
        for name, triton_fn, cublas_fn in gemm_cases(s, 2 * 8192):
            row = {"suite": "plain_gemm_ab", "shape": shape, "name": name}
            for provider, fn in (("triton", triton_fn), ("cublas", cublas_fn)):
                row[f"{provider}_back_to_back_ms"] = back_to_back_ms(fn)
                row[f"{provider}_flushed_ms"] = median_ms(fn, 25, 100)
            records.append(row)
            print(f"{shape:10s} {name:18s} back to back: triton {row['triton_back_to_back_ms']:.3f} cublas "
                  f"{row['cublas_back_to_back_ms']:.3f} ms; flushed: triton {row['triton_flushed_ms']:.3f} cublas "
                  f"{row['cublas_flushed_ms']:.3f} ms", flush=True)
        step = block_providers(s, 2, 8192, torch.device("cuda"), torch.bfloat16)[0]["codagen"]()

        def variant(enabled, step=step):
            def run():
                ON_CUBLAS["enabled"] = enabled
                step()
            return run
        variants = {"triton": variant(False), "cublas": variant(True)}
        for fn in variants.values():
            fn()
        times = timed_rounds(variants, args.rounds, lambda fn: median_ms(fn, 50, 300))
        row = {"suite": "plain_gemm_ab", "shape": shape, "name": "block_fwd_bwd", "round_ms": times,
               **{f"{k}_ms": statistics.median(v) for k, v in times.items()}}
        records.append(row)
        print(f"{shape:10s} block fwd+bwd       triton {row['triton_ms']:.3f} ms, cublas {row['cublas_ms']:.3f} ms "
              f"(cublas / triton {row['cublas_ms'] / row['triton_ms']:.3f}); rounds {times}", flush=True)
    if args.out:
        path = Path(args.out) / "plain-gemm-ab.json"
        path.write_text(json.dumps({"env": environment(), "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
