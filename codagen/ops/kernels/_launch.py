"""The plumbing every row kernel shares: the Triton import, the launcher's device and the dispatcher.

Each kernel comes as ``foo_ref`` (PyTorch), ``foo_triton`` (one launch of a module-level ``@triton.jit``
kernel by :func:`launch_kernel`, wrapped in :func:`launcher`) and ``foo = dispatcher(foo_ref, foo_triton)``:
the kernel for CUDA tensors when the selected backend is ``triton`` and the dtype is not float64 (the oracle
dtype); otherwise the twin. ``launch_kernel`` (:mod:`codagen.backends.triton.ahead`) launches, or in a dry run
under ``torch.compile``'s tracing compiles the kernel in the background instead.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from codagen.backends import on_device, resolve_backend_name
from codagen.epilogue.bind import cdiv

try:  # the package must import without Triton (or without a GPU)
    import triton
    import triton.language as tl

    from codagen.backends.triton import arrivals, dependent_launch
    from codagen.backends.triton.ahead import launch_kernel
    from codagen.backends.triton.arrivals import last_to_arrive
    from codagen.backends.triton.device_math import cos_sin, sigmoid
    from codagen.backends.triton.e4m3 import e4m3_code
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    class _NoTriton:
        """``triton`` where it is not installed: ``@triton.jit`` keeps the kernel a plain function, which
        nothing launches (:func:`use_triton` is false)."""

        @staticmethod
        def jit(fn=None, **_options):
            return fn if fn is not None else (lambda kernel: kernel)

    triton, tl, cos_sin, sigmoid, e4m3_code, launch_kernel, dependent_launch = (_NoTriton(), None, None, None, None,
                                                                                None, None)
    arrivals, last_to_arrive = None, None
    TRITON_AVAILABLE = False
else:
    TRITON_AVAILABLE = True

__all__ = ["triton", "tl", "cos_sin", "sigmoid", "e4m3_code", "launch_kernel", "dependent_launch", "arrivals",
           "last_to_arrive", "launcher", "dispatcher", "use_triton", "interpreting", "portable_math", "row_block",
           "next_power_of_2", "cdiv"]

#: widest block of a row kernel that loops over its row
MAX_BLOCK = 2048


def use_triton(t: torch.Tensor) -> bool:
    return (TRITON_AVAILABLE and t.is_cuda and t.dtype != torch.float64
            and resolve_backend_name(t.device) == "triton")


def launcher(fn: Callable) -> Callable:
    """Launch ``fn``'s kernel on its first tensor's device (:func:`codagen.backends.on_device`); a first
    argument that is a sequence of tensors gives its first one's (an empty one leaves ``fn`` to refuse it)."""
    @functools.wraps(fn)
    def launch(first, *args, **kwargs):
        tensor = first if isinstance(first, torch.Tensor) else next(iter(first), None)
        with on_device(tensor.device) if tensor is not None else contextlib.nullcontext():
            return fn(first, *args, **kwargs)
    return launch


def dispatcher(ref: Callable, triton_launcher: Callable, *, tensor_arg: int = 0) -> Callable:
    """The row op itself: ``triton_launcher`` when :func:`use_triton` holds for its positional argument
    ``tensor_arg``, else ``ref`` (whose name without ``_ref`` and docstring it takes)."""
    @functools.wraps(ref)
    def dispatch(*args, **kwargs):
        return (triton_launcher if use_triton(args[tensor_arg]) else ref)(*args, **kwargs)
    dispatch.__name__ = dispatch.__qualname__ = ref.__name__.removesuffix("_ref")
    return dispatch


def interpreting() -> bool:
    """Whether the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


def portable_math() -> bool:
    """Whether the device math takes its portable formulas (``PORTABLE``: no inline PTX): in the interpreter and
    on AMD GPUs (a ROCm build of torch)."""
    return interpreting() or torch.version.hip is not None


def next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` (1 for n <= 1): ``triton.next_power_of_2`` as a plain function (Triton's
    is a ``constexpr_function`` object, a few microseconds per host call; launchers call it every launch)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def row_block(columns: int) -> int:
    """The block of a kernel that loops over a row of ``columns``: the row's power of two, at most
    :data:`MAX_BLOCK`."""
    return min(next_power_of_2(columns), MAX_BLOCK)
