"""Does the persistent ``tl`` kernel compile with e4m3 operands for sm_90, in each GEMM layout? (CPU, no GPU)

    PYTHONPATH=. python bench/fp8_compile.py [--out FILE]

Rowwise-scaled FP8 (torchao's ``rowwise`` recipe) multiplies e4m3 operands into an fp32 accumulator and scales it
by one factor per row of A and one per column of B before anything else: the epilogue program
``Program.with_rowwise_scales()`` of ``linear``, ``input_grad`` and ``weight_grad``, ``acc * a_scale[m] *
b_scale[n]`` stored in bf16. This compiles that program's persistent kernel
(``codagen.backends.triton.cross_compile.compile_persistent``, the generator the bf16 programs use, operands typed
``fp8e4nv``) for sm_90 in the three layouts the training GEMMs take: ``linear`` (x @ W^T), ``input_grad`` (grad @ W)
and ``weight_grad`` (grad^T @ x). The configurations are the Hopper pool's (``configs.SM90``), each at its own
``BLOCK_K`` and at twice it: an e4m3 element is half a bf16 one, so ``2 BLOCK_K`` holds the bytes per stage of the
bf16 configuration. For each it reports the shared memory, registers and spilled bytes per thread (the cubin) and
the matrix instruction in the PTX. Nothing runs: the speed is a GPU question.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re

from codagen.backends.triton import configs
from codagen.backends.triton.cross_compile import compile_persistent, cubin_resources
from codagen.backends.triton.targets import TARGETS
from codagen.epilogue import library
from codagen.epilogue.core import Program

LAYOUTS = ("linear", "input_grad", "weight_grad")


def rowwise_scaled(layout: str) -> Program:
    """``out = (a @ b) * a_scale[m] * b_scale[n]``, bf16 with e4m3 operands, for the GEMM of ``layout``."""
    return getattr(library, layout)().with_rowwise_scales()


def report(program: Program, cfg) -> dict:
    target = TARGETS["sm_90"]
    try:
        compiled = compile_persistent(program, cfg, target, dtype="fp8e4nv")
    except Exception as error:  # noqa: BLE001 - the report says what failed
        return {"error": f"{type(error).__name__}: {str(error)[-300:]}"}
    registers, stack = cubin_resources(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    return {"shared": compiled.metadata.shared, "fits": compiled.metadata.shared <= target.shared_memory,
            "registers": registers, "stack": stack,
            "mma": sorted(set(re.findall(r"wgmma\.mma_async\.\S+?(?=\s)", ptx)) or
                          set(re.findall(r"mma\.sync\.\S+?(?=\s)", ptx)))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the reports as JSON here")
    args = parser.parse_args(argv)
    records = []
    for layout in LAYOUTS:
        program = rowwise_scaled(layout)
        for cfg in configs.SM90:
            for block_k in sorted({cfg.block_k, 2 * cfg.block_k}):
                case = dataclasses.replace(cfg, block_k=block_k)
                facts = report(program, case)
                records.append(dict(layout=layout, config=dataclasses.asdict(case), **facts))
                shape = f"{case.block_m}x{case.block_n}x{case.block_k} s{case.num_stages} w{case.num_warps} " \
                        f"split{case.epilogue_split}{' tma' if case.tma_epilogue else ''}"
                line = facts.get("error") or (f"shared {facts['shared']:6d}{'' if facts['fits'] else ' (too much)'}"
                                              f"  regs {facts['registers']:3d}  stack {facts['stack']:3d}  "
                                              f"{' '.join(facts['mma'])}")
                print(f"{layout:11s} {shape:34s} {line}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"target": "sm_90", "operands": "fp8e4nv", "records": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
