"""Layer 1: epilogue programs (the IR), their validation, the CODA program library and finishing reductions."""
from . import finish, library
from .bind import BoundProgram, bind
from .ir import *  # noqa: F401,F403 - the IR: the frame and every primitive
from .ir import __all__ as _ir

__all__ = [*_ir, "BoundProgram", "bind", "finish", "library"]
