"""Tune a bucket for every benchmark shape in it, not for whichever shape came first (GPU).

The backend tunes once per (program, dtypes, shape bucket): the first shape it meets in a bucket picks
the configuration for all of them (``M, N, K`` rounded up to powers of two). The paper's d 2048 and
LLaMA-3 1B share buckets (gate/up N = 11264 and 16384; SwiGLU backward N = 5632 and 8192), as do d 4096
and LLaMA-3 8B. This times every candidate on every block shape of a bucket and keeps the one with the
smallest total time over them (recorded as the entry's ``timings_ms``); the choices go to the tuning cache
(``$CODAGEN_CACHE_DIR/triton/tuning.json``), from which ``codagen/backends/triton/tuned.json`` is refreshed.

    PYTHONPATH=. python bench/tune_buckets.py [--programs rms_gate_up_swiglu swiglu_backward] [--rep-ms 150]
        [--rounds 3]

Default: every program of the kernel benchmark.
"""
import argparse
import collections
import math
import statistics

import torch

from codagen.backends.triton.backend import TritonBackend
from codagen.bench.common import median_ms
from codagen.bench.kernels import MODELS, Model, kernel_cases, random_inputs
from codagen.epilogue.bind import bind

# LLaMA-3 1B: head_dim 64 (32/8 heads); Model assumes head_dim 128, and 16/4 heads of it give the same
# QKV width (3072)
SHAPES = {**MODELS, "llama3_1b": Model("llama3_1b", 2048, 8192, 16, 4)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", nargs="+", default=None, help="program names (default: all benchmarked)")
    parser.add_argument("--rep-ms", type=float, default=150, help="milliseconds of timed runs per candidate and shape")
    parser.add_argument("--rounds", type=int, default=1,
                        help="timing rounds, the candidates' order rotating; each time is the median over rounds")
    args = parser.parse_args()
    backend = TritonBackend(autotune=False, verbose=False)
    device = torch.device("cuda")
    buckets = collections.defaultdict(list)  # tuning key -> [(shape name, bound, launch)]
    for model in SHAPES.values():
        for case in kernel_cases(model):
            if args.programs is not None and case.program.name not in args.programs:
                continue
            a, b, tensors = random_inputs(case.program, case.m, case.n, case.k, torch.bfloat16, device)
            bound = bind(case.program, a, b, tensors)
            launch = backend._prepare(bound, False, 9)
            buckets[backend._tuning_key(bound, launch)].append((f"{model.name} {case.name}", bound, launch))
    for key, members in buckets.items():
        pool = backend._candidates(members[0][1], members[0][2])
        samples = collections.defaultdict(list)  # (config, shape) -> ms per round
        for round_index in range(args.rounds):
            # one measurement can be 10% off (the GPU runs at its power cap): rounds in rotated order
            shift = round_index % len(pool)
            for cfg in pool[shift:] + pool[:shift]:
                for name, bound, launch in members:
                    if samples[cfg.short(), name] == [float("inf")]:
                        continue
                    try:
                        samples[cfg.short(), name].append(median_ms(backend._trial(bound, launch, cfg), 25, args.rep_ms))
                    except Exception:  # noqa: BLE001 - out of resources: not a candidate here
                        samples[cfg.short(), name] = [float("inf")]
        times = {key: statistics.median(ms) for key, ms in samples.items()}
        names = [name for name, _, _ in members]
        total = {cfg.short(): sum(times[cfg.short(), n] for n in names) for cfg in pool}
        chosen = min(pool, key=lambda c: total[c.short()])
        print(f"\n{key.split('|')[2]} {key.split('|')[-1]}: " + ", ".join(names))
        for cfg in pool:
            mark = " <-" if cfg is chosen else ""
            print(f"  {cfg.short():28s} " + "  ".join(f"{times[cfg.short(), n]:7.3f}" for n in names) +
                  f"   total {total[cfg.short()]:7.3f}{mark}")
        backend.tuning.put(key, chosen, {s: (ms if math.isfinite(ms) else float("nan")) for s, ms in total.items()})
    print(f"\nwrote {backend.tuning.path}")


if __name__ == "__main__":
    main()
