"""Layer 1: epilogue programs (the IR), their validation, the CODA program library and finishing reductions."""
from .bind import BoundProgram, bind
from .ir import (Accumulator, Binary, ColPartial, ColVector, Constant, Expr, Gemm, OneHot, Program, ProgramError, Rope,
                 RowPartial, RowVector, ScalarInput, SegmentSum, Store, SwiGLU, SwiGLUBackward, TileInput, Unary, Width)
from . import finish, library

__all__ = ["Accumulator", "Binary", "ColPartial", "ColVector", "Constant", "Expr", "Gemm", "OneHot", "Program",
           "ProgramError", "Rope", "RowPartial", "RowVector", "ScalarInput", "SegmentSum", "Store", "SwiGLU",
           "SwiGLUBackward", "TileInput", "Unary", "Width", "BoundProgram", "bind", "finish", "library"]
