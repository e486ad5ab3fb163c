"""The decode attention inside ``generate()``'s replayed loop against ``GreedyDecoder``'s (GPU).

Usage (from the repository root, on a CUDA machine):
    PYTHONPATH=. python bench/generate_loop_attention.py [--batches 64 8] [--layers 16]

At LLaMA-3 1B dims (random bf16 weights, ``--layers`` layers, a 2048-token prompt, greedy, no EOS token) it prints,
per batch:

- ms per new token (``(t(65) - t(1)) / 63``, medians of three runs after one) and the mean duration of the decode
  SDPA kernel (cuDNN's ``sm80_flash_fprop``, from ``torch.profiler`` over 16 tokens) for ``GreedyDecoder`` and for
  ``model.generate()`` (``codagen.models.generate_loop``);
- the same for ``generate()`` whose loop captures its graph after ``torch.cuda.synchronize()``, after that and
  ``torch.cuda.empty_cache()``, and after those and ``gc.collect()`` (what ``torch.cuda.graph`` does before a
  capture; ``GreedyDecoder`` captures under ``torch.cuda.graph``, the loop with ``capture_begin`` directly);
- the SDPA call alone at the decode step's shapes (``triton.testing.do_bench``, L2 flushed between runs), with the
  cache's unwritten slots zero or holding earlier keys, and the mask a view of a 2-D bias or a 4-D tensor.

``docs/notes/generate-loop-attention.md`` holds a run's numbers.
"""
from __future__ import annotations

import argparse
import gc
import statistics

import torch
import torch.nn.functional as F
import triton.testing
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaForCausalLM

import codagen
from codagen.bench.generate import MODELS
from codagen.models import decode_graphs, generate_loop
from codagen.models.decode import GreedyDecoder

PROMPT = 2048


def step_ms(run) -> float:
    """ms per new token: ``run(T)`` makes T tokens; CUDA events around each run, medians of three after one."""
    def median_ms(tokens: int) -> float:
        run(tokens)
        times = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(tokens)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    return (median_ms(64) - median_ms(1)) / 63


def decode_attention_us(run) -> float:
    """Mean duration of the decode SDPA kernel over a 16-token run (after one unprofiled run)."""
    run(16)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(16)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if "sm80_flash_fprop" in e.key]
    return sum(e.device_time_total for e in events) / max(1, sum(e.count for e in events))


def captured_after(prepare):
    """``decode_graphs.capture`` (the loop's capture) that runs ``prepare()`` first."""
    capture = decode_graphs.capture

    def capture_after_prepare(stream, fn):
        prepare()
        return capture(stream, fn)
    return capture_after_prepare


def standalone(batch: int, layers_shape) -> list[tuple[str, float]]:
    heads, kv_heads, head_dim = layers_shape.heads, layers_shape.kv_heads, layers_shape.head_dim
    slots, written = PROMPT + 32, PROMPT + 12
    q = torch.randn(batch, heads, 1, head_dim, device="cuda", dtype=torch.bfloat16)
    zero_tail = [torch.zeros(batch, kv_heads, slots, head_dim, device="cuda", dtype=torch.bfloat16) for _ in "kv"]
    for t in zero_tail:
        t[:, :, :written].normal_()
    stale_tail = [torch.randn_like(t) for t in zero_tail]
    for stale, t in zip(stale_tail, zero_tail):
        stale[:, :, :written] = t[:, :, :written]
    bias = torch.full((batch, slots), float("-inf"), device="cuda", dtype=torch.bfloat16)
    bias[:, :written + 1] = 0
    mask_4d = bias[:, None, None, :].contiguous()
    rows = []
    for name, (k, v), mask in (("zero tail, 2-D bias view", zero_tail, bias[:, None, None, :]),
                               ("zero tail, 4-D mask", zero_tail, mask_4d),
                               ("stale tail, 2-D bias view", stale_tail, bias[:, None, None, :]),
                               ("stale tail, 4-D mask", stale_tail, mask_4d)):
        us = 1e3 * triton.testing.do_bench(
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),  # noqa: B023
            warmup=20, rep=200, return_mode="median")
        rows.append((f"SDPA alone, {name}", us))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 8])
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    shape = MODELS["llama3-1b"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(shape.config(args.layers)).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    codagen.patch(model)
    capture = decode_graphs.capture
    with torch.no_grad():
        for batch in args.batches:
            ids = torch.randint(0, shape.vocab, (batch, PROMPT), device="cuda")
            decoder = GreedyDecoder(model, max_cache_len=PROMPT + 64)

            def greedy(tokens):
                return decoder(ids, max_new_tokens=tokens)

            def generate(tokens):
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                      do_sample=False, pad_token_id=0)

            def synchronize_and_empty():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()

            def as_torch_cuda_graph():
                torch.cuda.synchronize()
                gc.collect()
                torch.cuda.empty_cache()
            variants = [("GreedyDecoder", None, greedy), ("generate()", capture, generate),
                        ("generate(), capture after synchronize", captured_after(torch.cuda.synchronize), generate),
                        ("generate(), ... and empty_cache", captured_after(synchronize_and_empty), generate),
                        ("generate(), ... and gc.collect", captured_after(as_torch_cuda_graph), generate)]
            for name, loop_capture, run in variants:
                if loop_capture is not None:
                    decode_graphs.capture = loop_capture
                    generate_loop.drop(model)
                print(f"b{batch:<3d} {name:42s} {step_ms(run):.3f} ms/token, decode SDPA "
                      f"{decode_attention_us(run):.1f} us", flush=True)
            decode_graphs.capture = capture
            for name, us in standalone(batch, shape):
                print(f"b{batch:<3d} {name:42s} {us:.1f} us", flush=True)


if __name__ == "__main__":
    main()
