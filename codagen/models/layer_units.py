"""The layer-aligned forward of a patched model: every decoder layer, the final norm and the LM head run inside
their own module call, so hooks on them run, such as those of FSDP2 units placed per decoder layer (accelerate's
FSDP2 plugin, the Hugging Face Trainer, most recipes: ``fully_shard`` on each decoder layer, the embeddings, the
final norm with the LM head, and the root).

The regrouped decoder (:func:`codagen.models.llama.decoder_stack`) crosses the layers' boundaries: block ``i``'s
down-projection epilogue applies layer ``i + 1``'s input norm. Here each layer reads only its own parameters:

    normed, rstd = rms_norm_stats(x, input_norm_i)                        # the layer's own input norm
    x, _, _      = decoder_layer(x, normed, rstd, layer i, next_norm=input_norm_i)   # QKV ... down + residual

The down projection's ``normed`` and ``rstd`` outputs are not read (the next layer computes its own), so each layer
costs one row pass over ``x`` more than a regrouped block, forward only: ``rms_norm_stats`` has no backward, since
the norm's consumer (the QKV op) computes the norm's backward from ``x``, ``rstd`` and the norm weight, once per
norm, as in the regrouped decoder. The final norm's statistics run in the final norm's module call, the fused LM
head (``rms_lm_head_cross_entropy`` / ``rms_linear``) in the LM head's; both read their weights inside those calls,
after the hooks of a unit holding them (accelerate's ``fully_shard([norm, lm_head])``) have all-gathered them.

A module call runs the computation in place of the module's ``forward`` (:func:`call_as_module`), with the layer's
input ``x`` as its one argument: FSDP's ``cast_forward_inputs`` then casts nothing that must stay float32 (the RoPE
positions and frequencies, ``rstd``), and it registers its pre-backward all-gather on the call's output and its
post-backward reduce-scatter on ``x``, as for the unpatched layer.

A layer of the plain patched model gathers its fused layouts from its (unsharded) projections in its call
(``hf._block_weights``, LoRA's low-rank pairs included); its backward rebuilds them rather than keeping them from
forward to backward (:func:`_copies_rebuilt_in_backward`). A layer with fused parameters (``layer.fused``) reads
them as they are.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from codagen import ops

from . import tensor_parallel
from .checkpoint import CheckpointFn, checkpoint_block
from .llama import AttentionSpec, BlockWeights, decoder_layer, input_stats, lm_head

__all__ = ["call_as_module", "decoder_stack", "head"]


def call_as_module(module: nn.Module, forward: Callable, *args):
    """``module(*args)`` running ``forward(*args)`` in place of ``module.forward``: ``nn.Module.__call__`` runs the
    module's hooks around it (an FSDP unit's all-gather before, its reshard and backward hooks after)."""
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        return module(*args)
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


class _Rebuilt:
    """What the ops save in place of a weight copy (:func:`_copies_rebuilt_in_backward`): the copy's field of
    ``BlockWeights``, and the layer's weights rebuilt once, when its backward first reads one."""
    __slots__ = ("rebuilt", "field")

    def __init__(self, rebuilt: dict, field: str):
        self.rebuilt, self.field = rebuilt, field


_GEMM_WEIGHTS = ("qkv", "o", "gate_up", "down")


def _copies_rebuilt_in_backward(blk: BlockWeights, rebuild: Callable[[], BlockWeights], layer: nn.Module):
    """``saved_tensors_hooks`` under which a layer's ops save, for each GEMM weight of ``blk`` that is a copy rather
    than a parameter of ``layer`` (the fused QKV and gate/up layouts, casts to the compute dtype), a token that
    rebuilds it from the parameters (``rebuild()``, without autograd) when the layer's backward reads it. FSDP has
    all-gathered the parameters again by then, so the copies need not live from the layer's forward to its
    backward while the parameters themselves are resharded. The rebuilt copies live until the layer's backward
    nodes have run."""
    owned = {p.data_ptr() for p in layer.parameters()}
    copies = {(t.data_ptr(), t.shape, t.stride(), t.dtype): field for field in _GEMM_WEIGHTS
              if (t := getattr(blk, field)).data_ptr() not in owned}
    rebuilt: dict = {}

    def pack(t: torch.Tensor):
        field = copies.get((t.data_ptr(), t.shape, t.stride(), t.dtype)) if t.layout == torch.strided else None
        return t if field is None else _Rebuilt(rebuilt, field)

    def unpack(saved):
        if not isinstance(saved, _Rebuilt):
            return saved
        if not saved.rebuilt:
            with torch.no_grad():
                saved.rebuilt["weights"] = rebuild()
        return getattr(saved.rebuilt["weights"], saved.field)
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _layer(weights: Callable[[nn.Module], BlockWeights], eps: float, spec: AttentionSpec, positions: torch.Tensor,
           frequencies: torch.Tensor, checkpoint: CheckpointFn | None, layer: nn.Module, x: torch.Tensor):
    """One decoder layer on its own parameters (module docstring); ``weights(layer)``: its fused-layout tensors,
    whose copies are rebuilt in backward rather than kept (:func:`_copies_rebuilt_in_backward`)."""
    blk = weights(layer)
    normed, rstd = input_stats(x, blk.attn_norm, eps)

    def block(x, normed, rstd, blk, next_norm):
        return decoder_layer(x, normed, rstd, blk, next_norm, eps, spec, positions, frequencies)
    saving = (_copies_rebuilt_in_backward(blk, lambda: weights(layer), layer)
              if torch.is_grad_enabled() and not torch.compiler.is_compiling() else contextlib.nullcontext())
    # next_norm: any [d] weight (the down projection's normed output is not read), or None where there is no norm
    # before attention (OLMo 2)
    with saving:
        if checkpoint is None:
            return block(x, normed, rstd, blk, blk.attn_norm)[0]
        return checkpoint_block(checkpoint, block, x, normed, rstd, blk, blk.attn_norm)[0]


def _fused_layer(eps: float, spec: AttentionSpec, positions: torch.Tensor, frequencies: torch.Tensor,
                 checkpoint: CheckpointFn | None, layer: nn.Module, x: torch.Tensor):
    """:func:`_layer` of a layer with fused parameters (``layer.fused``, a module call: hooks on it run too)."""
    attn_norm = tensor_parallel.local(layer.input_layernorm.weight).to(x.dtype)
    mlp_norm = tensor_parallel.local(layer.post_attention_layernorm.weight).to(x.dtype)
    normed, rstd = ops.rms_norm_stats(x, attn_norm, eps)
    args = (attn_norm, mlp_norm, attn_norm, eps, spec, positions, frequencies)
    if checkpoint is None:
        return layer.fused(x, normed, rstd, *args)[0]
    return checkpoint(layer.fused, x, normed, rstd, *args)[0]


def decoder_stack(x: torch.Tensor, layers: Sequence[nn.Module], final_norm: nn.Module,
                  weights: Callable[[nn.Module], BlockWeights] | None, eps: float, spec: AttentionSpec,
                  positions: torch.Tensor, frequencies: torch.Tensor,
                  checkpoints: Sequence[CheckpointFn | None], norm_scale: float = 1.0, norm_offset: float = 0.0):
    """The decoder layers on the embeddings ``x`` [tokens, d], one module call each, then the final norm's
    statistics in ``final_norm``'s module call: ``(x, normed, rstd)`` for :func:`head`. ``weights(layer)`` gives a
    layer's tensors in the fused layout (``None``: the layers hold fused parameters, ``layer.fused``);
    ``checkpoints[i]`` checkpoints layer ``i`` inside its module call (hooks outside the checkpoint, as
    ``transformers``' layers do); the final norm multiplies by ``(norm_offset + weight) * norm_scale`` (Gemma's
    ``1 + w``, a logits multiplier)."""
    for layer, checkpoint in zip(layers, checkpoints, strict=True):
        forward = (functools.partial(_fused_layer, eps, spec, positions, frequencies, checkpoint, layer)
                   if weights is None else
                   functools.partial(_layer, weights, eps, spec, positions, frequencies, checkpoint, layer))
        x = call_as_module(layer, forward, x)

    def final_stats(x):
        return (x, *ops.rms_norm_stats(x, _norm_weight(final_norm, x.dtype, norm_scale, norm_offset), eps))
    return call_as_module(final_norm, final_stats, x)


def _norm_weight(norm: nn.Module, dtype: torch.dtype, scale: float, offset: float) -> torch.Tensor:
    weight = tensor_parallel.local(norm.weight)
    weight = (weight if offset == 0.0 else weight + offset).to(dtype)
    return weight if scale == 1.0 else weight * scale


def head(head_module: nn.Module, final_norm: nn.Module, x: torch.Tensor, normed: torch.Tensor, rstd: torch.Tensor,
         targets: torch.Tensor | None, reduction: str = "mean", norm_scale: float = 1.0,
         norm_offset: float = 0.0, softcap: float | None = None) -> torch.Tensor:
    """:func:`codagen.models.llama.lm_head` in ``head_module``'s module call, reading the final norm's and the
    head's weights inside it (``x``: its one argument, see the module docstring; ``norm_scale``, ``norm_offset`` as
    in :func:`decoder_stack`; ``softcap``: a tanh soft-cap on the logits)."""
    def forward(x):
        return lm_head(x, normed, rstd, _norm_weight(final_norm, x.dtype, norm_scale, norm_offset),
                       tensor_parallel.local(head_module.weight).to(x.dtype), targets, reduction, softcap)
    return call_as_module(head_module, forward, x)
