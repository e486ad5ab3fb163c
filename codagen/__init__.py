"""codagen: Transformer training with the memory-bound work fused into GEMM epilogues (the CODA method)."""
from ._version import __version__
from .backends import execute, set_backend, use_backend
from .epilogue import Program, ProgramError, library

__all__ = ["__version__", "execute", "set_backend", "use_backend", "Program", "ProgramError", "library",
           "patch", "unpatch", "is_patched"]


def __getattr__(name: str):
    if name in ("patch", "unpatch", "is_patched"):  # codagen.models.hf, loaded on first use (codagen.models)
        from . import models
        return getattr(models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
