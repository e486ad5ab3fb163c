"""Is attention slower inside codagen's block because of its inputs or because of its surroundings? (GPU, bf16)

    PYTHONPATH=. python bench/attention_in_block.py [--shapes d2048 llama3-1b] [--out DIR]

The same cuDNN attention kernels run 15-20% longer inside codagen's block than on the speed-of-light
line, and `bench/sdpa_data.py` found no such difference between the two kinds of q/k/v run alone. This
separates the two remaining explanations by running a *probe* -- SDPA forward+backward on contiguous
``randn`` q/k/v and ``dO``, exactly the speed-of-light line's attention -- right after each step:

``speed_of_light``         the line's step (its attention is the probe's twin)
``codagen``                codagen's block step, attention on the decoder's token-major views
``codagen_contiguous``     the same, with q/k/v and ``dO`` copied contiguous head-major before SDPA
``probe``                  the probe alone, back to back
``speed_of_light+probe``, ``codagen+probe``   the step, then the probe

If the probe slows down after codagen's step as codagen's own attention does, the surroundings
(clocks under the power cap) explain it; if the probe keeps the line's speed, the inputs do. Every case
first runs for ``--warm-s`` seconds back to back, so that the GPU sits at its power cap, then the profiler
takes the durations of the cuDNN kernels, which are reported as medians by role (``fprop``/``bprop``
of the step's attention and of the probe). Cases are interleaved over rotated rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import codagen.models.llama as llama
from codagen.bench.block import SHAPES, block_providers
from codagen.bench.common import environment


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (so SDPA's backward gets a contiguous dO)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def contiguous_attention(q, k, v, spec, sliding_window=None):
    """``llama.attention`` with head-major contiguous q/k/v and dO (copies outside SDPA)."""
    b, s, h, kv, hd = spec.batch, spec.seq, spec.num_heads, spec.num_kv_heads, spec.head_dim
    q, k, v = (t.view(b, s, heads, hd).transpose(1, 2).contiguous() for t, heads in ((q, h), (k, kv), (v, kv)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h)
    return _ContiguousGrad.apply(out).transpose(1, 2).reshape(b * s, h * hd)


def probe_of(shape, batch: int, seq: int):
    s = SHAPES[shape]
    q = torch.randn(batch, s.heads, seq, s.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, s.kv_heads, seq, s.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    grad = torch.randn_like(q)

    def probe():
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=s.kv_heads != s.heads).backward(grad)
    return probe


def cases(shape: str, batch: int = 2, seq: int = 8192) -> dict:
    factories, _ = block_providers(SHAPES[shape], batch, seq, torch.device("cuda"), torch.bfloat16)
    sol, codagen = factories["speed_of_light"](), factories["codagen"]()
    original = llama.attention
    llama.attention = contiguous_attention
    try:
        codagen_contiguous_built = factories["codagen"]()
    finally:
        llama.attention = original

    def codagen_contiguous():  # the decoder looks ``attention`` up at call time
        llama.attention = contiguous_attention
        try:
            codagen_contiguous_built()
        finally:
            llama.attention = original

    probe = probe_of(shape, batch, seq)

    def then_probe(step):
        def run():
            step()
            probe()
        return run
    return {"speed_of_light": sol, "codagen": codagen, "codagen_contiguous": codagen_contiguous, "probe": probe,
            "speed_of_light+probe": then_probe(sol), "codagen+probe": then_probe(codagen)}


def attention_kernel_ms(step, warm_s: float, steps: int = 6) -> dict[str, float]:
    """Median duration (ms) of each attention kernel of ``step`` by role, after ``warm_s`` s back to back."""
    deadline = time.perf_counter() + warm_s
    while time.perf_counter() < deadline:
        step()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "sdpa" in e.name and ("fprop" in e.name or "bprop" in e.name)),
                     key=lambda e: e.time_range.start)
    per_step = len(kernels) // steps  # 2 (one attention) or 4 (the step's, then the probe's)
    durations: dict[str, list[float]] = {}
    for i, event in enumerate(kernels):
        role = ("step " if i % per_step < 2 else "probe ") if per_step == 4 else ""
        role += "fprop" if "fprop" in event.name else "bprop"
        durations.setdefault(role, []).append(event.time_range.elapsed_us() / 1e3)
    return {role: statistics.median(ms) for role, ms in durations.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["d2048", "llama3-1b"], choices=sorted(SHAPES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warm-s", type=float, default=1.5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    records = []
    for shape in args.shapes:
        steps = cases(shape)
        names = list(steps)
        times = {name: [] for name in names}
        for round_index in range(args.rounds):
            for name in names[round_index % len(names):] + names[:round_index % len(names)]:
                times[name].append(attention_kernel_ms(steps[name], args.warm_s))
        for name, rounds in times.items():
            merged = {role: statistics.median(r[role] for r in rounds) for role in rounds[0]}
            records.append({"suite": "attention_in_block", "name": name, "shape": shape, "kernel_ms": merged,
                            "rounds": rounds})
            print(f"{shape:10s} {name:22s} " + "  ".join(f"{k} {v:6.3f}" for k, v in sorted(merged.items())),
                  flush=True)
        del steps
        torch.cuda.empty_cache()
    if args.out:
        path = Path(args.out) / "attention-in-block.json"
        path.write_text(json.dumps({"env": environment(), "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
