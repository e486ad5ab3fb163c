"""The scaffold of every fused op: a ``torch.library`` custom op declared once, an autograd Function
whose backward names its gradients.

Each public op validates its arguments, then calls a ``torch.autograd.Function`` whose forward and backward
call custom ops (``codagen::...``), so ``torch.compile(fullgraph=True)`` sees one opaque node per fused
step. A custom op cannot return None: a gradient it does not compute comes back as an empty tensor,
and the Function hands autograd None instead.

In plain eager calls (no tracing, no dispatch mode, no functorch transform, plain tensors, grad mode off
as inside a Function's forward and backward) the op's implementation is called directly: the
dispatcher's route to a Python implementation costs 30 to 40 microseconds per call, about as much as
the rest of a fused op's host path (``docs/notes/host-overhead.md``). Everywhere else the call goes
through ``torch.ops.codagen``.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from codagen.backends import compile_ahead

from ._inductor import register_fake

__all__ = ["custom_op", "named_gradients", "runs_directly"]

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _plain(value) -> bool:
    if isinstance(value, torch.Tensor):
        return type(value) in _PLAIN_TENSORS
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return True


def runs_directly(args: tuple, kwargs: dict) -> bool:
    """Whether a custom op called with ``args``/``kwargs`` may run its implementation without the
    dispatcher: eager (not under ``torch.compile``), grad mode off, no dispatch mode (``FakeTensorMode``,
    ``TorchDispatchMode`` recorders), no functorch transform, and only plain tensors (no FakeTensor,
    DTensor or FunctionalTensor): then the dispatcher would call the implementation and nothing else."""
    return (not torch.compiler.is_compiling() and not torch.is_grad_enabled()
            and _get_current_dispatch_mode() is None and not torch._C._are_functorch_transforms_active()
            and all(_plain(a) for a in args) and all(_plain(v) for v in kwargs.values()))


def custom_op(name: str, fake: Callable[..., object]) -> Callable:
    """Declare the decorated function as the custom op ``codagen::name`` (it mutates no argument); returns
    a function that calls the op, or its implementation directly where :func:`runs_directly` holds.

    ``fake`` gives the outputs' shapes and dtypes for tracing (empty tensors, no kernel runs). It takes
    the op's arguments by name and declares only those it reads (``**_`` for the rest). While tracing, the
    implementation also runs once on the fake tensors, to compile its kernels ahead
    (:func:`codagen.backends.compile_ahead`).
    """
    def declare(impl: Callable) -> Callable:
        op = torch.library.custom_op(f"codagen::{name}", mutates_args=())(impl)
        signature = inspect.signature(impl)

        def fake_impl(*args, **kwargs):
            compile_ahead(impl, args, kwargs)  # the kernels of the first real call compile while tracing goes on
            return fake(**signature.bind(*args, **kwargs).arguments)
        register_fake(op)(fake_impl)

        @functools.wraps(impl)
        def call(*args, **kwargs):
            return impl(*args, **kwargs) if runs_directly(args, kwargs) else op(*args, **kwargs)
        call.op = op
        return call
    return declare


def named_gradients(forward) -> Callable:
    """Decorate the ``backward`` of a ``torch.autograd.Function`` whose ``forward`` is given, so that it
    refers to the inputs by name: ``backward(ctx, needs, *grad_outputs)`` gets ``needs`` = {input name:
    ``ctx.needs_input_grad``} and returns {input name: gradient}; the inputs it leaves out get None."""
    names = tuple(inspect.signature(forward.__func__).parameters)[1:]  # after ctx

    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def autograd_backward(ctx, *grad_outputs):
            grads = backward(ctx, dict(zip(names, ctx.needs_input_grad)), *grad_outputs)
            unknown = [name for name in grads if name not in names]
            if unknown:
                raise TypeError(f"{backward.__qualname__}: no input named {unknown}")
            return tuple(grads.get(name) for name in names)
        return autograd_backward
    return decorate
