"""State codagen keeps per model (a walk of its modules, its fused inference weights), held by the model itself.

A global cache keyed by a model, even a ``weakref.WeakKeyDictionary``, keeps the model alive for as long as a value
refers to it, directly or through a module, a hook or a parameter that leads back to it: a walk of
``named_modules()`` names the model itself. The model, its gradients and its optimizer state then stay on the GPU
after the last user reference is gone. A :class:`PerModel` slot keeps its value in the model's own ``__dict__``
instead, so the value goes with the model (Python's cycle collector frees both). ``copy.deepcopy`` and pickling give a
copy an empty slot: what was kept describes the original's tensors and modules.
"""
from __future__ import annotations

from torch import nn

__all__ = ["PerModel"]


class _Held:
    __slots__ = ("value",)

    def __init__(self, value=None):
        self.value = value

    def __deepcopy__(self, memo):
        return _Held()

    def __reduce__(self):
        return (_Held, ())


class PerModel:
    """One named slot on every model: ``get(model)`` (``None`` when unset), ``set(model, value)``, ``pop(model)``,
    ``model in slot``."""

    def __init__(self, name: str):
        self.attribute = f"_codagen_{name}"

    def get(self, model: nn.Module):
        held = model.__dict__.get(self.attribute)
        return None if held is None else held.value

    def set(self, model: nn.Module, value) -> None:
        model.__dict__[self.attribute] = _Held(value)  # a plain attribute: nn.Module's __setattr__ has nothing to do

    def pop(self, model: nn.Module) -> None:
        model.__dict__.pop(self.attribute, None)

    def __contains__(self, model: nn.Module) -> bool:
        return self.get(model) is not None
