"""A decode step with and without programmatic dependent launch, in one process (GPU, bf16).

For each model (``codagen bench generate``'s shapes and layer counts, random weights, patched) one
:class:`codagen.models.decode.GreedyDecoder` per variant, each capturing its decode step with the
variant's launch settings (:mod:`codagen.backends.triton.dependent_launch`):

- ``plain``: every kernel in stream order;
- ``pdl``: the decode GEMMs, their split-K passes and finishers launched as programmatic dependents;
- ``pdl+prefetch<K>``: as ``pdl``, each GEMM program prefetching K columns of its first tile's weight
  rows into L2 before it waits.

A step's time is a median over rounds of ``--replays`` back-to-back replays of the captured step (CUDA
events around them), the variants alternating per round (the GPU's clock moves between rounds:
``docs/notes/power-cap-and-clocks.md``). ``of_limit``: the bandwidth limit of the step (every weight and
the KV cache read once at the measured copy rate) over its time. ``tokens_equal_plain``: whether a
variant's greedy tokens are bitwise the plain variant's.

    PYTHONPATH=. python bench/decode_dependent_launch.py --models llama3-8b llama3-1b --json out.json
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

import torch

import codagen
from codagen.backends import get_backend
from codagen.backends.triton import dependent_launch
from codagen.bench.common import environment
from codagen.bench.generate import MODELS, copy_bandwidth_gbps
from codagen.models.decode import GreedyDecoder

VARIANT = re.compile(r"(?P<plain>plain)|pdl(\+prefetch(?P<prefetch_k>\d+))?")


def settings(name: str) -> dict:
    """Variant ``name``'s launch settings: ``plain``, or ``pdl[+prefetch<K>]``."""
    match = VARIANT.fullmatch(name)
    if match is None:
        raise argparse.ArgumentTypeError(f"variant: expected plain or pdl[+prefetch<K>], got {name!r}")
    prefetch_k = int(match["prefetch_k"] or 0)
    if prefetch_k & (prefetch_k - 1) or 0 < prefetch_k < 64:
        raise argparse.ArgumentTypeError(f"variant {name!r}: the prefetched columns must be a power of two >= 64")
    return {"rows": 0 if match["plain"] else dependent_launch.SMALL_M_ROWS, "prefetch_k": prefetch_k}


def variant(name: str) -> str:
    """``--variants``' type: ``name``, refused unless :func:`settings` reads it."""
    settings(name)
    return name


def set_variant(name: str) -> None:
    """The launch settings of variant ``name``; the backend plans its calls again under them."""
    chosen = settings(name)
    dependent_launch.DEPENDENT_LAUNCH_ROWS, dependent_launch.PREFETCH_K = chosen["rows"], chosen["prefetch_k"]
    get_backend("triton").clear_plans()


def replay_ms(decoder: GreedyDecoder, ids: torch.Tensor, replays: int) -> float:
    """Milliseconds per replay of ``decoder``'s captured step, ``replays`` of them back to back."""
    decoder(ids, max_new_tokens=2)  # prefill (resets the cache) + one replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        decoder.graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def bench_model(name: str, variants: list[str], batch: int, context: int, replays: int, rounds: int,
                bandwidth: float) -> list[dict]:
    from transformers import LlamaForCausalLM
    shape = MODELS[name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(shape.config(shape.layers)).to(torch.bfloat16).eval()
    codagen.patch(model)
    ids = torch.randint(0, shape.vocab, (batch, context), device="cuda")
    decoders, tokens = {}, {}
    with torch.no_grad():
        for variant in variants:
            set_variant(variant)
            decoders[variant] = GreedyDecoder(model, max_cache_len=context + replays + 32)
            tokens[variant] = decoders[variant](ids, max_new_tokens=16)  # eager step, capture, replays
        times = {variant: [] for variant in variants}
        for round_index in range(rounds):
            order = variants[round_index % len(variants):] + variants[:round_index % len(variants)]
            for variant in order:
                times[variant].append(replay_ms(decoders[variant], ids, replays))
    bytes_per_step = shape.weight_bytes(shape.layers) + shape.kv_bytes(shape.layers, batch, context + replays / 2)
    limit_ms = bytes_per_step / bandwidth / 1e6
    records = []
    for variant in variants:
        ms = statistics.median(times[variant])
        records.append({"model": name, "layers": shape.layers, "batch": batch, "context": context,
                        "variant": variant, **settings(variant),
                        "median_ms": ms, "rounds_ms": times[variant], "bytes_per_step": bytes_per_step,
                        "limit_ms": limit_ms, "of_limit": limit_ms / ms,
                        "tokens_equal_plain": bool(torch.equal(tokens[variant], tokens[variants[0]]))})
        print(f"  {name:<10} b{batch:<3} {variant:<18} {ms * 1e3:8.1f} us/step  {100 * limit_ms / ms:5.1f}% of limit  "
              f"tokens equal: {records[-1]['tokens_equal_plain']}", flush=True)
    del decoders, model
    torch.cuda.empty_cache()
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["llama3-8b", "llama3-1b"])
    parser.add_argument("--variants", nargs="+", type=variant, default=["plain", "pdl", "pdl+prefetch256"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    if "plain" in args.variants:  # the reference of tokens_equal_plain comes first
        args.variants = ["plain"] + [v for v in args.variants if v != "plain"]
    bandwidth = copy_bandwidth_gbps("cuda")
    records = [r for name in args.models for batch in args.batch
               for r in bench_model(name, args.variants, batch, args.context, args.replays, args.rounds, bandwidth)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "copy_gbps": bandwidth, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
