"""torchtitan's Llama 3 and dense Qwen3 with codagen's fused blocks, under torchtitan's own parallelize steps.

Run torchtitan 0.3's trainer on this module as its config registry::

    torchrun --nproc_per_node 8 -m torchtitan.train --module codagen.integrations.torchtitan --config llama3_8b

(``llama3_8b``, ``llama3_70b``, ``llama3_debugmodel``, ``llama3_debugmodel_ce_loss``, ``qwen3_0_6b``,
``qwen3_1_7b``, ``qwen3_14b``, ``qwen3_32b``, ``qwen3_debugmodel``: torchtitan's configs of those names, converted;
``llama3_8b_fp8`` and ``llama3_debugmodel_fp8`` with FP8 GEMMs; the usual command-line flags apply on top), or
convert a model spec in a config registry of your own with ``llama3.model_registry(flavor,
converters=[CodagenConverter.Config()])`` (``CodagenConverter.Config(fp8="blockwise")``: every block's GEMMs in
FP8, ``docs/models.md``, "FP8 training") and set ``parallelism.spmd_backend = "partial_dtensor"``
(:func:`.config_registry.codagen_trainer_config` does both). The conversion replaces the model
config (a ``Llama3Model.Config`` / ``Qwen3Model.Config``) by :class:`CodagenLlama3Model.Config` /
:class:`CodagenQwen3Model.Config` and each block config by :class:`CodagenBlock.Config`, keeping every size, RoPE
setting and parameter init. Each decoder block then runs CODA's regrouped unit
(:func:`codagen.models.llama.decoder_layer`): norm + QKV + RoPE, attention, O-proj + residual + norm statistics,
gate/up + SwiGLU + down + residual + the next norm's statistics, as custom ops with fake and autograd registrations.
(torchtitan's ``--override.imports`` does not fit: the trainer builds the model config it held before applying
overrides, so an override of the root model config is not built; overrides of nested component configs are.)

torchtitan's ``parallelize_llama`` / ``parallelize_qwen3`` run unchanged on the converted model:

- activation checkpointing and ``torch.compile`` wrap each ``model.layers[i]``, a :class:`CodagenBlock`;
- ``apply_fsdp_to_decoder`` makes one FSDP2 unit per block (its GEMM weights), one for ``tok_embeddings`` and
  the root. Block ``i``'s down-projection epilogue applies block ``i + 1``'s input norm, so the RMSNorm weights
  are arguments of the blocks and live in the root (``block_norms``, ``final_norm``): the model has no
  ``norm`` child, which makes torchtitan leave the final norm and the LM head in the root unit
  (``docs/sharding.md``, "The units").

Layouts. ``wqkv = [wq; wk; wv]``, ``w13`` interleaves ``w1`` (gate) and ``w3`` (up) rows. Llama 3's RoPE
(``ComplexRoPE``) rotates adjacent channel pairs ``(2i, 2i + 1)``, the pair order codagen's QKV epilogue takes, so
its Q/K rows stay as they are; Qwen3's (``CosSinRoPE``) rotates Hugging Face's half-split pairs ``(i, i + hd/2)``,
so its Q/K rows and QK-norm weights are permuted to adjacent pairs (``ops.layouts``). State dicts keep torchtitan's
names and layouts (``attention.qkv_linear.wq``, ``feed_forward.w1``, ``attention_norm``, ``norm``, ...) through
hooks on the root, so torchtitan's DCP checkpoints and its Hugging Face state-dict adapters see the stock model's
keys.

It runs with ``parallelism.spmd_backend = "partial_dtensor"`` (FSDP2 and DTensor only where torchtitan adds
them; the default ``spmd_types`` backend annotates every module with sharding specs, which the blocks do not
declare). Tensor parallelism (torchtitan's ``parallelize_llama`` calls ``model.parallelize`` when ``tp`` > 1):
each block's GEMM weights are sharded over the ``tp`` mesh as the Hugging Face blocks'
(:mod:`codagen.models.tensor_parallel`, with sequence parallelism when ``parallelism.enable_sequence_parallel``);
the embeddings, norms and LM head stay whole on every rank. Not supported (each raises when configured): context /
pipeline / expert parallelism, async TP, the ``spmd_types`` and ``full_dtensor`` backends, attention masks
(document masking of packed sequences: the blocks run causal SDPA over each sequence), MoE blocks, biases.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.config.override import derive
from torchtitan.models.common.attention import GQAttention, QKVLinear, ScaledDotProductAttention
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module, ModuleDict

from codagen import ops
from codagen.models import tensor_parallel
from codagen.models.fused_layers import relayout
from codagen.models.llama import AttentionSpec, BlockWeights, decoder_layer, module_stack
from codagen.ops._fp8 import checked_recipe

__all__ = ["CodagenBlock", "CodagenConverter", "CodagenLlama3Model", "CodagenQwen3Model", "LayerNorms",
           "convert_config"]


def _qkv_config(attention: GQAttention.Config) -> Linear.Config:
    """One ``Linear.Config`` for ``[wq; wk; wv]``, initialized like torchtitan's Q/K/V projection."""
    n_kv = attention.n_kv_heads or attention.n_heads
    head_dim = attention.head_dim or attention.dim // attention.n_heads
    qkv = attention.qkv_linear
    source = qkv.wq if isinstance(qkv, QKVLinear.Config) else qkv.wqkv
    if source.bias:
        raise NotImplementedError("codagen.integrations.torchtitan: a QKV bias is not supported")
    return Linear.Config(in_features=attention.dim, out_features=(attention.n_heads + 2 * n_kv) * head_dim,
                         param_init=source.param_init)


class CodagenBlock(Module):
    """One decoder block's GEMM weights in codagen's fused layout; ``forward`` runs CODA's regrouped block.

    ``wqkv`` [(h + 2 kv) hd, d] holds ``[wq; wk; wv]`` (torchtitan's pair order), ``wo`` the O-proj, ``w13``
    [2 f, d] the interleaved ``w1``/``w3`` rows, ``w2`` the down-proj. ``w13`` takes ``w1``'s init for all its rows
    (torchtitan draws ``w3`` with the depth-scaled std of ``w2``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Llama3TransformerBlock.Config):
        fp8: str | None = None  # "blockwise": the block's GEMMs in FP8 (codagen.ops._fp8.RECIPES)

    def __init__(self, config: Config):
        super().__init__()
        attention, ffn = config.attention, config.feed_forward
        self.fp8 = checked_recipe(config.fp8) is not None
        if not isinstance(attention, GQAttention.Config) or ffn is None or config.moe is not None:
            raise NotImplementedError("codagen.integrations.torchtitan: a block must have GQA attention and a "
                                      f"dense feed-forward, got {type(attention).__name__} / moe={config.moe}")
        if not isinstance(attention.rope, (ComplexRoPE.Config, CosSinRoPE.Config)):
            raise NotImplementedError("codagen.integrations.torchtitan: RoPE must be ComplexRoPE or CosSinRoPE, got "
                                      f"{type(attention.rope).__name__}")
        if any(linear.bias for linear in (attention.wo, ffn.w1, ffn.w2, ffn.w3)):
            raise NotImplementedError("codagen.integrations.torchtitan: biases are not supported")
        self.wqkv = _qkv_config(attention).build()
        self.wo = attention.wo.build()
        self.w13 = Linear.Config(in_features=ffn.w1.in_features, out_features=2 * ffn.w1.out_features,
                                 param_init=ffn.w1.param_init).build()
        self.w2 = ffn.w2.build()
        # QK-norm (Qwen3): per-head RMSNorm weights [head_dim], in pair order, as each Q/K head's rows of wqkv
        self.q_norm, self.k_norm = ((attention.qk_norm.build(), attention.qk_norm.build())
                                    if attention.qk_norm is not None else (None, None))
        self.heads = (attention.n_heads, attention.n_kv_heads or attention.n_heads,
                      attention.head_dim or attention.dim // attention.n_heads)
        # tensor parallelism (:meth:`shard`): the "tp" mesh and whether the residual stream is split by rows
        self.parallel: tuple[DeviceMesh, bool] | None = None

    def shard(self, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        """Tensor parallelism over ``tp_mesh``, as the Hugging Face blocks' (:mod:`codagen.models.tensor_parallel`):
        column-parallel ``wqkv`` (whole heads per rank) and ``w13`` (a range of gate/up pairs), row-parallel ``wo``
        and ``w2``; the norms stay whole."""
        if self.fp8:
            raise NotImplementedError("codagen.integrations.torchtitan: fp8 with tensor parallelism is not supported "
                                      "yet")
        tensor_parallel.shard_block_weights("codagen.integrations.torchtitan", self.wqkv, self.w13, self.wo, self.w2,
                                            self.heads, tp_mesh)
        self.parallel = (tp_mesh, sequence_parallel)

    def forward(self, x: torch.Tensor, normed: torch.Tensor, rstd: torch.Tensor, attn_norm: torch.Tensor,
                mlp_norm: torch.Tensor, next_norm: torch.Tensor, eps: float, spec: AttentionSpec,
                positions: torch.Tensor, frequencies: torch.Tensor):
        """``(x, normed, rstd)`` of ``next_norm`` after this block, on token rows ``[B * S, d]`` (this rank's rows
        under sequence parallelism)."""
        dtype = x.dtype
        local = tensor_parallel.local  # a tensor-parallel shard or replica is the rank's local tensor
        q_norm, k_norm = (None if norm is None else local(norm.weight).to(dtype) for norm in (self.q_norm, self.k_norm))
        blk = BlockWeights(attn_norm=attn_norm.to(dtype), qkv=local(self.wqkv.weight), o=local(self.wo.weight),
                           mlp_norm=mlp_norm.to(dtype), gate_up=local(self.w13.weight), down=local(self.w2.weight),
                           q_norm=q_norm, k_norm=k_norm, fp8=self.fp8)
        if self.parallel is None:
            return decoder_layer(x, normed, rstd, blk, next_norm.to(dtype), eps, spec, positions, frequencies)
        return tensor_parallel.rank_block(blk, x, normed, rstd, next_norm.to(dtype), eps, spec, positions,
                                          frequencies, self.heads[2], *self.parallel)


class LayerNorms(Module):
    """A decoder layer's two RMSNorms, kept by the root: two blocks read each of them."""

    def __init__(self, attention_norm: nn.Module, ffn_norm: nn.Module):
        super().__init__()
        self.attention_norm, self.ffn_norm = attention_norm, ffn_norm


def _update_from_config(model_config, base: type, config, **kwargs) -> None:
    """A converted model config's ``update_from_config``: refuse the parallelisms the blocks do not implement,
    run the stock config's (``base``), and read whether tensor parallelism splits the residual stream by rows."""
    _check_parallelism(config)
    base.update_from_config(model_config, config=config, **kwargs)
    model_config.codagen_sequence_parallel = (config.parallelism.tensor_parallel_degree > 1
                                              and bool(config.parallelism.enable_sequence_parallel))


def _check_parallelism(config) -> None:
    """Refuse the parallelisms the blocks do not implement, given the trainer's config."""
    parallelism = config.parallelism
    if parallelism.spmd_backend != "partial_dtensor":
        raise NotImplementedError("codagen.integrations.torchtitan: parallelism.spmd_backend must be "
                                  f"'partial_dtensor' (FSDP2 on plain modules), got {parallelism.spmd_backend!r}")
    for name in ("context_parallel_degree", "pipeline_parallel_degree", "expert_parallel_degree"):
        if getattr(parallelism, name, 1) != 1:
            raise NotImplementedError(f"codagen.integrations.torchtitan: parallelism.{name} must be 1, "
                                      f"got {getattr(parallelism, name)}")
    if getattr(getattr(config, "compile", None), "enable_async_tensor_parallel", False):
        raise NotImplementedError("codagen.integrations.torchtitan: compile.enable_async_tensor_parallel is not "
                                  "supported (the blocks' tensor-parallel GEMMs are codagen's custom ops)")


class _CodagenDecoder:
    """A torchtitan ``Decoder`` whose ``layers`` are :class:`CodagenBlock` s (mixed in before the model class);
    ``forward(tokens, positions=None)`` returns the logits ``[B, S, vocab]`` (the final norm applied in the LM
    head GEMM, ``ops.rms_linear``)."""

    def __init__(self, config: Decoder.Config):
        super().__init__(config)
        attention = config.layers[0].attention
        self.n_heads, self.n_kv_heads = attention.n_heads, attention.n_kv_heads or attention.n_heads
        self.head_dim = attention.head_dim or config.dim // attention.n_heads
        self.rope = attention.rope.build()
        # torchtitan's CosSinRoPE rotates Hugging Face's half-split pairs (i, i + hd/2): the state-dict hooks
        # permute Q/K rows (and QK-norm weights) to adjacent pairs; ComplexRoPE's pairs are adjacent already
        self.half_split = isinstance(attention.rope, CosSinRoPE.Config)
        self.block_norms = ModuleDict({str(i): LayerNorms(layer_config.attention_norm.build(),
                                                          layer_config.ffn_norm.build())
                                       for i, layer_config in enumerate(config.layers)})
        # no ``norm`` child: torchtitan's apply_fsdp_to_decoder then keeps the final norm and the LM head in the
        # root unit, with the block norms, which the last block's epilogue and the head read
        self.final_norm, self.norm = self.norm, None
        norms = [self.final_norm, *(n for pair in self.block_norms.values() for n in pair.children()),
                 *(n for block in self.layers.values() for n in (block.q_norm, block.k_norm) if n is not None)]
        eps = {norm.eps for norm in norms}
        if len(eps) != 1 or None in eps:
            raise NotImplementedError(f"codagen.integrations.torchtitan: the RMSNorms must share one eps, got {eps}")
        self.eps = eps.pop()
        self.register_state_dict_post_hook(_to_torchtitan_layout)
        self.register_load_state_dict_pre_hook(_from_torchtitan_layout)
        self.sequence_parallel = config.codagen_sequence_parallel
        self.tp_mesh: DeviceMesh | None = None  # set by parallelize

    def parallelize(self, parallel_dims) -> None:
        """torchtitan's tensor-parallel step (``parallelize_llama`` calls it when ``tp`` > 1): each block's GEMM
        weights sharded over the ``tp`` mesh (:meth:`CodagenBlock.shard`); the embeddings, the norms and the LM
        head stay whole on every rank, as the Hugging Face path's (torchtitan's own sharding specs of those
        modules are not applied; their parameters become ``Replicate`` DTensors on the ``tp`` mesh, so that
        torchtitan's gradient clipping sees one mesh)."""
        if self._parallelized:
            raise ValueError(f"{type(self).__name__} has already been parallelized")
        self._parallelized = True
        self.tp_mesh = parallel_dims.get_optional_mesh("tp")
        if self.tp_mesh is not None:
            for block in self.layers.values():
                block.shard(self.tp_mesh, self.sequence_parallel)
            tensor_parallel.replicate_parameters(self, self.tp_mesh)  # one mesh for all (gradient clipping)

    @property
    def qkv_layout(self) -> tuple[int, int, int, int]:
        """``(heads, kv_heads, head_dim, groups)`` of ``wqkv``'s rows: under tensor parallelism they are rank-major
        in ``groups`` = the ``tp`` degree (:func:`codagen.models.tensor_parallel.qkv_rank_major`), else 1 group."""
        return self.n_heads, self.n_kv_heads, self.head_dim, self.tp_mesh.size() if self.tp_mesh is not None else 1

    def frequencies(self) -> torch.Tensor:
        """The QKV epilogue's per-pair frequencies, read off row 1 of torchtitan's RoPE cache (``exp(i inv_freq)``,
        or ``[cos | cos | sin | sin]`` of ``inv_freq``), so every RoPE scaling torchtitan computes carries over."""
        row, half = self.rope.cache[1], self.head_dim // 2
        inv_freq = torch.atan2(row[self.head_dim:][:half], row[:half]) if self.half_split else torch.angle(row)
        return ops.rope_frequencies(self.n_heads, self.n_kv_heads, self.head_dim, inv_freq=inv_freq)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                attention_masks=None) -> torch.Tensor:
        if attention_masks is not None:
            raise NotImplementedError("codagen.integrations.torchtitan: attention masks (document masking) are not "
                                      "supported; the blocks run causal attention over each sequence")
        batch, seq = tokens.shape
        if positions is None:
            positions = torch.arange(seq, device=tokens.device).expand(batch, seq)
        x = self.tok_embeddings(tokens).reshape(batch * seq, -1)
        spec = AttentionSpec(batch, seq, self.n_heads, self.n_kv_heads, self.head_dim)
        norms = list(self.block_norms.values())
        sequence_mesh = self.tp_mesh if self.tp_mesh is not None and self.sequence_parallel else None
        local = tensor_parallel.local  # under tensor parallelism the norms and the head are replicated DTensors
        final_norm = local(self.final_norm.weight)
        x, normed, rstd = tensor_parallel.on_sequence_rows(x, sequence_mesh, lambda x: module_stack(
            x, list(self.layers.values()), [local(n.attention_norm.weight) for n in norms],
            [local(n.ffn_norm.weight) for n in norms], final_norm, self.eps, spec, positions.reshape(-1).float(),
            self.frequencies()))
        if self._skip_lm_head:  # torchtitan's ChunkedLossWrapper applies the LM head itself, chunk by chunk
            return F.rms_norm(x, (x.shape[1],), final_norm.to(x.dtype), self.eps).view(batch, seq, -1)
        logits = ops.rms_linear(x, normed, rstd, final_norm.to(x.dtype), local(self.lm_head.weight))
        return logits.view(batch, seq, -1)


class CodagenLlama3Model(_CodagenDecoder, Llama3Model):
    """torchtitan's ``Llama3Model`` with codagen's blocks (:class:`_CodagenDecoder`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Llama3Model.Config):
        codagen_sequence_parallel: bool = False  # parallelism.enable_sequence_parallel, read in update_from_config

        def update_from_config(self, *, config, **kwargs) -> None:
            _update_from_config(self, Llama3Model.Config, config, **kwargs)


class CodagenQwen3Model(_CodagenDecoder, Qwen3Model):
    """torchtitan's dense ``Qwen3Model`` (QK-norm, half-split RoPE) with codagen's blocks (:class:`_CodagenDecoder`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3Model.Config):
        codagen_sequence_parallel: bool = False  # parallelism.enable_sequence_parallel, read in update_from_config

        def update_from_config(self, *, config, **kwargs) -> None:
            _update_from_config(self, Qwen3Model.Config, config, **kwargs)


# --- state dicts in torchtitan's names and layouts -------------------------------------------------------
def _to_torchtitan_layout(model: _CodagenDecoder, state_dict: dict, prefix: str, local_metadata) -> None:
    def pair_order(t, inverse=False):
        if not model.half_split:
            return t
        return (ops.rope_half_split_from_pairs if inverse else ops.rope_pairs_from_half_split)(t, model.head_dim)
    rows = (model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim, model.n_kv_heads * model.head_dim)
    state_dict[prefix + "norm.weight"] = state_dict.pop(prefix + "final_norm.weight")
    for i in model.layers:
        layer = f"{prefix}layers.{i}."
        for name in ("attention_norm", "ffn_norm"):
            state_dict[f"{layer}{name}.weight"] = state_dict.pop(f"{prefix}block_norms.{i}.{name}.weight")
        q, k, v = relayout(lambda t: [pair_order(part, inverse=True) if n < 2 else part for n, part in enumerate(
            tensor_parallel.qkv_from_rank_major(t, *model.qkv_layout).split(rows))],
            state_dict.pop(layer + "wqkv.weight"))
        for norm in ("q_norm", "k_norm"):
            if f"{layer}{norm}.weight" in state_dict:
                (state_dict[f"{layer}attention.{norm}.weight"],) = relayout(
                    lambda t: [pair_order(t, inverse=True)], state_dict.pop(f"{layer}{norm}.weight"))
        w1, w3 = relayout(lambda t: list(ops.split_gate_up(t)), state_dict.pop(layer + "w13.weight"))
        state_dict.update({layer + "attention.qkv_linear.wq.weight": q, layer + "attention.qkv_linear.wk.weight": k,
                           layer + "attention.qkv_linear.wv.weight": v,
                           layer + "attention.wo.weight": state_dict.pop(layer + "wo.weight"),
                           layer + "feed_forward.w1.weight": w1, layer + "feed_forward.w3.weight": w3,
                           layer + "feed_forward.w2.weight": state_dict.pop(layer + "w2.weight")})


def _from_torchtitan_layout(model: _CodagenDecoder, state_dict: dict, prefix: str, local_metadata, strict,
                            missing_keys, unexpected_keys, error_msgs) -> None:
    def pair_order(t):
        return ops.rope_pairs_from_half_split(t, model.head_dim) if model.half_split else t
    if prefix + "norm.weight" in state_dict:
        state_dict[prefix + "final_norm.weight"] = state_dict.pop(prefix + "norm.weight")
    for i in model.layers:
        layer = f"{prefix}layers.{i}."
        for name in ("attention_norm", "ffn_norm"):
            if f"{layer}{name}.weight" in state_dict:
                state_dict[f"{prefix}block_norms.{i}.{name}.weight"] = state_dict.pop(f"{layer}{name}.weight")
        qkv_keys = [layer + f"attention.qkv_linear.{n}.weight" for n in ("wq", "wk", "wv")]
        if all(key in state_dict for key in qkv_keys):
            (state_dict[layer + "wqkv.weight"],) = relayout(
                lambda q, k, v: [tensor_parallel.qkv_rank_major(torch.cat((pair_order(q), pair_order(k), v)),
                                                                *model.qkv_layout)],
                *(state_dict.pop(key) for key in qkv_keys))
        for norm in ("q_norm", "k_norm"):
            if f"{layer}attention.{norm}.weight" in state_dict:
                (state_dict[f"{layer}{norm}.weight"],) = relayout(lambda t: [pair_order(t)],
                                                                 state_dict.pop(f"{layer}attention.{norm}.weight"))
        ffn = layer + "feed_forward."
        if ffn + "w1.weight" in state_dict and ffn + "w3.weight" in state_dict:
            (state_dict[layer + "w13.weight"],) = relayout(lambda g, u: [ops.interleave_gate_up(g, u)],
                                                          state_dict.pop(ffn + "w1.weight"),
                                                          state_dict.pop(ffn + "w3.weight"))
        for ours, theirs in (("wo", "attention.wo"), ("w2", "feed_forward.w2")):
            if f"{layer}{theirs}.weight" in state_dict:
                state_dict[f"{layer}{ours}.weight"] = state_dict.pop(f"{layer}{theirs}.weight")


# --- the config rewrite ----------------------------------------------------------------------------------
_CONVERTED = {Llama3Model.Config: CodagenLlama3Model.Config, Qwen3Model.Config: CodagenQwen3Model.Config}


def convert_config(config: Llama3Model.Config | Qwen3Model.Config, fp8: str | None = None) -> Decoder.Config:
    """:class:`CodagenLlama3Model.Config` (:class:`CodagenQwen3Model.Config`) with ``config``'s fields; its blocks
    :class:`CodagenBlock.Config` s whose attention runs causal SDPA (so torchtitan's trainer builds no masks), with
    ``fp8`` (``"blockwise"``: every block's GEMMs in FP8, :mod:`codagen.ops._fp8`)."""
    checked_recipe(fp8)
    if type(config) not in _CONVERTED:
        raise TypeError("convert_config: config must be a torchtitan Llama3Model.Config or Qwen3Model.Config, got "
                        f"{type(config).__name__}")
    layers = []
    for layer in config.layers:
        attention = derive(layer.attention, type(layer.attention), inner_attention=ScaledDotProductAttention.Config())
        layers.append(derive(layer, CodagenBlock.Config, attention=attention, fp8=fp8))
    return derive(config, _CONVERTED[type(config)], layers=layers)


class CodagenConverter(ModelConfigConverter):
    """torchtitan model converter: ``llama3.model_registry(flavor, converters=[CodagenConverter.Config()])``
    (``CodagenConverter.Config(fp8="blockwise")``: the blocks' GEMMs in FP8)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        fp8: str | None = None

    def __init__(self, config: Config):
        self.config = config

    def convert(self, model_config: Llama3Model.Config | Qwen3Model.Config) -> Decoder.Config:
        return convert_config(model_config, self.config.fp8)
