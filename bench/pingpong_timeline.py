"""Where a ping-pong kernel's time goes (GPU): in-kernel phase times, SM clock and power.

For each benchmark kernel given (``name:model``, e.g. ``o_proj_residual_rms:d2048``):

1. **Timeline.** The kernel generated with ``timeline=True`` (:func:`codagen.backends.triton.pingpong.generate`) writes
   ``%globaltimer`` stamps for CTA 0's first tiles: tile start, turn taken, mainloop done, epilogue done.
   Reported as medians over the tiles after each consumer's first: the wait for the turn, the mainloop,
   the epilogue, and the time per tile (half a consumer's period). The same for the ``linear`` program
   (a plain store) of the same shape: the mainloop's own speed.
2. **Clock and power.** The production kernel (no stamps), the plain ``linear`` ping-pong kernel and the
   cuBLAS GEMM each run back to back for ``--seconds`` while ``nvidia-smi`` samples the SM clock, power
   and throttle reasons; reported are the time per run and the median clock and power after the first
   0.5 s.

Caveat: each stamp sits in a branch (``if stamping:``), and a branch is a scheduling boundary for ptxas,
so a timeline kernel is not always scheduled like the production one. Where ptxas hoists epilogue
arithmetic above the turn hand-off in the production kernel (``bench/pingpong_handoff.py`` shows where),
the stamp after the mainloop prevents that, and the timeline describes the kernel without the defect.

    PYTHONPATH=. python bench/pingpong_timeline.py [--kernels o_proj_residual_rms:d2048 ...] [--piece-n 16]
        [--seconds 2] [--out DIR]
"""
import argparse
import datetime
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from codagen.backends.triton import pingpong
from codagen.backends.triton.backend import TritonBackend
from codagen.backends.triton.configs import KernelConfig
from codagen.bench.common import load_module, write_results
from codagen.bench.kernels import MODELS, gemm, kernel_cases, random_inputs
from codagen.epilogue import library
from codagen.epilogue.bind import bind

DEFAULT_KERNELS = ["o_proj_residual_rms:d2048", "down_swiglu_bwd:d2048", "lm_head_ce:d2048", "qkv_rope:d2048"]
STAMPS = 4  # tile start, turn taken, mainloop done, epilogue done
_modules = Path(tempfile.mkdtemp(prefix="codagen-timeline-"))


def timeline_kernel(program):
    """The program's ping-pong kernel with stamps, loaded from a module file (``@gluon.jit`` reads it)."""
    path = _modules / f"{program.name}_timeline.py"
    path.write_text(pingpong.generate(program, timeline=True))
    module = load_module(path.stem, path)
    return getattr(module, f"{program.name}_kernel"), module.TIMELINE_TILES.value


class _WithTimeline:
    """``kernel[grid](..., M, N, K, **meta)`` as :func:`pingpong.launch` calls it, with ``timeline_ptr``
    inserted after ``K`` (where the timeline kernel takes it)."""

    def __init__(self, kernel, timeline: torch.Tensor):
        self.kernel, self.timeline = kernel, timeline

    def __getitem__(self, grid):
        run = self.kernel[grid]
        return lambda *args, **meta: run(*args, self.timeline, **meta)


def phases(bound, piece_n: int) -> dict:
    kernel, tiles = timeline_kernel(bound.program)
    stamps = torch.zeros(2 * tiles * STAMPS, dtype=torch.int64, device=bound.device)
    outs = bound.allocate_outputs(pingpong.BLOCK_M, pingpong.BLOCK_N)
    gpu = torch.cuda.get_device_properties(bound.device)
    slots = pingpong.input_slots(bound, piece_n, gpu.shared_memory_per_block_optin)
    for _ in range(3):  # the last run's stamps are kept
        pingpong.launch(_WithTimeline(kernel, stamps), bound, outs, piece_n, slots, gpu.multi_processor_count)
    torch.cuda.synchronize()
    ns = stamps.view(2, tiles, STAMPS).cpu().double()
    spans = {"turn wait": [], "mainloop": [], "epilogue": [], "per tile": []}
    for which in range(2):
        done = [row for row in ns[which] if row[STAMPS - 1] > 0]
        for previous, row in zip(done, done[1:]):  # a consumer's first tile waits for the pipeline to fill
            spans["turn wait"].append(row[1] - row[0])
            spans["mainloop"].append(row[2] - row[1])
            spans["epilogue"].append(row[3] - row[2])
            spans["per tile"].append((row[0] - previous[0]) / 2)  # a consumer takes every other tile
    return {k: round(statistics.median(float(x) for x in v) / 1000, 2) for k, v in spans.items() if v}


def clock_and_power(functions: dict, seconds: float) -> dict:
    """Each function back to back for ``seconds`` while nvidia-smi samples every 50 ms."""
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=log)
    windows = {}
    try:
        time.sleep(0.5)
        for name, fn in functions.items():
            fn()
            torch.cuda.synchronize()
            start, runs = datetime.datetime.now(), 0
            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            first.record()
            while (datetime.datetime.now() - start).total_seconds() < seconds:
                for _ in range(10):
                    fn()
                runs += 10
                torch.cuda.synchronize()
            last.record()
            torch.cuda.synchronize()
            windows[name] = (start + datetime.timedelta(seconds=0.5), datetime.datetime.now(),
                             first.elapsed_time(last) / runs)
            time.sleep(0.5)
    finally:
        smi.terminate()
        smi.wait()
    samples = []
    for line in Path(log.name).read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            samples.append((datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f"), float(fields[1]),
                            float(fields[2]), fields[3]))
        except (ValueError, IndexError):
            continue
    result = {}
    for name, (begin, end, ms) in windows.items():
        inside = [s for s in samples if begin <= s[0] <= end]
        result[name] = {"ms": round(ms, 4),
                        "sm_mhz": statistics.median(s[1] for s in inside) if inside else None,
                        "power_w": statistics.median(s[2] for s in inside) if inside else None,
                        "throttle_reasons": sorted({s[3] for s in inside})}
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", nargs="+", default=DEFAULT_KERNELS, help="name:model of benchmark kernels")
    parser.add_argument("--piece-n", type=int, default=16, choices=pingpong.PIECE_WIDTHS)
    parser.add_argument("--seconds", type=float, default=2.0, help="back-to-back time per kernel (0: skip)")
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    args = parser.parse_args()
    device = torch.device("cuda")
    records = []
    for spec in args.kernels:
        name, model = spec.split(":")
        case = next(c for c in kernel_cases(MODELS[model]) if c.name == name)
        program = case.program
        a, b, tensors = random_inputs(program, case.m, case.n, case.k, torch.bfloat16, device)
        bound = bind(program, a, b, tensors)
        b_nk = b if program.gemm.b_layout == "nk" else b.T.contiguous()
        plain = bind(library.linear(), a, b_nk, {})
        config = KernelConfig(pingpong.BLOCK_M, pingpong.BLOCK_N, pingpong.BLOCK_K, pingpong.STAGES,
                              pingpong.CONSUMER_WARPS, pingpong.BLOCK_N // args.piece_n, schedule="pingpong")
        backend = TritonBackend(config=config, autotune=False)
        record = {"suite": "pingpong_timeline", "name": name, "shape": {"model": model, "M": case.m, "N": case.n,
                  "K": case.k}, "piece_n": args.piece_n,
                  "phases_us": phases(bound, args.piece_n), "linear_phases_us": phases(plain, args.piece_n)}
        if args.seconds > 0:
            fused, _, _ = backend.launcher(bound)
            linear, _, _ = backend.launcher(plain)
            record["back_to_back"] = clock_and_power(
                {"codagen": fused, "linear_pingpong": linear, "cublas_gemm": lambda: gemm(program, a, b)}, args.seconds)
        records.append(record)
        print(f"{model} {name}: {record['phases_us']}  (linear: {record['linear_phases_us']})", flush=True)
        for provider, r in record.get("back_to_back", {}).items():
            print(f"    {provider:16s} {r['ms']:8.4f} ms  {r['sm_mhz']} MHz  {r['power_w']} W  {r['throttle_reasons']}")
    print(f"wrote {write_results('pingpong-timeline', records, args.out)}")


if __name__ == "__main__":
    main()
