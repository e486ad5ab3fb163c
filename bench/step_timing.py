"""Why one training step times differently back-to-back and under ``do_bench`` (GPU).

The block benchmark times a step with ``codagen.bench.common.median_ms`` (``triton.testing.do_bench``:
an L2 flush before every step, CUDA events around each step). ``bench/profile_block.py`` times 10 steps
back to back. On 2026-11-30 codagen's 2-layer 1B step read 1.0 ms slower under ``do_bench`` than back
to back, torch.compile's 0.3 ms (two machines). This script times both ways on one machine, plus
``do_bench``'s loop without the flush, in rounds of rotated order (the first run of this script,
2026-11-30, took the methods in a fixed order and every later one read slower for both providers, so
method and elapsed time were confounded), and looks for
host-device synchronizations inside a step (``torch.cuda.set_sync_debug_mode``: a sync stalls the GPU
while the host enqueues what follows).

    PYTHONPATH=. python bench/step_timing.py [--providers compile codagen] [--layers 2] [--rounds 3]
"""
import argparse
import statistics
import warnings

import torch
from profile_block import back_to_back  # bench/ is on the path when run as a script

from codagen.bench.block import SHAPES, model_providers
from codagen.bench.common import median_ms


def events_per_step(step, steps: int, flush: torch.Tensor | None) -> float:
    """Median of per-step CUDA-event times (do_bench's loop), with or without its L2 flush."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    for i in range(steps):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        step()
        ends[i].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends))[steps // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--providers", nargs="+", default=["compile", "codagen"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    factories = model_providers(SHAPES[args.shape], args.layers, 32768, 2, 8192, torch.device("cuda"), torch.bfloat16)
    flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device="cuda")  # as do_bench's
    steps = {}
    for name in args.providers:
        step = steps[name] = factories[name]()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:  # synchronizing calls inside one step
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            step()
            torch.cuda.set_sync_debug_mode("default")
        syncs = sorted({str(w.message).splitlines()[0][:100] for w in caught
                        if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)})
        print(f"{name}: syncs inside a step: {syncs or 'none'}", flush=True)
    methods = {"back_to_back": lambda step: back_to_back(step)[0],
               "events_no_flush": lambda step: events_per_step(step, 20, None),
               "events_flush": lambda step: events_per_step(step, 20, flush),
               "do_bench": median_ms}
    # the GPU's speed can drift over a run: every round takes the providers and the methods in a rotated
    # order, so neither a provider nor a method always comes first
    times = {(name, method): [] for name in steps for method in methods}
    names, keys = list(steps), list(methods)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for method in keys[r % len(keys):] + keys[:r % len(keys)]:
                times[name, method].append(methods[method](steps[name]))
    cpu = {name: back_to_back(step)[1] for name, step in steps.items()}
    print(f"\n{'ms per step':12s} " + " ".join(f"{k:>16s}" for k in keys) + f" {'cpu_enqueue':>16s}")
    for name in names:
        print(f"{name:12s} " + " ".join(f"{statistics.median(times[name, k]):16.3f}" for k in keys) +
              f" {cpu[name]:16.3f}")
    print("(medians over rounds; all rounds: " +
          "; ".join(f"{n} {k} " + "/".join(f"{t:.2f}" for t in times[n, k]) for n in names for k in keys) + ")")


if __name__ == "__main__":
    main()
