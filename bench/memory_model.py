"""Where codagen's block peaks in memory, on CPU (no GPU needed): live bytes sampled at op boundaries.

    PYTHONPATH=. python bench/memory_model.py

Runs one codagen block forward+backward (the block benchmark's ``codagen`` provider, reference backend,
float32) at shapes scaled down from the GPU ones with the same proportions M : d : F, so every tensor
shrinks by the same factor and the peak, in units of one ``[M, d]`` activation, carries over. Memory
is glibc's in-use total (``mallinfo2``) sampled after every top-level op (each fused op is one op), so
a fused op's internal temporaries are not seen. Prints the peak above the step's start and the op
after which it was reached.

Not for comparisons with eager: on CPU, eager's norms and attention decompose into several ops with
fp32 temporaries that its GPU kernels do not have.
"""
from __future__ import annotations

import ctypes
import gc

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from codagen.bench import block


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def bytes_in_use() -> int:
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd  # heap chunks + mmapped blocks (large tensors)


class PeakAtOpBoundaries(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.peak, self.after = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        used = bytes_in_use()
        if used > self.peak:
            self.peak, self.after = used, str(func)
        return out


#: GPU shape -> (the same proportions at 1/16 or 1/32 scale, batch, seq)
SCALED = {"d8192": (block.BlockShape(512, 1376, 4, 4, 128), 2, 512),
          "llama3-8b": (block.BlockShape(512, 1792, 4, 1, 128), 2, 1024)}


def main() -> int:
    for name, (shape, batch, seq) in SCALED.items():
        factories, _ = block.block_providers(shape, batch, seq, torch.device("cpu"), torch.float32)
        step = factories["codagen"]()
        step()
        step()
        for t in step.params:
            t.grad = None
        gc.collect()
        start = bytes_in_use()
        with PeakAtOpBoundaries() as sampler:
            step()
        activation = batch * seq * shape.d * 4
        print(f"{name}-like: peak {(sampler.peak - start) / activation:.2f} x [M, d] above the step's start, "
              f"after {sampler.after}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
