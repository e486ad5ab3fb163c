"""B1, the RoPE backward row kernel, at the block benchmark's shapes (GPU, bf16).

    PYTHONPATH=. python bench/rope_backward.py [--out DIR]

B1 reads the gradient of the QKV output and the saved ``qkv`` and writes ``grad_z``: three [M, N] passes.
This times, per shape:

``three_blocks``     ``rope_backward([grad_q, grad_k, grad_v])``, the three gradients as SDPA's backward
                     leaves them (separate token-major tensors): what the decoder runs;
``one_block``        ``rope_backward([grad_qkv])`` on one contiguous gradient;
``cat_then_kernel``  ``torch.cat`` of the three, then ``one_block``: what autograd does when q/k/v are
                     split outside the op (without ``split_sizes``), concatenating in its backward;
``add_same_bytes``   ``torch.add(a, b, out=c)`` over [M, N]: two reads and a write, B1's traffic with no
                     math, the memory system's pace for it;

and the kernel at other (BLOCK, num_warps) than the launcher's. Prints a table of ms and TB/s (three
[M, N] bf16 passes over the time); writes the JSON to ``--out``.

``--qk-norm`` times B1 with QK-norm (Qwen3: ``rope_qk_norm_backward``, head_dim 128) instead, against the same
``add_same_bytes``; ``--baseline FILE`` also times the launcher of a saved
``codagen/ops/kernels/rope_qk_norm.py`` (``git show REV:codagen/ops/kernels/rope_qk_norm.py >
FILE``), checked against today's output.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from codagen.bench.common import environment, load_module, median_ms
from codagen.ops import kernels

SHAPES = {  # tokens, q columns, k (= v) columns
    "d2048": (16384, 2048, 2048),
    "llama3-1b": (16384, 2048, 512),
    "llama3-8b": (16384, 4096, 1024),
    "d8192": (16384, 8192, 8192),
}
VARIANTS = ((512, 4), (1024, 4), (2048, 4), (2048, 8))
#: launches of the QK-norm B1 besides kernels.QK_NORM_LAUNCH: rows per program, columns per step, warps
QK_NORM_VARIANTS = ((16, 2048, 4), (32, 1024, 4), (8, 1024, 4), (16, 1024, 8), (16, 512, 4))


def cases(m: int, q_cols: int, kv_cols: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    n = q_cols + 2 * kv_cols
    grads = [torch.randn(m, c, device=dev, dtype=dt) for c in (q_cols, kv_cols, kv_cols)]
    grad_qkv = torch.cat(grads, 1)
    qkv = torch.randn(m, n, device=dev, dtype=dt)
    positions = torch.arange(m, device=dev).remainder(8192).float()
    frequencies = torch.rand(n // 2, device=dev)
    out = torch.empty(m, n, device=dev, dtype=dt)

    def kernel(block, warps):
        return lambda: kernels.rope_backward_triton(grads, qkv, positions, frequencies, 2048, launch=(block, warps))

    found = {
        "three_blocks": lambda: kernels.rope_backward(grads, qkv, positions, frequencies, 2048),
        "one_block": lambda: kernels.rope_backward([grad_qkv], qkv, positions, frequencies, 2048),
        "cat_then_kernel": lambda: kernels.rope_backward([torch.cat(grads, 1)], qkv, positions, frequencies, 2048),
        "add_same_bytes": lambda: torch.add(grad_qkv, qkv, out=out),
    }
    found.update({f"block{block}_warps{warps}": kernel(block, warps) for block, warps in VARIANTS})
    # the same numbers from every path
    want = kernels.rope_backward_ref([grad_qkv.float()], qkv.float(), positions, frequencies, 2048)
    for got in (kernels.rope_backward(grads, qkv, positions, frequencies, 2048),
                kernels.rope_backward([grad_qkv], qkv, positions, frequencies, 2048)):
        torch.testing.assert_close(got[0].float(), want[0], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got[1], want[1], rtol=1e-3, atol=1e-3)
    return found


def qk_norm_cases(m: int, q_cols: int, kv_cols: int, baseline=None, head_dim: int = 128) -> dict:
    """B1 with QK-norm: today's launcher (and ``baseline``'s), on the three gradient blocks."""
    from codagen import ops
    dev, dt = "cuda", torch.bfloat16
    heads, kv_heads = q_cols // head_dim, kv_cols // head_dim
    grads = [torch.randn(m, c, device=dev, dtype=dt) for c in (q_cols, kv_cols, kv_cols)]
    preact = torch.randn(m, q_cols + 2 * kv_cols, device=dev, dtype=dt)
    positions = torch.arange(m, device=dev).remainder(8192).float()
    frequencies = ops.rope_frequencies(heads, kv_heads, head_dim, device=dev)
    q_norm, k_norm = (1 + 0.1 * torch.randn(head_dim, device=dev, dtype=dt) for _ in range(2))
    args = (preact, positions, frequencies, q_norm, k_norm, heads, 1e-6, 2048)
    out = torch.empty_like(preact)
    grad_qkv = torch.cat(grads, 1)
    found = {"qk_norm": lambda: kernels.rope_qk_norm_backward(grads, *args),
             "add_same_bytes": lambda: torch.add(grad_qkv, preact, out=out)}
    want = kernels.rope_qk_norm_backward_ref([grad_qkv.float()], preact.float(), *args[1:])
    got = kernels.rope_qk_norm_backward(grads, *args)
    for name, a, b in zip(("grad_z", "mean_z_dz", "grad_q_norm", "grad_k_norm"), got, want):
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-2 * scale, msg=name)
    def variant(launch):
        return lambda: kernels.rope_qk_norm_backward_triton(grads, *args, launch=launch)
    found.update({"rows{}_step{}_warps{}".format(*launch): variant(launch) for launch in QK_NORM_VARIANTS})
    if baseline is not None:
        found["qk_norm_baseline"] = lambda: baseline.rope_qk_norm_backward(grads, *args)
        for name, a, b in zip(("grad_z", "mean_z_dz", "grad_q_norm", "grad_k_norm"), got,
                              baseline.rope_qk_norm_backward(grads, *args)):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2, msg=f"baseline {name}")
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", default=None, help="directory for the JSON (default: none written)")
    parser.add_argument("--qk-norm", action="store_true", help="B1 with QK-norm (head_dim 128 shapes only)")
    parser.add_argument("--baseline", default=None,
                        help="a saved codagen/ops/kernels/rope_qk_norm.py to time beside (--qk-norm)")
    args = parser.parse_args()
    baseline = load_module("codagen.ops.kernels.baseline", args.baseline) if args.baseline else None
    records = []
    for shape in args.shapes:
        m, q_cols, kv_cols = SHAPES[shape]
        n = q_cols + 2 * kv_cols
        if args.qk_norm and (q_cols % 128 or kv_cols % 128):
            continue
        made = qk_norm_cases(m, q_cols, kv_cols, baseline) if args.qk_norm else cases(m, q_cols, kv_cols)
        for name, fn in made.items():
            ms = median_ms(fn, warmup_ms=25, rep_ms=200)
            records.append({"suite": "rope_backward", "name": name, "shape": {"m": m, "q": q_cols, "kv": kv_cols},
                            "median_ms": ms, "tb_per_s": 3 * m * n * 2 / ms / 1e9})
            print(f"{shape:<10} {name:<18} {ms:7.3f} ms {records[-1]['tb_per_s']:5.2f} TB/s", flush=True)
    if args.out:
        path = Path(args.out) / ("rope-qk-norm-backward.json" if args.qk_norm else "rope-backward.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"env": environment(), "records": records}, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
