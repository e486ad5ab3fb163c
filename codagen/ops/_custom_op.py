"""The scaffold of every fused op: a ``torch.library`` custom op declared once, an autograd Function
whose backward names its gradients.

Each public op validates its arguments, then calls a ``torch.autograd.Function`` whose forward and backward
call custom ops (``codagen::...``), so ``torch.compile(fullgraph=True)`` sees one opaque node per fused
step. A custom op cannot return None: a gradient it does not compute comes back as an empty tensor,
and the Function hands autograd None instead.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from ._inductor import register_fake

__all__ = ["custom_op", "named_gradients"]


def custom_op(name: str, fake: Callable[..., object]) -> Callable:
    """Declare the decorated function as the custom op ``codagen::name`` (it mutates no argument).

    ``fake`` gives the outputs' shapes and dtypes for tracing (empty tensors, no kernel runs). It takes
    the op's arguments by name and declares only those it reads (``**_`` for the rest).
    """
    def declare(impl: Callable) -> Callable:
        op = torch.library.custom_op(f"codagen::{name}", mutates_args=())(impl)
        signature = inspect.signature(impl)

        def fake_impl(*args, **kwargs):
            return fake(**signature.bind(*args, **kwargs).arguments)
        register_fake(op)(fake_impl)
        return op
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
