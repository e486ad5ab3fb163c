"""Hugging Face decoder layers whose fused weights are their parameters (for sharded training).

:func:`fuse_layers` moves each decoder layer's projections into one :class:`FusedBlock` child,
``layer.fused``: ``qkv_proj`` holds ``[W_q; W_k; W_v]`` with the Q/K rows in RoPE pair order (and the
fused Q/K/V bias), ``gate_up_proj`` the interleaved gate/up rows, ``o_proj`` and ``down_proj`` the
originals, ``q_norm``/``k_norm`` (QK-norm) the original modules. The layer keeps its two RMSNorms. The
patched forward then calls ``layer.fused(...)`` once per regrouped block, a module call, so the hooks
of a ``torch.distributed.fsdp.fully_shard`` unit on it run around the block; no layout is rebuilt per step.

The block reads three norm weights: its own layer's two and the next layer's input norm (or the
final norm), which its down-projection epilogue applies. These are arguments, not parameters of the
block, so a block's parameters are exactly its GEMM weights (and QK-norm's), and the norms live in an
enclosing unit (:mod:`codagen.models.sharding`).

State dicts keep Hugging Face's names and layouts: a hook on each decoder layer splits ``fused.*``
into ``self_attn.{q,k,v,o}_proj`` / ``mlp.{gate,up,down}_proj`` when saving and fuses them back when
loading. A sharded value (a ``DTensor``) is gathered one weight at a time, converted, and sharded again
with the same placements.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from codagen import ops

from . import tensor_parallel
from .checkpoint import CheckpointFn
from .llama import AttentionSpec, BlockWeights, decoder_layer, fuse_qkv, module_stack, split_qkv
from .tensor_parallel import qkv_from_rank_major, qkv_rank_major

__all__ = ["FusedBlock", "fuse_layers", "is_fused", "decoder_stack"]

_ATTENTION = ("q_proj", "k_proj", "v_proj")


class FusedBlock(nn.Module):
    """One decoder layer's GEMM weights in the fused layout; ``forward`` runs the regrouped block."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, num_heads: int, num_kv_heads: int,
                 sliding_window: int | None):
        super().__init__()
        self.head_dim, self.num_heads, self.num_kv_heads = attn.head_dim, num_heads, num_kv_heads
        self.sliding_window = sliding_window
        q, k, v = (getattr(attn, name) for name in _ATTENTION)
        self.qkv_proj = _linear(fuse_qkv(q.weight, k.weight, v.weight, self.head_dim),
                                None if q.bias is None else fuse_qkv(q.bias, k.bias, v.bias, self.head_dim),
                                q.weight.requires_grad)
        self.o_proj = attn.o_proj
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.gate_up_proj = _linear(ops.interleave_gate_up(mlp.gate_proj.weight, mlp.up_proj.weight), None,
                                    mlp.gate_proj.weight.requires_grad)
        self.down_proj = mlp.down_proj
        # tensor parallelism (sharding.FusedBlockParallel): the mesh and whether the residual stream is split by
        # rows between blocks (sequence parallelism); qkv_proj's rows then form one [Q; K; V] group per rank
        self.parallel: tuple[DeviceMesh, bool] | None = None
        self.qkv_groups = 1

    def weights(self, attn_norm: torch.Tensor, mlp_norm: torch.Tensor, dtype: torch.dtype) -> BlockWeights:
        def cast(t):  # a tensor-parallel shard or replica is the rank's local tensor
            return None if t is None else tensor_parallel.local(t).to(dtype)
        # QK-norm weights ([head_dim] each) stay in HF's channel order and are permuted per forward
        q_norm, k_norm = (None if norm is None else ops.rope_pairs_from_half_split(cast(norm.weight), self.head_dim)
                          for norm in (self.q_norm, self.k_norm))
        return BlockWeights(attn_norm=cast(attn_norm), qkv=cast(self.qkv_proj.weight),
                            qkv_bias=cast(self.qkv_proj.bias), o=cast(self.o_proj.weight),
                            o_bias=cast(self.o_proj.bias), mlp_norm=cast(mlp_norm),
                            gate_up=cast(self.gate_up_proj.weight), down=cast(self.down_proj.weight),
                            q_norm=q_norm, k_norm=k_norm, sliding_window=self.sliding_window)

    def forward(self, x: torch.Tensor, normed: torch.Tensor, rstd: torch.Tensor, attn_norm: torch.Tensor,
                mlp_norm: torch.Tensor, next_norm: torch.Tensor, eps: float, spec: AttentionSpec,
                positions: torch.Tensor, frequencies: torch.Tensor):
        """``(x, normed, rstd)`` of ``next_norm`` after this block (:func:`codagen.models.llama.decoder_layer`)."""
        blk = self.weights(attn_norm, mlp_norm, x.dtype)
        if self.parallel is None:
            return decoder_layer(x, normed, rstd, blk, next_norm.to(x.dtype), eps, spec, positions, frequencies)
        return tensor_parallel.rank_block(blk, x, normed, rstd, next_norm.to(x.dtype), eps, spec, positions,
                                          frequencies, self.head_dim, *self.parallel)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, requires_grad: bool) -> nn.Linear:
    """An ``nn.Linear`` holding (copies of) ``weight`` and ``bias``, allocated without initialization."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=requires_grad)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().clone(), requires_grad=requires_grad)
    return linear


def is_fused(model: nn.Module) -> bool:
    """Whether :func:`fuse_layers` has converted ``model`` (a ``...ForCausalLM``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return isinstance(layers, nn.ModuleList) and len(layers) > 0 and isinstance(getattr(layers[0], "fused", None),
                                                                                  FusedBlock)


@torch.no_grad()
def fuse_layers(model: nn.Module, sliding_windows: list[int | None]) -> None:
    """Give every decoder layer of the checked, patched ``model`` a :class:`FusedBlock` (``layer.fused``) in place
    of its ``self_attn`` and ``mlp``; ``sliding_windows[i]`` is layer ``i``'s window."""
    config = model.config
    for layer, window in zip(model.model.layers, sliding_windows, strict=True):
        for p in layer.parameters():
            if isinstance(p, DTensor):
                raise ValueError("codagen.models.sharding.fuse_parameters: the model is sharded already (a DTensor "
                                 "parameter); fuse its parameters before fully_shard / parallelize_module")
        layer.fused = FusedBlock(layer.self_attn, layer.mlp, config.num_attention_heads, config.num_key_value_heads,
                                 window)
        del layer.self_attn, layer.mlp
        layer.register_state_dict_post_hook(_to_hf_layout)
        layer.register_load_state_dict_pre_hook(_from_hf_layout)


# --- state-dict hooks: Hugging Face names and layouts in, out ------------------------------------------
def relayout(fn, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """``fn(*tensors)`` (a list of tensors) on the full values; sharded inputs give outputs sharded like the first."""
    if not isinstance(tensors[0], DTensor):
        return fn(*tensors)
    mesh, placements = tensors[0].device_mesh, tensors[0].placements
    outs = fn(*(t.full_tensor() for t in tensors))
    return [DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(mesh, placements)
            for out in outs]


def _to_hf_layout(layer: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    block: FusedBlock = layer.fused
    f, a, m = prefix + "fused.", prefix + "self_attn.", prefix + "mlp."
    heads = (block.num_heads, block.num_kv_heads, block.head_dim)
    for kind in ("weight", "bias"):
        if f + f"qkv_proj.{kind}" in state_dict:
            parts = relayout(lambda t: list(split_qkv(qkv_from_rank_major(t, *heads, block.qkv_groups), *heads)),
                              state_dict.pop(f + f"qkv_proj.{kind}"))
            state_dict.update({a + f"{n}.{kind}": t for n, t in zip(_ATTENTION, parts)})
    gate, up = relayout(lambda t: list(ops.split_gate_up(t)), state_dict.pop(f + "gate_up_proj.weight"))
    state_dict.update({m + "gate_proj.weight": gate, m + "up_proj.weight": up})
    for key in [key for key in state_dict if key.startswith(f)]:
        name = key[len(f):]
        state_dict[(m if name.startswith("down_proj.") else a) + name] = state_dict.pop(key)


def _from_hf_layout(layer: nn.Module, state_dict: dict, prefix: str, local_metadata, strict, missing_keys,
                    unexpected_keys, error_msgs) -> None:
    block: FusedBlock = layer.fused
    f, a, m = prefix + "fused.", prefix + "self_attn.", prefix + "mlp."
    for kind in ("weight", "bias"):
        keys = [a + f"{n}.{kind}" for n in _ATTENTION]
        if all(key in state_dict for key in keys):
            heads = (block.num_heads, block.num_kv_heads, block.head_dim)
            (qkv,) = relayout(lambda *t: [qkv_rank_major(fuse_qkv(*t, block.head_dim), *heads, block.qkv_groups)],
                               *(state_dict.pop(key) for key in keys))
            state_dict[f + f"qkv_proj.{kind}"] = qkv
    if m + "gate_proj.weight" in state_dict and m + "up_proj.weight" in state_dict:
        (gate_up,) = relayout(lambda g, u: [ops.interleave_gate_up(g, u)], state_dict.pop(m + "gate_proj.weight"),
                               state_dict.pop(m + "up_proj.weight"))
        state_dict[f + "gate_up_proj.weight"] = gate_up
    for key in [key for key in state_dict if key.startswith((a, m))]:
        state_dict[f + key[len(a if key.startswith(a) else m):]] = state_dict.pop(key)


def decoder_stack(x: torch.Tensor, layers, final_norm: torch.Tensor, eps: float, spec: AttentionSpec,
                  positions: torch.Tensor, frequencies: torch.Tensor,
                  checkpoints: list[CheckpointFn | None] | None = None):
    """:func:`codagen.models.llama.module_stack` over fused HF layers: one ``layer.fused(...)`` call per block.
    Under sequence parallelism the blocks take and return this rank's rows; the head gets every row back."""
    parallel = layers[0].fused.parallel if len(layers) else None
    sequence_mesh = parallel[0] if parallel is not None and parallel[1] else None
    return tensor_parallel.on_sequence_rows(x, sequence_mesh, lambda x: module_stack(
        x, [layer.fused for layer in layers], [tensor_parallel.local(layer.input_layernorm.weight) for layer in layers],
        [tensor_parallel.local(layer.post_attention_layernorm.weight) for layer in layers], final_norm, eps, spec,
        positions, frequencies, checkpoints))
