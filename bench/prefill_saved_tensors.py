"""Prefill with and without the tensor a backward would need, in one process (GPU, bf16).

A patched model's forward under ``torch.no_grad`` runs the inference programs: its gate/up GEMM stores ``act``
[tokens, ffn] alone, where the training program also stores ``preact = z`` [tokens, 2 * ffn] for the SwiGLU
backward. Variants, both under ``no_grad`` (so both reuse the fused weights the model keeps for inference):

- ``inference``: the shipped forward;
- ``preact_stored``: the same forward with its gate/up GEMM running the training program
  (``codagen.epilogue.library.rms_gate_up_swiglu()``), ``preact`` dropped after the launch.

For each model (``codagen bench generate``'s shapes and layer counts, random weights) and prefill case
(1 x 8192 and 8 x 2048 tokens, ``logits_to_keep=1``, a fresh ``DynamicCache``): the forward's median time
(``codagen.bench.common.median_ms``) and its peak memory above what is allocated before it, the variants
alternating over ``--rounds`` rounds (the GPU's clock moves between rounds:
``docs/notes/power-cap-and-clocks.md``). ``logits_equal``: whether a variant's last logits are bitwise the
``inference`` variant's.

    PYTHONPATH=. python bench/prefill_saved_tensors.py --models llama3-8b llama3-1b --json out.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys

import torch

import codagen
from codagen.bench.common import environment, median_ms
from codagen.bench.generate import MODELS
from codagen.models.hf_cache import cache_field
from codagen.ops import mlp

VARIANTS = ("inference", "preact_stored")
CASES = ((1, 8192), (8, 2048))


def _gate_up_storing_preact(*args):
    """The training forward's gate/up op (``mlp._rms_gate_up_swiglu_op``) in the inference op's place: ``preact``
    stored, then dropped."""
    return mlp._rms_gate_up_swiglu_op(*args)[0]


@contextlib.contextmanager
def variant(name: str):
    if name == "inference":
        yield
        return
    shipped = mlp._rms_gate_up_swiglu_inference_op
    mlp._rms_gate_up_swiglu_inference_op = _gate_up_storing_preact
    try:
        yield
    finally:
        mlp._rms_gate_up_swiglu_inference_op = shipped


def bench_model(name: str, rounds: int) -> list[dict]:
    from transformers import DynamicCache, LlamaForCausalLM
    shape = MODELS[name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(shape.config(shape.layers)).to(torch.bfloat16).eval()
    codagen.patch(model)
    records = []
    for batch, seq in CASES:
        ids = torch.randint(0, shape.vocab, (batch, seq), device="cuda")

        def forward(mode):
            with torch.no_grad(), variant(mode):
                return model(ids, use_cache=True, logits_to_keep=1, **{cache_field(): DynamicCache()}).logits

        logits = {mode: forward(mode) for mode in VARIANTS}  # warm-up: compiles, plans, keeps the fused weights
        times: dict[str, list[float]] = {mode: [] for mode in VARIANTS}
        for round_ in range(rounds):
            for mode in (VARIANTS if round_ % 2 == 0 else reversed(VARIANTS)):
                times[mode].append(median_ms(lambda: forward(mode), rep_ms=300, min_reps=5))
        peak: dict[str, int] = {}
        for mode in VARIANTS:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            forward(mode)
            torch.cuda.synchronize()
            peak[mode] = torch.cuda.max_memory_allocated() - base
        for mode in VARIANTS:
            records.append(dict(name=name, layers=shape.layers, case=f"prefill {batch}x{seq}", variant=mode,
                                median_ms=statistics.median(times[mode]), round_ms=times[mode],
                                peak_bytes_above_start=peak[mode],
                                logits_equal=bool(torch.equal(logits[mode], logits["inference"]))))
            r = records[-1]
            print(f"  {name:<10} {r['case']:<15} {mode:<14} {r['median_ms']:8.3f} ms  "
                  f"peak +{peak[mode] / 2**20:8.0f} MiB  logits equal: {r['logits_equal']}", flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("prefill_saved_tensors: needs a CUDA GPU", file=sys.stderr)
        return 1
    records = []
    for name in args.models:
        records += bench_model(name, args.rounds)
        torch.cuda.empty_cache()  # the model is gone
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "rounds": args.rounds, "records": records}, f, indent=1)
    for name in args.models:
        for batch, seq in CASES:
            case = f"prefill {batch}x{seq}"
            fast, full = ({r["variant"]: r for r in records if r["name"] == name and r["case"] == case}[mode]
                          for mode in VARIANTS)
            print(f"{name} {case}: inference {fast['median_ms']:.2f} ms vs preact stored {full['median_ms']:.2f} ms "
                  f"({full['median_ms'] / fast['median_ms']:.3f}x); peak +{fast['peak_bytes_above_start'] / 2**20:.0f}"
                  f" vs +{full['peak_bytes_above_start'] / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
