"""Activation checkpointing of the regrouped decoder blocks.

The unit is one regrouped block (:func:`codagen.models.llama.decoder_stack`): QKV + RoPE (with the norm
statistics from the previous block), attention, O-proj + residual + statistics, gate/up + SwiGLU, down +
residual + the next norm's statistics. Its inputs are ``(x, normed, rstd)``, which is all a checkpointed
block keeps: ``2 d`` activations and one float32 per token, against ``(h + 2 kv) hd + 2 d + h hd + 2 f``
activations, attention's log-sum-exp (``h`` float32) and two float32 without checkpointing
(docs/models.md lists them per fused op).

Two policies, both through ``torch.utils.checkpoint`` (so Hugging Face's
``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`` selects them on a patched model):

- the default (any ``use_reentrant``): the whole block is recomputed in backward;
- ``context_fn=keep_attention`` (``use_reentrant=False``): attention's outputs (``out`` and its
  log-sum-exp) stay saved and only the fused GEMMs rerun. A fused GEMM of width ``N`` costs ``2 d N``
  flops per token to recompute and stores ``N`` activations: ``2 d`` flops per stored element, the same
  for each GEMM. Causal attention costs about ``2 S`` flops per element of its output (``S`` the
  sequence length), more than a GEMM once ``S > d``, at a lower rate. So attention is the one op worth
  keeping: ``h hd`` activations and ``h`` float32 more per token than the default, and no attention
  forward in backward.

Recomputation reproduces the forward bitwise: the fused ops are deterministic and
``torch.utils.checkpoint`` restores the RNG state for attention dropout.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from codagen.ops import LowRank

__all__ = ["CheckpointFn", "checkpoint_block", "keep_attention"]

CheckpointFn = Callable[..., Any]
"""``torch.utils.checkpoint.checkpoint`` or a partial of it (what Hugging Face stores as
``layer._gradient_checkpointing_func``): ``fn(function, *args)`` -> ``function(*args)``."""

# The SDPA kernels F.scaled_dot_product_attention dispatches to (those this PyTorch has)
_ATTENTION_OPS = tuple(getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name))


def checkpoint_block(checkpoint: CheckpointFn, block: Callable, x: torch.Tensor, normed: torch.Tensor,
                     rstd: torch.Tensor, weights, next_norm: torch.Tensor):
    """``block(x, normed, rstd, weights, next_norm)`` under ``checkpoint``. Every tensor of the
    ``weights`` dataclass (those of its ``LowRank`` adapters included) is passed positionally: under
    reentrant checkpointing their gradients then leave through the checkpoint's own node, not through a
    backward nested inside it."""
    fields = {f.name: getattr(weights, f.name) for f in dataclasses.fields(weights)}
    tensors = {name: value for name, value in fields.items() if isinstance(value, torch.Tensor)}
    adapters = {name: value for name, value in fields.items() if isinstance(value, LowRank)}
    flat = [*tensors.values()] + [t for adapter in adapters.values() for t in (adapter.a, adapter.b)]

    def run(x, normed, rstd, next_norm, *flat):
        given = dict(zip(tensors, flat))
        pairs = iter(flat[len(tensors):])
        given.update({name: dataclasses.replace(adapter, a=next(pairs), b=next(pairs))
                      for name, adapter in adapters.items()})
        return block(x, normed, rstd, dataclasses.replace(weights, **given), next_norm)
    return checkpoint(run, x, normed, rstd, next_norm, *flat)


def _keep_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def keep_attention():
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: attention's
    outputs are saved, everything else in the checkpointed block is recomputed. For example::

        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": keep_attention})
    """
    return create_selective_checkpoint_contexts(_keep_attention_policy)
