"""Tune a bucket for every benchmark shape in it, not for whichever shape came first (GPU).

The backend tunes once per (program, dtypes, shape bucket): the first shape it meets in a bucket picks
the configuration for all of them (``M, N, K`` rounded up to powers of two). The paper's d 2048 and
LLaMA-3 1B share buckets (gate/up N = 11264 and 16384; SwiGLU backward N = 5632 and 8192), as do d 4096
and LLaMA-3 8B. This times every candidate on every block shape of a bucket and keeps the one with the
smallest total time over them (recorded as the entry's ``timings_ms``); the choices go to the tuning cache
(``$CODAGEN_CACHE_DIR/triton/tuning.json``), from which ``codagen/backends/triton/tuned.json`` is refreshed.

    PYTHONPATH=. python bench/tune_buckets.py [--programs rms_gate_up_swiglu swiglu_backward] [--rep-ms 150]
        [--rounds 3] [--blocks]

Default: every program of the kernel benchmark. ``--blocks`` adds the buckets only the models meet (the
block benchmark's codagen blocks and 2-layer model step, whose norm weights are bf16 and whose LM head
runs in row chunks): each is run once at the Triton backend with tuning off, and every fused GEMM call
it makes is recorded (:func:`block_calls`).
"""
import argparse
import collections
import functools
import math
import statistics

import torch

from codagen.backends import get_backend, use_backend
from codagen.backends.triton.backend import TritonBackend
from codagen.backends.triton.configs import gemm_layout
from codagen.bench.common import median_ms, timed_rounds
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
    parser.add_argument("--blocks", action="store_true",
                        help="also the buckets the block benchmark's codagen blocks and model step meet")
    args = parser.parse_args()
    backend = TritonBackend(autotune=False, verbose=False)
    device = torch.device("cuda")
    calls = []  # (shape name, bound)
    for model in SHAPES.values():
        for case in kernel_cases(model):
            if args.programs is None or case.program.name in args.programs:
                a, b, tensors = random_inputs(case.program, case.m, case.n, case.k, torch.bfloat16, device)
                calls.append((f"{model.name} {case.name}", bind(case.program, a, b, tensors)))
    if args.blocks:
        from codagen.bench import block
        calls += block_calls(block.SHAPES, "llama3-1b", 2, 32768, 2, 8192, device, torch.bfloat16)
    buckets = collections.defaultdict(list)  # tuning key -> [(shape name, bound, pool, trial)]
    for name, bound in calls:
        if args.programs is not None and bound.program.name not in args.programs:
            continue
        key, pool, trial = backend.tuning_trials(bound)
        members = buckets[key]
        if all((b.m, b.n, b.k) != (bound.m, bound.n, bound.k) for _, b, _, _ in members):  # one shape once
            members.append((name, bound, pool, trial))
    for key, members in buckets.items():
        pool = members[0][2]
        # (config, shape) -> a function that makes the trial (scratch outputs exist while it is timed)
        trials = {(cfg.short(), name): functools.partial(trial, cfg) for cfg in pool for name, _, _, trial in members}
        times = dict.fromkeys(trials, float("inf"))  # out of resources: not a candidate here
        # one measurement can be 10% off (the GPU runs at its power cap): medians of rotated rounds
        samples = timed_rounds(trials, args.rounds, lambda trial: median_ms(trial(), 25, args.rep_ms),
                               on_error=lambda key, error: None)
        times.update({key: statistics.median(ms) for key, ms in samples.items()})
        names = [name for name, _, _, _ in members]
        total = {cfg.short(): sum(times[cfg.short(), n] for n in names) for cfg in pool}
        chosen = min(pool, key=lambda c: total[c.short()])
        print(f"\n{key.split('|')[2]} {key.split('|')[-1]}: " + ", ".join(names))
        for cfg in pool:
            mark = " <-" if cfg is chosen else ""
            print(f"  {cfg.short():28s} " + "  ".join(f"{times[cfg.short(), n]:7.3f}" for n in names) +
                  f"   total {total[cfg.short()]:7.3f}{mark}")
        backend.tuning.put(key, chosen, {s: (ms if math.isfinite(ms) else float("nan")) for s, ms in total.items()},
                           gemm_layout(members[0][1].program))
    print(f"\nwrote {backend.tuning.path}")


def block_calls(shapes: dict, model_shape: str, layers: int, vocab: int, batch: int, seq: int, device,
                dtype) -> list[tuple[str, object]]:
    """``(name, bound)`` of every fused GEMM that one forward+backward of the block benchmark's codagen
    block (each of ``shapes``) and of its ``layers``-block model step (``model_shape``) runs, recorded at
    the Triton backend (tuning off for the run: the first viable configuration computes it). The bounds
    keep their tensors, so they can be timed afterwards."""
    from codagen.bench import block
    backend = get_backend("triton")
    recorded, label = [], [""]

    def recording_run(bound):
        recorded.append((f"{label[0]} {bound.program.name}", bound))
        return type(backend).run(backend, bound)
    autotune = backend.autotune
    backend.run, backend.autotune = recording_run, False  # an instance attribute: the class's run stays
    try:
        with use_backend("triton"):
            for name, s in shapes.items():
                label[0] = f"{name} block"
                factories, _ = block.block_providers(s, batch, seq, device, dtype)
                factories["codagen"]()()
            label[0] = f"{model_shape}-x{layers} step"
            block.model_providers(shapes[model_shape], layers, vocab, batch, seq, device, dtype)["codagen"]()()
    finally:
        del backend.run
        backend.autotune = autotune
    return recorded


if __name__ == "__main__":
    main()
