"""Where a block's fwd+bwd time goes, per provider: wall time, CPU enqueue time, summed kernel time.

If CPU enqueue time >= wall time the provider is launch-bound; if the kernel sum ~ wall time, the
kernels themselves are slow and the top-kernel table says which. Usage (GPU; from the repository root,
where codagen is not pip-installed the root must be on the path):
    PYTHONPATH=. python bench/profile_block.py [--shape llama3-1b] [--providers eager codagen] [--warm-s 2]

``--warm-s`` runs each provider back to back for that long before the profiled steps, so that the GPU
sits at its power cap as it does in the benchmark's timed rounds; without it the profiled steps follow a
short burst and run at higher clocks, and kernels compare differently (attention most:
docs/notes/attention-under-load.md).
"""
import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from codagen.bench.block import SHAPES, block_providers, model_providers


def back_to_back(step, steps: int = 10) -> tuple[float, float]:
    """(GPU ms per step over ``steps`` back-to-back steps, median host ms to enqueue one step)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cpu = []
    start.record()
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        cpu.append(time.perf_counter() - t0)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, 1e3 * sorted(cpu)[steps // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-1b", choices=sorted(SHAPES))
    parser.add_argument("--providers", nargs="+", default=["eager", "codagen"])
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--sequence", action="store_true", help="also list one step's kernels in launch order")
    parser.add_argument("--warm-s", type=float, default=0.0,
                        help="run the provider back to back this many seconds first (the power-capped state)")
    parser.add_argument("--layers", type=int, default=0,
                        help="profile a training step of a model of this many blocks (LM head included) instead")
    args = parser.parse_args()
    if args.layers:
        factories = model_providers(SHAPES[args.shape], args.layers, 32768, 2, 8192, torch.device("cuda"),
                                    torch.bfloat16)
    else:
        factories, _ = block_providers(SHAPES[args.shape], 2, 8192, torch.device("cuda"), torch.bfloat16)
    for name in args.providers:
        step = factories[name]()
        for _ in range(3):
            step()
        deadline = time.perf_counter() + args.warm_s
        while time.perf_counter() < deadline:
            step()
            torch.cuda.synchronize()
        wall, cpu_ms = back_to_back(step)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        kernel_ms = sum(e.device_time_total for e in events) / 3 / 1e3
        launches = sum(e.count for e in events) / 3
        print(f"\n== {name} {args.shape}: wall {wall:.3f} ms/step, CPU enqueue {cpu_ms:.3f} ms/step, "
              f"kernels {kernel_ms:.3f} ms/step in {launches:.0f} launches")
        for e in sorted(events, key=lambda e: -e.device_time_total)[:args.top]:
            print(f"  {e.device_time_total / 3 / 1e3:8.3f} ms  x{e.count // 3:<3d} {e.key[:110]}")
        if args.sequence:  # the last of the 3 profiled steps, kernel by kernel
            kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                             key=lambda e: e.time_range.start)
            print("  -- one step in launch order (start offset ms, duration ms, kernel)")
            step = kernels[-len(kernels) // 3:]
            t0 = step[0].time_range.start
            for e in step:
                start_ms, ms = (e.time_range.start - t0) / 1e3, e.time_range.elapsed_us() / 1e3
                print(f"  {start_ms:9.3f} {ms:8.3f}  {e.name[:100]}")
        del step


if __name__ == "__main__":
    main()
