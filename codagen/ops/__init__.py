"""Layer 3: the CODA-reparameterized LLaMA block as fused ops with autograd (see docs/ops.md).

Activations are contiguous 2-D ``[tokens, features]`` matrices (flatten batch and sequence first).
Producers of the residual stream return ``(x, normed, rstd)``; ``normed = x * norm_weight`` and
``rstd = rsqrt(mean(x^2) + eps)`` are non-differentiable, and the norm's single consumer op takes
``(x, normed, rstd, norm_weight, ...)`` and owns the whole RMSNorm backward (docs/design.md).
"""
from .cross_entropy import rms_lm_head_cross_entropy
from .embedding import embedding
from .fp8_linear import fp8_linear
from .layouts import (
    interleave_gate_up,
    rope_frequencies,
    rope_half_split_from_pairs,
    rope_pairs_from_half_split,
    split_gate_up,
)
from .linear import rms_linear
from .low_rank import LowRank
from .mlp import gate_up_swiglu, rms_gate_up_swiglu, swiglu_mlp_residual_rms
from .post_norm import linear_post_norm_residual_rms
from .qkv import qkv_norm_rope, rms_qkv_rope
from .residual import out_proj_residual_rms, rms_norm_stats

__all__ = ["rms_norm_stats", "out_proj_residual_rms", "rms_qkv_rope", "rms_gate_up_swiglu", "swiglu_mlp_residual_rms",
           "rms_linear", "rms_lm_head_cross_entropy", "embedding", "LowRank", "interleave_gate_up", "split_gate_up",
           "rope_pairs_from_half_split", "rope_half_split_from_pairs", "rope_frequencies",
           "linear_post_norm_residual_rms", "qkv_norm_rope", "gate_up_swiglu", "fp8_linear"]
