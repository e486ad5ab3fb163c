"""Decode GEMMs (M = the batch of one decode step) against tile configurations, next to cuBLAS (GPU, bf16).

Records the fused programs one decode step of a patched ``LlamaForCausalLM`` binds (``--model`` dims of
``codagen bench generate``, one layer: every layer binds the same shapes; the LM head once), then times each
of them, kernel alone, over a grid of tile configurations: the decode pool ``SMALL_M``, and with
``--grid wide`` (the default) more 16-row tiles and K split in 2, 4 or 8 ranges where N <= 8192. Each runs
with the persistent grid (``min(tiles, SMs)`` programs) and, where there are more tiles than SMs, with one
program per tile (``oversubscribed``), beside the same GEMM through ``torch.nn.functional.linear`` (cuBLAS).
Each is timed as a decode step runs it: back to back from a CUDA graph, over copies of the weight that keep
it out of L2. Prints microseconds and the weight read rate (bytes of B / time) per key; ``--json`` writes
the records (docs/notes/decode-gemms.md). ``--tiles`` adds 16-row tiles to the pool (``--grid none``: only
them), each with its K split on every GEMM. Decode launches are programmatic dependents
(codagen.backends.triton.dependent_launch), so back-to-back launches of one GEMM overlap as in the step.

    PYTHONPATH=. python bench/decode_configs.py --model llama3-8b --batch 1 8 [--tiles 64x128s4] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

import torch

from codagen.backends.triton.configs import SMALL_M, KernelConfig, smem_estimate
from codagen.backends.triton.targets import TARGETS
from codagen.bench.common import environment
from codagen.bench.generate import MODELS

SPLIT = tuple(KernelConfig(16, block_n, block_k, stages, 4, epilogue_split=1, group_m=1, split_k=split_k)
              for block_n, block_k, stages in ((32, 256, 6), (64, 256, 4), (128, 128, 6)) for split_k in (2, 4, 8))
WIDE = tuple(KernelConfig(16, block_n, block_k, stages, 4, epilogue_split=1, group_m=1)
             for block_n, block_k, stages in ((16, 256, 8), (32, 128, 8), (32, 256, 6), (64, 128, 8), (64, 256, 4),
                                              (128, 64, 8), (128, 128, 6), (256, 64, 6)))


def tile(text: str) -> KernelConfig:
    """``"64x128s4"`` or ``"64x256s4k2"``: a 16-row decode tile of BLOCK_N x BLOCK_K, its stages and K split."""
    match = re.fullmatch(r"(\d+)x(\d+)s(\d+)(?:k(\d+))?", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected BLOCK_NxBLOCK_KsSTAGES[kSPLIT], e.g. 64x128s4, got {text!r}")
    block_n, block_k, stages, split_k = (int(g) if g else 1 for g in match.groups())
    return KernelConfig(16, block_n, block_k, stages, 4, epilogue_split=1, group_m=1, split_k=split_k)


def with_programs(planned, programs: int):
    """A launch's planned ``launch.metas`` entry with the persistent grid set to ``programs``."""
    return (programs,), planned[1]


def record_bounds(model, batch: int, context: int) -> list:
    """The distinct fused-program calls (BoundProgram) of one decode step at ``batch`` rows."""
    from transformers import StaticCache

    from codagen.backends.triton import TritonBackend
    from codagen.models.hf_cache import cache_field
    seen, bounds = set(), []
    original = TritonBackend.run

    def recording(self, bound):
        key = (bound.program.name, bound.m, bound.n, bound.k)
        if bound.m == batch and key not in seen:
            seen.add(key)
            bounds.append(bound)
        return original(self, bound)
    cache = StaticCache(config=model.config, max_cache_len=context + 4)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=model.device)
    TritonBackend.run = recording
    try:
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1, **{cache_field(): cache})
            model(ids[:, :1], use_cache=True, logits_to_keep=1, **{cache_field(): cache})
    finally:
        TritonBackend.run = original
    return bounds


def graph_us(calls, rounds: int = 4, replays: int = 5) -> float:
    """Microseconds per call of ``calls`` (one per weight copy) replayed back to back from one CUDA graph, as
    a decode step replays them: launch gaps as in the step, and the copies keep the weights out of L2."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles, plans
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for call in calls:
                call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (replays * rounds * len(calls))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--grid", choices=["small_m", "wide", "none"], default="wide",
                        help="the pool: SMALL_M, SMALL_M + WIDE + SPLIT, or only --tiles")
    parser.add_argument("--tiles", nargs="+", type=tile, default=[],
                        help="more 16-row tiles, BLOCK_N x BLOCK_K with stages and split K: 64x128s4, 64x256s4k2")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from transformers import LlamaForCausalLM

    import codagen
    from codagen.backends import get_backend
    from codagen.backends.triton import backend as triton_backend
    shape = MODELS[args.model]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(shape.config(1)).to(torch.bfloat16).eval()
    codagen.patch(model)
    backend = get_backend("triton")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    smem_limit = triton_backend._smem_limit(torch.device("cuda"))
    pool = {"small_m": list(SMALL_M), "wide": list(SMALL_M) + list(WIDE) + list(SPLIT), "none": []}[args.grid]
    pool += [cfg for cfg in args.tiles if cfg not in pool]
    records = []
    for batch in args.batch:
        for bound in record_bounds(model, batch, args.context):
            name = bound.program.name
            weight_bytes = bound.b.numel() * bound.b.element_size()
            copies = [dataclasses.replace(bound, b=bound.b.clone())
                      for _ in range(max(2, min(8, -(-(256 << 20) // weight_bytes))))]
            cublas = graph_us([lambda b=c.b: torch.nn.functional.linear(bound.a, b) for c in copies])
            print(f"\n== {name} M={bound.m} N={bound.n} K={bound.k}: cuBLAS {cublas:.1f} us "
                  f"({weight_bytes / cublas / 1e6:.2f} TB/s)", flush=True)
            launch = backend._prepare(bound, False, TARGETS["sm_90"])
            fitting = [cfg for cfg in pool if smem_estimate(bound.program, cfg, 2) <= smem_limit
                       and (cfg.split_k == 1 or bound.n <= 8192 or cfg in args.tiles)]
            backend._compile_ahead(bound, launch, fitting)
            row = {"program": name, "m": bound.m, "n": bound.n, "k": bound.k, "weight_bytes": weight_bytes,
                   "cublas_us": cublas, "configs": {}}
            for cfg in fitting:
                tiles = -(-bound.m // cfg.block_m) * -(-bound.n // cfg.block_n) * cfg.split_k
                times = {}
                for variant, programs in (("persistent", min(tiles, num_sms)), ("oversubscribed", tiles)):
                    if variant == "oversubscribed" and programs <= num_sms:
                        continue
                    planned = (backend._split_k_meta if cfg.split_k > 1 else backend._meta)(bound, launch, cfg)
                    launch.metas[cfg] = with_programs(planned, programs)
                    try:
                        times[variant] = graph_us([backend._trial(c, launch, cfg) for c in copies])
                    except Exception as error:  # noqa: BLE001 - a report
                        times[variant] = float("nan")
                        print(f"  {cfg.short()} {variant}: {type(error).__name__}: {str(error)[:100]}")
                    launch.metas[cfg] = planned
                row["configs"][cfg.short()] = dict(times, tiles=tiles)
                print(f"  {cfg.short():<28} tiles {tiles:5d}  " + "  ".join(
                    f"{v} {t:7.1f} us ({weight_bytes / t / 1e6:.2f} TB/s)" for v, t in times.items()), flush=True)
            records.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "model": args.model, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
