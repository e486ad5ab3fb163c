"""What a tuned choice and a generated module are keyed by: the program, the code of its kernels and the
library versions. (The configurations, their pruning and the cache of tuned choices are :mod:`.configs`.)"""
from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import torch
import triton

from codagen._version import __version__
from codagen.epilogue.bind import BoundProgram
from codagen.epilogue.ir import Program

from . import persistent, pingpong

__all__ = ["library_versions", "program_key", "source_hash", "kernel_hash", "tuning_key", "TRITON_DTYPE"]

#: short names of dtypes in keys and cached file names
TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
                torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}

_HERE = Path(__file__).parent


def library_versions() -> str:
    """The library versions a generated module is cached under (and its header names)."""
    return (f"codagen {__version__}, generator {persistent.GENERATOR_VERSION}, triton {triton.__version__}, "
            f"torch {torch.__version__.split('+')[0]}")


def program_key(program: Program) -> str:
    """A canonical text of everything that changes the generated code (the dataclass reprs)."""
    return f"{program.name}|{program.gemm!r}|{program.gemm.a_layout}{program.gemm.b_layout}|{program.outputs!r}"


def source_hash(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


_kernel_hashes: dict[str, str] = {}


#: the shared modules a generated kernel may import, in the order they join its hash
_KERNEL_MODULES = ("device_math", "arrivals", "e4m3")


def kernel_hash(program: Program) -> str:
    """Hash of the code a tuned choice is measured on: the generated ``tl`` kernel (without its version
    line), the shared modules it imports (:data:`_KERNEL_MODULES`: the device math and arrival counters, the e4m3
    coder of a quantizing program) and, for a program the ping-pong schedule takes, the generated Gluon kernel and
    the ping-pong runtime (:mod:`.pingpong.runtime`). A choice stays valid until one of them changes, whatever else
    changes in the generators."""
    key = program_key(program)
    if key not in _kernel_hashes:
        def code_lines(source: str) -> list[str]:
            return [line for line in source.splitlines() if "generator version" not in line]
        source = persistent.generate(program)
        parts = code_lines(source) + [_code_of(_HERE / f"{module}.py") for module in _KERNEL_MODULES
                                      if f"from codagen.backends.triton.{module} import" in source]
        if pingpong.RUNTIME and pingpong.refusal(program) is None:  # the ping-pong kernels exist on this Triton
            parts += code_lines(pingpong.generate(program)) + [_code_of(_HERE / "pingpong" / "runtime.py")]
        _kernel_hashes[key] = source_hash(*parts)
    return _kernel_hashes[key]


def _code_of(path: Path) -> str:
    """A module's lines without docstrings, comment lines and blank lines, so editing those keeps tuned
    choices (a trailing comment still counts). Line-based, not ``ast.dump``: that differs between Python
    versions, and the shipped table must match on every one."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    return "\n".join(line.strip() for number, line in enumerate(source.splitlines(), 1)
                     if number not in docstrings and line.strip() and not line.strip().startswith("#"))


def tuning_key(gpu: str, bound: BoundProgram, tma_mainloop: bool, tma_epilogue_ok: bool,
               versions: str | None = None) -> str:
    """What a tuned choice is cached under: GPU name, Triton and torch versions (``versions``: these
    instead of the installed ones), the program and its kernel's code (:func:`kernel_hash`), operand and
    input dtypes, TMA eligibility and the shape bucket (M, N, K rounded up to powers of two)."""
    if versions is None:
        versions = f"triton {triton.__version__}, torch {torch.__version__.split('+')[0]}"

    def bucket(x: int) -> int:
        return 1 << max(0, (x - 1).bit_length())
    tensors = ",".join(f"{n}:{TRITON_DTYPE.get(t.dtype, t.dtype)}" for n, t in sorted(bound.tensors.items()))
    return (f"{gpu}|{versions}|"
            f"{bound.program.name}:{kernel_hash(bound.program)}|a:{TRITON_DTYPE[bound.dtype]},{tensors}|"
            f"tma:{int(tma_mainloop)}{int(tma_epilogue_ok)}|M{bucket(bound.m)} N{bucket(bound.n)} K{bucket(bound.k)}")
