"""The KV-cache forward of a patched Hugging Face model: prefill and decode on the fused kernels.

``generate()`` and any forward with ``past_key_values``/``cache`` or ``use_cache=True`` run here. Each
block is the training block (:func:`block_qkv`, attention, :func:`block_out_mlp`); only attention
differs: the step's new K and V go into the ``transformers`` cache, and SDPA reads the whole cache with
the mask ``transformers`` itself builds for that cache (left padding, sliding windows, static caches).

Cache layout: Hugging Face's. Keys and values are ``[batch, kv_heads, tokens, head_dim]`` and K's
head channels are in HF's half-split RoPE order. The fused QKV GEMM emits Q and K heads in adjacent-pair
order (:func:`fuse_qkv`); the new Q and K rows are permuted back to half-split on their way into the cache
and SDPA. So a cache filled by a patched model continues in the unpatched one and vice versa.

The cache write: an allocated full-attention ``StaticLayer`` (``StaticCache``, outside ``torch.compile``)
takes the step in one launch (:func:`codagen.ops.kernels.static_cache_write`): K and V into the slots
``cumulative_length + t``, read on the device (no host sync: a decode step captures in a CUDA graph), Q into a
new half-split tensor for SDPA, and ``cumulative_length`` advanced by the step's tokens. Every other layer
(``DynamicCache``, sliding-window layers, the prefill that allocates a ``StaticLayer``, and any layer under
``torch.compile``, where Dynamo traces transformers' own update) gets half-split copies of Q and K and
``cache.update``.

Supported caches: ``DynamicCache`` (full and sliding-window layers) and ``StaticCache`` (full and
sliding-window layers). Anything else (quantized, offloaded, encoder-decoder, legacy tuples) is refused.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch

from codagen.ops.kernels import half_split_heads, static_cache_write

from .llama import AttentionSpec, BlockWeights, block_out_mlp, block_qkv, heads_attention, input_stats
from .per_model import PerModel

__all__ = ["inference_blocks", "inference_blocks_build", "new_dynamic_cache", "check_cache", "attention_masks",
           "decoder_stack_with_cache", "half_split_heads", "output"]

_SUPPORTED_CACHES = ("DynamicCache", "StaticCache")
_SUPPORTED_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer", "StaticLayer", "StaticSlidingWindowLayer")


# on each model: (what the fused weights were built from, the fused weights, a token of this build, the parameters and
# modules they were built from); on the model, as the modules name it (per_model)
_FUSED_WEIGHTS = PerModel("fused_weights")


def drop_inference_blocks(model) -> None:
    """Forget the fused weights :func:`inference_blocks` keeps for ``model`` (a forward with autograd on)."""
    _FUSED_WEIGHTS.pop(model)


@torch.compiler.disable  # reads version counters; a compiled forward (generate's static cache) calls it eagerly
def inference_blocks(model, dtype: torch.dtype, fuse: Callable[[], list[BlockWeights]],
                     modules: Sequence[tuple[str, torch.nn.Module]] | None = None) -> list[BlockWeights]:
    """``fuse()`` (the blocks' weights in the fused layout), reused across forwards without autograd.

    For forwards without autograd (with autograd on the caller fuses differentiably and drops the kept
    copy: :func:`drop_inference_blocks`): under ``torch.no_grad`` / inference mode (generation,
    evaluation) the fused layout is built once and kept while every parameter has the same storage and
    version counter and the same modules: an optimizer step, ``load_state_dict`` or a module swap changes them
    and the next forward re-fuses.
    A decode step then reads each weight once instead of gathering QKV and gate/up into new copies.
    In-place writes through ``param.data`` bypass the version counter and are not seen:
    :func:`codagen.models.hf.refresh_weights` drops the kept copy.
    ``modules``: ``model.named_modules()`` when the caller has walked them already.
    """
    # modules too: merging an adapter (peft's merge_and_unload) writes through ``.data`` and swaps modules
    modules = tuple(m for _, m in (model.named_modules() if modules is None else modules))
    # (a parameter shared by two modules appears twice)
    params = tuple(p for m in modules for p in m._parameters.values() if p is not None)
    key = (dtype, tuple((p.data_ptr(), p._version) for p in params), tuple(map(id, modules)))
    kept = _FUSED_WEIGHTS.get(model)
    if kept is None or kept[0] != key:
        # the parameters and modules are kept with their build: while they are, a replacement cannot take an old
        # one's address or id and so match its key (a new parameter starts at version 0, as an untouched old one)
        kept = (key, fuse(), object(), params, modules)
        _FUSED_WEIGHTS.set(model, kept)
    return kept[1]


def inference_blocks_build(model) -> object | None:
    """A token of the fused weights :func:`inference_blocks` keeps for ``model`` (``None``: none kept), new with each
    build: a captured decode step reads that build's tensors, so it is valid while the token is the same."""
    kept = _FUSED_WEIGHTS.get(model)
    return None if kept is None else kept[2]


_TRANSFORMERS: tuple | None = None
_CACHE_FIELD = "cache"  # set with _TRANSFORMERS (load_transformers)


def load_transformers() -> None:
    """Import ``transformers``' cache, mask and output modules (an optional dependency: only a patched
    forward needs them). ``codagen.patch`` calls it, so the forward finds them loaded: under
    ``torch.compile`` an import of transformers' lazy modules inside the forward is a graph break (torch
    2.11 with transformers 5.17)."""
    global _TRANSFORMERS, _CACHE_FIELD
    if _TRANSFORMERS is None:
        try:
            from transformers import cache_utils, masking_utils, modeling_outputs
        except ModuleNotFoundError as error:
            if error.name != "transformers":
                raise
            raise ImportError('codagen.patch runs transformers models and needs transformers: from the codagen '
                              'checkout, pip install -e ".[hf]"') from error
        _CACHE_FIELD = ("cache" if "cache" in inspect.signature(masking_utils.create_causal_mask).parameters
                        else "past_key_values")
        _TRANSFORMERS = cache_utils, masking_utils, modeling_outputs


def _transformers():
    if _TRANSFORMERS is None:
        load_transformers()
    return _TRANSFORMERS


def _refuse_cache(kind: str) -> NotImplementedError:
    return NotImplementedError(f"codagen.patch: KV cache {kind} is not supported by the fused decoder (supported: "
                               f"{', '.join(_SUPPORTED_CACHES)}); call codagen.unpatch(model) to run it with "
                               f"transformers")


def new_dynamic_cache(config):
    """The cache ``use_cache=True`` without one starts, as ``transformers``: a ``DynamicCache`` for ``config``
    (sliding-window layers where the config has them)."""
    cache_utils, _, _ = _transformers()
    return cache_utils.DynamicCache(config=config)


def check_cache(cache) -> None:
    """Refuse every cache but a plain ``DynamicCache`` / ``StaticCache`` of full or sliding-window layers."""
    cache_utils, _, _ = _transformers()
    if not isinstance(cache, cache_utils.Cache):
        raise _refuse_cache(f"of type {type(cache).__name__} (a legacy tuple cache or a non-Cache object)")
    kind = type(cache).__name__
    if kind not in _SUPPORTED_CACHES or type(cache) is not getattr(cache_utils, kind):
        raise _refuse_cache(kind)
    if getattr(cache, "offloading", False):
        raise _refuse_cache(f"{kind} with offloading (an offloaded cache)")
    for i, layer in enumerate(cache.layers):
        if type(layer).__name__ not in _SUPPORTED_LAYERS:
            raise _refuse_cache(f"{kind} with a {type(layer).__name__} at layer {i}")


def cache_field() -> str:
    """The name of the cache in ``transformers``' model outputs and mask functions (``cache`` from 5.2x,
    ``past_key_values`` before); read from the signature once, when transformers is loaded."""
    _transformers()
    return _CACHE_FIELD


def output(loss, logits, cache):
    """``CausalLMOutputWithPast`` carrying ``cache`` under the installed version's field name."""
    _, _, modeling_outputs = _transformers()
    return modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits, **{cache_field(): cache})


def attention_masks(config, x: torch.Tensor, attention_mask, cache, position_ids: torch.Tensor) -> dict:
    """The SDPA masks of this forward, ``{"full": ..., "sliding": ...}`` (``None``: causal), built by
    ``transformers`` for this cache before any layer updates it, exactly as the unpatched model does.

    ``attention_mask`` is the 2-D padding mask, a prepared 4-D mask (``generate`` with a static cache) or
    a dict of them per layer type; ``x`` is ``[batch, seq, hidden]`` (only its shape, dtype, device are read).
    """
    _, masking_utils, _ = _transformers()
    if isinstance(attention_mask, dict):
        masks = {"full": attention_mask.get("full_attention"), "sliding": attention_mask.get("sliding_attention")}
    else:
        kwargs = dict(config=config, inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids,
                      **{cache_field(): cache})
        masks = {"full": masking_utils.create_causal_mask(**kwargs),
                 "sliding": masking_utils.create_sliding_window_causal_mask(**kwargs)
                 if getattr(config, "sliding_window", None) is not None else None}
    for kind, mask in masks.items():
        if mask is not None and not (torch.is_tensor(mask) and mask.dim() == 4):
            raise NotImplementedError(
                f"codagen.patch: the {kind} attention mask built for attn_implementation="
                f"{getattr(config, '_attn_implementation', None)!r} is a {type(mask).__name__} of "
                f"{getattr(mask, 'dim', lambda: '?')()} dims; the KV-cache path takes 4-D SDPA masks "
                f"(attn_implementation 'sdpa' or 'eager')")
        if mask is not None and mask.dtype == torch.bool:
            # SDPA turns a boolean mask into this additive one on every call: once per forward instead of per layer
            masks[kind] = torch.zeros(mask.shape, dtype=x.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return masks


def _static_layer(cache, layer_idx: int):
    """``cache``'s layer ``layer_idx`` when :func:`static_cache_write` can update it: exactly
    transformers' full-attention ``StaticLayer``, allocated, with a tensor ``cumulative_length``, outside
    ``torch.compile`` (generate's compiled static-cache step keeps transformers' update, which Dynamo traces);
    else ``None``."""
    if torch.compiler.is_compiling():
        return None
    cache_utils, _, _ = _transformers()
    layers = getattr(cache, "layers", ())
    layer = layers[layer_idx] if layer_idx < len(layers) else None
    if (type(layer) is cache_utils.StaticLayer and layer.is_initialized
            and torch.is_tensor(getattr(layer, "cumulative_length", None))):
        return layer
    return None


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, cache, layer_idx: int,
                     mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of the step's token-major ``q``, ``k``, ``v`` (pair order) over the cache after adding ``k``, ``v``
    to it; returns ``[batch * seq, heads * head_dim]``. Mirrors ``transformers``' SDPA attention."""
    b, s, h, kv, hd = spec.batch, spec.seq, spec.num_heads, spec.num_kv_heads, spec.head_dim
    layer = _static_layer(cache, layer_idx)
    if layer is not None:  # one launch: K, V into their slots, Q permuted, the length advanced
        q_heads = static_cache_write(q, k, v, layer.keys, layer.values, layer.cumulative_length, b, s, h, kv, hd,
                                     spec.half_split_dim)
        keys, values = layer.keys, layer.values
    else:
        keys, values = cache.update(half_split_heads(k, b, s, kv, hd, spec.half_split_dim),
                                    v.view(b, s, kv, hd).transpose(1, 2),
                                    layer_idx)
        q_heads = half_split_heads(q, b, s, h, hd, spec.half_split_dim)
    if mask is not None:
        mask = mask[:, :, :, : keys.shape[-2]]
    out = heads_attention(q_heads, keys, values, spec, mask, is_causal=mask is None and s > 1)
    return out.transpose(1, 2).reshape(b * s, h * hd)


def decoder_stack_with_cache(x: torch.Tensor, blocks: Sequence[BlockWeights], final_norm: torch.Tensor, eps: float,
                             spec: AttentionSpec, positions: torch.Tensor, frequencies: torch.Tensor, cache,
                             masks: dict):
    """:func:`decoder_stack` with the KV cache: each block's new K and V enter ``cache`` (layer ``i`` for block ``i``),
    and attention reads the whole cache under ``masks`` (:func:`attention_masks`); returns ``(x, normed, rstd)``."""
    norms = [blk.attn_norm for blk in blocks] + [final_norm]
    normed, rstd = input_stats(x, norms[0], eps)
    for layer_idx, (blk, next_norm) in enumerate(zip(blocks, norms[1:])):
        q, k, v, x = block_qkv(blk, x, normed, rstd, spec, positions, frequencies, eps)
        mask = masks["sliding" if blk.sliding_window is not None else "full"]
        attn = cached_attention(q, k, v, spec, cache, layer_idx, mask)
        x, normed, rstd = block_out_mlp(blk, attn, x, next_norm, eps)
    return x, normed, rstd
