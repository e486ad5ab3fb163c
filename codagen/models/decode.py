"""Greedy decoding of a patched Hugging Face model with a ``StaticCache``, each decode step one CUDA graph.

A decode step is a few dozen small kernels (the batch's rows through every layer's fused GEMMs,
attention, the cache writes), so on the GPU its launches, not its bytes, set the time. The step has
static shapes and no host syncs (the cache position is a device tensor, the mask is built on the
device from it), so :class:`GreedyDecoder` captures the whole step (forward, argmax, the next token's
mask) once and replays it::

    decoder = GreedyDecoder(model, max_cache_len=4096)
    tokens = decoder(input_ids, attention_mask=attention_mask, max_new_tokens=256)   # [batch, max_new_tokens]

The prefill runs eagerly (one forward over the prompt); the first decode step runs eagerly too (it
compiles and plans the kernels), then the captured step replays ``max_new_tokens - 2`` times. Positions
follow ``transformers``: ``cache length + step``, with or without left padding. No stopping criteria:
every row gets ``max_new_tokens`` tokens. ``capture=False`` runs the same step eagerly (CPU, tests).
``model.generate()`` is the general entry point: on a GPU it replays a captured loop of its own (sampling, logits
processors, stopping: :mod:`.generate_loop`) at 0.93-1.18x this decoder's step time.
"""
from __future__ import annotations

import torch
from torch import nn

from codagen.ops.kernels import greedy_append

from . import decode_graphs, hf_cache
from .hf import _sliding_window, is_patched

__all__ = ["GreedyDecoder"]


class GreedyDecoder:
    """Greedy decoding with a ``StaticCache`` of ``max_cache_len`` tokens; the decode step replays one CUDA graph.

    ``model``: a patched (:func:`codagen.patch`) causal LM in eval mode without sliding-window layers.
    The cache and the graph are kept for the next call with the same batch size and the same weights: a parameter
    written (an optimizer step, ``load_state_dict``) or a module swapped since the capture makes the call capture
    again (:func:`.decode_graphs.weights_key`).
    """

    def __init__(self, model: nn.Module, max_cache_len: int, capture: bool | None = None):
        if not is_patched(model):
            raise ValueError("GreedyDecoder: model must be patched by codagen.patch")
        if any(_sliding_window(model, layer) is not None for layer in model.model.layers):
            raise NotImplementedError("GreedyDecoder: sliding-window layers (their StaticCache is a ring buffer); "
                                      "use model.generate(..., cache_implementation='static')")
        if not isinstance(max_cache_len, int) or max_cache_len <= 1:
            raise ValueError(f"max_cache_len: expected an int > 1, got {max_cache_len!r}")
        self.model, self.max_cache_len, self.capture = model, max_cache_len, capture
        self._batch = None
        self._weights = None  # decode_graphs.weights_key of the model the graph was captured on

    def _setup(self, batch: int, device: torch.device) -> None:
        cache_utils, _, _ = hf_cache._transformers()
        self.cache = cache_utils.StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # the step's input, then its output
        # SDPA's additive mask by slot (0 or -inf): the prompt's padding and the slots not written yet; a step
        # unmasks its own slot (one launch) and passes it as is
        self.attention_bias = torch.zeros(batch, self.max_cache_len, dtype=self.model.dtype, device=device)
        self.generated = torch.zeros(batch, self.max_cache_len, dtype=torch.long, device=device)
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        self.graph = None
        self._batch = batch

    def _append_greedy(self, logits: torch.Tensor) -> None:
        """The greedy token of each row's last position into ``tokens`` (the next step's input) and ``generated``
        at ``step_index``, which advances: one launch on the GPU (:func:`codagen.ops.kernels.greedy_append`)."""
        greedy_append(logits[:, -1], self.tokens, self.generated, self.step_index)

    def _step(self) -> None:
        """One decode step on the static buffers: ``tokens`` in, the argmax token out, appended to ``generated``."""
        length = self.cache.get_seq_length()  # a device tensor: no sync
        self.attention_bias.index_fill_(1, length.reshape(1), 0.0)  # this step's token goes to slot `length`
        logits = self.model(self.tokens, attention_mask=self.attention_bias[:, None, None, :], use_cache=True,
                            logits_to_keep=1, **{hf_cache.cache_field(): self.cache}).logits
        self._append_greedy(logits)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 16) -> torch.Tensor:
        """The ``max_new_tokens`` greedy tokens after each row of ``input_ids`` [batch, prompt] (left-padded where
        ``attention_mask`` is 0): ``[batch, max_new_tokens]``."""
        batch, prompt = input_ids.shape
        if prompt + max_new_tokens > self.max_cache_len:
            raise ValueError(f"max_new_tokens: prompt ({prompt}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_cache_len ({self.max_cache_len})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        device = input_ids.device
        if self._batch != batch:
            self._setup(batch, device)
        self.cache.reset()
        self.attention_bias.fill_(float("-inf"))
        prompt_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.bool().long()
        self.attention_bias[:, :prompt].masked_fill_(prompt_mask != 0, 0.0)
        self.step_index.zero_()
        logits = self.model(input_ids, attention_mask=prompt_mask, use_cache=True, logits_to_keep=1,
                            **{hf_cache.cache_field(): self.cache}).logits
        weights = decode_graphs.weights_key(self.model)  # after the prefill, which builds the fused weights it reads
        if weights != self._weights:  # the graph reads the fused weights of the model it was captured on
            self.graph, self._weights = None, weights
        self._append_greedy(logits)
        capture = device.type == "cuda" if self.capture is None else self.capture
        for step in range(1, max_new_tokens):
            if not capture:
                self._step()
            elif self.graph is None:  # warm-up step on a side stream (kernel compiles, plans), then capture
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    self._step()
                torch.cuda.current_stream(device).wait_stream(side)
                if step + 1 < max_new_tokens:  # captured on the warm-up's stream: it finds the same arrival counters
                    self.graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(self.graph, stream=side):
                        self._step()
            else:
                self.graph.replay()
        return self.generated[:, :max_new_tokens].clone()
