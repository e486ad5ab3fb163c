"""codagen: Transformer training with the memory-bound work fused into GEMM epilogues (the CODA method)."""
from ._version import __version__
from .backends import execute, set_backend, use_backend
from .epilogue import Program, ProgramError, library
from .models import is_patched, patch, unpatch

__all__ = ["__version__", "execute", "set_backend", "use_backend", "Program", "ProgramError", "library",
           "patch", "unpatch", "is_patched"]
