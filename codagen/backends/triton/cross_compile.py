"""Compile a program's persistent kernel, or a row kernel's launch, for a target without its GPU (``triton.compile``
with a ``GPUTarget``).

What the compile matrices (``tests/backends/test_compile_matrix.py``, the row kernels' in ``tests/ops/test_kernels.py``)
and ``bench/triton_resources.py`` run:

- :func:`compile_persistent`: the generated ``tl`` kernel of one configuration, its pointer arguments 16-byte aligned
  and M, N, K multiples of 16 (what the backend's launches specialize on for aligned tensors), TMA where the target
  has it;
- :func:`compile_row_kernel`: one launch of a ``codagen.ops.kernels`` row kernel, its arguments specialized by
  Triton's own binder, as a launch on that target would;

both with the device math portable where the target has no inline PTX (:mod:`.targets`).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import MockTensor, create_function_from_signature

from codagen.epilogue.bind import ACTIVATION_DTYPE
from codagen.epilogue.ir import Program, QuantizedStore, RowVector, Store, TileInput

from .configs import KernelConfig
from .modules import load_kernel
from .targets import Target, compile_target
from .tuning import TRITON_DTYPE

__all__ = ["signature", "compile_persistent", "Pointer", "compile_row_kernel", "cubin_resources"]

_CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "EPILOGUE_SPLIT", "SUB_N", "TMA_MAINLOOP", "TMA_EPILOGUE",
               "UPCAST_OPERANDS", "DOT_PRECISION", "FLATTEN", "PORTABLE", "PDL", "PREFETCH_K")


#: the activation dtype of operands whose "input" stores and tiles are another one (bind.ACTIVATION_DTYPE), by
#: Triton's names
_ACTIVATION = {TRITON_DTYPE[operand]: TRITON_DTYPE[activation] for operand, activation in ACTIVATION_DTYPE.items()}


def signature(program: Program, dtype: str) -> dict[str, str]:
    """The persistent kernel's argument types (``dtype``: the operands' Triton type, ``"bf16"``): operands, the
    epilogue's inputs (tiles in the activation dtype: ``dtype``, bf16 for ``"fp8e4nv"``; index vectors int64, the
    rest fp32) and outputs (``"input"`` stores in the activation dtype, the others in their own), M, N, K,
    constexprs. A quantized store's e4m3 codes are passed as their bits (uint8); its scales and K-group scales are
    fp32."""
    sig = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}"}
    sig.update({f"{name}_ptr": f"*{dtype}" if name in ("a2", "b2") else "*fp32"
                for name in program.gemm.operand_tensors})
    activation = _ACTIVATION.get(dtype, dtype)
    for name, e in program.inputs.items():
        if isinstance(e, RowVector) and e.index:
            sig[f"{name}_ptr"] = "*i64"
        elif isinstance(e, TileInput):
            sig[f"{name}_ptr"] = f"*{activation}"
        else:
            sig[f"{name}_ptr"] = "*fp32"
    for o in program.outputs:
        if isinstance(o, QuantizedStore):
            sig[f"{o.name}_ptr"], sig[f"{o.scale}_ptr"] = "*u8", "*fp32"  # the codes as their bits
        elif not isinstance(o, Store):
            sig[f"{o.name}_ptr"] = "*fp32"  # partials
        else:
            sig[f"{o.name}_ptr"] = f"*{activation if o.dtype == 'input' else TRITON_DTYPE[getattr(torch, o.dtype)]}"
    sig.update(M="i32", N="i32", K="i32")
    sig.update({name: "constexpr" for name in _CONSTEXPRS})
    return sig


def compile_persistent(program: Program, cfg: KernelConfig, target: Target, dtype: str = "bf16"):
    """The compiled persistent kernel of ``program`` in ``cfg`` for ``target`` (a ``triton.compiler`` result:
    ``asm`` holds the PTX or AMDGCN, ``metadata.shared`` its shared memory)."""
    import triton
    kernel = load_kernel(program, dtypes=f"cross:{dtype}", arch=target.name, interpret=False)
    sig = signature(program, dtype)
    pointers = sum(1 for v in sig.values() if v.startswith("*"))
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(pointers + 3)}
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                      EPILOGUE_SPLIT=cfg.epilogue_split, SUB_N=cfg.sub_n, TMA_MAINLOOP=target.tma,
                      TMA_EPILOGUE=cfg.tma_epilogue and target.tma, UPCAST_OPERANDS=False,
                      DOT_PRECISION=target.dot_precision(dtype == "fp32"), FLATTEN=True, PORTABLE=target.portable,
                      PDL=False, PREFETCH_K=0)
    return triton.compile(ASTSource(kernel, sig, constexprs, aligned), target=compile_target(target),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


class Pointer(MockTensor):
    """A tensor argument as a kernel specializes on it, without storage: its dtype and its address modulo 16."""

    def __init__(self, dtype, offset: int = 0):
        super().__init__(dtype)
        self._offset = offset

    def data_ptr(self) -> int:
        return self._offset


def compile_row_kernel(kernel, args: list, meta: dict, target: Target):
    """``kernel`` (a module-level ``@triton.jit`` kernel) compiled for ``target`` as its launch with ``args`` (tensors
    as :class:`Pointer`) and ``meta`` (constexprs and ``num_warps``) would compile it there.

    Triton's binder for the target's backend specializes the arguments (16-byte alignment, integers equal to 1 or
    multiples of 16; ``JITFunction._pack_args`` of the Triton range pyproject pins); ``PORTABLE`` follows the target,
    and ``PDL`` (programmatic dependent launch, :mod:`.dependent_launch`) is on where the target has it (NVIDIA sm_90+).
    """
    import triton
    meta = dict(meta)
    if "PORTABLE" in meta:
        meta["PORTABLE"] = target.portable
    if "PDL" in meta:
        meta["PDL"] = target.backend == "cuda" and target.arch >= 90
    meta.pop("launch_pdl", None)  # a launch option: the compiled code is the same
    gpu = compile_target(target)
    backend = make_backend(gpu)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **meta)
    options, sig, constexprs, attrs = kernel._pack_args(backend, meta, bound, specialization, options)
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=gpu, options=options.__dict__)


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """``(registers per thread, stack bytes per thread)`` of an NVIDIA kernel (``cuobjdump --dump-resource-usage``,
    the one Triton ships); stack bytes are spilled registers or local arrays. ``-1`` where it prints none."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    registers, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    return int(registers.group(1)) if registers else -1, int(stack.group(1)) if stack else -1
