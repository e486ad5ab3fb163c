"""Compile codagen's Triton kernels ahead of their first launch, from the shapes a trace sees.

A kernel compiles on its first launch: 0.3 to 2 s each, one after the other, inside the first step (about
19 s for a Llama's training step on empty caches). Under ``torch.compile`` the shapes are known long
before that step: AOTAutograd calls every codagen op's fake implementation while it traces, and then
Inductor compiles the rest of the graph for many seconds. So each fake implementation also runs the op's
real implementation once on the fake tensors (:func:`dry_run`). There every launch the op would make
(:func:`launch_kernel`) becomes ``JITFunction.warmup`` on stand-ins of its tensors, under Triton's
``AsyncCompileMode``: the kernel compiles in a worker thread (Triton's compiler releases the GIL and
``ptxas`` is a process of its own) and nothing runs. The first real launch after the trace collects the
compiled kernels into Triton's in-process cache (waiting for any still compiling), so it compiles nothing.

Compilation specializes on dtypes, 16-byte alignment and the integers' values, not on addresses: a stand-in
(:class:`_Operand`) carries a fake tensor's dtype, shape, strides and byte offset, and an allocation's base
is taken as aligned (as a fresh allocation from PyTorch's caching allocator is). Where a real tensor
differs, its launch compiles its own specialization, as without this module. A dry run that fails (an
implementation that needs values) is dropped: its kernels compile on first launch.

An eager training step gets the same from a fake trace of itself (:mod:`codagen.models.compile_ahead`).
``CODAGEN_COMPILE_AHEAD=0`` turns the dry runs off.
"""
from __future__ import annotations

import contextvars
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from triton.runtime import _async_compile
from triton.runtime.jit import MockTensor

from .switches import env_flag

__all__ = ["dry_run", "enabled", "launch_kernel", "operand", "tracing", "byte_offset", "pending", "wait"]

_tracing: contextvars.ContextVar[bool] = contextvars.ContextVar("codagen_compile_ahead", default=False)
_mode: _async_compile.AsyncCompileMode | None = None  # created on the first dry run


def tracing() -> bool:
    """Whether the current call is a dry run: launches compile in the background instead of running."""
    return _tracing.get()


def _on_cuda(values) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_cuda for v in values)


def enabled() -> bool:
    """``CODAGEN_COMPILE_AHEAD`` is not 0."""
    return env_flag("CODAGEN_COMPILE_AHEAD", default=True)


def dry_run(impl: Callable, args: tuple, kwargs: dict) -> None:
    """Run ``impl`` (a codagen op's implementation) on fake CUDA tensors, compiling the kernels it would
    launch in worker threads; its results are discarded (the op's fake implementation gives the outputs)."""
    global _mode
    if not enabled() or not (_on_cuda(args) or _on_cuda(kwargs.values())):
        return
    if _mode is None:
        _mode = _async_compile.AsyncCompileMode(_CompileAndLoad(max_workers=os.cpu_count() or 2,
                                                                thread_name_prefix="codagen-compile"))
    token = _tracing.set(True)
    try:
        impl(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an implementation that needs values: its kernels compile when launched
        pass
    finally:
        _tracing.reset(token)


class _CompileAndLoad(ThreadPoolExecutor):
    """Compile workers that also build each compiled kernel's launcher and load it: Triton does that at the first
    launch, on the launching thread, and on empty caches each new launcher signature is a C module built with the
    host compiler, one after the other."""

    def submit(self, fn, /, *args, **kwargs):
        device = torch.cuda.current_device()  # the submitting thread's: the kernel is cached for that device

        def compile_and_load():
            kernel = fn(*args, **kwargs)
            try:
                with torch.cuda.device(device):
                    kernel._init_handles()
            except Exception:  # noqa: BLE001 - the first launch loads it again and reports what is wrong
                kernel.module, kernel.function, kernel._run = None, None, None
            return kernel
        return super().submit(compile_and_load)


class _Operand(MockTensor):
    """What Triton specializes a tensor argument on, without its storage: dtype, shape, strides and the
    byte offset of its first element (an allocation's base counts as 16-byte aligned)."""

    def __init__(self, t: torch.Tensor):
        super().__init__(t.dtype, list(t.shape))
        self._strides = tuple(t.stride())
        self._offset = byte_offset(t)

    def stride(self, dim: int | None = None):
        return self._strides if dim is None else self._strides[dim]

    def data_ptr(self) -> int:
        return self._offset


def byte_offset(t: torch.Tensor) -> int:
    """``t.data_ptr()``, or in a dry run its offset in bytes from its allocation's base (fake tensors
    have no address; only the address modulo 16 matters to the kernels' specialization and TMA checks)."""
    return t.storage_offset() * t.element_size() if _tracing.get() else t.data_ptr()


def operand(t: torch.Tensor):
    """``t``, or in a dry run its stand-in (for a host-side tensor descriptor built around it)."""
    return _Operand(t) if _tracing.get() else t


def launch_kernel(kernel, grid, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``; in a dry run, the kernel's compilation submitted instead."""
    if _tracing.get():
        stand_ins = [_Operand(a) if isinstance(a, torch.Tensor) else a for a in args]
        active = _async_compile.active_mode.get()
        token = _async_compile.active_mode.set(_mode) if active is None else None
        try:
            kernel.warmup(*stand_ins, grid=grid, **meta)
        except Exception:  # noqa: BLE001 - the real launch compiles it, and reports what is wrong
            pass
        finally:
            if token is not None:
                _async_compile.active_mode.reset(token)
        return
    if _mode is not None and _mode.future_kernels:
        wait()
    kernel[grid](*args, **meta)


def pending() -> int:
    """How many kernels dry runs submitted that no launch has collected yet (:func:`wait`)."""
    return 0 if _mode is None else len(_mode.future_kernels)


def wait() -> None:
    """Wait for every kernel submitted by a dry run and put it into Triton's in-process cache (a kernel
    that failed to compile is left out: its launch compiles it again and raises the error)."""
    if _mode is None:
        return
    pending, _mode.future_kernels, _mode.raw_futures = _mode.future_kernels, {}, []
    for future_kernel in pending.values():
        future_kernel.result(ignore_errors=True)
