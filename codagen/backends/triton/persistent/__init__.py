"""The persistent schedule: one ``tl`` kernel per program, each tile's mainloop then its epilogue on the
same warps (:mod:`.generator`)."""
from .generator import GENERATOR_VERSION, generate

__all__ = ["generate", "GENERATOR_VERSION"]
