"""Triton backend: each epilogue program compiles to ONE persistent GEMM kernel with the program fused in.

* Mainloop: persistent grid over output tiles in grouped (L2-friendly) order; on Hopper, TMA
  tensor-descriptor loads with a multi-stage pipeline; a masked pointer-load variant of the same
  template for other GPUs and for operands whose rows break TMA's 16-byte alignment. bf16/fp16
  operands use the tensor cores with fp32 accumulation; float32 operands multiply in IEEE fp32.
* Epilogue: generated from the IR (:mod:`.persistent`), run on the fp32 accumulator in registers;
  :func:`program_source` prints it.
* Tuning: a few configurations pruned by shared memory and registers, timed on first use, cached on
  disk per GPU, versions, kernel code and shape bucket (:mod:`.configs`, :mod:`.tuning`). On Hopper the
  candidates include a warp-specialized ping-pong kernel generated from the same program in Gluon
  (:mod:`.pingpong`): one consumer warpgroup's epilogue overlaps the other's mainloop.
* CPU tensors run the same kernels in the Triton interpreter (no ``TRITON_INTERPRET`` needed).
"""
from .backend import SUPPORTED_DTYPES, TritonBackend
from .configs import INTERPRETER_CONFIG, KernelConfig
from .modules import load_kernel, program_source

__all__ = ["TritonBackend", "program_source", "load_kernel", "KernelConfig", "INTERPRETER_CONFIG",
           "SUPPORTED_DTYPES"]
