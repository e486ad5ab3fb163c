"""Compile a program's persistent kernel for a target without its GPU (``triton.compile`` with a ``GPUTarget``).

What the compile matrix (``tests/backends/test_compile_matrix.py``) and ``bench/triton_resources.py`` run: the
generated ``tl`` kernel of one configuration, its pointer arguments 16-byte aligned and M, N, K multiples of 16 (what
the backend's launches specialize on for aligned tensors), TMA where the target has it, the device math portable
where the target has no inline PTX (:mod:`.targets`).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

from triton.compiler import ASTSource

from codagen.epilogue.ir import Program, RowVector, Store, TileInput

from .configs import KernelConfig
from .modules import load_kernel
from .targets import Target, compile_target

__all__ = ["signature", "compile_persistent", "cubin_resources"]

_CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "EPILOGUE_SPLIT", "SUB_N", "TMA_MAINLOOP", "TMA_EPILOGUE",
               "UPCAST_OPERANDS", "DOT_PRECISION", "FLATTEN", "PORTABLE", "PDL", "PREFETCH_K")


def signature(program: Program, dtype: str) -> dict[str, str]:
    """The persistent kernel's argument types (``dtype``: the operands' Triton type, ``"bf16"``): operands, the
    epilogue's inputs (tiles in ``dtype``, index vectors int64, the rest fp32) and outputs, M, N, K, constexprs."""
    sig = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}"}
    for name, e in program.inputs.items():
        if isinstance(e, RowVector) and e.index:
            sig[f"{name}_ptr"] = "*i64"
        elif isinstance(e, TileInput):
            sig[f"{name}_ptr"] = f"*{dtype}"
        else:
            sig[f"{name}_ptr"] = "*fp32"
    for o in program.outputs:
        sig[f"{o.name}_ptr"] = (f"*{dtype}" if o.dtype == "input" else "*fp32") if isinstance(o, Store) else "*fp32"
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
