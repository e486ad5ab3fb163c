"""How fast could each row of ``codagen bench models`` be? A lower bound from its GEMMs, attention and optimizer.

The fused epilogues remove memory-bound work around the GEMMs; they leave the GEMMs' own FLOPs, attention and the
optimizer step. So no provider that runs the same GEMMs at the same rate, the same attention kernel and the same
optimizer can be faster than their sum, and ``best peer / bound`` is the most any such provider can gain over the
best peer.

- GEMM FLOPs per step: ``6 * tokens * (layers * (d * (q + 2 kv) + q * d + 3 d * ffn) + d * vocab)`` (forward and
  both backward GEMMs of every projection and of the LM head; q = heads * head_dim, kv = kv heads * head_dim).
- Profiled rows (``bench/model_step_profile.py`` records of ``codagen_compile``): the GEMM kernels' measured time
  (codagen's mainloop runs at cuBLAS's rate inside a block, ``docs/notes/speed-of-light-gap.md``), the attention
  kernels' and the optimizer step's (its span on the GPU). Only the kernels the record lists count (its
  ``--top``): a kernel left out of the list makes the bound lower still.
- The other rows: their GEMM FLOPs at the GEMM rate measured at the nearest profiled width, and nothing else: a
  bound lower still (attention and the optimizer left out), so ``best peer / bound`` overstates what is possible.

    python bench/model_step_bounds.py bench/results/2026-12-02-models-full.json \\
        bench/results/2026-12-02-model-step-profile.json \\
        bench/results/2026-12-02-model-step-profile-llama3-8b-fused-adamw.json

Prints a Markdown table per model: GEMM TFLOP, the bound and what it counts, the best peer and codagen's best step
(from the models results), and the two ratios.
"""
from __future__ import annotations

import argparse
import json
import sys

GEMM_KERNELS = ("weight_grad", "rms_norm_backward", "rms_linear", "rms_gate_up_swiglu", "swiglu_backward",
                "residual_rms_stats", "rms_qkv_rope", "input_grad", "linear_kernel")
PEERS = ("eager", "compile", "liger")
OURS = ("codagen", "codagen_compile", "codagen_compile_graphs")


def gemm_flops(shape: dict) -> float:
    d, ffn, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * ffn
    return 6.0 * shape["tokens"] * (shape["layers"] * per_layer + d * vocab)


def categories(profile: dict) -> dict:
    """Milliseconds of the profiled step's GEMM, attention and optimizer kernels (the top kernels recorded)."""
    out = {"gemm": 0.0, "attention": 0.0, "optimizer": 0.0}
    span = None  # the optimizer step's record_function span on the GPU: all of its kernels, listed or not
    for kernel in profile["kernels"]:
        name = kernel["name"]
        if name.startswith("Optimizer."):
            span = kernel["ms"]
            continue
        if any(name.startswith(g) for g in GEMM_KERNELS):
            out["gemm"] += kernel["ms"]
        elif "sdpa" in name or "flash" in name:
            out["attention"] += kernel["ms"]
        elif "multi_tensor_apply" in name:
            out["optimizer"] += kernel["ms"]
    if span is not None:
        out["optimizer"] = max(out["optimizer"], span)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", help="a codagen bench models results JSON (full steps)")
    parser.add_argument("profiles", nargs="+", help="bench/model_step_profile.py results JSONs")
    args = parser.parse_args()
    records = json.load(open(args.models))["records"]
    models_optimizer = next((r.get("optimizer") for r in records if r.get("optimizer")), "AdamW(foreach=True)")
    profiles = {r["model"]: r for path in args.profiles for r in json.load(open(path))["records"]
                if r["provider"] == "codagen_compile"}
    rows = {}
    for r in records:
        if r.get("median_ms") and r["step"] == "full":
            rows.setdefault(r["name"], {"shape": r["shape"]})[r["provider"]] = r["median_ms"]
    rates = {}  # width -> measured GEMM TFLOP/s
    for name, profile in profiles.items():
        if name in rows:
            shape = rows[name]["shape"]
            rates[shape["hidden_size"]] = gemm_flops(shape) / categories(profile)["gemm"] / 1e9
    print("| model | GEMM TFLOP | bound ms (what it counts) | best peer ms | codagen best ms | best peer / bound "
          "| codagen best / bound |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        shape, flops = row["shape"], gemm_flops(row["shape"])
        if name in profiles:
            parts = categories(profiles[name])
            bound = sum(parts.values())
            optimizer = profiles[name].get("optimizer", "AdamW(foreach=True)")
            counts = (f"measured: GEMMs {parts['gemm']:.1f} ({flops / parts['gemm'] / 1e9:.0f} TFLOP/s), attention "
                      f"{parts['attention']:.1f}, optimizer {parts['optimizer']:.1f}"
                      + ("" if optimizer == models_optimizer
                         else f" with {optimizer}, the steps ran {models_optimizer}"))
        else:
            width = min(rates, key=lambda w: abs(w - shape["hidden_size"]))
            bound = flops / rates[width] / 1e9
            counts = f"GEMMs only, at {rates[width]:.0f} TFLOP/s (measured at d {width})"
        peer = min(row[p] for p in PEERS if p in row)
        ours = min(row[p] for p in OURS if p in row)
        print(f"| {name} | {flops / 1e12:.1f} | {bound:.1f} ({counts}) | {peer:.1f} | {ours:.1f} | {peer / bound:.3f}x "
              f"| {ours / bound:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
