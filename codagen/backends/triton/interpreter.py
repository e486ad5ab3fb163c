"""Launching generated kernels in the Triton interpreter, per call, next to compiled ones.

The interpreter is normally chosen once, by ``TRITON_INTERPRET=1`` before ``import triton``; here it is
chosen per launch: :mod:`.modules` loads the generated module a second time with
``triton.knobs.runtime.interpret`` set (so its ``@triton.jit`` functions become interpreted ones), and
while it runs, the ``@triton.jit`` functions of ``triton.language`` itself (``tl.zeros``, ``tl.sum``, ...)
are called the interpreter's way (:func:`interpreting`). Nothing needs exporting before import and GPU
kernels are unaffected.

Only the interpreter needs numpy (Triton's interpreter is numpy), and Triton 3.6's breaks on numpy 2.3 and
newer: :func:`check_numpy` refuses a CPU launch on any other numpy with the fix, and numpy and Triton's
interpreter are imported at the first interpreted launch.
"""
from __future__ import annotations

import contextlib
import re
import threading

from triton.runtime.jit import JITFunction

__all__ = ["interpreting", "check_numpy", "NUMPY_BELOW"]

#: the numpy versions the Triton 3.6 interpreter runs on: below this one
NUMPY_BELOW = (2, 3)
_interpret_lock = threading.RLock()
_interpreted_wrappers: dict = {}


def check_numpy() -> None:
    """Refuse to run the interpreter without numpy or on a numpy it breaks on, naming the installed version
    and the fix (instead of an error from inside the interpreter)."""
    below = ".".join(map(str, NUMPY_BELOW))
    try:
        import numpy
        version = numpy.__version__
    except ModuleNotFoundError:
        version = None
    match = re.match(r"(\d+)\.(\d+)", version or "")
    if version is None or (match is not None and tuple(map(int, match.groups())) >= NUMPY_BELOW):
        installed = "numpy is not installed" if version is None else f"numpy {version} is installed"
        raise RuntimeError(f"the Triton interpreter (codagen's Triton kernels on CPU tensors) needs numpy < {below}, "
                           f"but {installed}: pip install \"numpy<{below}\" (or, from the checkout, pip install -e "
                           f"\".[interpret]\"), or run CPU tensors on the reference backend "
                           f"(codagen.set_backend(\"reference\"))")


@contextlib.contextmanager
def interpreting():
    """Run ``triton.language``'s own ``@triton.jit`` helpers the interpreter's way, for one launch.

    The interpreter swaps ``triton.language`` builtins for numpy ones while it runs. Triton 3.6 puts
    back what a kernel launch swapped but not what an interpreted helper call swapped (e.g. ``tl.cdiv``'s
    module ``triton.language.core``); left so, a later compile in the same process (a real kernel for
    the GPU) fails inside ``tl.cdiv``. Every attribute swapped during the launch is restored here to
    the value it had before the launch."""
    import numpy as np
    from triton.runtime import interpreter

    def call_interpreted(self, *args, **kwargs):
        wrapper = _interpreted_wrappers.get(self.fn)
        if wrapper is None:
            wrapper = _interpreted_wrappers[self.fn] = interpreter.InterpretedFunction(self.fn)
        return wrapper(*args, **kwargs)

    before: dict[tuple[int, str], tuple[object, str, object]] = {}
    set_attr = interpreter._LangPatchScope.set_attr

    def recording_set_attr(scope, obj, name, value):
        before.setdefault((id(obj), name), (obj, name, getattr(obj, name, interpreter._MISSING)))
        set_attr(scope, obj, name, value)

    with _interpret_lock, np.errstate(all="ignore"):  # masked-off lanes are computed too (log 0, x / 0)
        original = JITFunction.__call__
        JITFunction.__call__ = call_interpreted
        interpreter._LangPatchScope.set_attr = recording_set_attr
        try:
            yield
        finally:
            JITFunction.__call__ = original
            interpreter._LangPatchScope.set_attr = set_attr
            for obj, name, value in before.values():
                if value is interpreter._MISSING:
                    if name in vars(obj):
                        delattr(obj, name)
                else:
                    setattr(obj, name, value)
