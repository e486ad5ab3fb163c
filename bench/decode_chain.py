"""Two decode GEMMs in one launch against two: what the boundary between a layer's GEMMs costs (GPU, bf16).

Question: at batch 1 each decode GEMM takes a few microseconds longer than its weight's bytes at the copy rate,
whatever its size (``docs/notes/decode-finishing-in-launch.md``). Does one persistent launch that streams the
weights of two GEMMs back to back, waiting only for the activations it needs, win that back?

The pair is the MLP of a decode step, ``act = swiglu(x @ gate_up^T)`` then ``y = act @ down^T`` (gate/up rows
interleaved ``g0, u0, ...``; no norm or residual: the epilogues are not the question). One ``@triton.jit``
kernel, written for this measurement only (it is not a codagen program), does either GEMM or both, with the
decode GEMMs' first-guess tiles: 16 x 64 x 256, 4 stages, the persistent grid, the down-projection's K cut in
the most ranges that keep one program per SM, its fp32 partials summed outside the timed region. Variants:

- ``two_launches``: the gate/up launch, then the down-projection's, in stream order;
- ``two_launches_pdl``: the down-projection's launched as a programmatic dependent, which prefetches its first
  256 columns into L2 before ``gdc_wait``, as codagen's decode GEMMs do (``dependent_launch``);
- ``one_launch``: both in one launch. Each program does its gate/up tiles, then its down-projection work: K
  range ``r`` of a column tile prefetches its first 256 columns into L2 and waits on the arrival counter of range
  ``r`` (the gate/up tiles that write those ``act`` columns), not on the whole gate/up GEMM;
- ``one_launch_barrier``: the same, every down-projection range waiting for the whole gate/up GEMM;
- ``one_launch_backoff``: ``one_launch`` with a 500 ns sleep between two polls of a counter;
- ``one_launch_unordered``: ``one_launch`` without the counters, so its down-projection reads ``act`` before it
  is written (its result is wrong, its error is not checked): the two weight streams alone, one after the other;
- ``one_launch_unflattened``: ``one_launch`` with its two persistent loops not flattened (``tl.range``'s
  ``flatten``, on in every other variant as in codagen's kernels);
- ``cublas``: ``F.linear`` twice (``x @ gate_up^T``, then a stand-in ``act @ down^T``), no SwiGLU: the yardstick.

Each variant is captured in a CUDA graph of ``--chains`` pairs over distinct weight copies (their bytes exceed
L2), replayed; microseconds per pair (median of ``--rounds`` replays, the variants alternating per round) and
the pair's weight bytes over that time. ``max_abs_error``: ``y`` against ``F.linear`` of the eager SwiGLU in fp32.

    PYTHONPATH=. python bench/decode_chain.py --models llama3-8b llama3-1b --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from codagen.backends.triton.backend import set_scratch_allocator
from codagen.backends.triton.persistent.runtime import prefetch_weight_rows
from codagen.bench.common import environment
from codagen.bench.generate import MODELS, copy_bandwidth_gbps

BLOCK_N, BLOCK_K, STAGES, WARPS, PREFETCH_K = 64, 256, 4, 4, 256
VARIANTS = ("two_launches", "two_launches_pdl", "one_launch", "one_launch_barrier", "one_launch_backoff",
            "one_launch_unordered", "one_launch_unflattened", "cublas")


@triton.jit
def _mlp_chain_kernel(x_ptr, gate_up_ptr, down_ptr, act_ptr, partial_ptr, ready_ptr, D, F,
                      GATE_UP: tl.constexpr, DOWN: tl.constexpr, WAIT: tl.constexpr, BARRIER: tl.constexpr,
                      BACKOFF: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PREFETCH_K: tl.constexpr, FLATTEN: tl.constexpr):
    """x [D], gate_up [2F, D], down [D, F], act [F], partial [SPLIT, D] (fp32), ready [SPLIT] (int32, zeroed)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    rows = tl.arange(0, 16)
    first_row = (rows == 0)[:, None]
    range_cols = F // SPLIT
    gate_up_tiles = 2 * F // BLOCK_N
    # TMA boxes, as the decode GEMMs' mainloop: rows past the one real row of x and act are zero-filled
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[1, D], strides=[D, 1], block_shape=[16, BLOCK_K])
    act_desc = tl.make_tensor_descriptor(act_ptr, shape=[1, F], strides=[F, 1], block_shape=[16, BLOCK_K])
    gate_up_desc = tl.make_tensor_descriptor(gate_up_ptr, shape=[2 * F, D], strides=[D, 1],
                                             block_shape=[BLOCK_N, BLOCK_K])
    down_desc = tl.make_tensor_descriptor(down_ptr, shape=[D, F], strides=[F, 1], block_shape=[BLOCK_N, BLOCK_K])
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if GATE_UP:
        for tile in tl.range(pid, gate_up_tiles, programs, flatten=FLATTEN):
            acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):
                acc = tl.dot(x_desc.load([0, k0]), gate_up_desc.load([tile * BLOCK_N, k0]).T, acc)
            gate, up = tl.split(tl.reshape(acc, (16, BLOCK_N // 2, 2)))
            act = gate * tl.sigmoid(gate) * up
            cols = tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(act_ptr + rows[:, None] * 0 + cols[None, :], act.to(act_ptr.dtype.element_ty), mask=first_row)
            if WAIT:  # publish the tile: every thread's store issued, then one release arrival
                tl.debug_barrier()
                counter = 0 if BARRIER else tile * (BLOCK_N // 2) // range_cols
                tl.atomic_add(ready_ptr + counter, 1, sem="release", scope="gpu")
    if DOWN:
        units = D // BLOCK_N * SPLIT
        target = gate_up_tiles if BARRIER else range_cols // (BLOCK_N // 2)
        for unit in tl.range(pid, units, programs, flatten=FLATTEN):
            n_tile, r = unit // SPLIT, unit % SPLIT
            if PREFETCH_K > 0:  # the weight depends on nothing
                prefetch_weight_rows(down_ptr, n_tile * BLOCK_N, r * range_cols, D, F, BLOCK_N, PREFETCH_K)
            if PDL:
                tl.extra.cuda.gdc_wait()
            if WAIT:
                counter = ready_ptr + (0 if BARRIER else r)
                seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
                while seen < target:
                    if BACKOFF:  # fewer polls of the counter's L2 line while the producers arrive at it
                        tl.inline_asm_elementwise("nanosleep.u32 500; mov.u32 $0, $1;", "=r,r", [seen],
                                                  dtype=tl.int32, is_pure=False, pack=1)
                    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
                # act was stored through the generic proxy, and the TMA loads below read through the async one
                tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, $1;", "=r,r", [seen],
                                          dtype=tl.int32, is_pure=False, pack=1)
            acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
            for k0 in range(r * range_cols, (r + 1) * range_cols, BLOCK_K):
                acc = tl.dot(act_desc.load([0, k0]), down_desc.load([n_tile * BLOCK_N, k0]).T, acc)
            n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(partial_ptr + r * D + n, tl.sum(tl.where(first_row, acc, 0.0), axis=0))


def _split(d: int, num_sms: int) -> int:
    """The most K ranges (1, 2 or 4) that keep the down-projection at one unit per program."""
    return max(s for s in (1, 2, 4) if s * (d // BLOCK_N) <= num_sms)


def variant_fn(name: str, x, gate_up, down, act, partial, ready, num_sms: int):
    """A zero-argument run of one pair of the variant (``ready`` zeroed by the caller for the counting ones)."""
    d, ffn = down.shape
    split = partial.shape[0]
    units = d // BLOCK_N * split
    common = dict(SPLIT=split, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, FLATTEN=name != "one_launch_unflattened",
                  num_stages=STAGES, num_warps=WARPS)
    args = (x, gate_up, down, act, partial, ready, d, ffn)
    if name == "cublas":
        def run():
            F.linear(x.view(1, -1), gate_up)
            F.linear(act.view(1, -1), down)
        return run
    if name.startswith("two_launches"):
        pdl = name.endswith("pdl")

        def run():
            _mlp_chain_kernel[(num_sms,)](*args, GATE_UP=True, DOWN=False, WAIT=False, BARRIER=False, BACKOFF=False,
                                         PDL=pdl, PREFETCH_K=0, **common)
            _mlp_chain_kernel[(min(units, num_sms),)](*args, GATE_UP=False, DOWN=True, WAIT=False, BARRIER=False,
                                                      BACKOFF=False, PDL=pdl, PREFETCH_K=PREFETCH_K if pdl else 0,
                                                      **common, **({"launch_pdl": True} if pdl else {}))
        return run
    return lambda: _mlp_chain_kernel[(num_sms,)](*args, GATE_UP=True, DOWN=True, WAIT=name != "one_launch_unordered",
                                                 BARRIER=name == "one_launch_barrier",
                                                 BACKOFF=name == "one_launch_backoff", PDL=False,
                                                 PREFETCH_K=PREFETCH_K, **common)


def bench_model(name: str, chains: int, rounds: int, replays: int, num_sms: int) -> list[dict]:
    shape = MODELS[name]
    d, ffn = shape.hidden, shape.ffn
    split = _split(d, num_sms)
    torch.manual_seed(0)
    weights = [(torch.randn(2 * ffn, d, device="cuda", dtype=torch.bfloat16) * d ** -0.5,
                torch.randn(d, ffn, device="cuda", dtype=torch.bfloat16) * ffn ** -0.5) for _ in range(chains)]
    x = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    act = torch.full((ffn,), float("nan"), device="cuda", dtype=torch.bfloat16)
    partial = torch.full((split, d), float("nan"), device="cuda", dtype=torch.float32)
    ready = torch.zeros(chains, split, device="cuda", dtype=torch.int32)
    gate, up = (F.linear(x.float()[None], weights[0][0].float()).view(-1, 2)).unbind(-1)
    want = F.linear((F.silu(gate) * up)[None], weights[0][1].float())[0]

    graphs, errors = {}, {}
    for variant in VARIANTS:
        fns = [variant_fn(variant, x, gate_up, down, act, partial, ready[i], num_sms)
               for i, (gate_up, down) in enumerate(weights)]
        ready.zero_()
        partial.fill_(float("nan"))
        fns[0]()
        torch.cuda.synchronize()
        errors[variant] = (None if variant in ("cublas", "one_launch_unordered")
                           else (partial.sum(0) - want).abs().max().item())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles, plans; then capture
            ready.zero_()
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ready.zero_()  # one memset for every pair of the replay
            for fn in fns:
                fn()
        graphs[variant] = graph
    times = {variant: [] for variant in VARIANTS}
    for round_ in range(rounds):
        for variant in (VARIANTS if round_ % 2 == 0 else tuple(reversed(VARIANTS))):
            graphs[variant].replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graphs[variant].replay()
            end.record()
            torch.cuda.synchronize()
            times[variant].append(1e3 * start.elapsed_time(end) / (replays * chains))
    weight_bytes = 2 * (2 * ffn * d + d * ffn)
    records = []
    for variant in VARIANTS:
        us = statistics.median(times[variant])
        records.append(dict(model=name, d=d, ffn=ffn, split=split, variant=variant, us=us, round_us=times[variant],
                            weight_bytes=weight_bytes, weight_gbps=weight_bytes / us / 1e3,
                            max_abs_error=errors[variant]))
        error = "" if errors[variant] is None else f"  error {errors[variant]:.1e}"
        print(f"  {name:<10} {variant:<19} {us:7.1f} us  {weight_bytes / us / 1e3:6.0f} GB/s{error}", flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--chains", type=int, default=4, help="pairs per graph, each over its own weight copy")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_chain: needs a CUDA GPU", file=sys.stderr)
        return 1
    set_scratch_allocator()  # the TMA descriptors' scratch
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    records = [r for name in args.models for r in bench_model(name, args.chains, args.rounds, args.replays, num_sms)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "copy_gbps": copy_bandwidth_gbps(torch.device("cuda")),
                       "block": f"16x{BLOCK_N}x{BLOCK_K} s{STAGES} w{WARPS}", "prefetch_k": PREFETCH_K,
                       "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
