"""Tensor parallelism of a regrouped block, with the RMSNorms still applied in the GEMM epilogues.

The block's GEMM weights are DTensors on a 1-D mesh of ``tp`` ranks (``codagen.models.sharding.FusedBlockParallel``):

- column-parallel QKV: each rank holds whole heads, rows ``[Q heads | K heads | V heads]`` of its share
  (:func:`qkv_rank_major` orders the fused weight so that ``Shard(0)`` gives them);
- column-parallel gate/up: ``Shard(0)`` of the interleaved rows, a contiguous range of (gate, up) pairs;
- row-parallel O and down: ``Shard(1)``, the columns matching the rank's heads and pairs.

A row-parallel GEMM's output is a partial sum until it is reduced, so the statistics its epilogue would
compute on one GPU are wrong on a rank. Here the O and down GEMMs run without an epilogue, their outputs
are all-reduced (or, with sequence parallelism, reduce-scattered to the rank's rows), and the residual add
and the next norm's statistics (``normed``, ``rstd``) run on the reduced rows in one row kernel
(:func:`codagen.ops.rms_norm_stats`). The consuming column-parallel GEMM (QKV, gate/up) then takes
``x`` and ``rstd`` (with sequence parallelism all-gathered, ``normed = x * gamma`` recomputed from them) and
applies ``rstd`` in its epilogue and owns the norm's backward, as on one GPU. Its input gradient and its
norm weights' gradients are partial sums over the rank's heads or pairs, so they are all-reduced (with
sequence parallelism reduce-scattered) on the way back: each is a DTensor ``Replicate`` input whose
gradient is declared ``Partial``.

Communication per block, ``M`` tokens, hidden size ``d``, in the activation dtype: without sequence
parallelism two all-reduces of ``M d`` in forward and two in backward; with it, forward two reduce-scatters
of ``M d`` and two all-gathers of ``M d`` (``x``) plus ``M`` float32 (``rstd``), backward two all-gathers
and two reduce-scatters of ``M d``. Both add the all-reduces of the norm weights' gradients: ``2 d`` (and
``2 hd`` with QK-norm) per block.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from codagen import ops

from .llama import AttentionSpec, BlockWeights, attention, block_qkv

__all__ = ["qkv_rank_major", "qkv_from_rank_major", "shard_block_weights", "replicate_parameters", "local",
           "rank_block", "parallel_block", "sequence_rows", "rows_of", "all_rows", "on_sequence_rows"]


def qkv_rank_major(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, ranks: int) -> torch.Tensor:
    """Reorder a fused ``[Q; K; V]`` weight (or bias) to ``ranks`` groups ``[Q_r; K_r; V_r]``, each with
    ``num_heads / ranks`` Q heads and ``num_kv_heads / ranks`` K and V heads."""
    q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim))
    return torch.cat([part for group in zip(q.chunk(ranks), k.chunk(ranks), v.chunk(ranks)) for part in group])


def qkv_from_rank_major(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                        ranks: int) -> torch.Tensor:
    """Inverse of :func:`qkv_rank_major`."""
    sizes = (num_heads // ranks * head_dim, num_kv_heads // ranks * head_dim, num_kv_heads // ranks * head_dim)
    groups = [chunk.split(sizes) for chunk in qkv.chunk(ranks)]
    return torch.cat([torch.cat(parts) for parts in zip(*groups)])


def shard_block_weights(who: str, qkv: nn.Module, gate_up: nn.Module, o: nn.Module, down: nn.Module,
                        heads: tuple[int, int, int], mesh: DeviceMesh, src_data_rank: int | None = 0) -> None:
    """Shard a block's GEMM weights over the 1-D ``mesh`` in place, as the module docstring lays them out: ``qkv``
    (weight and bias, rank-major), ``gate_up`` by rows, ``o`` and ``down`` by columns. ``heads`` is
    ``(num_heads, num_kv_heads, head_dim)``; every count must divide by the degree (``ValueError`` naming it,
    with ``who`` the caller)."""
    ranks = mesh.size()
    sizes = {"num_attention_heads": heads[0], "num_key_value_heads": heads[1],
             "intermediate_size": gate_up.weight.shape[0] // 2}
    for name, size in sizes.items():
        if size % ranks:
            raise ValueError(f"{who}: {name} ({size}) must be a multiple of the tensor-parallel degree ({ranks})")

    def shard(linear: nn.Module, name: str, dim: int, layout=lambda t: t):
        value = getattr(linear, name)
        if value is not None:
            setattr(linear, name, nn.Parameter(distribute_tensor(layout(value.detach()), mesh, [Shard(dim)],
                                                                 src_data_rank=src_data_rank),
                                               requires_grad=value.requires_grad))
    with torch.no_grad():
        for name in ("weight", "bias"):
            shard(qkv, name, 0, lambda t: qkv_rank_major(t, *heads, ranks))
        shard(gate_up, "weight", 0)
        shard(o, "weight", 1)
        shard(down, "weight", 1)


def replicate_parameters(model: nn.Module, mesh: DeviceMesh, src_data_rank: int | None = 0) -> None:
    """Every parameter of ``model`` that is not a DTensor yet becomes a ``Replicate`` DTensor on ``mesh``, in place
    (a parameter shared by two modules, such as tied embeddings, stays shared). So all parameters live on one mesh,
    which what reduces over them needs (``torch.nn.utils.clip_grad_norm_`` stacks their norms); the forward reads
    the replicated ones through :func:`local`. Their gradients are the same on every rank: each rank computes
    the replicated parts on all tokens, and the blocks reduce the partial sums of the norm weights'."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, value in list(module._parameters.items()):
            if value is None or isinstance(value, DTensor):
                continue
            if id(value) not in replaced:
                replaced[id(value)] = nn.Parameter(distribute_tensor(value.detach(), mesh, [Replicate()],
                                                                     src_data_rank=src_data_rank),
                                                   requires_grad=value.requires_grad)
            module._parameters[name] = replaced[id(value)]


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's tensor of a parameter: the local tensor of a DTensor (a tensor-parallel shard or replica), else
    ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def rank_block(blk: BlockWeights, x: torch.Tensor, normed: torch.Tensor, rstd: torch.Tensor, next_norm: torch.Tensor,
               eps: float, spec: AttentionSpec, positions: torch.Tensor, frequencies: torch.Tensor, head_dim: int,
               mesh: DeviceMesh, sequence_parallel: bool):
    """:func:`parallel_block` with the whole model's ``spec`` and ``frequencies``: narrowed to this rank's heads."""
    ranks = mesh.size()
    spec = dataclasses.replace(spec, num_heads=spec.num_heads // ranks, num_kv_heads=spec.num_kv_heads // ranks)
    frequencies = ops.rope_frequencies(spec.num_heads, spec.num_kv_heads, head_dim,
                                       inv_freq=frequencies[: head_dim // 2])
    return parallel_block(blk, x, normed, rstd, next_norm, eps, spec, positions, frequencies, mesh, sequence_parallel)


def sequence_rows(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's rows of the residual stream ``x`` (all tokens, the same on every rank) under sequence
    parallelism; ``ValueError`` unless the token count divides by the degree."""
    if x.shape[0] % mesh.size():
        raise ValueError(f"codagen: sequence parallelism needs batch * seq ({x.shape[0]} tokens) to be a multiple "
                         f"of the tensor-parallel degree ({mesh.size()})")
    return rows_of(x, mesh)


def on_sequence_rows(x: torch.Tensor, mesh: DeviceMesh | None, stack: Callable[[torch.Tensor], tuple]) -> tuple:
    """``stack(x)``, a decoder stack over the residual stream ``x`` returning ``(x, normed, rstd)``; under sequence
    parallelism over ``mesh`` on this rank's rows of ``x`` (:func:`sequence_rows`), with every rank's rows of the
    three gathered back for the head (:func:`all_rows`). ``mesh`` None: no sequence parallelism."""
    if mesh is None:
        return stack(x)
    return tuple(all_rows(t, mesh) for t in stack(sequence_rows(x, mesh)))


def _gradient_reduced(t: torch.Tensor | None, mesh: DeviceMesh) -> torch.Tensor | None:
    """``t`` itself; its gradient is all-reduced over ``mesh`` (a column-parallel GEMM's input or norm weight)."""
    if t is None:
        return None
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _reduced(partial: torch.Tensor, mesh: DeviceMesh, sequence_parallel: bool) -> torch.Tensor:
    """A row-parallel GEMM's partial output summed over ``mesh``: all rows, or this rank's with sequence parallelism."""
    placement = Shard(0) if sequence_parallel else Replicate()
    return DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(mesh, [placement]).to_local()


def _gathered(rows: torch.Tensor, mesh: DeviceMesh, partial_gradient: bool = True) -> torch.Tensor:
    """Every rank's ``rows``, concatenated; the gradient is reduce-scattered back (``partial_gradient``: each
    rank's gradient is a partial sum) or sliced (it is the same on every rank)."""
    full = DTensor.from_local(rows, mesh, [Shard(0)], run_check=False).redistribute(mesh, [Replicate()])
    return full.to_local(grad_placements=[Partial()] if partial_gradient else None)


def rows_of(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's rows of ``t`` (the same on every rank); the gradient is all-gathered back."""
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(0)]).to_local()


def all_rows(rows: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's ``rows``, for a consumer that runs the same on every rank (the LM head)."""
    return _gathered(rows, mesh, partial_gradient=False)


def parallel_block(blk: BlockWeights, x: torch.Tensor, normed: torch.Tensor, rstd: torch.Tensor,
                   next_norm: torch.Tensor, eps: float, spec: AttentionSpec, positions: torch.Tensor,
                   frequencies: torch.Tensor, mesh: DeviceMesh, sequence_parallel: bool):
    """One block on this rank: ``blk`` holds the rank's shards of the GEMM weights (and the whole norm weights),
    ``spec`` and ``frequencies`` the rank's heads. ``x``, ``normed``, ``rstd`` are all tokens, or with
    ``sequence_parallel`` this rank's rows (``positions`` are always all tokens'). Returns them after the block."""
    column = dataclasses.replace(blk, attn_norm=_gradient_reduced(blk.attn_norm, mesh),
                                 q_norm=_gradient_reduced(blk.q_norm, mesh), k_norm=_gradient_reduced(blk.k_norm, mesh))
    x_in, normed_in, rstd_in = _column_inputs(x, rstd, blk.attn_norm, mesh, sequence_parallel, normed)
    # x passes through the QKV op unused: the residual path keeps the rank's own x, whose gradient is complete
    q, k, v, _ = block_qkv(column, x_in, normed_in, rstd_in, spec, positions, frequencies, eps)
    attn = attention(q, k, v, spec, blk.sliding_window)
    x = x + _reduced(attn @ blk.o.T, mesh, sequence_parallel)
    if blk.o_bias is not None:  # with sequence parallelism its gradient sums this rank's rows only
        x = x + (_gradient_reduced(blk.o_bias, mesh) if sequence_parallel else blk.o_bias)
    normed, rstd = ops.rms_norm_stats(x, blk.mlp_norm, eps)
    x_in, normed_in, rstd_in = _column_inputs(x, rstd, blk.mlp_norm, mesh, sequence_parallel, normed)
    act = ops.rms_gate_up_swiglu(x_in, normed_in, rstd_in, _gradient_reduced(blk.mlp_norm, mesh), blk.gate_up)
    x = x + _reduced(act @ blk.down.T, mesh, sequence_parallel)
    normed, rstd = ops.rms_norm_stats(x, next_norm, eps)
    return x, normed, rstd


def _column_inputs(x, rstd, norm_weight, mesh, sequence_parallel, normed):
    """``(x, normed, rstd)`` for a column-parallel GEMM: all tokens, ``x``'s gradient reduced over the ranks."""
    if not sequence_parallel:
        return _gradient_reduced(x, mesh), normed, rstd
    x = _gathered(x, mesh)
    rstd = _gathered(rstd.detach(), mesh, partial_gradient=False)
    with torch.no_grad():  # normed = x * gamma is non-differentiable; the consumer owns the norm's backward
        normed = x * norm_weight
    return x, normed, rstd
