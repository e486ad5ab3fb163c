"""FSDP2 on codagen models: the fused parameters and the wrapping policy for ``torch.distributed.fsdp.fully_shard``.

CODA's regrouped block crosses a decoder layer's boundary: block ``i`` runs layer ``i``'s QKV, O, gate/up and
down GEMMs, and its down-projection epilogue applies layer ``i + 1``'s input-norm weight (the final norm's
for the last block), which block ``i + 1``'s QKV GEMM also reads. So the FSDP units are placed on the
blocks, not on the decoder layers:

- one unit per block: :class:`~codagen.models.fused_layers.FusedBlock`'s parameters (the QKV, O, gate/up
  and down weights in the fused layout, and QK-norm's), all-gathered by its forward pre-hook, resharded by
  its forward hook, all-gathered again for its backward and reduce-scattered after it by FSDP's own hooks,
  since the patched forward calls each block as a module;
- the root unit: embeddings, LM head and every RMSNorm weight (``2 d`` values per layer), unsharded for
  the whole step (FSDP does not reshard the root after forward).

:func:`fuse_parameters` stores the fused layouts once as the parameters (the plain patched model gathers
them from the separate projections on every forward); state dicts keep Hugging Face's names and layouts.
:func:`fully_shard` applies it and the units. Refused: PEFT models (LoRA keeps the separate q/k/v modules),
a model sharded before its parameters are fused, ``fully_shard`` on a decoder layer (its norms would be
sharded inside the unit that the previous block also reads), KV caches on fused models.
"""
from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from . import fused_layers, hf, lora
from .llama import Llama

__all__ = ["fuse_parameters", "fully_shard", "blocks_of"]


def fuse_parameters(model: nn.Module) -> nn.Module:
    """Patch ``model`` (a ``transformers`` causal LM that :func:`codagen.patch` takes) and store its fused
    weights as its parameters, in place: each decoder layer's projections move into ``layer.fused``
    (:mod:`codagen.models.fused_layers`). ``state_dict()`` / ``load_state_dict()`` keep Hugging Face's names
    and layouts. The optimizer must be built after this call (the fused weights are new parameters)."""
    if lora.unwrap_peft(model) is not model:
        raise NotImplementedError("codagen.models.sharding.fuse_parameters: PEFT models are not supported (LoRA "
                                  "adapters sit on the separate q/k/v and gate/up modules); patch the PeftModel "
                                  "with codagen.patch, without fused parameters")
    if fused_layers.is_fused(model):
        return model
    hf.patch(model)
    if lora.prepare_adapters(model):
        raise NotImplementedError("codagen.models.sharding.fuse_parameters: the model holds LoRA layers")
    fused_layers.fuse_layers(model, [hf._sliding_window(model, layer) for layer in model.model.layers])
    return model


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`fully_shard` makes units of: one per regrouped block, in order."""
    if isinstance(model, Llama):
        return list(model.layers)
    if not fused_layers.is_fused(model):
        raise ValueError("codagen.models.sharding.blocks_of: model has no fused blocks (fuse_parameters(model))")
    return [layer.fused for layer in model.model.layers]


def fully_shard(model: nn.Module, *, mesh=None, reshard_after_forward: bool | int | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy()) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard`` on each fused block of ``model`` and on ``model`` (the root),
    in place; returns ``model``. Arguments as torch's; ``reshard_after_forward`` applies to the blocks and the
    root as torch's does (``None``: the blocks reshard, the root does not).

    ``model`` is a ``transformers`` causal LM (:func:`fuse_parameters` runs first) or a
    :class:`codagen.models.Llama` (its blocks hold their GEMM weights, its norms are the model's). The blocks'
    units take ``mp_policy`` with ``cast_forward_inputs=False``: a block's inputs come from the previous block
    already in the compute dtype, and its float32 ones (the RMSNorm ``rstd``, the RoPE frequencies) must stay
    float32. Each block's forward pre-hook issues the next block's all-gather (prefetch).
    """
    if not isinstance(model, Llama):
        fuse_parameters(model)
    blocks = blocks_of(model)
    block_policy = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    for block in blocks:
        torch_fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=block_policy,
                          offload_policy=offload_policy)
    torch_fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                      offload_policy=offload_policy)
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following])
    return model
