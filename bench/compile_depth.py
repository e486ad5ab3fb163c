"""First ``torch.compile``d training step of a Hugging Face Llama at depth, patched vs unpatched (GPU).

The model: ``LlamaForCausalLM`` with d 2048, ffn 8192, 32/8 heads, vocab 32768, bf16, 4 x 4096 tokens
(the shipped tuning's shapes), ``--layers`` decoder layers. Each (model, depth) runs in its own process
with empty Inductor and Triton caches (what a new user pays; ``--warm-caches`` keeps them), under
``CODAGEN_TRITON_AUTOTUNE=0``. Recorded per run: the first step (forward + backward, synchronized) in
seconds, the steady step (median of ``--steps`` steps) in ms, dynamo's counters (graph breaks,
recompiles, frames, graphs), its compile-phase times, and for the patched model where each fused
kernel's configuration came from and how many of codagen's kernels compiled ahead, from the trace
(``codagen.backends.triton.ahead``), or on their first launch. Wanted: patched first step <= 1.5x
unpatched at every depth; 0 graph breaks; 0 recompiles after the first step.

    PYTHONPATH=. python bench/compile_depth.py [--layers 4,16,32] [--steps 5] [--timeout 300]

Writes ``bench/results/<date>-compile-depth.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from codagen.bench.common import write_results

TOKENS = (4, 4096)


def worker(patched: bool, layers: int, steps: int) -> dict:
    import torch
    import transformers
    import triton
    from torch._dynamo.utils import compile_times, counters

    import codagen
    from codagen.backends import get_backend
    compiles = {"ahead": 0, "on_launch": 0}  # codagen's kernels: compiled from the trace's dry runs, or on launch

    def count(*, fn, is_manual_warmup, **_):
        if fn.module.startswith("codagen"):
            compiles["ahead" if is_manual_warmup else "on_launch"] += 1
    triton.knobs.runtime.jit_cache_hook = count
    config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                                      num_key_value_heads=8, vocab_size=32768, num_hidden_layers=layers,
                                      max_position_embeddings=TOKENS[1], attn_implementation="sdpa")
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()
    if patched:
        codagen.patch(model)
    ids = torch.randint(0, config.vocab_size, TOKENS, device="cuda")
    compiled = torch.compile(model)

    def step():
        compiled(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    start = time.perf_counter()
    step()
    first_s = time.perf_counter() - start
    recompiles_after_first = sum(counters["recompiles"].values())
    frames_after_first = counters["frames"]["ok"]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - start))
    record = {"first_step_s": first_s, "steady_step_ms": statistics.median(times), "step_ms": times,
              "graph_breaks": dict(counters["graph_break"]), "stats": dict(counters["stats"]),
              "frames": dict(counters["frames"]),
              "recompiles_after_first_step": sum(counters["recompiles"].values()) - recompiles_after_first,
              "frames_compiled_after_first_step": counters["frames"]["ok"] - frames_after_first,
              "compile_times": compile_times(repr="str", aggregate=True),
              "peak_memory_gb": torch.cuda.max_memory_allocated() / 2 ** 30}
    if patched:
        sources = list(get_backend("triton").choices.values())
        record["kernel_choices"] = {s: sources.count(s) for s in sorted(set(sources))}
        record["codagen_kernel_compiles"] = compiles
    return record


def run_one(patched: bool, layers: int, args) -> dict:
    """One (model, depth) in a fresh process with its own caches; the record it prints, or the error."""
    with tempfile.TemporaryDirectory() as caches:
        env = dict(os.environ, CODAGEN_TRITON_AUTOTUNE="0")
        if not args.warm_caches:
            env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(caches, "triton"))
        command = [sys.executable, __file__, "--worker", "patched" if patched else "unpatched", "--layers",
                   str(layers), "--steps", str(args.steps)]
        start = time.perf_counter()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"did not finish in {args.timeout} s"}
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            return {"error": (done.stderr or done.stdout)[-2000:]}
        return dict(json.loads(lines[-1]), process_s=time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="4,16,32", help="comma-separated depths (default 4,16,32)")
    parser.add_argument("--steps", type=int, default=5, help="steady steps timed after the first")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per (model, depth) process")
    parser.add_argument("--warm-caches", action="store_true", help="keep the Inductor/Triton on-disk caches")
    parser.add_argument("--worker", choices=("patched", "unpatched"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help="results folder (default: bench/results)")
    args = parser.parse_args()
    if args.worker:
        layers = int(args.layers)
        print(json.dumps(worker(args.worker == "patched", layers, args.steps)), flush=True)
        return 0
    records = []
    for layers in (int(n) for n in args.layers.split(",")):
        pair = {}
        for patched in (False, True):
            provider = "codagen" if patched else "unpatched"
            rec = pair[provider] = run_one(patched, layers, args)
            records.append(dict(suite="compile-depth", name=f"d2048-x{layers}", provider=provider,
                                shape=dict(layers=layers, tokens=TOKENS[0] * TOKENS[1], hidden=2048, ffn=8192,
                                           heads=32, kv_heads=8, vocab=32768),
                                dtype="bfloat16", warm_caches=args.warm_caches, **rec))
            summary = rec.get("error") or (
                f"first step {rec['first_step_s']:.1f} s, steady {rec['steady_step_ms']:.1f} ms, graph breaks "
                f"{sum(rec['graph_breaks'].values())}, recompiles after step 1: {rec['recompiles_after_first_step']}")
            print(f"{layers:3d} layers {provider:9s}: {summary}", flush=True)
            write_results("compile-depth", records, args.out)
        if all("first_step_s" in r for r in pair.values()):
            ratio = pair["codagen"]["first_step_s"] / pair["unpatched"]["first_step_s"]
            records[-1]["first_step_vs_unpatched"] = ratio
            print(f"{layers:3d} layers: patched first step {ratio:.2f}x unpatched (wanted <= 1.5x)", flush=True)
    path = write_results("compile-depth", records, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
