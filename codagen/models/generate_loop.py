"""``generate()``'s decode loop on a patched model with a ``StaticCache``: each new token one CUDA graph replay.

transformers' loop (``GenerationMixin._sample``) does per token, on the host: ``prepare_inputs_for_generation``,
the forward, the logits processors, a ``torch.cat`` of the sequence, the stopping criteria and a host sync on
"every row finished". With the forward replayed (:mod:`.decode_graphs`) that host work is most of a small batch's
step. A patched model's ``_sample`` (greedy decoding and sampling) runs this loop instead where it can:

1. the prefill is transformers' own (``_prefill``, then ``_update_model_kwargs_for_generation``);
2. every later token is one step over static buffers, captured once as a CUDA graph and replayed:

   - the forward of the last token at its position (transformers' ``position_ids``, advanced on the device) with
     an additive mask over the cache's slots (the prompt's padding masked; each step unmasks its own slot);
   - the call's logits processors, called on a fixed-length copy of the sequence;
   - the token: ``argmax``, or a sample drawn as ``torch.multinomial`` draws one (``argmax(probs / q)`` with
     ``q ~ Exponential(1)``, the same random numbers) without its host-side checks;
   - finished rows padded, the EOS test, the token written at the step's column of the sequence;
3. the host reads "every row finished" once per :data:`CHECK_EVERY` steps (one sync) and cuts the sequence where
   transformers' loop stops: after the first step at which every row had finished, or at ``max_length``. The steps
   run past that point change nothing returned; the cache's length is set back to where transformers leaves it.

The fixed-length sequence: the columns not generated yet hold the row's last prompt token, so that a processor that
reads the tokens as a set (the repetition penalty, with or without an ignored prompt prefix) sees the same set as on
the grown sequence. A graph reads the tensors it was captured with: the call's processors are pointed at the loop's
copies of their tensors, and the loop keeps its own copies of the EOS and pad tokens (:func:`_bind`).

The loop runs for ``_sample`` calls with: a ``StaticCache`` of full-attention layers with room for
``max_length`` tokens (on a GPU, a patched model's ``generate()`` that names no cache gets one:
:func:`.decode_graphs.default_static_cache`); logits processors among :data:`SET_PROCESSORS`; stopping only
by ``max_length`` and EOS; no streamer, no ``synced_gpus``, no ``return_dict_in_generate``, no assistant model;
a model without PEFT modules; model inputs the step understands (``attention_mask``, ``position_ids``, the cache,
``use_cache``, ``logits_to_keep``). Every other call runs transformers' loop (whose forward still replays per
step). On the CPU the same steps run eagerly (no graph).

A graph is kept per *loop kind* (batch, cache size, processors and their settings, greedy or sampling, the EOS
tokens' count), with the cache tensors it was captured on: each ``generate()`` call makes a new ``StaticCache``, whose
layers are given the kind's kept tensors before the prefill (:func:`_adopt`), so the graph replays as is. It is
captured again for a cache passed in at other addresses, and when a parameter, a module or the kept fused weights
changed (:func:`.decode_graphs.weights_key`, compared once per call). A forward with autograd (a training step)
drops the kept fused weights, and with them the loops, their graphs and kept caches. The first step of a new kind
runs eagerly on the kind's stream (kernel compiles and plans), the next one captures. Memory: the kinds' kept
caches stay allocated between calls (:data:`MAX_LOOP_KINDS` at most; :func:`drop` frees them).
"""
from __future__ import annotations

import inspect
from collections import OrderedDict

import torch
from torch import nn

from . import decode_graphs, families, hf_cache, lora
from .per_model import PerModel

__all__ = ["takes", "decode", "sample", "loops_of", "drop", "CHECK_EVERY", "SET_PROCESSORS"]

#: steps between two host reads of "every row finished" (each a sync); at most this many steps run past the end
CHECK_EVERY = 8
#: loop kinds kept per model (least recently used dropped first)
MAX_LOOP_KINDS = 4
#: transformers' logits processors that read the sequence only as a set of tokens, or not at all
SET_PROCESSORS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                  "RepetitionPenaltyLogitsProcessor")
_STOPPING = ("MaxLengthCriteria", "EosTokenCriteria")
_SAMPLE_MODES = ("greedy_search", "sample")  # transformers' GenerationMode values (a str enum) that run _sample
_MODEL_INPUTS = frozenset({"attention_mask", "position_ids", "past_key_values", "cache", "use_cache",
                           "logits_to_keep"})


class _Loop:
    """One loop kind's static buffers, stream and graph (see the module docstring)."""

    def __init__(self, batch: int, slots: int, positions: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device):
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # the step's input token per row
        self.positions = None if positions is None else torch.zeros_like(positions[..., -1:])
        self.mask = torch.zeros(batch, 1, 1, slots, dtype=dtype, device=device)  # additive, over the cache's slots
        self.sequence = torch.zeros(batch, slots + 1, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)  # where the step writes its token
        self.unfinished = torch.ones(batch, dtype=torch.long, device=device)
        self.all_finished = torch.zeros(slots + 1, dtype=torch.bool, device=device)  # per column
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.cache_tensors: tuple = ()
        self.bound: dict = {}  # the loop's copies of the processors' tensors, EOS and pad (:func:`_bind`)
        self.cache_layers: list | None = None  # the last call's cache tensors per layer (:func:`_adopt`)
        self.warmed_up = False
        self.captures = self.replays = 0


class _ModelLoops:
    def __init__(self):
        self.weights: tuple | None = None  # decode_graphs.weights_key of the model the graphs were captured on
        self.loops: OrderedDict[tuple, _Loop] = OrderedDict()


_LOOPS = PerModel("generate_loops")


def loops_of(model: nn.Module) -> dict[tuple, _Loop]:
    """The loop kinds kept for ``model`` (tests and benchmarks read ``captures`` and ``replays``)."""
    state = _LOOPS.get(model)
    return {} if state is None else dict(state.loops)


def drop(model: nn.Module) -> None:
    """Forget ``model``'s loops and their graphs."""
    _LOOPS.pop(model)


#: generate() arguments that transformers' custom_generate path does not hand to the decode loop: a call with any of
#: them keeps transformers' own loop
_GENERATE_OWN = ("custom_generate", "assistant_model", "streamer", "synced_gpus", "tokenizer", "assistant_tokenizer")


def takes(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``model.generate(*args, **kwargs)`` would run transformers' greedy or sampling loop (``_sample``)
    that :func:`decode` can stand in for as transformers' ``custom_generate`` callable. :func:`decode` still falls
    back to ``_sample`` where its loop does not run (:func:`sample`)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False  # transformers may sync the ranks' loops (synced_gpus), which custom_generate does not pass on
    try:
        bound = inspect.signature(type(model).generate).bind(model, *args, **kwargs).arguments
    except TypeError:
        return False  # transformers raises its own error
    named = {**bound.get("kwargs", {}), **{k: v for k, v in bound.items() if k not in ("self", "kwargs")}}
    if any(named.get(name) is not None and named.get(name) is not False for name in _GENERATE_OWN):
        return False
    generation_config, _ = model._prepare_generation_config(named.get("generation_config"), **bound.get("kwargs", {}))
    return generation_config.get_generation_mode() in _SAMPLE_MODES


def decode(model: nn.Module, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
           **model_kwargs):
    """transformers' ``custom_generate`` callable for a greedy or sampling ``generate()``: :func:`sample`, else
    transformers' ``_sample`` on the same prepared inputs."""
    sequences = sample(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs)
    if sequences is not None:
        return sequences
    return type(model)._sample(model, input_ids, logits_processor, stopping_criteria, generation_config,
                               **model_kwargs)


def _processor_key(processor) -> tuple:
    """A processor's type and settings; tensors by shape and dtype (their values are copied in: :func:`_bind`)."""
    settings = ((k, ("tensor", tuple(v.shape), v.dtype) if torch.is_tensor(v) else repr(v))
                for k, v in vars(processor).items())
    return type(processor).__name__, tuple(sorted(settings))


def _runs_here(model: nn.Module, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
               synced_gpus: bool, streamer, model_kwargs: dict):
    """``(cache, max_length, eos)`` where this loop runs the call, else ``None``."""
    if synced_gpus or streamer is not None or generation_config.return_dict_in_generate:
        return None
    if getattr(generation_config, "is_assistant", False) or not model_kwargs.keys() <= _MODEL_INPUTS:
        return None
    if model_kwargs.get("use_cache") is False or input_ids.dim() != 2:
        return None
    cache = decode_graphs.given_cache(model_kwargs)
    if not decode_graphs.static_full_attention(cache):
        return None
    if any(type(p).__name__ not in SET_PROCESSORS for p in logits_processor):
        return None
    if any(isinstance(getattr(p, "prompt_ignore_length", None), int) and p.prompt_ignore_length >= input_ids.shape[1]
           for p in logits_processor):
        return None  # the filler (the last prompt token) would be counted
    if any(type(c).__name__ not in _STOPPING for c in stopping_criteria):
        return None
    max_length = next((c.max_length for c in stopping_criteria if type(c).__name__ == "MaxLengthCriteria"), None)
    if max_length is None or max_length > min(layer.max_cache_len for layer in cache.layers) + 1:
        return None
    eos = next((c.eos_token_id for c in stopping_criteria if type(c).__name__ == "EosTokenCriteria"), None)
    if eos is not None and generation_config._pad_token_tensor is None:
        return None
    if any(layer.is_initialized for layer in cache.layers) and int(cache.get_seq_length()) != 0:
        return None  # a cache holding a prefix: transformers' loop slices the inputs
    if any(lora.is_peft_module(m) for m in model.modules()):
        return None  # adapters switch without touching a parameter
    if families.rope_from_positions(model):
        return None  # the rotary module picks its frequencies per step, on the host
    return cache, max_length, eos


@torch.no_grad()
def sample(model: nn.Module, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
           synced_gpus: bool = False, streamer=None, **model_kwargs) -> torch.Tensor | None:
    """``model._sample(...)`` (transformers' greedy and sampling loop) run as this module's loop: the sequences, or
    ``None`` where the loop does not take the call (the caller runs transformers' loop)."""
    ran = _runs_here(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
                     model_kwargs)
    if ran is None:
        return None
    cache, max_length, eos = ran
    batch, prompt = input_ids.shape
    prompt_mask, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
    do_sample = bool(generation_config.do_sample)
    pad = generation_config._pad_token_tensor
    slots = cache.layers[0].max_cache_len
    key = (batch, slots, None if positions is None else tuple(positions.shape[:-1]), model.dtype, do_sample,
           tuple(map(_processor_key, logits_processor)), None if eos is None else tuple(eos.shape), pad is None)
    state = _LOOPS.get(model)
    kept = None if state is None or key not in state.loops else state.loops[key].cache_layers
    if kept is not None:
        _adopt(cache, kept)
    outputs = model._prefill(input_ids, generation_config, model_kwargs)
    model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs)
    positions = model_kwargs.get("position_ids")
    loop = _loop_for(model, key, positions, slots, input_ids.device)
    loop.cache_layers = [(layer.keys, layer.values, layer.cumulative_length) for layer in cache.layers]
    _start(loop, input_ids, prompt_mask, positions)
    choose = _Choose(loop, logits_processor, do_sample, *_bind(loop, logits_processor, eos, pad))
    choose(outputs.logits[:, -1])
    del outputs
    new_tokens = max(max_length - prompt, 1)
    cache_field = hf_cache.cache_field()

    def step():
        length = cache.get_seq_length()  # a device tensor: no sync
        loop.mask.index_fill_(-1, length.reshape(1), 0.0)  # this step's token goes to slot `length`
        inputs = {} if loop.positions is None else {"position_ids": loop.positions}
        with decode_graphs.eagerly():  # the whole step is this loop's graph
            logits = model(input_ids=loop.tokens, attention_mask=loop.mask, use_cache=True, logits_to_keep=1,
                           return_dict=True, **inputs, **{cache_field: cache}).logits
        choose(logits[:, -1])

    cache_tensors = decode_graphs.cache_tensors(cache)  # allocated by the prefill; fixed for the call
    produced = 1
    while produced < new_tokens:
        if eos is not None and produced % CHECK_EVERY == 0 and bool(loop.all_finished[prompt:prompt + produced].any()):
            break
        _run_step(loop, step, cache_tensors, remaining=new_tokens - produced)
        produced += 1
    end = prompt + produced
    if eos is not None:
        finished = loop.all_finished[prompt:end]
        if bool(finished.any()):
            end = prompt + int(finished.int().argmax()) + 1
    for layer in cache.layers:  # as transformers leaves it: every token but the last one fed
        layer.cumulative_length.fill_(end - 1)
    return loop.sequence[:, :end].clone()


def _loop_for(model: nn.Module, key: tuple, positions, slots: int, device: torch.device) -> _Loop:
    state = _LOOPS.get(model)
    if state is None:
        state = _ModelLoops()
        _LOOPS.set(model, state)
    weights = decode_graphs.weights_key(model)
    if weights != state.weights:  # a graph reads the fused weights of the model it was captured on
        state.loops.clear()
        state.weights = weights
    loop = state.loops.get(key)
    if loop is None:
        while len(state.loops) >= MAX_LOOP_KINDS:
            state.loops.popitem(last=False)
        loop = state.loops[key] = _Loop(key[0], slots, positions, model.dtype, device)
    state.loops.move_to_end(key)
    return loop


def _adopt(cache, kept: list) -> None:
    """Give a new ``StaticCache``'s layers the tensors the loop kind kept from its last call (the ones its graph was
    captured on), so that its decode steps replay without a capture. A layer is initialized by transformers' own
    ``lazy_initialization`` (the version's metadata; it allocates a zeroed copy, dropped at once), then reads the
    kept tensors. The slots past the new prompt hold the last call's keys and values: masked until written."""
    for layer, (keys, values, length) in zip(cache.layers, kept):
        if layer.is_initialized or layer.max_cache_len != keys.shape[2]:
            continue
        layer.lazy_initialization(keys[:, :, :1], values[:, :, :1])
        layer.keys, layer.values, layer.cumulative_length = keys, values, length.zero_()


def _start(loop: _Loop, input_ids: torch.Tensor, prompt_mask: torch.Tensor | None, positions) -> None:
    """Fill the buffers for a new call: the prompt (its last token as the filler), its mask, the positions."""
    prompt = input_ids.shape[1]
    loop.sequence[:, :prompt].copy_(input_ids)
    loop.sequence[:, prompt:].copy_(input_ids[:, -1:])
    loop.column.fill_(prompt)
    loop.mask.fill_(float("-inf"))
    if prompt_mask is None:
        loop.mask[..., :prompt].fill_(0.0)
    else:
        loop.mask[..., :prompt].masked_fill_(prompt_mask.bool()[:, None, None, :], 0.0)
    if positions is not None:  # transformers' positions after the prefill: the first generated token's last
        loop.positions.copy_(positions[..., -1:] - 1)
    loop.unfinished.fill_(1)
    loop.all_finished.fill_(False)


def _bind(loop: _Loop, logits_processor, eos, pad) -> tuple:
    """Point this call's processors at the loop's copies of their tensors (a graph reads the tensors it was
    captured with, and each call makes new processors); ``(eos, pad)``: the loop's copies of those."""
    for index, processor in enumerate(logits_processor):
        for name, value in list(vars(processor).items()):
            if torch.is_tensor(value):
                setattr(processor, name, _kept(loop, (index, name), value))
    return tuple(None if value is None else _kept(loop, name, value) for name, value in (("eos", eos), ("pad", pad)))


def _kept(loop: _Loop, name, value: torch.Tensor) -> torch.Tensor:
    kept = loop.bound.get(name)
    if kept is None:
        kept = loop.bound[name] = value.to(loop.tokens.device, copy=True)
    else:
        kept.copy_(value)
    return kept


class _Choose:
    """The token from the last position's logits, as transformers' ``_sample`` picks it, written into the loop's
    buffers: the next step's input, the sequence at the step's column, the EOS state; the column and position
    advance. Device work only (captured in the step's graph)."""

    def __init__(self, loop: _Loop, logits_processor, do_sample: bool, eos, pad):
        self.loop, self.logits_processor, self.do_sample = loop, logits_processor, do_sample
        self.eos, self.pad = eos, pad

    def __call__(self, logits: torch.Tensor) -> None:
        loop = self.loop
        scores = logits.to(copy=True, dtype=torch.float32)
        scores = self.logits_processor(loop.sequence, scores)
        if self.do_sample:  # torch.multinomial's draw of one sample, without its host-side checks
            probs = nn.functional.softmax(scores, dim=-1)
            tokens = probs.div_(torch.empty_like(probs).exponential_(1)).argmax(dim=-1)
        else:
            tokens = torch.argmax(scores, dim=-1)
        if self.eos is not None:
            tokens = tokens * loop.unfinished + self.pad * (1 - loop.unfinished)
            loop.unfinished.mul_(~torch.isin(tokens, self.eos))
            loop.all_finished.index_copy_(0, loop.column, (loop.unfinished.max() == 0).reshape(1))
        loop.sequence.index_copy_(1, loop.column, tokens[:, None])
        loop.tokens.copy_(tokens[:, None])
        loop.column.add_(1)
        if loop.positions is not None:
            loop.positions.add_(1)


def _run_step(loop: _Loop, step, cache_tensors: tuple, remaining: int) -> None:
    """One decode step: eagerly on the CPU and for a new kind's first step (on its stream, which warms up the
    kernels), else by replaying the kind's graph (captured first where there is none for this cache and at
    least one more step follows, so that the capture pays off)."""
    if loop.stream is None:
        step()
        return
    if not loop.warmed_up:
        decode_graphs.on_stream(loop.stream, step)
        loop.warmed_up = True
        return
    if loop.graph is None or loop.cache_tensors != cache_tensors:
        if remaining < 2:
            decode_graphs.on_stream(loop.stream, step)
            return
        loop.graph = None  # the previous cache's graph and its memory go first
        loop.graph, _ = decode_graphs.capture(loop.stream, step)
        loop.cache_tensors = cache_tensors
        loop.captures += 1
    loop.graph.replay()
    loop.replays += 1
