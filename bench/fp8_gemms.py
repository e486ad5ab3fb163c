"""How fast are the FP8 GEMMs and the FP8 linear layer against cuBLAS? (GPU)

    PYTHONPATH=. python bench/fp8_gemms.py [--tokens 16384] [--rounds 3] [--out FILE]
    PYTHONPATH=. python bench/fp8_gemms.py --dry-run     (CPU: tiny shapes, the harness and the agreement only)

At LLaMA-3-8B's training GEMMs (QKV 6144 x 4096, O 4096 x 4096, gate/up 28672 x 4096, down 4096 x 14336; M the
tokens), for each of the three GEMMs of a linear layer (forward ``x @ W^T``, input gradient ``dy @ W``, weight
gradient ``dy^T @ x``), the median of rotated rounds for:

- ``bf16``: ``torch.matmul`` in bf16 (cuBLAS), the yardstick;
- ``scaled_mm_rowwise``: ``torch._scaled_mm`` with rowwise scales, bf16 out (cuBLAS FP8; its operand layout, the
  second operand column-major, whatever the GEMM's);
- ``codagen_rowwise``: the library program in that layout, ``Program.with_rowwise_scales()``;
- ``codagen_blockwise``: the blockwise program (``with_blockwise_scales``: 128 x 128 weight blocks in the forward
  and the input gradient, 1 x 128 groups on both operands in the weight gradient).

Then the layer: ``codagen.ops.fp8_linear`` forward + backward (its quantize kernels included) against the bf16
linear's (``F.linear``), and the quantize kernels alone (``kernels.quantize_groups``). Tuning: the FP8 programs have
no shipped entries; ``CODAGEN_TRITON_AUTOTUNE=1`` times their candidates on first use. Every provider's output is
checked against the bf16 product first. Prints a table; ``--out`` gets the JSON (GPU, versions, shapes, medians).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import codagen
from codagen.bench.common import environment, median_ms, timed_rounds, wall_ms
from codagen.epilogue import library
from codagen.ops import fp8_linear, kernels

#: (name, out features, in features) of LLaMA-3-8B's linear layers
LAYERS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
SMOKE_LAYERS = (("tiny", 256, 128),)
GROUP = 128


def gemm_operands(kind: str, tokens: int, d_out: int, d_in: int, device):
    """(M, N, K) and bf16 operands of one GEMM of the layer, in the layouts codagen's programs take."""
    torch.manual_seed(0)
    x = torch.randn(tokens, d_in, device=device)
    weight = torch.randn(d_out, d_in, device=device) / d_in ** 0.5
    grad = torch.randn(tokens, d_out, device=device)
    if kind == "forward":      # x [M, K] @ W^T, W [N, K]
        return (tokens, d_out, d_in), x, weight
    if kind == "input_grad":   # dy [M, K] @ W, W [K, N]
        return (tokens, d_in, d_out), grad, weight
    return (d_out, d_in, tokens), grad, x  # weight_grad: dy^T @ x, dy [K, M], x [K, N]


PROGRAMS = {"forward": library.linear, "input_grad": library.input_grad, "weight_grad": library.weight_grad}


def providers(kind: str, a: torch.Tensor, b: torch.Tensor) -> dict:
    """name -> a no-argument function giving the GEMM's bf16 output [M, N]; the operands quantized beforehand."""
    program = PROGRAMS[kind]()
    # the math view of each operand: A [M, K], B [K, N]
    a_math = a if kind != "weight_grad" else a.t()
    b_math = b.t() if kind == "forward" else b
    a16, b16 = a_math.bfloat16().contiguous(), b_math.bfloat16().contiguous()
    found = {"bf16": lambda: a16 @ b16}

    # cuBLAS FP8, rowwise: A row-major [M, K], B column-major [K, N] (the transpose of a row-major [N, K])
    a_rows, a_scale = kernels.quantize_rowwise(a_math.contiguous())
    b_cols, b_scale = kernels.quantize_rowwise(b_math.t().contiguous())
    if a_rows.is_cuda:
        found["scaled_mm_rowwise"] = lambda: torch._scaled_mm(a_rows, b_cols.t(), scale_a=a_scale[:, None],
                                                              scale_b=b_scale[None, :], out_dtype=torch.bfloat16)

    # codagen, rowwise: each operand quantized along K in the program's own layout
    def rowwise_operand(t, k_last: bool):
        q, s = kernels.quantize_rowwise(t if k_last else t.t().contiguous())
        return (q if k_last else q.t().contiguous()), s
    a_q, a_s = rowwise_operand(a, kind != "weight_grad")
    b_q, b_s = rowwise_operand(b, kind == "forward")
    rowwise = program.with_rowwise_scales()
    found["codagen_rowwise"] = lambda: next(iter(codagen.execute(rowwise, a_q, b_q, a_scale=a_s, b_scale=b_s).values()))

    # codagen, blockwise: groups along K as the recipe lays them out
    a_along = "n" if kind != "weight_grad" else "m"
    a_g, a_gs = kernels.quantize_groups(a, GROUP, a_along)
    if kind == "weight_grad":
        b_g, b_gs = kernels.quantize_groups(b, GROUP, "m")
        blockwise = program.with_blockwise_scales(GROUP)
    else:
        b_g, b_gs = kernels.quantize_groups(b, GROUP, "blocks")
        blockwise = program.with_blockwise_scales(GROUP, b_block=True)
    found["codagen_blockwise"] = lambda: next(iter(codagen.execute(blockwise, a_g, b_g, a_scale=a_gs,
                                                                    b_scale=b_gs).values()))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the harness and the agreement")
    parser.add_argument("--out", help="write the records as JSON here")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    layers, tokens = (SMOKE_LAYERS, 200) if args.dry_run else (LAYERS, args.tokens)
    timer = wall_ms if args.dry_run else median_ms
    records = []

    def record(suite, name, shape, times, errors, flops=None):
        for provider, runs in times.items():
            ms = sorted(runs)[len(runs) // 2]
            records.append(dict(suite=suite, name=name, shape=shape, provider=provider, median_ms=ms, rounds=runs,
                                tflops=None if flops is None else flops / ms / 1e9))
        for provider, error in errors.items():
            records.append(dict(suite=suite, name=name, shape=shape, provider=provider, error=error))

    for layer, d_out, d_in in layers:
        for kind in PROGRAMS:
            (m, n, k), a, b = gemm_operands(kind, tokens, d_out, d_in, device)
            functions = providers(kind, a, b)
            want = functions["bf16"]().float()
            errors = {}
            for name, fn in list(functions.items()):  # each provider is the GEMM before it is timed
                try:
                    relative = ((fn().float() - want).norm() / want.norm()).item()
                    if not relative < 0.1:
                        raise AssertionError(f"relative error {relative:.3g} against bf16")
                except Exception as error:  # noqa: BLE001 - recorded, not timed
                    errors[name] = f"{type(error).__name__}: {str(error)[:300]}"
                    del functions[name]
            times = timed_rounds(functions, args.rounds, timer,
                                 on_error=lambda name, error: errors.__setitem__(name, str(error)[:300]))
            record("gemm", f"{layer} {kind}", dict(M=m, N=n, K=k), times, errors, flops=2 * m * n * k)

        # the layer: forward + backward, FP8 against bf16
        torch.manual_seed(0)
        x = torch.randn(tokens, d_in, device=device, dtype=torch.bfloat16, requires_grad=True)
        weight = (torch.randn(d_out, d_in, device=device) / d_in ** 0.5).bfloat16().requires_grad_()
        grad = torch.randn(tokens, d_out, device=device, dtype=torch.bfloat16)

        def step(linear):
            def run():
                x.grad = weight.grad = None
                linear(x, weight).backward(grad)
            return run
        times = timed_rounds({"bf16_linear": step(F.linear), "codagen_fp8_linear": step(fp8_linear)}, args.rounds,
                             timer)
        record("layer", f"{layer} fwd+bwd", dict(tokens=tokens, d_out=d_out, d_in=d_in), times, {},
               flops=6 * tokens * d_out * d_in)
        along = {"x along n": (x.detach(), "n"), "x along m": (x.detach(), "m"), "weight blocks": (weight.detach(),
                                                                                                   "blocks")}
        times = timed_rounds({name: (lambda t=t, a=a: kernels.quantize_groups(t, GROUP, a))
                              for name, (t, a) in along.items()}, args.rounds, timer)
        record("quantize", f"{layer} quantize_groups", dict(tokens=tokens, d_out=d_out, d_in=d_in), times, {})

    print(f"{'suite':9s} {'name':24s} {'provider':20s} {'ms':>9s} {'TFLOP/s':>8s}")
    for r in records:
        if "error" in r:
            print(f"{r['suite']:9s} {r['name']:24s} {r['provider']:20s} error: {r['error'][:60]}")
        else:
            tflops = "" if r["tflops"] is None else f"{r['tflops']:8.1f}"
            print(f"{r['suite']:9s} {r['name']:24s} {r['provider']:20s} {r['median_ms']:9.3f} {tflops}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": environment(), "tokens": tokens, "records": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
