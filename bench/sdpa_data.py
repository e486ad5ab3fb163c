"""Why is attention slower inside a block than on the speed-of-light line? Layout or data (GPU, bf16).

    PYTHONPATH=. python bench/sdpa_data.py [--shapes d2048 llama3-1b] [--out DIR]

In the block profiles the same cuDNN kernels run 15-20% longer inside codagen's (and torch.compile's)
block than on the speed-of-light line, which feeds SDPA contiguous ``torch.randn`` q/k/v. This runs
cuDNN SDPA forward+backward (causal, GQA) with q/k/v

``randn_contiguous``    contiguous ``[B, heads, S, hd]`` ``randn`` leaves (the speed-of-light line);
``randn_token_major``   views of one ``randn`` ``[B*S, (h + 2 kv) hd]`` buffer (codagen's layout);
``block_contiguous``    a codagen block's own q/k/v (its QKV op on ``randn`` x with the block benchmark's
                        weights), copied contiguous head-major;
``block_token_major``   that block's q/k/v as the views the decoder hands SDPA;

``dO`` ``randn`` in every case, and reports the median duration of each cuDNN kernel over profiled steps
(kernel time alone: no copies, no launch gaps), the cases interleaved over two rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from codagen import ops
from codagen.bench.block import SHAPES, block_weights, codagen_block_weights
from codagen.bench.common import environment


def cases(shape: str, batch: int = 2, seq: int = 8192):
    s = SHAPES[shape]
    dev, dt = "cuda", torch.bfloat16
    b, h, kv, hd = batch, s.heads, s.kv_heads, s.head_dim
    m, n = b * seq, (h + 2 * kv) * hd
    split = (h * hd, kv * hd, kv * hd)
    with torch.no_grad():
        blk, _ = codagen_block_weights(block_weights(s, dev, dt), s)
        x = torch.randn(m, s.d, device=dev, dtype=dt)
        normed, rstd = ops.rms_norm_stats(x, blk.attn_norm, 1e-5)
        positions = torch.arange(seq, device=dev).repeat(b)
        freqs = ops.rope_frequencies(h, kv, hd, base=500000.0).to(dev)
        block_qkv = ops.rms_qkv_rope(x, normed, rstd, blk.attn_norm, blk.qkv, positions, freqs)
    randn_qkv = torch.randn(m, n, device=dev, dtype=dt)

    def token_major(buffer):
        return [t.view(b, seq, -1, hd).transpose(1, 2) for t in buffer.split(split, dim=1)]

    def contiguous(buffer):
        return [t.contiguous() for t in token_major(buffer)]

    made = {"randn_contiguous": [torch.randn(b, c // hd, seq, hd, device=dev, dtype=dt) for c in split],
            "randn_token_major": token_major(randn_qkv),
            "block_contiguous": contiguous(block_qkv),
            "block_token_major": token_major(block_qkv)}
    grad = torch.randn(b, h, seq, hd, device=dev, dtype=dt)
    stats = {"q_std": block_qkv[:, :split[0]].float().std().item(),
             "k_std": block_qkv[:, split[0]:split[0] + split[1]].float().std().item()}

    def step_of(q, k, v):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

        def step():
            q.grad = k.grad = v.grad = None
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h).backward(grad)
        return step
    return {name: step_of(*qkv) for name, qkv in made.items()}, stats


def kernel_ms(step, steps: int = 10) -> dict[str, float]:
    """Median duration (ms) of each CUDA kernel of ``step`` over ``steps`` profiled runs, by name."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    durations = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and "sdpa" in event.name:
            kind = "bprop" if "bprop" in event.name else "fprop" if "fprop" in event.name else event.name[:40]
            durations.setdefault(kind, []).append(event.time_range.elapsed_us() / 1e3)
    return {kind: statistics.median(ms) for kind, ms in durations.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["d2048", "llama3-1b"], choices=sorted(SHAPES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    records = []
    for shape in args.shapes:
        steps, stats = cases(shape)
        times = {name: [] for name in steps}
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for round_index in range(args.rounds):
                order = list(steps)[round_index % len(steps):] + list(steps)[:round_index % len(steps)]
                for name in order:
                    times[name].append(kernel_ms(steps[name]))
        for name, rounds in times.items():
            merged = {kind: statistics.median(r[kind] for r in rounds) for kind in rounds[0]}
            records.append({"suite": "sdpa_data", "name": name, "shape": shape, "kernel_ms": merged,
                            "rounds": rounds, **stats})
            print(f"{shape:10s} {name:18s} " + "  ".join(f"{k} {v:6.3f} ms" for k, v in sorted(merged.items())),
                  flush=True)
        print(f"{shape:10s} block q std {stats['q_std']:.3f}, k std {stats['k_std']:.3f}", flush=True)
    if args.out:
        path = Path(args.out) / "sdpa-data.json"
        path.write_text(json.dumps({"env": environment(), "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
