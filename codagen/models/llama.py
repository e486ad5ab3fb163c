"""A LLaMA decoder built from the fused ops and regrouped the CODA way.

Each RMSNorm is split around GEMMs (docs/method.md section 2): the GEMM that produces the residual stream
``x`` also produces ``normed = x * gamma`` and ``rstd``, and the next GEMM applies ``rstd`` in its
epilogue. So a block is three fused GEMMs plus attention::

    q, k, v, x     = rms_qkv_rope(x, normed, rstd, attn_norm, W_qkv, positions, frequencies,
                                  split_sizes=(h hd, kv hd, kv hd), pass_residual=True)  # norm + QKV + RoPE
    attn           = SDPA(q, k, v, causal, GQA)
    x, normed, r   = out_proj_residual_rms(attn, W_o, x, mlp_norm, eps)                   # O-proj + residual + stats
    x, normed, r   = swiglu_mlp_residual_rms(x, normed, r, mlp_norm, W_gu, W_down, next_norm, eps)  # MLP, ditto

where ``next_norm`` is the next block's input norm weight, or the final norm's for the last block.
The first block's statistics come from ``rms_norm_stats``; the last block's ``normed``/``rstd``
feed the LM head (``rms_lm_head_cross_entropy`` for the loss, ``rms_linear`` for logits).

A block without norms before attention and the MLP (OLMo 2: ``attn_norm`` and ``mlp_norm`` None, norms after
both instead) threads ``normed = rstd = None``: its QKV GEMM reads ``x`` itself (``qkv_norm_rope``, QK-norm over
the whole Q and K projections), its gate/up GEMM likewise (``gate_up_swiglu``).

Weight layouts (converted from/to Hugging Face's inside :meth:`Llama.from_hf_state_dict` /
:meth:`Llama.to_hf_state_dict`): ``W_qkv = [W_q; W_k; W_v]`` with each Q/K head's rows permuted from
HF's half-split RoPE order ``(0..hd/2-1 | hd/2..hd-1)`` to adjacent pairs ``(0, hd/2), (1, hd/2+1), ...``
(q.k is invariant under a common permutation of head channels, so attention is unchanged; V is not
permuted); ``W_gu`` interleaves gate and up rows ``(g0, u0, g1, u1, ...)``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from codagen import ops
from codagen.ops._quantized import Quantized

from .checkpoint import CheckpointFn, checkpoint_block
from .config import LlamaConfig
from .masks import with_sliding_window

__all__ = ["Llama", "BlockWeights", "AttentionSpec", "decoder_stack", "module_stack", "block_qkv", "block_out_mlp",
           "input_stats", "lm_head", "head_normed", "rotate_pairs", "fuse_qkv", "split_qkv"]


@dataclasses.dataclass(frozen=True)
class BlockWeights:
    """One block's tensors in the fused layout the ops take (see the module docstring)."""
    attn_norm: torch.Tensor | None  # None: no norm before attention (OLMo 2); q_norm/k_norm then span Q and K whole
    qkv: torch.Tensor
    o: torch.Tensor
    mlp_norm: torch.Tensor | None  # None: no norm before the MLP (OLMo 2, whose post-norms are then required)
    gate_up: torch.Tensor
    down: torch.Tensor
    qkv_bias: torch.Tensor | None = None  # pair order, as the rows of ``qkv``
    o_bias: torch.Tensor | None = None
    # QK-norm weights [head_dim], pair order, as each head's rows of ``qkv``; without attn_norm [Q columns] and
    # [K columns]: one norm over each whole projection
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    sliding_window: int | None = None  # key j is visible to query i iff i - window < j <= i
    # the block's own RoPE frequencies (None: the model's): zeros on a layer without RoPE (SmolLM3's NoPE layers:
    # the angle 0 rotates nothing), its layer type's base (Gemma 3)
    frequencies: torch.Tensor | None = None
    # norms of the attention block's and the MLP's outputs before their residual adds (Gemma's sandwich norms):
    # x = residual + RMSNorm(y) * weight, each by codagen.ops.linear_post_norm_residual_rms
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    # LoRA updates (codagen.ops.LowRank) in the fused layouts: b's rows ordered like the weight's rows
    qkv_low_rank: ops.LowRank | None = None
    o_low_rank: ops.LowRank | None = None
    gate_up_low_rank: ops.LowRank | None = None
    down_low_rank: ops.LowRank | None = None
    # the projections' GEMMs on e4m3 operands in blockwise groups (codagen.ops._fp8), forward and backward
    fp8: bool = False


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """How SDPA runs over ``[batch * seq]`` token rows: causal, GQA, attention dropout, and ``mask``, a
    ``[batch | 1, 1, seq, seq]`` SDPA mask, boolean or additive (causality, padding, documents:
    :mod:`codagen.models.masks`), or ``None`` for plain causal attention."""
    batch: int
    seq: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dropout: float = 0.0
    mask: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    # the leading channels of each Q/K head in Hugging Face's half-split RoPE order (None: all; a partial rotary
    # embedding's rotated ones; 0: interleaved RoPE, no permutation): the order the KV cache holds
    half_split_dim: int | None = None
    # a tanh soft-cap on the attention logits, cap * tanh(q.k scale / cap) (Gemma 2's attn_logit_softcapping): SDPA
    # has none, so attention runs as transformers' eager attention does (scores materialized)
    softcap: float | None = None
    scale: float | None = None  # of q.k: None is SDPA's 1 / sqrt(head_dim) (Granite's attention_multiplier is not)


def rotate_pairs(z: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent column pairs: ``(a, b) -> (a cos t - b sin t, a sin t + b cos t)``, ``angles`` [..., N/2]."""
    a, b = z.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = angles.cos(), angles.sin()
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
              sliding_window: int | None = None) -> torch.Tensor:
    """Causal (GQA) SDPA over token-major ``q`` [B*S, h hd], ``k``, ``v`` [B*S, kv hd] -> ``[B*S, h hd]``,
    under ``spec.mask`` and the ``sliding_window`` (key j visible to query i iff ``i - window < j <= i``).

    The inputs may be column views of one buffer (the QKV op's ``split_sizes`` outputs): SDPA reads them
    strided, and its backward writes each gradient token-major, so each reaches the QKV op as is.
    """
    b, s, h, kv, hd = spec.batch, spec.seq, spec.num_heads, spec.num_kv_heads, spec.head_dim
    q, k, v = (t.view(b, s, heads, hd).transpose(1, 2) for t, heads in ((q, h), (k, kv), (v, kv)))
    mask = with_sliding_window(spec.mask, s, sliding_window, q.device)
    if kv != h and mask is not None:  # SDPA's GQA kernels take no mask (CUDA would fall back to the math path)
        k, v = (t.repeat_interleave(h // kv, dim=1) for t in (k, v))
    out = heads_attention(q, k, v, spec, mask, is_causal=mask is None)
    return out.transpose(1, 2).reshape(b * s, h * hd)


def heads_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, mask: torch.Tensor | None,
                    is_causal: bool) -> torch.Tensor:
    """``[batch, heads, seq, hd]`` attention of ``q`` over ``k``, ``v`` (``[batch, kv_heads | heads, keys, hd]``) under
    ``mask`` (boolean or additive) or plain causality: SDPA, or with ``spec.softcap`` the soft-capped logits
    ``cap * tanh(q k^T scale / cap)``, masked, through an fp32 softmax, as transformers' eager attention computes."""
    gqa = k.shape[1] != q.shape[1]
    if spec.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=spec.dropout,
                                              enable_gqa=gqa, scale=spec.scale)
    if gqa:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scale = q.shape[-1] ** -0.5 if spec.scale is None else spec.scale
    scores = torch.tanh((q @ k.transpose(-1, -2)) * (scale / spec.softcap)) * spec.softcap
    if mask is None and is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - q.shape[-2])
    if mask is not None:  # the dtype's lowest value, not -inf: a row with no visible key (left padding) stays finite
        lowest = torch.finfo(scores.dtype).min
        scores = scores.masked_fill(~mask, lowest) if mask.dtype == torch.bool else scores + mask.clamp(min=lowest)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return F.dropout(probs, spec.dropout, training=spec.dropout > 0) @ v


#: whether the decoder layer is a ``torch.compiler.nested_compile_region``: torch 2.11's Dynamo fails on it
#: (``KeyError: example_value`` comparing the second layer's backward subgraph with the first's) and torch
#: < 2.8 has none; there the layer is inlined into the model's graph
COMPILE_REGION = (hasattr(torch.compiler, "nested_compile_region")
                  and tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13))


def _compile_region(fn):
    return torch.compiler.nested_compile_region(fn) if COMPILE_REGION else fn


def block_qkv(blk: BlockWeights, x: torch.Tensor, normed: torch.Tensor, rstd: torch.Tensor, spec: AttentionSpec,
              positions: torch.Tensor, frequencies: torch.Tensor, eps: float):
    """A block's norm + QKV projection (+ bias) + RoPE (+ QK-norm): ``(q, k, v, x)``, q/k in pair order.

    ``x`` passes through the QKV op, so that the residual path's gradient joins its backward's store;
    q, k, v come back as separate views, so that their gradients reach its backward unconcatenated.
    """
    q_cols, kv_cols = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    split_sizes = (q_cols, kv_cols, kv_cols)
    if blk.frequencies is not None:
        frequencies = blk.frequencies
    if blk.attn_norm is None:  # OLMo 2: x as it is, one QK-norm over each whole projection
        if blk.q_norm is None or blk.k_norm is None:
            raise NotImplementedError("decoder_stack: a block without attn_norm needs q_norm and k_norm (OLMo 2)")
        return ops.qkv_norm_rope(x, blk.qkv, positions, frequencies, blk.q_norm, blk.k_norm, eps,
                                 split_sizes=split_sizes, pass_residual=True, low_rank=blk.qkv_low_rank, fp8=blk.fp8)
    if blk.q_norm is None and blk.k_norm is None:
        return ops.rms_qkv_rope(x, normed, rstd, blk.attn_norm, blk.qkv, positions, frequencies,
                                split_sizes=split_sizes, pass_residual=True, low_rank=blk.qkv_low_rank,
                                bias=blk.qkv_bias, fp8=blk.fp8)
    if blk.qkv_bias is not None:  # the bias would have to enter before the norm, inside the kernel
        raise NotImplementedError("decoder_stack: a QKV bias together with QK-norm is not supported")
    return ops.rms_qkv_rope(x, normed, rstd, blk.attn_norm, blk.qkv, positions, frequencies, blk.q_norm, blk.k_norm,
                            num_heads=spec.num_heads, qk_norm_eps=eps, split_sizes=split_sizes, pass_residual=True,
                            low_rank=blk.qkv_low_rank, fp8=blk.fp8)


def block_out_mlp(blk: BlockWeights, attn: torch.Tensor, x: torch.Tensor, next_norm: torch.Tensor, eps: float):
    """A block after attention: O-proj + residual, then the MLP + residual; ``(x, normed, rstd)`` of ``next_norm``.

    With a norm after a projection (``post_attn_norm``, ``post_mlp_norm``) that projection is
    :func:`codagen.ops.linear_post_norm_residual_rms`, and the MLP's gate/up GEMM the standalone
    :func:`codagen.ops.rms_gate_up_swiglu` (:func:`codagen.ops.gate_up_swiglu` without ``mlp_norm``, where
    ``normed`` and ``rstd`` are None; so are those returned with ``next_norm`` None)."""
    if (blk.mlp_norm is None or next_norm is None) and (blk.post_attn_norm is None or blk.post_mlp_norm is None):
        raise NotImplementedError("decoder_stack: a block without a norm before the MLP or the next block needs "
                                  "post_attn_norm and post_mlp_norm (OLMo 2)")
    if blk.post_attn_norm is None:
        # An O-proj bias is part of the residual add: x' = attn W_o^T + (x + b).
        residual = x if blk.o_bias is None else x + blk.o_bias
        x, normed, rstd = ops.out_proj_residual_rms(attn, blk.o, residual, blk.mlp_norm, eps, low_rank=blk.o_low_rank,
                                                    fp8=blk.fp8)
    else:
        x, normed, rstd = ops.linear_post_norm_residual_rms(attn, blk.o, x, blk.post_attn_norm, blk.mlp_norm, eps,
                                                            low_rank=blk.o_low_rank, fp8=blk.fp8)
    if blk.post_mlp_norm is None:
        return ops.swiglu_mlp_residual_rms(x, normed, rstd, blk.mlp_norm, blk.gate_up, blk.down, next_norm, eps,
                                           gate_up_low_rank=blk.gate_up_low_rank, down_low_rank=blk.down_low_rank,
                                           fp8=blk.fp8, **_activation(blk))
    if blk.mlp_norm is None:  # x passes through the op, so that the residual path's gradient joins its backward's
        act, x = ops.gate_up_swiglu(x, blk.gate_up, low_rank=blk.gate_up_low_rank, pass_residual=True,
                                    fp8=blk.fp8, **_activation(blk))
    else:
        act = ops.rms_gate_up_swiglu(x, normed, rstd, blk.mlp_norm, blk.gate_up, low_rank=blk.gate_up_low_rank,
                                     fp8=blk.fp8, **_activation(blk))
    return ops.linear_post_norm_residual_rms(act, blk.down, x, blk.post_mlp_norm, next_norm, eps,
                                             low_rank=blk.down_low_rank, fp8=blk.fp8)


def _activation(blk: BlockWeights) -> dict:
    """The gated MLP ops' ``activation`` keyword: given only when it is not their default (SwiGLU)."""
    return {} if blk.activation == "silu" else {"activation": blk.activation}


def input_stats(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float):
    """``(normed, rstd)`` of the first block's input norm (:func:`codagen.ops.rms_norm_stats`), ``(None, None)``
    where the block has none (OLMo 2)."""
    return (None, None) if norm_weight is None else ops.rms_norm_stats(x, norm_weight, eps)


def decoder_stack(x: torch.Tensor, blocks: Sequence[BlockWeights], final_norm: torch.Tensor, eps: float,
                  spec: AttentionSpec, positions: torch.Tensor, frequencies: torch.Tensor,
                  checkpoints: Sequence[CheckpointFn | None] | None = None):
    """Run the blocks on the embeddings ``x`` [tokens, d]; return ``(x, normed, rstd)`` of the final norm.

    ``positions`` [tokens] and ``frequencies`` [(h + 2 kv) hd / 2] (V pairs 0) drive RoPE in the QKV epilogue.
    Blocks with ``q_norm``/``k_norm`` apply QK-norm (eps ``eps``) in the same epilogue, before RoPE.
    ``checkpoints[i]``, when given and not ``None``, is a ``torch.utils.checkpoint``-like function that runs
    block ``i`` keeping only its inputs ``(x, normed, rstd)`` (:func:`codagen.models.checkpoint.checkpoint_block`).
    """
    norms = [blk.attn_norm for blk in blocks] + [final_norm]
    normed, rstd = input_stats(x, norms[0], eps)

    def block(x, normed, rstd, blk, next_norm):
        return decoder_layer(x, normed, rstd, blk, next_norm, eps, spec, positions, frequencies)

    for blk, next_norm, checkpoint in zip(blocks, norms[1:], checkpoints or [None] * len(blocks), strict=True):
        if checkpoint is None:
            x, normed, rstd = block(x, normed, rstd, blk, next_norm)
        else:
            x, normed, rstd = checkpoint_block(checkpoint, block, x, normed, rstd, blk, next_norm)
    return x, normed, rstd


def module_stack(x: torch.Tensor, blocks: Sequence[nn.Module], attn_norms: Sequence[torch.Tensor],
                 mlp_norms: Sequence[torch.Tensor], final_norm: torch.Tensor, eps: float, spec: AttentionSpec,
                 positions: torch.Tensor, frequencies: torch.Tensor,
                 checkpoints: Sequence[CheckpointFn | None] | None = None):
    """:func:`decoder_stack` over block modules holding their own GEMM weights: one module call per block,
    ``blocks[i](x, normed, rstd, attn_norms[i], mlp_norms[i], next_norm, eps, spec, positions, frequencies)``.

    The norm weights are arguments, not the blocks' parameters: block ``i``'s down-projection epilogue applies
    block ``i + 1``'s input norm, which that block's QKV GEMM also reads. A module call per block is what lets
    hooks on the block run around it, e.g. those of an FSDP2 unit (:mod:`codagen.models.sharding`).
    ``checkpoints[i]``, when given, runs block ``i`` as ``checkpoints[i](blocks[i], x, normed, rstd, ...)``."""
    norms = [*attn_norms, final_norm]
    normed, rstd = ops.rms_norm_stats(x, norms[0].to(x.dtype), eps)
    for i, (block, checkpoint) in enumerate(zip(blocks, checkpoints or [None] * len(blocks), strict=True)):
        args = (attn_norms[i], mlp_norms[i], norms[i + 1], eps, spec, positions, frequencies)
        if checkpoint is None:
            x, normed, rstd = block(x, normed, rstd, *args)
        else:
            x, normed, rstd = checkpoint(block, x, normed, rstd, *args)
    return x, normed, rstd


@_compile_region
def decoder_layer(x: torch.Tensor, normed: torch.Tensor, rstd: torch.Tensor, blk: BlockWeights, next_norm: torch.Tensor,
                  eps: float, spec: AttentionSpec, positions: torch.Tensor, frequencies: torch.Tensor):
    """One block of :func:`decoder_stack`: ``(x, normed, rstd)`` of ``next_norm`` after it.

    A nested compile region (torch >= 2.13): ``torch.compile`` traces one block and stamps its graph out for every
    layer with the same shapes, so dynamo, AOTAutograd and Inductor work on one block whatever the
    depth (``docs/notes/compile.md``). In eager mode the decorator only calls the function."""
    q, k, v, x = block_qkv(blk, x, normed, rstd, spec, positions, frequencies, eps)
    attn = attention(q, k, v, spec, blk.sliding_window)
    x, normed, rstd = block_out_mlp(blk, attn, x, next_norm, eps)
    return x, normed, rstd


def head_normed(x: torch.Tensor, normed: torch.Tensor | Quantized, norm_weight: torch.Tensor) -> torch.Tensor:
    """The final norm's ``normed = x * norm_weight`` as the LM head reads it (in ``x``'s dtype): an FP8 block's
    down-projection stores it in e4m3 for a next FP8 GEMM, which the head is not, so it is recomputed from ``x``
    (one elementwise pass; non-differentiable, as the producers' ``normed``)."""
    if not isinstance(normed, Quantized):
        return normed
    with torch.no_grad():
        return x * norm_weight


def lm_head(x: torch.Tensor, normed: torch.Tensor | Quantized, rstd: torch.Tensor, norm_weight: torch.Tensor,
            weight: torch.Tensor, targets: torch.Tensor | None, reduction: str = "mean",
            softcap: float | None = None) -> torch.Tensor:
    """Logits ``RMSNorm(x) W^T`` [tokens, vocab] without ``targets``, else the fused cross-entropy
    (``targets`` [tokens], -100 ignored; logits never stored); ``softcap``: logits ``cap * tanh(logits / cap)``
    (Gemma 2's final soft-cap), in the same epilogues."""
    normed = head_normed(x, normed, norm_weight)
    capped = {} if softcap is None else {"softcap": softcap}
    if targets is None:
        return ops.rms_linear(x, normed, rstd, norm_weight, weight, **capped)
    return ops.rms_lm_head_cross_entropy(x, normed, rstd, norm_weight, weight, targets, ignore_index=-100,
                                         reduction=reduction, **capped)


# --- Hugging Face layout <-> fused layout --------------------------------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int,
             half_split_dim: int | None = None) -> torch.Tensor:
    """``[W_q; W_k; W_v]`` with Q/K rows moved from HF's half-split RoPE order to adjacent pairs.

    Takes weights ``[rows, in]`` or biases ``[rows]``; differentiable (the model's own parameters can
    be fused on every forward). One concatenation of strided views (:func:`codagen.ops.rope_pairs_from_half_split`'s
    per-head transpose for Q and K), so one copy forward and at most one per input backward. ``half_split_dim``:
    as in :func:`codagen.ops.rope_pairs_from_half_split` (partial or interleaved rotary embeddings).
    """
    if half_split_dim is not None and half_split_dim != head_dim:
        return torch.cat((ops.rope_pairs_from_half_split(q, head_dim, half_split_dim),
                          ops.rope_pairs_from_half_split(k, head_dim, half_split_dim), v), dim=0)
    half = head_dim // 2

    def heads(w, split):  # [heads, hd/2, 2, ...]: Q/K half-split rows transposed per head; V as it is
        w = w.reshape(w.shape[0] // head_dim, *((2, half) if split else (half, 2)), *w.shape[1:])
        return w.transpose(1, 2) if split else w
    fused = torch.cat((heads(q, True), heads(k, True), heads(v, False)), dim=0)
    return fused.reshape(q.shape[0] + k.shape[0] + v.shape[0], *q.shape[1:])


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Inverse of :func:`fuse_qkv`: ``(W_q, W_k, W_v)`` in HF layout."""
    q, k, v = qkv.split((num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim), dim=0)
    return ops.rope_half_split_from_pairs(q, head_dim), ops.rope_half_split_from_pairs(k, head_dim), v


class _Block(nn.Module):
    """A block's GEMM weights (and QK-norm's); its norms are the model's (:func:`module_stack`)."""

    def __init__(self, c: LlamaConfig, factory: dict):
        super().__init__()
        d = c.hidden_size
        self.qkv = nn.Parameter(torch.empty(c.qkv_size, d, **factory))
        self.o = nn.Parameter(torch.empty(d, c.num_heads * c.head_dim, **factory))
        self.gate_up = nn.Parameter(torch.empty(2 * c.intermediate_size, d, **factory))
        self.down = nn.Parameter(torch.empty(d, c.intermediate_size, **factory))
        if c.qk_norm:  # pair order, as each Q/K head's rows of qkv
            self.q_norm = nn.Parameter(torch.ones(c.head_dim, **factory))
            self.k_norm = nn.Parameter(torch.ones(c.head_dim, **factory))
        else:
            self.q_norm = self.k_norm = None
        self.fp8 = c.fp8 is not None

    def forward(self, x: torch.Tensor, normed: torch.Tensor, rstd: torch.Tensor, attn_norm: torch.Tensor,
                mlp_norm: torch.Tensor, next_norm: torch.Tensor, eps: float, spec: AttentionSpec,
                positions: torch.Tensor, frequencies: torch.Tensor):
        blk = BlockWeights(attn_norm, self.qkv, self.o, mlp_norm, self.gate_up, self.down, q_norm=self.q_norm,
                           k_norm=self.k_norm, fp8=self.fp8)
        return decoder_layer(x, normed, rstd, blk, next_norm, eps, spec, positions, frequencies)


class Llama(nn.Module):
    """LLaMA decoder on codagen ops; parameters stored in the fused layout (no per-step conversion).

    ``forward(input_ids [B, S], targets=None, positions=None)``: mean cross-entropy over targets
    (already shifted, -100 ignored) when given, else logits ``[B, S, vocab]``.
    """

    def __init__(self, config: LlamaConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = c = config
        factory = {"device": device, "dtype": dtype}
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size, **factory)
        self.layers = nn.ModuleList(_Block(c, factory) for _ in range(c.num_layers))
        self.attn_norms = nn.ParameterList(torch.ones(c.hidden_size, **factory) for _ in range(c.num_layers))
        self.mlp_norms = nn.ParameterList(torch.ones(c.hidden_size, **factory) for _ in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size, **factory))
        self.lm_head = (self.embed.weight if c.tie_word_embeddings
                        else nn.Parameter(torch.empty(c.vocab_size, c.hidden_size, **factory)))
        frequencies = ops.rope_frequencies(c.num_heads, c.num_kv_heads, c.head_dim, base=c.rope_theta)
        self.register_buffer("frequencies", frequencies.to(device), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Hugging Face's init: every matrix ~ N(0, std^2), norm weights 1. Row permutations of an
        i.i.d. matrix are i.i.d., so initializing the fused layout directly gives the same law."""
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=std)
            else:
                nn.init.ones_(p)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        if input_ids.dim() != 2:
            raise ValueError(f"Llama.forward: input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        batch, seq = input_ids.shape
        if positions is None:
            positions = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        x = ops.embedding(input_ids, self.embed.weight).reshape(batch * seq, c.hidden_size)
        spec = AttentionSpec(batch, seq, c.num_heads, c.num_kv_heads, c.head_dim)
        x, normed, rstd = module_stack(x, self.layers, self.attn_norms, self.mlp_norms, self.norm, c.rms_norm_eps, spec,
                                       positions.reshape(-1).float(), self.frequencies)
        out = lm_head(x, normed, rstd, self.norm, self.lm_head, None if targets is None else targets.reshape(-1))
        return out if targets is not None else out.view(batch, seq, c.vocab_size)

    # --- Hugging Face state dicts (LlamaForCausalLM names; Qwen3ForCausalLM's with qk_norm) ----------------
    def _hf_keys(self) -> list[str]:
        keys = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            keys += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
            keys += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
            if self.config.qk_norm:
                keys += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return keys

    @torch.no_grad()
    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters under Hugging Face ``LlamaForCausalLM`` names and layouts (copies); with
        ``qk_norm`` also ``self_attn.q_norm.weight``/``k_norm.weight`` (``Qwen3ForCausalLM``)."""
        c = self.config
        sd = {"model.embed_tokens.weight": self.embed.weight, "model.norm.weight": self.norm,
              "lm_head.weight": self.lm_head}
        for i, blk in enumerate(self.layers):
            p = f"model.layers.{i}."
            q, k, v = split_qkv(blk.qkv, c.num_heads, c.num_kv_heads, c.head_dim)
            gate, up = ops.split_gate_up(blk.gate_up)
            sd.update({p + "input_layernorm.weight": self.attn_norms[i],
                       p + "post_attention_layernorm.weight": self.mlp_norms[i],
                       p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                       p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": blk.o,
                       p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                       p + "mlp.down_proj.weight": blk.down})
            if c.qk_norm:
                sd.update({p + "self_attn.q_norm.weight": ops.rope_half_split_from_pairs(blk.q_norm, c.head_dim),
                           p + "self_attn.k_norm.weight": ops.rope_half_split_from_pairs(blk.k_norm, c.head_dim)})
        return {key: t.detach().clone() for key, t in sd.items()}

    @classmethod
    def from_hf_state_dict(cls, config: LlamaConfig, state_dict: Mapping[str, torch.Tensor], *, device=None,
                           dtype=None) -> Llama:
        """Build from a Hugging Face ``LlamaForCausalLM`` state dict (converting layouts).

        Raises ``KeyError`` naming missing or unexpected keys (e.g. biases, which this model lacks).
        With tied embeddings ``lm_head.weight`` may be absent; if present it must equal the embedding.
        """
        model = cls(config, device=device or "meta", dtype=dtype)
        expected = set(model._hf_keys())
        given = {k for k in state_dict if not k.endswith("rotary_emb.inv_freq")}
        missing = expected - given - ({"lm_head.weight"} if config.tie_word_embeddings else set())
        if missing or given - expected:
            raise KeyError(f"Llama.from_hf_state_dict: state_dict does not match the config: missing "
                           f"{sorted(missing)}, unexpected {sorted(given - expected)}")
        sd = state_dict
        if config.tie_word_embeddings and "lm_head.weight" in sd and not torch.equal(
                sd["lm_head.weight"], sd["model.embed_tokens.weight"]):
            raise ValueError("Llama.from_hf_state_dict: tie_word_embeddings is set but lm_head.weight differs "
                             "from model.embed_tokens.weight")
        ours = {"embed.weight": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"],
                "lm_head": sd["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]}
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv = fuse_qkv(*(sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"), config.head_dim)
            gate_up = ops.interleave_gate_up(sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"])
            ours.update({f"attn_norms.{i}": sd[p + "input_layernorm.weight"],
                         f"mlp_norms.{i}": sd[p + "post_attention_layernorm.weight"],
                         f"layers.{i}.qkv": qkv, f"layers.{i}.o": sd[p + "self_attn.o_proj.weight"],
                         f"layers.{i}.gate_up": gate_up, f"layers.{i}.down": sd[p + "mlp.down_proj.weight"]})
            if config.qk_norm:
                ours.update({f"layers.{i}.{n}": ops.rope_pairs_from_half_split(sd[p + f"self_attn.{n}.weight"],
                                                                               config.head_dim)
                             for n in ("q_norm", "k_norm")})
        if device is None:
            device = sd["model.embed_tokens.weight"].device
        model = model.to_empty(device=device)
        model.load_state_dict(ours, strict=True)
        model.frequencies = ops.rope_frequencies(config.num_heads, config.num_kv_heads, config.head_dim,
                                                 base=config.rope_theta).to(device)
        return model
