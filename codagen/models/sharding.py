"""FSDP2 and tensor parallelism on codagen models: the fused parameters, the wrapping policy for
``torch.distributed.fsdp.fully_shard``, and the ``parallelize_module`` style of the fused blocks.

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
a model sharded before its parameters are fused, KV caches on fused models.

Units per decoder layer, as accelerate's FSDP2 plugin and the Hugging Face Trainer place them (``fully_shard`` on
each decoder layer and the root, of a patched model with or without fused parameters, PEFT LoRA included), run
the layer-aligned forward instead of the regrouped one (:mod:`codagen.models.layer_units`): each layer reads only
its own norms, at one extra row pass per layer.

:func:`parallelize` shards each fused block's GEMM weights over a tensor-parallel mesh
(:class:`FusedBlockParallel`; the computation is :mod:`codagen.models.tensor_parallel`); :func:`fully_shard` over
the other dimension of a 2-D mesh then shards them further. docs/sharding.md has both, with the collectives each
runs.
"""
from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from . import families, fused_layers, hf, lora
from .llama import Llama
from .tensor_parallel import replicate_parameters, shard_block_weights

__all__ = ["fuse_parameters", "fully_shard", "blocks_of", "FusedBlockParallel", "parallelize"]


def fuse_parameters(model: nn.Module) -> nn.Module:
    """Patch ``model`` (a ``transformers`` causal LM that :func:`codagen.patch` takes) and store its fused
    weights as its parameters, in place: each decoder layer's projections move into ``layer.fused``
    (:mod:`codagen.models.fused_layers`). ``state_dict()`` / ``load_state_dict()`` keep Hugging Face's names
    and layouts. The optimizer must be built after this call (the fused weights are new parameters)."""
    if lora.unwrap_peft(model) is not model:
        raise NotImplementedError("codagen.models.sharding.fuse_parameters: PEFT models are not supported (LoRA "
                                  "adapters sit on the separate q/k/v and gate/up modules); patch the PeftModel "
                                  "with codagen.patch, without fused parameters, and fully_shard its decoder layers "
                                  "and the root (accelerate's FSDP2 placement: codagen.models.layer_units)")
    if fused_layers.is_fused(model):
        return model
    family = families.family_of(model)
    rotary = model.model.rotary_emb
    if families.rope_from_positions(model) or getattr(rotary, "attention_scaling", 1.0) != 1.0:
        raise NotImplementedError(f"codagen.models.sharding.fuse_parameters: rope_type "
                                  f"{getattr(rotary, 'rope_type', 'default')!r} (frequencies chosen per forward, or "
                                  f"an attention_scaling) is not supported yet with fused parameters; patch the model "
                                  f"with codagen.patch and fully_shard its decoder layers and the root")
    if not family.llama_layout:
        raise NotImplementedError(f"codagen.models.sharding.fuse_parameters: the {family.name} family (its fused "
                                  f"projections, multipliers or layers without RoPE) is not supported yet; patch it "
                                  f"with codagen.patch and fully_shard its decoder layers and the root (accelerate's "
                                  f"FSDP2 placement: codagen.models.layer_units)")
    if hf.fp8_recipe(model) is not None:  # patching again would drop the recipe
        raise NotImplementedError(f"codagen.models.sharding.fuse_parameters: the model is patched with "
                                  f"fp8={hf.fp8_recipe(model)!r}, which fused parameters do not take yet; fully_shard "
                                  f"its decoder layers and the root instead (codagen.models.layer_units)")
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
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - torch's defaults (frozen)
                offload_policy: OffloadPolicy = OffloadPolicy()) -> nn.Module:  # noqa: B008
    """``torch.distributed.fsdp.fully_shard`` on each fused block of ``model`` and on ``model`` (the root),
    in place; returns ``model``. Arguments as torch's; ``reshard_after_forward`` applies to the blocks and the
    root as torch's does (``None``: the blocks reshard, the root does not).

    ``model`` is a ``transformers`` causal LM (:func:`fuse_parameters` runs first) or a
    :class:`codagen.models.Llama` (its blocks hold their GEMM weights, its norms are the model's). The blocks'
    units take ``mp_policy`` with ``cast_forward_inputs=False``: a block's inputs come from the previous block
    already in the compute dtype, and its float32 ones (the RMSNorm ``rstd``, the RoPE frequencies) must stay
    float32. Each block's forward pre-hook issues the next block's all-gather (prefetch).

    FSDP with tensor parallelism (a 2-D mesh): :func:`parallelize` over one dimension of the mesh first, then this
    with ``mesh`` the other (data-parallel) dimension; FSDP shards the tensor-parallel shards further::

        mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh["tp"], sequence_parallel=True)
        fully_shard(model, mesh=mesh["dp"])
    """
    if not isinstance(model, Llama):
        fuse_parameters(model)
    blocks = blocks_of(model)
    tp_mesh = next((block.parallel[0] for block in blocks if getattr(block, "parallel", None) is not None), None)
    if tp_mesh is not None and (mesh is None or not _orthogonal(mesh, tp_mesh)):
        raise ValueError("codagen.models.sharding.fully_shard: the model is tensor-parallel; give mesh= the "
                         "data-parallel dimension of the 2-D mesh whose other dimension parallelize() took (e.g. "
                         "mesh['dp'] of init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')))")
    block_policy = dataclasses.replace(mp_policy, cast_forward_inputs=False)
    for block in blocks:
        torch_fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=block_policy,
                          offload_policy=offload_policy)
    torch_fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                      offload_policy=offload_policy)
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following])
    return model


def _orthogonal(mesh: DeviceMesh, other: DeviceMesh) -> bool:
    """Whether two 1-D meshes are two dimensions of one 2-D mesh: their ranks meet in this rank alone."""
    ranks, other_ranks = set(mesh.mesh.flatten().tolist()), set(other.mesh.flatten().tolist())
    return mesh.ndim == 1 and len(ranks & other_ranks) == 1


class FusedBlockParallel(ParallelStyle):
    """A ``parallelize_module`` style for a :class:`~codagen.models.fused_layers.FusedBlock` on a 1-D mesh:
    column-parallel QKV (whole heads per rank) and gate/up (a contiguous range of interleaved pairs per
    rank), row-parallel O and down (:mod:`codagen.models.tensor_parallel`). With ``sequence_parallel`` the
    residual stream between blocks is split by rows. Norm weights, embeddings and the LM head stay
    replicated (:func:`parallelize` makes them ``Replicate`` DTensors on the same mesh)."""

    def __init__(self, *, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, fused_layers.FusedBlock):
            raise TypeError(f"FusedBlockParallel: expected a codagen FusedBlock (fuse_parameters(model)), "
                            f"got {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(f"FusedBlockParallel: expected a 1-D device mesh, got {device_mesh.ndim} dimensions")
        if module.parallel is not None:
            raise ValueError("FusedBlockParallel: the block is tensor-parallel already")
        shard_block_weights("FusedBlockParallel", module.qkv_proj, module.gate_up_proj, module.o_proj,
                            module.down_proj, (module.num_heads, module.num_kv_heads, module.head_dim), device_mesh,
                            self.src_data_rank)
        module.parallel, module.qkv_groups = (device_mesh, self.sequence_parallel), device_mesh.size()
        return module


def parallelize(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool = False) -> nn.Module:
    """Tensor parallelism of a ``transformers`` causal LM over the 1-D ``mesh``, in place: :func:`fuse_parameters`,
    then ``parallelize_module`` with :class:`FusedBlockParallel` on every ``model.layers.*.fused``; every other
    parameter becomes a ``Replicate`` DTensor on ``mesh``
    (:func:`~codagen.models.tensor_parallel.replicate_parameters`), so that gradient clipping sees one mesh."""
    fuse_parameters(model)
    parallelize_module(model, mesh, {"model.layers.*.fused": FusedBlockParallel(sequence_parallel=sequence_parallel)})
    replicate_parameters(model, mesh)  # norms, embeddings, the LM head: Replicate DTensors, so all share the mesh
    return model
