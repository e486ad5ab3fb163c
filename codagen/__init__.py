"""codagen: Transformer training with the memory-bound work fused into GEMM epilogues (the CODA method)."""
import importlib

from ._version import __version__
from .backends import execute, set_backend, use_backend
from .epilogue import Program, ProgramError, library

__all__ = ["__version__", "execute", "set_backend", "use_backend", "Program", "ProgramError", "library",
           "patch", "unpatch", "is_patched", "refresh_weights"]


def __getattr__(name: str):
    """``patch``, ``unpatch``, ``is_patched``, ``refresh_weights`` (:mod:`codagen.models.hf`) and the ``models``
    and ``ops`` packages, imported on first use: ``import codagen`` leaves out FSDP, DTensor and Dynamo, which
    :mod:`codagen.models.hf` imports."""
    if name in ("patch", "unpatch", "is_patched", "refresh_weights"):
        from . import models
        return getattr(models, name)
    if name in ("models", "ops"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
