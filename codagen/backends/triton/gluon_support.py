"""Which Triton releases the Gluon ping-pong kernels (:mod:`.pingpong`) run on.

Gluon (``triton.experimental.gluon``) is experimental: its names and signatures change between minor
releases of Triton. The ping-pong kernels are written against Triton 3.6 and run on
:data:`GLUON_TRITON` releases only. On any other release the ping-pong schedule is not offered: tuning
keeps to the persistent ``tl`` kernels (one ``UserWarning`` per process says so), a configuration that
asks for ``schedule="pingpong"`` raises ``ProgramError`` naming the installed version, and importing
:mod:`.pingpong.runtime` raises ``ImportError`` with the same reason. The persistent kernels need no Gluon.
"""
from __future__ import annotations

import functools
import importlib
import re
import warnings

import triton

__all__ = ["GLUON_TRITON", "GLUON_NAMES", "pingpong_unsupported", "pingpong_available"]

#: Triton releases the ping-pong kernels run on: ``[lowest, first unsupported)`` as (major, minor)
GLUON_TRITON = ((3, 6), (3, 7))

#: the Gluon names the ping-pong runtime and its generated kernels use, by module
GLUON_NAMES = {
    "triton.experimental.gluon": ("jit",),
    "triton.experimental.gluon.language": (
        "NVMMADistributedLayout", "NVMMASharedLayout", "SliceLayout", "allocate_shared_memory", "arange",
        "convert_layout", "warp_specialize", "static_range", "inline_asm_elementwise", "expand_dims", "join",
        "split", "reshape", "permute", "where", "exp", "log", "fma", "floor", "maximum", "minimum", "sum", "max",
        "load", "store", "full", "zeros", "program_id", "num_programs", "cdiv", "constexpr", "float32",
        "bfloat16", "float16", "int64", "int32"),
    "triton.experimental.gluon._runtime": ("GluonASTSource",),
    "triton.experimental.gluon.nvidia.hopper": ("TensorDescriptor",),
    "triton.experimental.gluon.language.nvidia.hopper": ("mbarrier", "tma", "warpgroup_mma", "warpgroup_mma_wait"),
    "triton.experimental.gluon.language.nvidia.hopper.tma": (
        "async_copy_global_to_shared", "async_copy_shared_to_global", "store_wait"),
    "triton.experimental.gluon.language.nvidia.hopper.mbarrier": ("MBarrierLayout", "init", "wait", "expect",
                                                                    "arrive"),
}


def _release(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def pingpong_unsupported(version: str | None = None) -> str | None:
    """Why the installed Triton (or a release ``version``) cannot run the ping-pong kernels; None if it
    can. A release outside :data:`GLUON_TRITON` is refused by its number; the installed one must also
    have every name of :data:`GLUON_NAMES` (a build that lacks one is refused naming it)."""
    if version is None:
        return _installed_unsupported()
    (low, high), release = GLUON_TRITON, _release(version)
    if release is None or not low <= release < high:
        return (f"the Gluon ping-pong kernels need Triton >= {low[0]}.{low[1]}, < {high[0]}.{high[1]} (Gluon's API "
                f"changes between minor releases); Triton {version} is installed")
    return None


@functools.cache
def _installed_unsupported() -> str | None:
    reason = pingpong_unsupported(triton.__version__)
    if reason is not None:
        return reason
    missing = []
    for module_name, names in GLUON_NAMES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        missing += [f"{module_name}.{name}" for name in names if not hasattr(module, name)]
    if missing:
        return f"Triton {triton.__version__} lacks the Gluon names the ping-pong kernels use: {', '.join(missing)}"
    return None


_warned = False


def pingpong_available() -> bool:
    """Whether tuning may offer the ping-pong schedule; warns once per process when it may not."""
    global _warned
    reason = pingpong_unsupported()
    if reason is not None and not _warned:
        _warned = True
        warnings.warn(f"codagen: {reason}; the Triton backend tunes over the persistent kernels only", UserWarning,
                      stacklevel=3)
    return reason is None
