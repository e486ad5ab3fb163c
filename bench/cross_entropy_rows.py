"""The cross-entropy row kernel of the training LM head, on one chunk of logits (GPU, bf16).

    PYTHONPATH=. python bench/cross_entropy_rows.py [--vocabs 32768 128256] [--out DIR]

``ops.rms_lm_head_cross_entropy`` computes a chunk's logits with one GEMM, then
:func:`codagen.ops.kernels.cross_entropy_logits_grad` turns them in place into ``dz = softmax(z) -
onehot(target)`` (times the row weight), with each row's loss and ``mean_z_dz``. Its traffic is one read
and one write of the chunk; its math one ``exp`` per logit per pass. This times, on a chunk of the size
the op uses (``cross_entropy.chunk_rows``: 512 MiB of logits):

``kernel``           the launcher (the shipped BLOCK and num_warps);
``block*_warps*``    the kernel at other launch parameters;
``lane_online``      the per-lane form: a running max per logit lane rather than per group of 8
                     (two exps per logit in pass 1), pass 2 in the same order as pass 1, 2048 x 4 warps;
``copy_same_bytes``  ``logits.copy_(fresh)``: one read and one write of the chunk, the memory system's pace;

The kernel rewrites its input, and the logits must not turn into gradients of gradients between timed
runs (near-constant data), so every run first restores the chunk (``copy_same_bytes``, from a second
buffer) and a case's time is its run's median minus the restore's. Prints ms and TB/s (a read and a
write of the chunk over the time); ``--out`` gets the JSON.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from codagen.bench.common import environment, median_ms
from codagen.ops import kernels
from codagen.ops.cross_entropy import chunk_rows

#: (BLOCK, num_warps) besides the launcher's
VARIANTS = ((1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 16), (8192, 8), (8192, 16), (16384, 16), (16384, 32),
            (32768, 32))


@triton.jit
def _lane_online_kernel(logits_ptr, target_ptr, row_weight_ptr, row_loss_ptr, mean_z_dz_ptr, n_cols, inv_width,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * n_cols
    target = tl.load(target_ptr + row)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], dtype=tl.float32)
    target_logit = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(logits_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, z)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(z - shift)
        lane_max = new_max
        target_logit += tl.where(mask & (cols == target), z, 0.0)
    row_max = tl.max(lane_max, axis=0)
    lse = row_max + tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_max), axis=0))
    weight = tl.load(row_weight_ptr + row).to(tl.float32)
    z_dz = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
        dz = (tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)) * weight
        z_dz += tl.where(mask, z * dz, 0.0)
        tl.store(logits_row + cols, dz.to(logits_ptr.dtype.element_ty), mask=mask)
    tl.store(row_loss_ptr + row, lse - tl.sum(target_logit, axis=0))
    tl.store(mean_z_dz_ptr + row, tl.sum(z_dz, axis=0) * inv_width)


def cases(vocab: int, width: int = 2048) -> tuple[int, torch.Tensor, torch.Tensor, dict]:
    """(rows, fresh logits, the buffer the kernels rewrite, name -> run), every kernel checked first."""
    dev, dt = "cuda", torch.bfloat16
    rows = chunk_rows(16384, vocab, 2)
    fresh = 4 * torch.randn(rows, vocab, device=dev, dtype=dt)
    logits = fresh.clone()
    target = torch.randint(0, vocab, (rows,), device=dev)
    target[::7] = -100
    row_weight = (target >= 0).float() / rows

    def kernel(block, warps):
        return lambda: kernels.cross_entropy_logits_grad_triton(logits, target, row_weight, width,
                                                                launch=(block, warps))

    found = {"kernel": lambda: kernels.cross_entropy_logits_grad(logits, target, row_weight, width),
             "lane_online": lambda: lane_online_launcher(logits, target, row_weight, width)}
    found.update({f"block{b}_warps{w}": kernel(b, w) for b, w in VARIANTS})
    # every kernel gives the reference's numbers (each from the same logits)
    want_logits = fresh.clone()
    want = kernels.cross_entropy_logits_grad_ref(want_logits, target, row_weight, width)
    for name, run in found.items():
        logits.copy_(fresh)
        got = run()
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4, msg=name)
        torch.testing.assert_close(got[1], want[1], rtol=1e-3, atol=1e-6, msg=name)
        torch.testing.assert_close(logits.float(), want_logits.float(), rtol=1e-2, atol=1e-6, msg=name)
    return rows, fresh, logits, found


def lane_online_launcher(logits, target, row_weight, width):
    """The per-lane form behind the launcher's signature (``kernels.cross_entropy_logits_grad_triton``)."""
    rows, vocab = logits.shape
    row_loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    mean_z_dz = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _lane_online_kernel[(rows,)](logits, target, row_weight, row_loss, mean_z_dz, vocab, 1.0 / width, BLOCK=2048,
                                 num_warps=4)
    return row_loss, mean_z_dz


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", nargs="+", type=int, default=[32768, 128256])
    parser.add_argument("--out", default=None, help="directory for the JSON (default: none written)")
    args = parser.parse_args()
    records = []
    for vocab in args.vocabs:
        rows, fresh, logits, found = cases(vocab)
        chunk_bytes = rows * vocab * 2
        restore_ms = median_ms(lambda: logits.copy_(fresh), warmup_ms=25, rep_ms=200)
        timed = {"copy_same_bytes": (restore_ms, restore_ms)}
        for name, run in found.items():
            with_restore_ms = median_ms(lambda: (logits.copy_(fresh), run()), warmup_ms=25, rep_ms=200)
            timed[name] = (with_restore_ms - restore_ms, with_restore_ms)
        for name, (ms, with_restore_ms) in timed.items():
            records.append({"suite": "cross_entropy_rows", "name": name, "shape": {"rows": rows, "vocab": vocab},
                            "median_ms": ms, "with_restore_ms": with_restore_ms, "restore_ms": restore_ms,
                            "tb_per_s": 2 * chunk_bytes / ms / 1e9})
            print(f"vocab {vocab:<7} rows {rows:<5} {name:<18} {ms:7.3f} ms {records[-1]['tb_per_s']:5.2f} TB/s",
                  flush=True)
    if args.out:
        path = Path(args.out) / "cross-entropy-rows.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"env": environment(), "records": records}, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
