"""A/B a change to the ping-pong schedule in one process (GPU): today's :mod:`.pingpong` against saved copies.

A change to ``codagen/backends/triton/pingpong/runtime.py`` re-keys every ping-pong tuned choice, and timings
taken in different runs differ by up to 10% (power cap, thermal state: docs/triton.md), so a change is
judged here first: each benchmark kernel's generated ping-pong kernel is built on every saved module
(``--baseline``, named by file stem) and on today's (``candidate``), checked for bitwise-equal outputs,
and timed in alternation with the cuBLAS GEMM of its shape for ``--rounds`` rounds (medians per round,
in an order that rotates: in fixed order, two builds of identical device code differed by up to 4%).
A kernel given as ``name:model:piece_n`` runs with that piece width only, else with each that fits.

    git show HEAD~1:codagen/backends/triton/pingpong/runtime.py > /tmp/pingpong_saved.py
    PYTHONPATH=. python bench/pingpong_ab.py --baseline /tmp/pingpong_saved.py [more.py ...]
        [--kernels lm_head_ce:d2048 o_proj_residual_rms:d2048:32 ...] [--rounds 3] [--rep-ms 60] [--out DIR]
"""
import argparse
import tempfile
from pathlib import Path

import torch

from codagen.backends.triton import pingpong
from codagen.backends.triton.backend import set_scratch_allocator
from codagen.bench.common import load_module, median_ms, timed_rounds, write_results
from codagen.bench.kernels import MODELS, gemm, kernel_cases, random_inputs
from codagen.epilogue.bind import bind, set_poison_outputs

DEFAULT_KERNELS = ["lm_head_ce:d2048", "lm_head_ce_bwd:d2048", "o_proj_residual_rms:d2048", "down_swiglu_bwd:d2048",
                   "qkv_rope:d2048", "gate_up_swiglu:d4096"]
_modules = Path(tempfile.mkdtemp(prefix="codagen-ab-"))


def baseline_module(path: str):
    """A saved pingpong/runtime.py as a sibling module, so its relative imports resolve."""
    return load_module(f"codagen.backends.triton.pingpong.{Path(path).stem}", path)


def kernel_on(schedule, program):
    """The program's generated ping-pong kernel, importing its fixed parts from ``schedule``."""
    source = pingpong.generate(program).replace(
        f"from {pingpong.__name__} import", f"from {schedule.__name__} import")
    path = _modules / f"{program.name}_{schedule.__name__.rsplit('.', 1)[1]}.py"
    path.write_text(source)
    return getattr(load_module(path.stem, path), f"{program.name}_kernel")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", nargs="+", required=True, help="paths of saved pingpong/runtime.py versions")
    parser.add_argument("--kernels", nargs="+", default=DEFAULT_KERNELS, help="name:model of benchmark kernels")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep-ms", type=float, default=60)
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    args = parser.parse_args()
    set_scratch_allocator()
    set_poison_outputs(True)
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_properties(device)
    smem_limit, num_sms = gpu.shared_memory_per_block_optin, gpu.multi_processor_count
    schedules = {Path(path).stem: baseline_module(path) for path in args.baseline}
    schedules["candidate"] = pingpong
    first = next(iter(schedules))
    records = []
    for spec in args.kernels:
        name, model, *piece = spec.split(":")
        case = next(c for c in kernel_cases(MODELS[model]) if c.name == name)
        program = case.program
        a, b, tensors = random_inputs(program, case.m, case.n, case.k, torch.bfloat16, device)
        bound = bind(program, a, b, tensors)
        kernels = {version: kernel_on(schedule, program) for version, schedule in schedules.items()}
        for piece_n in [int(p) for p in piece] or pingpong.PIECE_WIDTHS:
            if pingpong.refuses(bound, piece_n, smem_limit):
                continue
            slots = pingpong.input_slots(bound, piece_n, smem_limit)
            runs, results = {}, {}
            for version, schedule in schedules.items():
                outs = bound.allocate_outputs(pingpong.BLOCK_M, pingpong.BLOCK_N)
                runs[version] = (lambda schedule=schedule, kernel=kernels[version], outs=outs:
                                 schedule.launch(kernel, bound, outs, piece_n, slots, num_sms))
                runs[version]()
                torch.cuda.synchronize()
                results[version] = outs
            equal = all(torch.equal(results[first][k].view(torch.uint8), outs[k].view(torch.uint8))
                        for outs in results.values() for k in outs)
            runs["cublas_gemm"] = lambda: gemm(program, a, b)
            rounds = timed_rounds(runs, args.rounds, lambda run: round(median_ms(run, 25, args.rep_ms), 4))
            records.append({"suite": "pingpong_ab", "name": name, "shape": {"model": model, "M": case.m, "N": case.n,
                            "K": case.k}, "piece_n": piece_n, "in_slots": slots, "bitwise_equal": equal,
                            "median_ms_by_round": rounds})
            print(f"{model} {name}, pieces of {piece_n} (bitwise equal: {equal}):", flush=True)
            for version, times in rounds.items():
                ratio = [t / f for t, f in zip(times, rounds[first])]
                print(f"    {version:20s} {times}   / {first}: {min(ratio):.3f}-{max(ratio):.3f}", flush=True)
    print(f"wrote {write_results('pingpong-ab', records, args.out)}")


if __name__ == "__main__":
    main()
