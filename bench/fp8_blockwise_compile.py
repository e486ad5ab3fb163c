"""Do the blockwise FP8 GEMMs and the quantizing epilogue compile without spilling? (CPU, no GPU)

    PYTHONPATH=. python bench/fp8_blockwise_compile.py [--out FILE]

Two kernels of FP8 training without a separate cast kernel (``docs/notes/fp8-quantizing-epilogue.md``):

- **Blockwise GEMMs** (``Program.with_blockwise_scales``): e4m3 operands scaled per group of 128 along K, each K tile's
  product scaled into the fp32 accumulator. Cases: the forward and the input gradient with 128 x 128 weight blocks
  (``b_block``), the weight gradient with 1 x 128 groups on both operands, and the forward with per-column weight
  scales, the form the weight blocks replace.
- **A quantizing epilogue**: the residual add storing its sum in bf16 and in e4m3 with scales per 128 columns or per
  128 rows (``QuantizedStore``, along N or M), with the next norm's statistics, on bf16 operands.

Each is compiled (``cross_compile.compile_persistent``) for every target with an e4m3 instruction, in the
configurations the tuner offers there (``configs.candidates``), and on sm_90 also in the raw Hopper pool's shapes the
candidate rules set aside (4-stage tiles, 128 x 256 tiles, full accumulators). Reported per case: shared memory, and
on NVIDIA the registers and spilled (stack) bytes per thread from the cubin. Nothing runs: speed is a GPU question.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from codagen.backends.triton import configs
from codagen.backends.triton.configs import KernelConfig
from codagen.backends.triton.cross_compile import compile_persistent, cubin_resources
from codagen.backends.triton.targets import TARGETS
from codagen.epilogue import library
from codagen.epilogue.ir import Accumulator, Gemm, Program, QuantizedStore, RowPartial, Store, TileInput, Unary

#: targets with an e4m3 matrix instruction
FP8_TARGETS = [name for name, target in TARGETS.items() if target.fp8_mma]


def residual_quantized(along: str = "n") -> Program:
    """``x = acc + residual`` stored in bf16 and as e4m3 with scales per 128 columns (``along="n"``) or 128 rows
    (``"m"``), with the sum of squares per tile."""
    x = Accumulator() + TileInput("residual")
    return Program(f"residual_quantized_{along}", Gemm.linear(), (
        Store("out", x), QuantizedStore("out_e4m3", x, along=along), RowPartial("partial_sumsq", Unary("square", x))))


#: case name -> (program, operand dtype)
CASES = {
    "linear, 128x128 weight blocks": (lambda: library.linear().with_blockwise_scales(128, b_block=True), "fp8e4nv"),
    "input_grad, 128x128 weight blocks": (lambda: library.input_grad().with_blockwise_scales(128, b_block=True),
                                          "fp8e4nv"),
    "weight_grad, 1x128 on both": (lambda: library.weight_grad().with_blockwise_scales(128), "fp8e4nv"),
    "linear, per-column weight scales": (lambda: library.linear().with_blockwise_scales(128), "fp8e4nv"),
    # the block ops' FP8 programs (codagen.ops._fp8): their epilogues on blockwise GEMMs, and the backward GEMMs that
    # store a weight gradient's operand in e4m3 along the tokens
    "residual_rms_stats, 128x128 weight blocks": (
        lambda: library.residual_rms_stats().with_blockwise_scales(128, b_block=True), "fp8e4nv"),
    "residual_rms_stats + normed e4m3, blocks": (
        lambda: library.residual_rms_stats().with_quantized_store("normed", "n").with_blockwise_scales(
            128, b_block=True), "fp8e4nv"),
    "rms_qkv_rope, 128x128 weight blocks": (lambda: library.rms_qkv_rope().with_blockwise_scales(128, b_block=True),
                                            "fp8e4nv"),
    "rms_qkv_rope QK-norm (head 128), weight blocks": (
        lambda: library.rms_qkv_rope(128, 1e-6, True).with_blockwise_scales(128, b_block=True), "fp8e4nv"),
    "rms_gate_up_swiglu, 128x128 weight blocks": (
        lambda: library.rms_gate_up_swiglu().with_blockwise_scales(128, b_block=True), "fp8e4nv"),
    "swiglu_backward + act e4m3 along M, blocks": (
        lambda: library.swiglu_backward().with_quantized_store("act", "m").with_blockwise_scales(128, b_block=True),
        "fp8e4nv"),
    "rms_norm_backward + normed e4m3 along M, blocks": (
        lambda: library.rms_norm_backward("add").with_quantized_store("normed", "m").with_blockwise_scales(
            128, b_block=True), "fp8e4nv"),
    "input_grad + residual gradient, weight blocks": (
        lambda: library.input_grad(True).with_blockwise_scales(128, b_block=True), "fp8e4nv"),
    "residual + quantized store (bf16 operands)": (residual_quantized, "bf16"),
    "residual + quantized store along M (bf16)": (lambda: residual_quantized("m"), "bf16"),
}

#: sm_90 shapes outside the candidates: the Hopper pool's 128 x 256 and 4-stage tiles at e4m3's BLOCK_K 128
SET_ASIDE = (KernelConfig(128, 256, 128, 3, 8, epilogue_split=2), KernelConfig(128, 128, 128, 4, 8, epilogue_split=1),
             KernelConfig(128, 128, 128, 4, 8, epilogue_split=2), KernelConfig(128, 256, 64, 3, 8, epilogue_split=2))


def report(case: str, target_name: str, cfg: KernelConfig, candidate: bool) -> dict:
    make, dtype = CASES[case]
    program, target = make(), TARGETS[target_name]
    record = dict(case=case, target=target_name, config=dataclasses.asdict(cfg), candidate=candidate)
    try:
        compiled = compile_persistent(program, cfg, target, dtype=dtype)
    except Exception as error:  # noqa: BLE001 - the report says what failed
        return dict(record, error=f"{type(error).__name__}: {str(error)[-300:]}")
    registers, stack = cubin_resources(compiled.asm["cubin"]) if target.backend == "cuda" else (None, None)
    return dict(record, shared=compiled.metadata.shared, fits=compiled.metadata.shared <= target.shared_memory,
                registers=registers, stack=stack)


def jobs():
    for case, (make, dtype) in CASES.items():
        program, operand_bytes = make(), 1 if dtype == "fp8e4nv" else 2
        for target_name in FP8_TARGETS:
            target = TARGETS[target_name]
            pool = [cfg for cfg in configs.candidates(program, target=target_name, operand_bytes=operand_bytes,
                                                      smem_limit=target.shared_memory, tma=target.tma,
                                                      tma_epilogue=target.tma) if cfg.schedule == "persistent"]
            yield from ((case, target_name, cfg, True) for cfg in pool)
            if target_name == "sm_90":
                column_groups = [g.column_group for g in program.column_groups()]  # heads, quantized groups
                set_aside = [cfg for cfg in SET_ASIDE if cfg not in pool
                             and (dtype == "fp8e4nv") == (cfg.block_k == 128)
                             and not (program.gemm.b_scale_block and cfg.block_n > 128)  # a block holds the tile
                             and all(cfg.sub_n % g == 0 for g in column_groups)]  # a sub-tile holds its groups
                yield from ((case, target_name, cfg, False) for cfg in set_aside)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the reports as JSON here")
    args = parser.parse_args(argv)
    work = list(jobs())
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=multiprocessing.get_context("spawn")) as pool:
        records = list(pool.map(report, *zip(*work)))
    for r in records:
        cfg = KernelConfig(**r["config"])
        facts = r.get("error") or (f"shared {r['shared']:6d}{'' if r['fits'] else ' (too much)'}" + (
            f"  regs {r['registers']:3d}  stack {r['stack']:3d}" if r["registers"] is not None else ""))
        print(f"{r['case']:44s} {r['target']:7s} {cfg.short():32s} {'candidate' if r['candidate'] else 'set aside':9s} "
              f"{facts}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"records": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
