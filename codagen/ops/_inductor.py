"""The codagen custom ops as Inductor fallbacks, registered before Inductor lowers a graph.

For an op it has no lowering for, torch 2.11's Inductor (``GraphLowering.call_function``) first formats
a log message of the op's arguments, eagerly and at any log level, then registers the op as an implicit
fallback. The arguments are IR nodes that print their inputs recursively, so the message prints the
graph above the op as a tree: a residual stream reaches each layer along two paths, and the text
doubles with every layer (a 4-layer patched Llama's first compiled step did not finish in 400 s on CPU;
``docs/notes/compile.md``). Registering the fallbacks ahead skips that message. Each fake implementation
calls :func:`register_inductor_fallbacks`: fakes run when AOTAutograd traces, after Inductor is imported
and before it lowers.
"""
from __future__ import annotations

import functools
import sys

import torch

__all__ = ["register_fake", "register_inductor_fallbacks"]

_registered = False


def register_inductor_fallbacks() -> None:
    """Make every ``codagen::`` op an Inductor fallback (once, and only where Inductor is loaded)."""
    global _registered
    lowering = sys.modules.get("torch._inductor.lowering")
    if _registered or lowering is None:
        return
    for name in dir(torch.ops.codagen):
        packet = getattr(torch.ops.codagen, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if op not in lowering.lowerings:
                lowering.make_fallback(op, warn=False)
    _registered = True


def register_fake(op):
    """``@op.register_fake`` whose implementation first calls :func:`register_inductor_fallbacks`."""
    def decorate(fn):
        @functools.wraps(fn)
        def fake(*args, **kwargs):
            register_inductor_fallbacks()
            return fn(*args, **kwargs)
        op.register_fake(fake)
        return fn
    return decorate
