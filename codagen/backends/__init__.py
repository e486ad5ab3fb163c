"""Backends execute epilogue programs.

``reference``  PyTorch, any device (the oracle; the default without a GPU).
``triton``     fused Triton kernels: persistent TMA GEMM on Hopper, pointer loads elsewhere, and the
               Triton interpreter on CPU tensors.
``auto``       ``triton`` for CUDA tensors when Triton is importable, else ``reference``.

Choose with ``codagen.set_backend(name)``, the ``backend=`` argument of :func:`execute`, or the
environment variable ``CODAGEN_BACKEND`` (read at each call; ``set_backend`` wins over it).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator

import torch

from codagen.epilogue.bind import bind
from codagen.epilogue.ir import Program

from .device import on_device
from .reference import ReferenceBackend

_TRITON = importlib.util.find_spec("triton") is not None
if _TRITON:  # the package imports without Triton; the backend is there when Triton is
    from .triton import TritonBackend, ahead

__all__ = ["BACKENDS", "execute", "get_backend", "resolve_backend_name", "set_backend", "use_backend",
           "triton_available", "on_device", "compile_ahead", "compiles_ahead", "compiling_ahead"]

BACKENDS = ("auto", "reference", "triton")
_selected: str | None = None


def triton_available() -> bool:
    return _TRITON


def _check_name(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: unknown backend {name!r}; expected one of {BACKENDS}")
    return name


def set_backend(name: str | None) -> None:
    """Select the backend for later calls; ``None`` returns control to ``CODAGEN_BACKEND``."""
    global _selected
    _selected = None if name is None else _check_name(name, "set_backend")


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """``with use_backend("reference"): ...`` selects a backend for a block of code."""
    global _selected
    previous = _selected
    set_backend(name)
    try:
        yield
    finally:
        _selected = previous


def resolve_backend_name(device: torch.device, name: str | None = None) -> str:
    """The concrete backend (``reference`` or ``triton``) that runs for tensors on ``device``."""
    if name is not None:
        name = _check_name(name, "backend argument")
    elif _selected is not None:
        name = _selected
    else:
        name = _check_name(os.environ.get("CODAGEN_BACKEND", "auto").strip().lower() or "auto", "CODAGEN_BACKEND")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "reference"
    if name == "triton" and not triton_available():
        raise RuntimeError("backend 'triton' was selected but Triton is not installed (pip install triton)")
    return name


@functools.cache
def get_backend(name: str):
    """The backend object for a concrete name."""
    if name == "reference":
        return ReferenceBackend()
    if name == "triton":
        return TritonBackend()
    raise ValueError(f"no backend object for {name!r}; expected 'reference' or 'triton'")


def execute(program: Program, a: torch.Tensor, b: torch.Tensor, *, backend: str | None = None,
            **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run ``program`` on operands ``a``, ``b`` and its named inputs; return its outputs by name.

    Outputs stored with ``accumulate=True`` are passed in ``tensors`` and updated in place.
    A forward primitive: the outputs never carry autograd history, whatever ``requires_grad`` the inputs
    have, on every backend (:mod:`codagen.ops` adds the autograd).
    """
    bound = bind(program, a, b, tensors)
    with torch.no_grad():
        return get_backend(resolve_backend_name(bound.device, backend)).run(bound)


def compiles_ahead(device: torch.device) -> bool:
    """Whether ops on ``device`` compile their kernels ahead when traced: the Triton backend runs them on a GPU,
    and ``CODAGEN_COMPILE_AHEAD`` is not 0."""
    return (_TRITON and device.type == "cuda" and resolve_backend_name(device) == "triton"
            and ahead.enabled())


def compiling_ahead() -> int:
    """How many kernels the ops' dry runs have submitted that no launch has collected yet."""
    return ahead.pending() if _TRITON else 0


def compile_ahead(impl, args: tuple, kwargs: dict) -> None:
    """Called by a codagen op's fake implementation while a trace runs: where the Triton backend runs the
    op's CUDA tensors, ``impl(*args, **kwargs)`` runs once on the fakes and each kernel it would launch
    compiles in a worker thread instead (:mod:`codagen.backends.triton.ahead`)."""
    if not _TRITON:
        return
    first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.is_cuda), None)
    if first is not None and resolve_backend_name(first.device) == "triton":
        ahead.dry_run(impl, args, kwargs)
