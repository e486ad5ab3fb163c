"""What both generators share: the formulas of the epilogue's maps, written once for ``tl`` and ``gl``."""
from __future__ import annotations

from codagen.epilogue.ir import Expr

__all__ = ["UNARY", "BINARY", "comment", "swiglu_backward_lines", "rope_lines"]

#: elementwise formulas in ``lang`` (``tl`` or ``gl``: the same names and meaning in both)
UNARY = {
    "neg": "-{x}",
    "exp": "{lang}.exp({x})",
    "log": "{lang}.log({x})",
    "square": "{x} * {x}",
    "rsqrt": "{lang}.rsqrt({x})",
}
BINARY = {
    "add": "{a} + {b}",
    "sub": "{a} - {b}",
    "mul": "{a} * {b}",
    "div": "{a} / {b}",
    "max": "{lang}.maximum({a}, {b}, propagate_nan={lang}.PropagateNan.ALL)",  # torch.maximum propagates NaN
}


def swiglu_backward_lines(name: str, dy: str, gate: str, up: str, sig: str) -> list[str]:
    """The SwiGLU backward of one pair form (both generators emit it): ``name_gate``, ``name_up``."""
    return [f"{name}_gate = {dy} * {up} * {sig} * (1.0 + {gate} * (1.0 - {sig}))",
            f"{name}_up = {dy} * {gate} * {sig}"]


def rope_lines(name: str, even: str, odd: str, cos: str, sin: str, inverse: bool) -> list[str]:
    """The rotation of each pair (even, odd) by theta, or by -theta when ``inverse`` (cos(-t) = cos t,
    sin(-t) = -sin t): ``name_even``, ``name_odd`` (both generators emit it)."""
    if inverse:
        first, second = f"{even} * {cos} + {odd} * {sin}", f"{odd} * {cos} - {even} * {sin}"
    else:
        first, second = f"{even} * {cos} - {odd} * {sin}", f"{even} * {sin} + {odd} * {cos}"
    return [f"{name}_even = {first}", f"{name}_odd = {second}"]


def comment(expr: Expr) -> str:
    text = str(expr)
    return text if len(text) <= 90 else text[:87] + "..."


