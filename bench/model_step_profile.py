"""Where one training step of a published model's config spends its time: kernels, gaps between them, host ops (GPU).

Per model (:data:`codagen.bench.models.MODELS`) and provider (those of ``codagen bench models`` but Liger), the
step of ``codagen bench models`` (:func:`codagen.bench.models.training_step`: full fine-tune, fused AdamW) after
``--warmup`` steps, one step under ``torch.profiler``:

- ``kernels``: the GPU's kernels by total time (name, launches, ms);
- ``gaps``: the idle intervals between consecutive kernels longer than ``--min-gap-us``, grouped by the kernels
  on either side (count, ms): what the GPU waits on;
- ``host``: the host ops by self CPU time;
- ``launches``: kernels per step.

    PYTHONPATH=. python bench/model_step_profile.py --models Qwen3-0.6B Qwen2.5-0.5B --providers codagen compile

Writes ``<out>/<date>-model-step-profile.json`` (default ``bench/results``) and prints a short summary per run.
"""
from __future__ import annotations

import argparse
import collections
import sys

import torch

from codagen.bench.common import write_results
from codagen.bench.models import MODELS, PROVIDERS, build, kernel_union_ms, profiled_kernels, training_step


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def profile_step(model_name: str, provider: str, layers: int, batch: int, seq: int, warmup: int,
                 min_gap_us: float, top: int) -> dict:
    model = MODELS[model_name]
    hf_model, step_model = build(model, layers, "full", "peft", provider, torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(0, model.vocab_size, (batch, seq), device="cuda")
    step, optimizer = training_step(hf_model, step_model, ids, provider)
    for _ in range(warmup):
        step()
    gpu, wall_ms, prof = profiled_kernels(step)
    kernel_ms = kernel_union_ms(gpu)
    per_kernel = collections.defaultdict(lambda: [0, 0.0])
    gaps = collections.defaultdict(lambda: [0, 0.0])
    covered_to, previous = float("-inf"), "(step start)"
    for begin, stop, name in gpu:
        per_kernel[name][0] += 1
        per_kernel[name][1] += (stop - begin) / 1e3
        if covered_to != float("-inf") and begin - covered_to >= min_gap_us:
            group = gaps[(_short(previous, 60), _short(name, 60))]
            group[0] += 1
            group[1] += (begin - covered_to) / 1e3
        if stop > covered_to:
            covered_to, previous = stop, name
    host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:top]
    return {"model": model_name, "provider": provider, "optimizer": optimizer, "layers": layers, "batch": batch,
            "seq": seq, "wall_ms": wall_ms, "kernel_ms": kernel_ms, "idle_share": max(0.0, 1 - kernel_ms / wall_ms),
            "launches": len(gpu),
            "kernels": [{"name": _short(n), "launches": c, "ms": ms}
                        for n, (c, ms) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:top]],
            "gaps": [{"before": b, "after": a, "count": c, "ms": ms}
                     for (b, a), (c, ms) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:top]],
            "host": [{"name": _short(a.key), "calls": a.count, "self_cpu_ms": a.self_cpu_time_total / 1e3}
                     for a in host]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["Qwen3-0.6B"])
    parser.add_argument("--providers", nargs="+", default=["codagen", "compile"],
                        choices=[p for p in PROVIDERS if p != "liger"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--min-gap-us", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", help="results folder (default: bench/results)")
    args = parser.parse_args()
    records = []
    for model_name in args.models:
        for provider in args.providers:
            r = profile_step(model_name, provider, args.layers, args.batch, args.seq, args.warmup, args.min_gap_us,
                             args.top)
            records.append(r)
            print(f"\n== {model_name} {provider}: wall {r['wall_ms']:.1f} ms, kernels {r['kernel_ms']:.1f} ms, "
                  f"idle {100 * r['idle_share']:.1f}%, {r['launches']} launches", flush=True)
            for k in r["kernels"][:12]:
                print(f"  {k['ms']:8.2f} ms {k['launches']:5d}x  {k['name']}")
            print("  gaps:")
            for g in r["gaps"][:10]:
                print(f"  {g['ms']:8.2f} ms {g['count']:5d}x  {g['before']}  ->  {g['after']}")
            print("  host (self CPU):")
            for h in r["host"][:10]:
                print(f"  {h['self_cpu_ms']:8.2f} ms {h['calls']:5d}x  {h['name']}")
    print(f"wrote {write_results('model-step-profile', records, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
