"""What do a patched forward's checks of the model cost on the host, with the module walk kept and re-walked? (CPU)

Before it computes, a patched forward checks the model's hooks, PEFT modules and structure
(``codagen.models.hf._check_before_forward``).
The walk of ``named_modules()`` those checks read is kept while nothing is registered anywhere
(``codagen.models.module_changes``); after a registration the forward walks again. This times the checks alone,
both ways, alternating the two in rounds (the machine's noise lands on both), on a tiny Llama of ``--layers``
decoder layers (the cost grows with the module count, not the width).

Usage (CPU; from the repository root):
    PYTHONPATH=. python bench/forward_checks.py [--layers 16] [--calls 300] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import codagen
from codagen.models import hf


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    model = codagen.patch(transformers.LlamaForCausalLM(config))
    kept = lambda: hf._check_before_forward(model)  # noqa: E731

    def walked():  # the kept walk dropped: the checks walk the modules again
        hf._WALKS.pop(model)
        hf._check_before_forward(model)
    kept(), walked()
    times = {"kept": [], "walked": []}
    for _ in range(args.rounds):
        times["kept"].append(per_call_us(kept, args.calls))
        times["walked"].append(per_call_us(walked, args.calls))
    modules = sum(1 for _ in model.modules())
    print(f"{args.layers} layers, {modules} modules, torch {torch.__version__}; median of {args.rounds} rounds")
    for name, values in times.items():
        print(f"checks per forward, walk {name:6s} {statistics.median(values):8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
