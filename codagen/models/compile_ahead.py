"""Compile a patched model's kernels in parallel before its first eager training step at new shapes.

Each Triton kernel compiles on its first launch, 0.3 to 2 s apiece, one after the other: a patched model's first
training step at a new shape spends tens of seconds there. Under ``torch.compile`` the op's fake
implementations dry-run the kernels during tracing (:mod:`codagen.backends.triton.ahead`). In eager mode nothing
traces, so :func:`trace_first_step` does: the first time a forward with autograd on sees a new call signature
(the arguments' shapes and dtypes, train/eval mode, autocast), it runs that forward and the backward of its
loss once more on fake tensors (``FakeTensorMode``; the parameters swapped for fakes as
``torch.func.functional_call`` swaps them, so nothing real is read or written). Every codagen op the step would
call then goes through its fake implementation, which submits the op's kernels to the compile workers; the real
forward that follows waits for them at its first launch. So the step's kernels compile side by side, and the first
launches compile nothing.

A trace costs host time: the forward and backward in Python, of one decoder layer of each kind
(:func:`one_of_each`) and the head, whatever the depth. A trace that submits no new kernel (Triton specializes
kernels on the divisibility of sizes, not their values, so a new sequence length rarely needs one) ends the
tracing of that model: later new shapes run untraced, and any kernel one of them needs compiles on its first
launch.

The dry trace is skipped (the kernels compile on first launch) outside the Triton backend on a GPU,
with ``CODAGEN_COMPILE_AHEAD=0``, under ``torch.compile`` (its own tracing does it), with a KV cache, for
distributed (DTensor) parameters, and when a real input requires a gradient (the fake backward would reach it).
A trace that fails (a value read on the host, an unsupported module) is dropped the same way: it can cost the
ahead compilation, never the step.
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from codagen.backends import compiles_ahead, compiling_ahead

from .per_model import PerModel

__all__ = ["trace_first_step", "tracing", "one_of_each"]

_tracing: contextvars.ContextVar[bool] = contextvars.ContextVar("codagen_first_step_trace", default=False)
# model -> the call signatures already traced
_TRACED = PerModel("traced_signatures")
# models whose last trace found every kernel compiled already: later new shapes are not traced
_SETTLED = PerModel("settled")


def tracing() -> bool:
    """Whether the current forward is the fake dry trace (caches kept across forwards must not keep its fakes).
    Never under ``torch.compile``, which cannot read the ContextVar."""
    return not torch.compiler.is_compiling() and _tracing.get()


def one_of_each(layers, attention_key: Callable[[nn.Module], object]) -> list[nn.Module]:
    """The first of each kind of decoder layer: same parameters (names, shapes, dtypes, whether they train: LoRA
    adapters included) and same ``attention_key`` (a sliding window, say). Layers of one kind launch the same
    kernels at the same shapes, so the trace runs one of them, whatever the model's depth."""
    kinds = {}
    for layer in layers:
        key = (attention_key(layer), tuple((name, tuple(p.shape), p.dtype, p.requires_grad)
                                           for name, p in layer.named_parameters()))
        kinds.setdefault(key, layer)
    return list(kinds.values())


def _describe(value) -> object:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    return type(value).__name__


def _signature(model: nn.Module, args: tuple, kwargs: dict, device: torch.device) -> tuple:
    autocast = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None)
    return (model.training, autocast, _describe(args), tuple(sorted((k, _describe(v)) for k, v in kwargs.items())))


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    return next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)


def trace_first_step(model: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> None:
    """Before ``forward(model, *args, **kwargs)``, the patched ``model``'s forward: where this is a new signature of
    an eager forward with autograd on, run it and its backward on fake tensors so that its kernels compile in
    parallel (module docstring)."""
    if torch.compiler.is_compiling():  # its own trace compiles ahead (and Dynamo cannot read a ContextVar)
        return
    if (_tracing.get() or not torch.is_grad_enabled() or model in _SETTLED or kwargs.get("use_cache")
            or kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None):
        return
    first = _first_tensor(args, kwargs)
    if first is None or not compiles_ahead(first.device):
        return
    signature = _signature(model, args, kwargs, first.device)
    traced = _TRACED.get(model)
    if traced is None:
        traced = set()
        _TRACED.set(model, traced)
    if signature in traced:  # the common case from the second step on: no walk of the parameters
        return
    traced.add(signature)
    if any(isinstance(v, torch.Tensor) and v.requires_grad for v in (*args, *kwargs.values())):
        return
    named = dict(model.named_parameters())
    if any(type(p) is not nn.Parameter for p in named.values()):  # DTensor (FSDP2, tensor parallel) parameters
        return
    submitted = compiling_ahead()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call swaps with
    token = _tracing.set(True)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = {name: mode.from_tensor(p) for name, p in named.items()}
            args, kwargs = tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
            # the forward itself, not model(...): hooks on the model are the user's and see only real calls
            with _reparametrize_module(model, fakes, tie_weights=True, strict=False):
                output = forward(model, *args, **kwargs)
            loss = getattr(output, "loss", None)
            if loss is None and getattr(output, "logits", None) is not None:
                loss = output.logits.float().sum()
            if loss is not None and loss.requires_grad:
                loss.backward()  # into the fakes' .grad, dropped with them
    except Exception:  # noqa: BLE001 - the step's kernels then compile on first launch, as without the trace
        return
    finally:
        _tracing.reset(token)
    if compiling_ahead() == submitted:  # Triton specializes on shapes' divisibility, not values: this shape
        _SETTLED.set(model, True)  # compiled nothing new, and another one will rarely either
