"""Does the layout of q/k/v change SDPA's speed? (GPU, bf16; a diagnostic for the block benchmark.)

    PYTHONPATH=. python bench/sdpa_layout.py [--shapes ...] [--backends flash cudnn] [--out DIR]

The codagen block hands SDPA strided views of the fused QKV output ``[B*S, (h + 2 kv) hd]``; eager
hands it contiguous ``[B, h, S, hd]`` tensors. For each shape and each SDPA backend this times
forward + backward of causal (GQA) attention three ways:

``contiguous``   q, k, v contiguous ``[B, heads, S, hd]`` leaves (eager's layout);
``fused_views``  q, k, v views of one ``[B*S, (h + 2 kv) hd]`` leaf, transposed then split: the
                 gradient of that leaf is a head-major concatenation of dq, dk, dv plus a copy;
``fused_split``  the same views, split then transposed (the decoder before the eighth session): one
                 concatenation straight into the leaf's layout;
``views_only``   the same views, but gradients taken for q, k, v themselves (no copy): the layout's
                 cost alone.

Two more end at the out-projection's operand, ``out`` as ``[B*S, h hd]`` (free for a token-major
``out``, a copy for a head-major one), its gradient arriving in that layout, as in a block:

``block_split``       ``fused_split`` as the decoder runs it;
``block_head_major``  q, k, v head slices of one head-major ``[B, h + 2 kv, S, hd]`` leaf: what a QKV
                      epilogue storing head-major would hand SDPA (``benchmarks.md``: the speed-of-light
                      line's attention runs on contiguous head-major tensors and is faster).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from codagen.bench.common import environment, median_ms

SHAPES = {  # batch, seq, heads, kv heads, head_dim
    "llama3-8b": (2, 8192, 32, 8, 128),
    "llama3-1b": (2, 8192, 32, 8, 64),
    "d2048-mha": (2, 8192, 16, 16, 128),
}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def cases(b, s, h, kv, hd):
    dev, dt = "cuda", torch.bfloat16
    grad = torch.randn(b, h, s, hd, device=dev, dtype=dt)

    def contiguous():
        q = torch.randn(b, h, s, hd, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(b, kv, s, hd, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(b, kv, s, hd, device=dev, dtype=dt, requires_grad=True)
        return (q, k, v), (q, k, v)

    def fused(views_only, split_first=False):
        qkv = torch.randn(b * s, (h + 2 * kv) * hd, device=dev, dtype=dt, requires_grad=not views_only)
        if split_first:
            q, k, v = (t.transpose(1, 2) for t in qkv.view(b, s, h + 2 * kv, hd).split((h, kv, kv), dim=2))
        else:
            q, k, v = qkv.view(b, s, h + 2 * kv, hd).transpose(1, 2).split((h, kv, kv), dim=1)
        if views_only:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            return (q, k, v), (q, k, v)
        return (q, k, v), (qkv,)

    def head_major():
        qkv = torch.randn(b, h + 2 * kv, s, hd, device=dev, dtype=dt, requires_grad=True)
        return qkv.split((h, kv, kv), dim=1), (qkv,)

    grad_tokens = torch.randn(b * s, h * hd, device=dev, dtype=dt)
    for name, make in (("contiguous", contiguous), ("fused_views", lambda: fused(False)),
                       ("fused_split", lambda: fused(False, split_first=True)), ("views_only", lambda: fused(True)),
                       ("block_split", lambda: fused(False, split_first=True)), ("block_head_major", head_major)):
        (q, k, v), leaves = make()
        to_tokens = name.startswith("block_")

        def step(q=q, k=k, v=v, leaves=leaves, to_tokens=to_tokens):
            for t in leaves:
                t.grad = None
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h)
            if to_tokens:  # the out-projection's operand [B*S, h hd] and its gradient
                out.transpose(1, 2).reshape(b * s, h * hd).backward(grad_tokens)
            else:
                out.backward(grad)
        yield name, step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", nargs="*", default=list(SHAPES))
    p.add_argument("--backends", nargs="*", default=list(BACKENDS))
    args = p.parse_args(argv)
    records = []
    for shape in args.shapes:
        for backend_name in args.backends:
            backend = BACKENDS[backend_name]
            for layout, step in cases(*SHAPES[shape]):
                try:
                    with sdpa_kernel(backend):
                        step()
                        ms = median_ms(step, 25, 150)
                except Exception as e:  # noqa: BLE001 - a backend that refuses the shape is a result too
                    ms, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                else:
                    err = None
                records.append({"suite": "sdpa_layout", "name": layout, "pass": "fwd+bwd", "shape": shape,
                                "provider": backend_name, "median_ms": ms, "error": err})
                print(f"{shape:10s} {backend_name:9s} {layout:12s} " + (f"{ms:7.3f} ms" if ms else f"- {err}"),
                      flush=True)
    if args.out:
        with open(f"{args.out}/sdpa_layout.json", "w") as f:
            json.dump({"env": environment(), "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
