"""Decode attention over a static KV cache: PyTorch's ways to run it, timed as a decode step runs them (GPU, bf16).

One query token per row attends to a ``[batch, kv_heads, max_cache_len, head_dim]`` cache under an additive
mask (slots past the current length are ``-inf``: a static cache's shape does not follow the length). Ways:

- ``sdpa``: ``F.scaled_dot_product_attention(q, k, v, attn_mask, enable_gqa=True)`` with PyTorch's choice of
  backend (cuDNN on an H200 with torch 2.11);
- ``sdpa_efficient``: the same, restricted to the memory-efficient backend;
- ``sdpa_grouped``: the query heads of each KV head as rows of one query block (``[batch, kv_heads, group,
  head_dim]``, no ``enable_gqa``), PyTorch's choice of backend;
- ``matmul``: scores by ``q @ k^T`` (a batched GEMV over the cache), mask, softmax, ``@ v``;
- ``flash_lengths``: no mask: PyTorch's flash-attention kernel (``aten._flash_attention_forward``) on the
  cache's token-major view with ``seqused_k`` (the valid slots per row, a device tensor), query heads grouped
  over their KV head by the kernel (torch 2.11 reads ``seqused_k`` only in the packed form: the result differs);
- ``flash_varlen``: the same kernel's packed form with ``seqused_k`` (batch 1: the cache's one row is its
  packed keys);
- ``flex``: ``torch.compile(flex_attention)`` with ``enable_gqa=True`` and a block mask of the slots before
  each row's length (a device tensor read by its ``mask_mod``), built once outside the timed calls:
  Inductor's flex-decoding kernel (the cache split over programs) and its two reductions.
- ``split<S>`` (S = 4, 8, 16): flash decoding out of PyTorch's ops. The cache
  cut into S chunks of slots, each chunk a head of its own: ``[batch, kv_heads, slots, head_dim]`` viewed as
  ``[batch, kv_heads * S, slots / S, head_dim]`` (no copy); each KV head's query heads as the query rows of
  each of its chunks; cuDNN's attention op (``aten._scaled_dot_product_cudnn_attention``) returning every
  chunk's output and logsumexp; then ``torch.compile``'s one kernel of the combine
  ``out = sum_s softmax_s(lse_s) out_s``. The repeated queries and the chunked mask are built outside the timed
  calls: a decode step builds its mask once for every layer, and the cache write, which permutes the queries
  already, could write them repeated.

Each is captured in a CUDA graph of ``--calls`` calls over distinct caches (their bytes exceed L2), replayed;
microseconds per call, with the cache's bytes over that time as a bandwidth.

    PYTHONPATH=. python bench/decode_attention.py --json out.json
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from codagen.bench.common import environment

SHAPES = {"llama3-8b": (32, 8, 128), "llama3-1b": (32, 8, 64)}  # heads, kv heads, head dim


@functools.cache
def _flex_attention():
    """``torch.compile(flex_attention)``, compiled once for every way and shape."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


SPLITS = (4, 8, 16)


@functools.cache
def _combine():
    """``out [batch, heads, 1, head_dim]`` of the chunks' ``out_s [batch, kv_heads, S, group, head_dim]`` and
    ``lse_s [batch, kv_heads, S, group]``: ``sum_s softmax_s(lse) out_s``, compiled to one kernel. A chunk past
    the length (every slot masked) has ``lse = -inf``: its weight is 0 and its output, which may be NaN, is
    not read."""
    def combine(out, lse):
        batch, kv_heads, _, group, head_dim = out.shape
        weight = torch.softmax(lse.float(), dim=2)[..., None]
        mixed = torch.where(weight > 0, weight * out.float(), 0.0).sum(2)
        return mixed.to(out.dtype).view(batch, kv_heads * group, 1, head_dim)
    return torch.compile(combine, dynamic=False)


def split_inputs(q, k, v, mask, splits: int):
    """The chunked views of the cache, the repeated query rows and the chunked mask (the ``split<S>`` ways)."""
    batch, heads, _, head_dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    group, chunk = heads // kv_heads, slots // splits
    rows = q.view(batch, kv_heads, 1, group, head_dim).expand(batch, kv_heads, splits, group, head_dim)
    rows = rows.reshape(batch, kv_heads * splits, group, head_dim)
    chunk_mask = mask.view(batch, 1, splits, 1, chunk).expand(batch, kv_heads, splits, group, chunk)
    chunk_mask = chunk_mask.reshape(batch, kv_heads * splits, group, chunk)
    return (rows, k.view(batch, kv_heads * splits, chunk, head_dim), v.view(batch, kv_heads * splits, chunk, head_dim),
            chunk_mask)


def ways(q, k, v, mask, lengths):
    batch, heads, _, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def sdpa_efficient():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def sdpa_grouped():
        grouped = q.view(batch, kv_heads, group, head_dim)
        return F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask).view(batch, heads, 1, head_dim)

    def matmul():
        grouped = q.view(batch, kv_heads, group, head_dim)
        scores = torch.matmul(grouped, k.transpose(-1, -2)) * head_dim ** -0.5 + mask
        return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v).view(batch, heads, 1, head_dim)

    def flash_lengths():
        out = torch.ops.aten._flash_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, 1, k.shape[2], 0.0, False, False,
            seqused_k=lengths)[0]
        return out.transpose(1, 2)

    def flash_varlen():
        if batch != 1:
            raise ValueError("the packed form of a [batch, kv_heads, slots, head_dim] cache needs batch 1")
        cum_q = torch.arange(2, device=q.device, dtype=torch.int32)
        cum_k = cum_q * k.shape[2]
        out = torch.ops.aten._flash_attention_forward(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cum_q, cum_k, 1, k.shape[2], 0.0,
            False, False, seqused_k=lengths)[0]
        return out.transpose(0, 1)[None]

    def before_length(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    block_mask = []

    def flex():
        if not block_mask:
            from torch.nn.attention.flex_attention import create_block_mask
            block_mask.append(create_block_mask(before_length, batch, None, 1, k.shape[2], device=q.device))
        return _flex_attention()(q, k, v, block_mask=block_mask[0], enable_gqa=True)
    found = {"sdpa": sdpa, "sdpa_efficient": sdpa_efficient, "sdpa_grouped": sdpa_grouped, "matmul": matmul,
             "flash_lengths": flash_lengths, "flash_varlen": flash_varlen, "flex": flex}

    def split(splits):
        inputs = []

        def run():
            if not inputs:
                inputs.extend(split_inputs(q, k, v, mask, splits))
            out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(*inputs, True, 0.0, False, False)[:2]
            return _combine()(out.view(batch, kv_heads, splits, group, head_dim),
                              lse.reshape(batch, kv_heads, splits, group))
        return run
    for splits in SPLITS:
        found[f"split{splits}"] = split(splits)
    return found


def bench(model: str, batch: int, length: int, max_cache_len: int, calls: int, rounds: int,
          names: list[str] | None = None) -> list[dict]:
    heads, kv_heads, head_dim = SHAPES[model]
    caches = [(torch.randn(batch, kv_heads, max_cache_len, head_dim, device="cuda", dtype=torch.bfloat16),
               torch.randn(batch, kv_heads, max_cache_len, head_dim, device="cuda", dtype=torch.bfloat16))
              for _ in range(calls)]
    q = torch.randn(batch, heads, 1, head_dim, device="cuda", dtype=torch.bfloat16)
    mask = torch.zeros(batch, 1, 1, max_cache_len, device="cuda", dtype=torch.bfloat16)
    mask[..., length:] = float("-inf")
    lengths = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    reference = None
    records = []
    for name in names or ways(q, *caches[0], mask, lengths):
        fns = [ways(q, k, v, mask, lengths)[name] for k, v in caches]
        try:
            out = fns[0]()
            if reference is None:
                reference = out.float()
            error = (out.float() - reference).abs().max().item()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for fn in fns:
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for fn in fns:
                    fn()
            times = []
            for _ in range(rounds):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / calls)
            us = statistics.median(times)
            cache_bytes = 2 * batch * kv_heads * length * head_dim * 2
            records.append({"model": model, "batch": batch, "length": length, "max_cache_len": max_cache_len,
                            "way": name, "us": us, "gbps_of_cache": cache_bytes / us / 1e3,
                            "max_abs_diff_vs_sdpa": error})
            print(f"  {model:<10} b{batch:<3} {name:<15} {us:7.2f} us  {cache_bytes / us / 1e3:7.0f} GB/s  "
                  f"diff {error:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a way PyTorch refuses for this shape
            records.append({"model": model, "batch": batch, "way": name, "error": f"{type(e).__name__}: {e}"[:300]})
            print(f"  {model:<10} b{batch:<3} {name:<15} {type(e).__name__}: {str(e)[:100]}", flush=True)
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--length", type=int, default=2080)
    parser.add_argument("--max-cache-len", type=int, default=2112)
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--ways", nargs="+", help="these ways only (the first is the reference of the difference)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch._dynamo.config.recompile_limit = 64  # the compiled combine (split<S>) specializes on each shape
    records = [r for model in args.models for batch in args.batch
               for r in bench(model, batch, args.length, args.max_cache_len, args.calls, args.rounds,
                             args.ways)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
