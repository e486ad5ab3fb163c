"""Mainloop tile-configuration sweep: plain-store GEMMs (our template, no epilogue work) vs cuBLAS (GPU).

    PYTHONPATH=. python bench/mainloop_configs.py [--models llama3-8b,d2048] [--out DIR]

For the three GEMM layouts of a block (forward ``linear``, input gradient ``input_grad``, weight
gradient ``weight_grad``) at each model's shapes, times every configuration in ``CONFIGS`` (the shipped
Hopper pool plus experimental ones) and ``torch.mm``. A configuration that beats the shipped pool's
best on most shapes is a candidate for ``configs.SM90``. Prints a table of ratios (cuBLAS ms / ours),
writes the JSON records (suite ``mainloop``) under ``--out``.
"""
from __future__ import annotations

import argparse
import sys

import torch

from codagen.backends.triton import TritonBackend
from codagen.backends.triton.configs import SM90, KernelConfig
from codagen.bench.common import median_ms, write_results
from codagen.bench.kernels import MODELS, gemm, random_inputs
from codagen.epilogue import library
from codagen.epilogue.bind import bind

EXPERIMENTAL = (
    KernelConfig(128, 256, 64, 4, 8, epilogue_split=4),
    KernelConfig(256, 128, 64, 3, 8, epilogue_split=2),
    KernelConfig(256, 128, 64, 4, 8, epilogue_split=4),
    KernelConfig(128, 256, 64, 3, 8, epilogue_split=2, group_m=4),
    KernelConfig(128, 256, 64, 3, 8, epilogue_split=2, group_m=16),
    KernelConfig(128, 256, 128, 2, 8, epilogue_split=2),
    KernelConfig(128, 128, 128, 3, 8, epilogue_split=1),
)
CONFIGS = tuple(c for c in SM90 if not c.tma_epilogue) + EXPERIMENTAL


def shapes(model) -> list[tuple[str, object, int, int, int]]:
    m, d, f, qkv = 16384, model.d, model.f, model.qkv
    return [("gate_up fwd", library.linear(), m, 2 * f, d), ("o-proj fwd", library.linear(), m, d, d),
            ("down dgrad", library.input_grad(), m, f, d), ("gate_up dgrad", library.input_grad(), m, d, 2 * f),
            ("qkv wgrad", library.weight_grad(), qkv, d, m), ("gate_up wgrad", library.weight_grad(), 2 * f, d, m)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama3-8b,d2048")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    records, rows = [], []
    for model_name in args.models.split(","):
        model = MODELS[model_name]
        for name, program, m, n, k in shapes(model):
            a, b, tensors = random_inputs(program, m, n, k, torch.bfloat16, torch.device("cuda"))
            cublas = median_ms(lambda: gemm(program, a, b))
            times = {}
            for cfg in CONFIGS:
                backend = TritonBackend(config=cfg)
                bound = bind(program, a, b, tensors)
                try:
                    backend.run(bound)
                    times[cfg.short() + f" g{cfg.group_m}"] = median_ms(lambda: backend.run(bound))
                except Exception as error:  # noqa: BLE001 - out of resources: report and go on
                    times[cfg.short() + f" g{cfg.group_m}"] = float("nan")
                    print(f"  {cfg.short()}: {type(error).__name__}: {str(error)[:120]}", file=sys.stderr)
            shape = {"model": model_name, "M": m, "N": n, "K": k, "program": program.name}
            records.append({"suite": "mainloop", "name": name, "shape": shape, "provider": "cublas_gemm",
                            "median_ms": cublas})
            records += [{"suite": "mainloop", "name": name, "shape": shape, "provider": "codagen", "config": c,
                         "median_ms": t} for c, t in times.items()]
            rows.append((f"{model_name} {name}", cublas, times))
            print(f"{model_name} {name}: cuBLAS {cublas:.3f} ms; " + ", ".join(
                f"{c} {cublas / t:.3f}" for c, t in times.items()), flush=True)
    if args.out:
        write_results("mainloop", records, args.out)
    names = list(rows[0][2])
    print("\n| shape | cuBLAS ms | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for label, cublas, times in rows:
        print(f"| {label} | {cublas:.3f} | " + " | ".join(f"{cublas / times[c]:.3f}" for c in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
