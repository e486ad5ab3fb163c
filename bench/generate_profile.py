"""Where a decode step of ``model.generate()`` spends its time, patched and unpatched (GPU).

Usage (from the repository root, on a CUDA machine; ``--device cpu`` checks the script, not speed):
    PYTHONPATH=. python bench/generate_profile.py [--model Llama-3.2-1B] [--layers 4] [--cache dynamic|static]
        [--batches 1 8 64] [--device cuda] [--out results.json]

Builds the model from its config (``codagen.bench.models.MODELS``, random bf16 weights, ``--layers`` layers) and,
for the patched copy (``codagen.patch``) and the unpatched one, prints and writes:

- ms per new token of ``model.generate()`` after a 128-token prompt, greedy, no EOS token
  (``(t(65) - t(1)) / 64``, the least of three runs each), at each batch;
- for the patched model at batch 1: Triton launches per token, microseconds per launch spent in
  ``codagen.backends.triton.ahead.launch_kernel`` and in ``JITFunction.run`` (host time, 33 tokens);
- device events per token and the device time per token against the wall time (``torch.profiler``, 17 tokens);
- the 30 functions with the most own time in a cProfile of 33 tokens of the patched model (``--cache`` picks
  ``cache_implementation``: ``dynamic`` steps run eagerly, ``static`` ones replay a CUDA graph).
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import pstats
import time

import torch
import transformers
from triton.runtime.jit import JITFunction

import codagen
from codagen.backends.triton import ahead
from codagen.bench.models import MODELS, hf_config


def generate(model, ids, new_tokens: int, cache: str):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, cache_implementation=cache)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ms_per_token(model, ids, cache: str) -> float:
    for _ in range(2):
        generate(model, ids, 8, cache)
    best = {}
    for new_tokens in (1, 65):
        times = []
        for _ in range(3):
            synchronize(ids.device)
            start = time.perf_counter()
            generate(model, ids, new_tokens, cache)
            synchronize(ids.device)
            times.append(time.perf_counter() - start)
        best[new_tokens] = min(times)
    return (best[65] - best[1]) / 64 * 1e3


def launch_host_time(model, ids, cache: str, tokens: int = 33) -> dict:
    """Launches per token and host microseconds per launch, in launch_kernel and in JITFunction.run."""
    spent = {"launch_kernel": 0.0, "jit_run": 0.0, "launches": 0}
    launch_kernel, run = ahead.launch_kernel, JITFunction.run

    def timed_launch(*args, **kwargs):
        start = time.perf_counter()
        launch_kernel(*args, **kwargs)
        spent["launch_kernel"] += time.perf_counter() - start
        spent["launches"] += 1

    def timed_run(self, *args, **kwargs):
        start = time.perf_counter()
        result = run(self, *args, **kwargs)
        spent["jit_run"] += time.perf_counter() - start
        return result
    generate(model, ids, 2, cache)
    ahead.launch_kernel, JITFunction.run = timed_launch, timed_run
    try:
        generate(model, ids, tokens, cache)
    finally:
        ahead.launch_kernel, JITFunction.run = launch_kernel, run
    launches = max(spent["launches"], 1)
    return {"launches_per_token": spent["launches"] / tokens,
            "launch_kernel_us_each": spent["launch_kernel"] / launches * 1e6,
            "jit_run_us_each": spent["jit_run"] / launches * 1e6}


def device_time(model, ids, cache: str, tokens: int = 17) -> dict:
    from torch.profiler import ProfilerActivity, profile
    generate(model, ids, 4, cache)
    synchronize(ids.device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA] if ids.is_cuda else [ProfilerActivity.CPU]) as prof:
        generate(model, ids, tokens, cache)
        synchronize(ids.device)
    wall = time.perf_counter() - start
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"device_events_per_token": len(events) / tokens,
            "device_ms_per_token": sum(e.device_time for e in events) / 1e3 / tokens,
            "profiled_wall_ms_per_token": wall * 1e3 / tokens}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Llama-3.2-1B", choices=list(MODELS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cache", default="dynamic", choices=["dynamic", "static"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = hf_config(MODELS[args.model], args.layers)
    device = torch.device(args.device)
    with device:
        unpatched = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    unpatched.generation_config.eos_token_id = None
    patched = codagen.patch(copy.deepcopy(unpatched))
    result = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "torch": torch.__version__,
              "transformers": transformers.__version__,
              "model": args.model, "layers": args.layers, "cache": args.cache, "ms_per_token": {}}
    for batch in args.batches:
        ids = torch.randint(0, config.vocab_size, (batch, 128), device=device)
        for name, model in (("unpatched", unpatched), ("patched", patched)):
            result["ms_per_token"][f"{name} b{batch}"] = ms_per_token(model, ids, args.cache)
            print(f"{name} b{batch}: {result['ms_per_token'][f'{name} b{batch}']:.3f} ms/token", flush=True)
    ids = torch.randint(0, config.vocab_size, (1, 128), device=device)
    result["patched_launches"] = launch_host_time(patched, ids, args.cache)
    result["device"] = {name: device_time(model, ids, args.cache)
                        for name, model in (("unpatched", unpatched), ("patched", patched))}
    print(json.dumps({k: result[k] for k in ("patched_launches", "device")}, indent=1))
    profiler = cProfile.Profile()
    profiler.enable()
    generate(patched, ids, 33, args.cache)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
