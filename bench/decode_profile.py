"""Where one greedy decode step's time goes: kernel by kernel, per provider (GPU, bf16).

A decode step's kernels are the kernels of a run of ``T`` new tokens less those of a run of one
(both include the prefill, which cancels), over ``T - 1``: the same difference as
``codagen bench generate`` takes of the times. Providers as there: ``compile_static`` (transformers'
``StaticCache`` step through ``torch.compile(mode="reduce-overhead")``) and ``codagen``
(:class:`codagen.models.decode.GreedyDecoder`). Kernels inside CUDA graph replays are recorded by the
profiler like any other. For every kernel: microseconds per step, launches per step, and for the
codagen GEMMs the configuration the backend chose for each decode-shaped key (``--autotune``: time the
candidates first, ``CODAGEN_TRITON_AUTOTUNE=1`` with a fresh ``CODAGEN_CACHE_DIR``).

    PYTHONPATH=. python bench/decode_profile.py --model llama3-8b --batch 1 [--autotune] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from codagen.bench.common import environment
from codagen.bench.generate import MODELS, Providers, copy_bandwidth_gbps


def kernel_us(run) -> dict[str, tuple[float, int]]:
    """{kernel name: (total device microseconds, launches)} of one call of ``run``."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name][0] += event.device_time
            totals[event.name][1] += 1
    return {name: (us, count) for name, (us, count) in totals.items()}


def per_step(ids, run, new_tokens: int) -> list[dict]:
    """Kernels of one decode step: (run of ``new_tokens``) - (run of one), over ``new_tokens - 1``."""
    run(ids, new_tokens)  # warm-up: compiles, captures
    long, short = kernel_us(lambda: run(ids, new_tokens)), kernel_us(lambda: run(ids, 1))
    rows = []
    for name in long:
        us = (long[name][0] - short.get(name, (0.0, 0))[0]) / (new_tokens - 1)
        launches = (long[name][1] - short.get(name, (0.0, 0))[1]) / (new_tokens - 1)
        if launches > 0.5:
            rows.append({"kernel": name, "us_per_step": us, "launches_per_step": launches})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument("--layers", type=int, help="default: the generate benchmark's count")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=17)
    parser.add_argument("--providers", nargs="+", default=["compile_static", "codagen"],
                        choices=["compile_static", "codagen"])
    parser.add_argument("--autotune", action="store_true", help="time the decode GEMMs' candidates first")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_profile needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.autotune:
        os.environ["CODAGEN_TRITON_AUTOTUNE"] = "1"
    from transformers import LlamaForCausalLM

    import codagen
    shape = MODELS[args.model]
    layers = args.layers or shape.layers
    device = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(shape.config(layers)).to(torch.bfloat16).eval()
    runs = Providers(model, max_cache_len=args.context + args.new_tokens, device=device)
    bandwidth = copy_bandwidth_gbps(device)
    step_bytes = shape.weight_bytes(layers) + shape.kv_bytes(layers, args.batch, args.context + args.new_tokens / 2)
    ids = torch.randint(0, shape.vocab, (args.batch, args.context), device=device)
    result = {"env": environment(), "model": args.model, "layers": layers, "batch": args.batch,
              "context": args.context, "new_tokens": args.new_tokens, "autotune": args.autotune,
              "copy_gbps": bandwidth, "bytes_per_step": step_bytes,
              "limit_us": step_bytes / bandwidth / 1e3, "providers": {}}
    print(f"{args.model} x{layers} layers, batch {args.batch}, context {args.context}: "
          f"limit {result['limit_us']:.0f} us/step at {bandwidth:.0f} GB/s", flush=True)
    with torch.no_grad():
        for provider in args.providers:
            rows = per_step(ids, runs.generate(provider), args.new_tokens)
            total = sum(r["us_per_step"] for r in rows)
            result["providers"][provider] = {"kernels": rows, "kernel_us_per_step": total,
                                             "launches_per_step": sum(r["launches_per_step"] for r in rows)}
            print(f"\n== {provider}: kernels {total:.0f} us/step in "
                  f"{result['providers'][provider]['launches_per_step']:.0f} launches", flush=True)
            for r in rows[:args.top]:
                print(f"  {r['us_per_step']:8.1f} us  x{r['launches_per_step']:<5.1f} {r['kernel'][:110]}")
    backend = codagen.backends.get_backend("triton")
    decode_bucket = f"|M{1 << max(0, (args.batch - 1).bit_length())} "  # the tuning keys' M bucket of a decode step
    result["codagen_configs"] = {key: {"config": cfg.short(), "source": backend.choices.get(key)}
                                 for key, cfg in backend.chosen.items() if decode_bucket in key}
    print("\n== codagen decode GEMM configurations")
    for key, entry in result["codagen_configs"].items():
        program, bucket = key.split("|")[2].split(":")[0], key.rsplit("|", 1)[1]
        timings = backend.tuning._load().get(key, {}).get("timings_ms", {})
        print(f"  {program:<28} {bucket:<20} {entry['config']:<28} {entry['source']}  "
              + " ".join(f"{c}={1e3 * ms:.1f}us" for c, ms in sorted(timings.items(), key=lambda kv: kv[1])))
        entry["timings_ms"] = timings
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
