"""Compiler resource report of every library kernel for Hopper, made on any machine (no GPU needed).

    python bench/triton_resources.py [--arch 90] [--dtype bf16] [program ...]

For each program and each Hopper candidate configuration it compiles the generated kernel for
``sm_<arch>`` (``triton.compile`` with a ``GPUTarget``) and prints shared memory, registers per thread,
spilled bytes (``cuobjdump --dump-resource-usage`` on the cubin) and whether the PTX uses ``wgmma``.
That is what decides which configurations can run before any device time is spent.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from codagen.backends.triton.backend import load_kernel  # noqa: E402
from codagen.backends.triton.configs import SM90, candidates, smem_estimate  # noqa: E402
from codagen.backends.triton.cross_compile import compile_persistent, cubin_resources  # noqa: E402
from codagen.backends.triton.targets import TARGETS  # noqa: E402
from codagen.epilogue import library  # noqa: E402


def compile_one(program, cfg, dtype: str, arch: int):
    if cfg.schedule == "pingpong":  # the generated Gluon kernel (codagen.backends.triton.pingpong)
        from codagen.backends.triton import pingpong
        kernel = load_kernel(program, dtypes=f"report:{dtype}", arch=f"sm_{arch}", interpret=False, schedule="pingpong")
        return pingpong.compile_sm90(kernel, program, cfg.sub_n, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    return compile_persistent(program, cfg, TARGETS[f"sm_{arch}"], dtype)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("programs", nargs="*")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--all", action="store_true", help="every Hopper config, not only the pruned candidates")
    args = p.parse_args(argv)
    names = args.programs or list(library.PROGRAMS)
    print(f"{'program':36s} {'config':34s} {'est KiB':>7s} {'smem KiB':>8s} {'regs':>4s} {'stack':>5s} wgmma")
    for name in names:
        program = library.PROGRAMS[name]()
        pool = list(SM90) if args.all else candidates(program, target="sm_90", operand_bytes=2, smem_limit=232448,
                                                      tma=True, tma_epilogue=True)
        for cfg in pool:
            est = smem_estimate(program, cfg, 2) / 1024
            try:
                c = compile_one(program, cfg, args.dtype, args.arch)
            except Exception as e:  # noqa: BLE001 - a report: show the failure and go on
                print(f"{name:36s} {cfg.short():34s} {est:7.0f} FAILED {type(e).__name__}: {str(e)[:80]}")
                continue
            regs, stack = cubin_resources(c.asm["cubin"])
            print(f"{name:36s} {cfg.short():34s} {est:7.0f} {c.metadata.shared / 1024:8.0f} {regs:4d} {stack:5d} "
                  f"{'yes' if 'wgmma' in c.asm['ptx'] else 'NO'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
