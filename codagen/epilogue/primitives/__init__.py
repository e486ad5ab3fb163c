"""The epilogue primitives, one module each: writing a new primitive is adding a module here.

A module defines one :class:`~codagen.epilogue.core.Expr` subclass, registered with ``@primitive``,
that carries everything about it (see ``Expr``): the node and its validation, its printed form, its
reference semantics, its ``tl`` and Gluon code (through the emitter a generator passes in: the program
layer produces text and imports nothing of the backends), its tile constraints and example programs.
The gated activations (SwiGLU, GeGLU and their backwards) subclass the two bases of
:mod:`codagen.epilogue.gated`: a new one gives its name, float64 twin and device formulas only.
Backends dispatch through these methods; ``tests/program/test_primitives.py`` runs every primitive's
examples against float64 math, on the reference backend, in the Triton interpreter in every GEMM layout
and through the sm_90 compile of the ping-pong kernel. Every module of this package is imported here,
so a new one needs no other edit.
"""
import importlib
import pkgutil

from ..core import PRIMITIVES

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

globals().update(PRIMITIVES)
__all__ = list(PRIMITIVES)
