"""The emitter both generators build on: the lines of one generated function, its temporaries and memo.

A primitive writes its own code (``emit_persistent``, ``emit_pingpong`` in ``codagen.epilogue.primitives``)
through the emitter a generator passes in; the emitter supplies the variables of operands, the shared
helper values (pair splits, sigmoids, angles) and the index/mask names of the schedule.
"""
from __future__ import annotations

from codagen.epilogue.ir import Expr, Program

__all__ = ["Emitter", "comment"]


def comment(expr: Expr) -> str:
    """An expression's printed form, shortened to fit a trailing comment."""
    text = str(expr)
    return text if len(text) <= 90 else text[:87] + "..."


class Emitter:
    """Lines in order, numbered temporaries ``<stem>_<n>`` and a memo of shared helper values."""

    def __init__(self, program: Program):
        self.program = program
        self.lines: list[str] = []
        self.memo: dict[tuple, object] = {}
        self.counter = 0

    def emit(self, line: str = "") -> None:
        self.lines.append(line)

    def fresh(self, stem: str) -> str:
        self.counter += 1
        return f"{stem}_{self.counter}"

    @staticmethod
    def comment(expr: Expr) -> str:
        return comment(expr)
