"""How much host time does a patched forward spend per fused op? (CPU, kernel launches stubbed)

Runs everything a decode step does on the host up to the kernel launch itself: argument checks, autograd
Functions, custom-op dispatch, ``bind``, the Triton backend's checks, plan lookup and output allocation,
the row kernels' launchers, the patched forward's per-layer Python and the fused-weight cache lookup.
The launches are no-ops (``JITFunction.run``), and the Triton backend takes CPU tensors for CUDA ones of
an sm_90 GPU (the compiled path, not the interpreter), so the GPU's host path runs on this machine.
The unpatched ``transformers`` model runs the same decode loop for real (its tiny GEMMs cost little).

Usage (CPU; from the repository root):
    PYTHONPATH=. python bench/host_overhead.py [--steps 300] [--layers 4] [--hidden 256] [--profile 25]
        [--out bench/results/host-overhead.json]

Prints, and writes to ``--out``: microseconds per decode-step forward (patched, unpatched), per layer,
per fused op call (each public op alone at the decode shape) and the launches per step.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import json
import platform
import pstats
import time
import types
from unittest import mock

import torch
import transformers
import triton
from triton.runtime.jit import JITFunction

import codagen
from codagen import ops
from codagen.backends import get_backend
from codagen.backends.triton.targets import TARGETS
from codagen.ops.kernels import _launch


@contextlib.contextmanager
def stubbed_gpu_launches():
    """CPU tensors take the Triton backend's compiled (sm_90) host path; every Triton launch is a no-op."""
    props = types.SimpleNamespace(multi_processor_count=132, shared_memory_per_block_optin=232448,
                                  name="NVIDIA H200")
    launches = {"n": 0}

    def no_launch(self, *args, grid, warmup, **kwargs):
        launches["n"] += 1

    def use_triton(t):  # the row kernels' dispatch, with the CUDA test left out
        return t.dtype != torch.float64 and codagen.backends.resolve_backend_name(torch.device("cuda")) == "triton"

    backend = get_backend("triton")

    def check(bound):  # TritonBackend._check for an sm_90 GPU
        backend_check(bound)  # the dtype checks
        return False, TARGETS["sm_90"]

    backend_check = type(backend)._check.__get__(backend)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(JITFunction, "run", no_launch))
        stack.enter_context(mock.patch.object(_launch, "use_triton", use_triton))
        stack.enter_context(mock.patch.object(backend, "_check", check))
        stack.enter_context(mock.patch("torch.cuda.get_device_capability", lambda *_: (9, 0)))
        stack.enter_context(mock.patch("torch.cuda.get_device_properties", lambda *_: props))
        stack.enter_context(mock.patch("torch.cuda.get_device_name", lambda *_: props.name))
        stack.enter_context(mock.patch("torch.cuda.current_device", lambda: 0))
        stack.enter_context(codagen.use_backend("triton"))
        yield launches


def tiny_llama(layers: int, hidden: int) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=4096, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def decode_us(model, steps: int, prompt: int = 16, repeats: int = 5) -> float:
    """The least over ``repeats`` of the mean process CPU microseconds per decode-step forward (batch 1,
    DynamicCache): CPU time and the least run, so that other work on the machine counts little."""
    ids = torch.randint(0, model.config.vocab_size, (1, prompt))
    token = ids[:, -1:]
    results = []
    with torch.no_grad():
        for _ in range(repeats):
            cache = transformers.DynamicCache(config=model.config)
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            start = time.process_time()
            for _ in range(steps):
                model(input_ids=token, past_key_values=cache, use_cache=True)
            results.append((time.process_time() - start) / steps * 1e6)
    return min(results)


def op_calls(hidden: int):
    """Each public op a decode layer calls, at the decode shape (one token), as a zero-argument call."""
    heads, kv, hd, ffn = 4, 2, hidden // 4, 2 * hidden
    x = torch.randn(1, hidden)
    normed, rstd = torch.randn(1, hidden), torch.rand(1) + 0.5
    w = torch.ones(hidden)
    qkv_w = torch.randn((heads + 2 * kv) * hd, hidden)
    freqs = ops.rope_frequencies(heads, kv, hd)
    pos = torch.zeros(1, dtype=torch.int64)
    attn = torch.randn(1, heads * hd)
    o_w, gu_w, down_w = torch.randn(hidden, heads * hd), torch.randn(2 * ffn, hidden), torch.randn(hidden, ffn)
    split = (heads * hd, kv * hd, kv * hd)
    return {
        "rms_norm_stats": lambda: ops.rms_norm_stats(x, w, 1e-5),
        "rms_qkv_rope": lambda: ops.rms_qkv_rope(x, normed, rstd, w, qkv_w, pos, freqs, split_sizes=split,
                                                 pass_residual=True),
        "out_proj_residual_rms": lambda: ops.out_proj_residual_rms(attn, o_w, x, w, 1e-5),
        "swiglu_mlp_residual_rms": lambda: ops.swiglu_mlp_residual_rms(x, normed, rstd, w, gu_w, down_w, w, 1e-5),
    }


def per_call_us(fn, calls: int = 1000, repeats: int = 5) -> float:
    """The least over ``repeats`` of the mean process CPU microseconds per call of ``fn``."""
    results = []
    with torch.no_grad():
        for _ in range(20):
            fn()
        for _ in range(repeats):
            start = time.process_time()
            for _ in range(calls):
                fn()
            results.append((time.process_time() - start) / calls * 1e6)
    return min(results)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print the N top functions (cumulative time) of the patched decode steps")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)

    unpatched = tiny_llama(args.layers, args.hidden)
    patched = codagen.patch(copy.deepcopy(unpatched))
    result = {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
              "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
              "layers": args.layers, "hidden": args.hidden, "steps": args.steps, "batch": 1}
    result["unpatched_step_us"] = decode_us(unpatched, args.steps)
    with stubbed_gpu_launches() as launches:
        decode_us(patched, 5, repeats=1)  # plans made
        before = launches["n"]
        decode_us(patched, 10, repeats=1)
        result["launches_per_step"] = (launches["n"] - before) / 10
        result["patched_step_us"] = decode_us(patched, args.steps)
        result["op_call_us"] = {name: per_call_us(fn) for name, fn in op_calls(args.hidden).items()}
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            decode_us(patched, args.steps, repeats=1)
            profiler.disable()
    result["patched_layer_us"] = result["patched_step_us"] / args.layers
    result["unpatched_layer_us"] = result["unpatched_step_us"] / args.layers
    for key, value in result.items():
        print(f"{key:26s} {json.dumps(value) if isinstance(value, dict) else value}")
    if args.profile:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
