"""A patched model's decode step with a ``StaticCache``, captured once as a CUDA graph and replayed.

``generate(cache_implementation="static")`` (and transformers' compiled generation, ``generation_config.
compile_config``) calls the model once per new token with the same shapes: ``input_ids`` ``[batch, 1]``, the
cache, ``position_ids`` and a 4-D mask over the cache's slots. On the GPU such a step is a few dozen small
kernels whose launches, not their bytes, set its time. It has static shapes and no host sync (the cache write
advances the cache length on the device: :mod:`.hf_cache`), so the patched forward captures it and replays it:

1. the first such call of a *step kind* (batch, mask and position layout, ``logits_to_keep``) runs eagerly, on a
   stream of its own (it compiles and plans the kernels and allocates their per-stream state);
2. the next one, and the first one with a new cache, captures the step on that stream into a CUDA graph whose
   inputs are buffers of the step's ``input_ids``, ``position_ids`` and mask, and replays it;
3. every later call copies its inputs into the buffers, replays the graph and returns a copy of the logits.

transformers' own loop does the rest after the graph: logits processors, sampling, stopping, padding of
finished rows, ``num_return_sequences``. (A greedy or sampling ``generate()`` that :mod:`.generate_loop` takes replays
a graph of the whole token instead; the steps here serve the calls it leaves to transformers' loop, and any caller
that runs decode steps itself.) Patched models leave transformers' auto-compile of the forward off
where a step replays (:func:`compiles_forward`), so that its compiled graph does not wrap the replay, and on a GPU
a greedy or sampling ``generate()`` that names no cache gets a ``StaticCache`` (:func:`default_static_cache`):
``cache_implementation="dynamic"`` asks for transformers' default, a ``DynamicCache``, whose steps run eagerly.

When a call replays: on a CUDA device, without autograd, outside ``torch.compile``, in eval mode, for
``input_ids`` of one token per row (no ``inputs_embeds``, no labels), a ``StaticCache`` of allocated
full-attention layers (sliding-window layers keep their length on the host), a 4-D mask tensor or none,
a model without PEFT modules (adapters switch without touching a parameter). Any other call runs eagerly.

The graphs are dropped when the weights change: each replay compares the parameters' version counters with the
ones the graphs were captured on (an optimizer step), and the first replay after any other forward of the model
(each ``generate()`` call's prefill) also their storage and the modules (``p.data = w``, ``load_state_dict``,
a module swap). The step then runs eagerly on the new weights, and captures again. Writes through ``.data`` are
not seen, as for every forward without autograd (:func:`codagen.models.hf.refresh_weights` drops the graphs
too). Hooks and the patch-time refusals are checked by the eager forwards: each ``generate()`` call's prefill
and each step kind's first step.

A graph replays for a cache whose tensors (each layer's keys, values and length: :func:`cache_tensors`) are the
ones it was captured on, at the same addresses and shapes. transformers makes a new ``StaticCache`` for each
``generate()`` call (unless one is passed in); where the allocator hands it the previous cache's memory, the
previous graph replays, else the call's first decode step captures again, on the warmed-up stream (21-26 ms at
16 layers of LLaMA-3 1B dims on the H200).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from . import families, fused_layers, hf_cache, lora
from .per_model import PerModel

__all__ = ["replay", "compiles_forward", "default_static_cache", "drop", "eagerly", "graphs_of", "weights_key",
           "on_stream", "cache_tensors", "capture", "given_cache", "static_full_attention"]

#: step kinds kept per model (least recently used dropped first): a new cache or batch size is a new kind
MAX_STEP_KINDS = 4
# the forward arguments a replayed step takes; any other one (labels, inputs_embeds, ...) runs eagerly
_STEP_ARGUMENTS = frozenset({"input_ids", "attention_mask", "position_ids", "past_key_values", "cache", "use_cache",
                             "return_dict", "logits_to_keep", "cache_position"})


class _Step:
    """One step kind: its stream, warmed up by an eager step; once captured, the graph, the cache tensors it reads
    and writes (:func:`cache_tensors`), its input buffers and its output logits."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.cache_tensors: tuple = ()
        self.inputs: dict[str, torch.Tensor | None] = {}
        self.logits: torch.Tensor | None = None
        self.captures = self.replays = 0


class _ModelGraphs:
    """The step kinds of one model, and the parameters and modules they were captured on."""

    def __init__(self):
        self.modules_key: tuple | None = None  # every parameter's storage and version, every module's identity
        self.parameters: list[nn.Parameter] = []
        self.versions: tuple = ()
        self.verified = False  # no other forward of the model since modules_key was compared
        self.eligible = False  # no PEFT module
        self.steps: OrderedDict[tuple, _Step] = OrderedDict()

    def check(self, model: nn.Module) -> None:
        """Drop the steps if a parameter or module changed since they were captured: per step the parameters'
        version counters (an optimizer step); after any other forward (each ``generate()`` call's prefill) also
        their storage and the modules (``p.data = w``, a module swap, PEFT's merges)."""
        if self.verified and tuple(p._version for p in self.parameters) == self.versions:
            return
        key = weights_key(model)
        if key != self.modules_key:  # new weights: an eager step rebuilds the kept fused copies first
            self.steps.clear()
            self.modules_key = key
            self.parameters = [p for m in model.modules() for p in m._parameters.values() if p is not None]
            self.eligible = (not any(lora.is_peft_module(m) for m in model.modules())
                             and not families.rope_from_positions(model))
        self.versions = tuple(p._version for p in self.parameters)
        self.verified = True


_GRAPHS = PerModel("decode_graphs")
_EAGERLY = contextvars.ContextVar("codagen_decode_steps_eagerly", default=False)


@contextlib.contextmanager
def eagerly():
    """Forwards in this context never replay: a caller that captures a larger step itself
    (:mod:`.generate_loop`)."""
    token = _EAGERLY.set(True)
    try:
        yield
    finally:
        _EAGERLY.reset(token)


def weights_key(model: nn.Module) -> tuple:
    """What a captured step of ``model`` reads, as a value to compare: every parameter's storage and version
    counter, every module's identity, and the build of the fused weights kept for forwards without autograd
    (:func:`.hf_cache.inference_blocks_build`: a forward with autograd drops them, the next one builds new ones)."""
    modules = list(model.modules())
    return (tuple((p.data_ptr(), p._version) for m in modules for p in m._parameters.values() if p is not None),
            tuple(map(id, modules)), hf_cache.inference_blocks_build(model))


def graphs_of(model: nn.Module) -> dict[tuple, _Step]:
    """The step kinds captured or warmed up for ``model`` (tests and benchmarks read ``replays``)."""
    state = _GRAPHS.get(model)
    return {} if state is None else dict(state.steps)


def drop(model: nn.Module) -> None:
    """Forget ``model``'s captured steps."""
    _GRAPHS.pop(model)


def given_cache(model_kwargs: dict):
    """The cache a ``generate()`` call's model inputs hold (``cache`` from transformers 5.2x, ``past_key_values``
    before), or ``None``."""
    return next((model_kwargs[name] for name in ("cache", "past_key_values") if model_kwargs.get(name) is not None),
                None)


def static_full_attention(cache) -> bool:
    """A ``StaticCache`` whose layers are all full-attention ``StaticLayer``\\ s (allocated or not)."""
    cache_utils, _, _ = hf_cache._transformers()
    return (type(cache) is cache_utils.StaticCache and bool(cache.layers)
            and all(type(layer) is cache_utils.StaticLayer for layer in cache.layers))


def _full_static_cache(cache) -> bool:
    """A ``StaticCache`` whose layers are all allocated full-attention ``StaticLayer``\\ s with a device length."""
    return static_full_attention(cache) and all(layer.is_initialized and torch.is_tensor(layer.cumulative_length)
                                                for layer in cache.layers)


def compiles_forward(model: nn.Module, model_kwargs: dict) -> bool | None:
    """``False`` where ``generate()`` with these ``model_kwargs`` would replay the decode step (a CUDA model and
    a ``StaticCache`` of full-attention layers): transformers' auto-compile stays off. ``None``: transformers
    decides."""
    if model.device.type == "cuda" and static_full_attention(given_cache(model_kwargs)):
        return False
    return None


def default_static_cache(model: nn.Module, generation_config, model_kwargs: dict, generation_mode) -> bool:
    """Whether a ``generate()`` call that names no cache gets a ``StaticCache`` (whose decode steps replay): on a
    CUDA model without PEFT modules, for greedy decoding and sampling with the cache on, when neither
    ``cache_implementation`` nor a cache is given (``cache_implementation="dynamic"`` keeps the ``DynamicCache``).
    Models with sliding-window layers are left out by the caller (their static layers do not replay)."""
    if (model.device.type != "cuda" or generation_config.cache_implementation is not None
            or generation_config.use_cache is False or generation_mode not in ("greedy_search", "sample")):
        return False
    if given_cache(model_kwargs) is not None:
        return False
    return not any(lora.is_peft_module(m) for m in model.modules())


def _step_kind(model: nn.Module, args: tuple, kwargs: dict):
    """``(key, cache, inputs)`` of a call that can replay, else ``None``; ``key``: its step kind but for the cache
    (a ``StaticCache`` of the same shapes, as each ``generate()`` call makes, reuses the warmed-up stream)."""
    if torch.compiler.is_compiling() or torch.is_grad_enabled() or model.training or _EAGERLY.get():
        return None
    if args or not kwargs.keys() <= _STEP_ARGUMENTS or kwargs.get("use_cache") is False:
        return None
    input_ids = kwargs.get("input_ids")
    if not (torch.is_tensor(input_ids) and input_ids.is_cuda and input_ids.dim() == 2 and input_ids.shape[1] == 1):
        return None
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None or not _full_static_cache(cache):
        return None
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    cache_position = kwargs.get("cache_position")
    if isinstance(mask, dict):  # transformers' masks per layer type: only full-attention layers replay
        if mask.keys() - {"full_attention"}:
            return None
        mask = mask.get("full_attention")
    if mask is not None and not (torch.is_tensor(mask) and mask.dim() == 4 and mask.device == input_ids.device):
        return None
    if any(t is not None and not (torch.is_tensor(t) and t.device == input_ids.device)
           for t in (positions, cache_position)):
        return None
    logits_to_keep = kwargs.get("logits_to_keep", 0)
    if not isinstance(logits_to_keep, int) or fused_layers.is_fused(model):
        return None

    def layout(t):
        return None if t is None else (tuple(t.shape), t.dtype, t.stride())
    key = (input_ids.shape[0], layout(mask), layout(positions), layout(cache_position), logits_to_keep)
    return key, cache, {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions,
                        "cache_position": cache_position}


def replay(model: nn.Module, forward: Callable, args: tuple, kwargs: dict):
    """The output of ``forward(model, *args, **kwargs)`` (the patched forward) for a decode step that replays
    (see the module docstring), else ``None``: the caller runs the forward."""
    kind = _step_kind(model, args, kwargs)
    state = _GRAPHS.get(model)
    if kind is None:
        if state is not None:
            state.verified = False  # this forward may follow new weights: the next replay compares them all
        return None
    key, cache, inputs = kind
    if state is None:
        state = _ModelGraphs()
        _GRAPHS.set(model, state)
    state.check(model)
    if not state.eligible:
        return None
    return_dict = kwargs.get("return_dict")
    step = state.steps.get(key)
    if step is None:  # first call of this kind: an eager step on the step's stream
        while len(state.steps) >= MAX_STEP_KINDS:
            state.steps.popitem(last=False)
        step = state.steps[key] = _Step(inputs["input_ids"].device)
        return on_stream(step.stream, lambda: forward(model, *args, **kwargs))
    state.steps.move_to_end(key)
    tensors = cache_tensors(cache)
    if step.graph is None or step.cache_tensors != tensors:  # a cache at other addresses: capture again
        _capture(step, model, forward, cache, tensors, inputs, kwargs.get("logits_to_keep", 0))
    else:
        for name, t in inputs.items():
            if t is not None:
                step.inputs[name].copy_(t)
    step.graph.replay()
    step.replays += 1
    output = hf_cache.output(None, step.logits.clone(), cache)
    return output if return_dict is None or return_dict else output.to_tuple()


def on_stream(stream: torch.cuda.Stream, fn: Callable):
    """``fn()`` run on ``stream``, ordered after and before the current stream's work; its result."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        result = fn()
    current.wait_stream(stream)
    return result


def cache_tensors(cache) -> tuple:
    """Everything of ``cache`` a captured step touches: each layer's keys, values and length, by address and shape.
    A graph is valid for any cache that matches: the cache object itself is not read."""
    return tuple((t.data_ptr(), t.shape) for layer in cache.layers
                 for t in (layer.keys, layer.values, layer.cumulative_length))


def capture(stream: torch.cuda.Stream, fn: Callable) -> tuple[torch.cuda.CUDAGraph, object]:
    """``(graph, fn's result)``: ``fn`` captured on ``stream`` (the stream its eager run warmed up: the kernels'
    per-stream state); capturing runs nothing, the caller replays. ``capture_begin`` directly, not
    ``torch.cuda.graph``: that also synchronizes the device, collects garbage and empties the allocator's cache,
    tens of milliseconds per capture."""
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            result = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(stream.device).wait_stream(stream)
    return graph, result


def _capture(step: _Step, model: nn.Module, forward: Callable, cache, tensors: tuple, inputs: dict,
             logits_to_keep: int) -> None:
    """Capture the step (:func:`capture`) with buffers holding this call's inputs; the graph is replayed by the
    caller."""
    step.graph = step.logits = None  # the previous cache's graph and its memory go first
    step.inputs = {name: None if t is None else t.clone() for name, t in inputs.items()}
    graph, out = capture(step.stream, lambda: forward(
        model, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep, return_dict=True,
        **{name: t for name, t in step.inputs.items() if t is not None}))
    step.graph, step.logits, step.cache_tensors = graph, out.logits, tensors
    step.captures += 1
