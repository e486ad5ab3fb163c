"""Small row-wise kernels the ops need outside any GEMM, one module each, each with a PyTorch ``*_ref`` twin.

- :mod:`.rms_norm`: the first block's RMSNorm statistics (no producer GEMM precedes it);
- :mod:`.post_norm`: a norm of a GEMM's output before its residual add (sandwich norms, post-norms), with the
  next norm's statistics, and its backward;
- :mod:`.qk_norm_rope` (F4's QK-norm and RoPE where no epilogue sub-tile holds whole heads, e.g. head_dim 256):
  each Q/K head's RMSNorm and the rotation, on the ``z`` the QKV GEMM stored;
- :mod:`.quantize`: e4m3 quantization of an FP8 GEMM's operand, rowwise or in groups of 128 (each row's or
  group's amax onto 448, its fp32 scale);
- :mod:`.rope` (B1): rotate the QKV gradient back and compute ``mean_z_dz`` for the RMSNorm backward;
- :mod:`.rope_qk_norm` (B1 with QK-norm): the same, plus the per-head RMSNorm backward of the Q/K
  heads and the q_norm / k_norm weight gradients (per-row-block partials, summed after the launch);
- :mod:`.swiglu`: SwiGLU (or GeGLU) backward + ``mean_z_dz`` for the standalone gate/up op (the fused MLP op
  does this in the down-projection's input-gradient epilogue instead);
- :mod:`.row_dot`: ``mean_z_dz = sum_k z dz / width`` for ops whose output gradient arrives as is;
- :mod:`.cross_entropy`: a chunk of logits -> each row's loss, its gradient (in place) and
  ``mean_z_dz``, optionally of the soft-capped logits ``cap * tanh(z / cap)``;
- :mod:`.softcap`: the backward of a logit soft-cap + ``mean_z_dz`` for ``rms_linear``'s capped logits;
- :mod:`.scale`: ``(src * factor).to(dtype)`` with ``factor`` a device scalar, one rounding (the LM
  head's saved gradients times the loss gradient);
- :mod:`.embedding`: the embedding table's gradient, each vocabulary row's tokens summed in
  token order;
- :mod:`.finish`: a fused GEMM's tile partials finished into ``rstd``, ``mean_z_dz``, a norm weight's
  gradient or each row's cross-entropy, one launch each;
- :mod:`.kv_cache`: a decode step's K and V into a ``transformers`` ``StaticLayer``'s slots and its Q into
  the cache's half-split head order, one launch;
- :mod:`.greedy`: a decode step's greedy token (each row's argmax of the logits) into the next step's input
  and the generated tokens, and the step counter advanced, one launch.

Each comes as ``foo_ref`` (PyTorch), ``foo_triton`` (one launch of a module-level ``@triton.jit`` kernel)
and the dispatcher ``foo`` (:mod:`._launch`): the kernel for CUDA tensors when the selected backend is
``triton`` and the dtype is not float64 (the oracle dtype); otherwise the twin. (The tests run the
``*_triton`` launchers on CPU under ``TRITON_INTERPRET=1``.) Kernels keep fp32 statistics and write one
value per row or column; the only atomics are arrival counters (:mod:`codagen.backends.triton.arrivals`),
whose last arrival reads its group's partials in a fixed order: results are deterministic.
"""
from .cross_entropy import (
    CROSS_ENTROPY_GROUP,
    CROSS_ENTROPY_LAUNCH,
    cross_entropy_logits_grad,
    cross_entropy_logits_grad_ref,
    cross_entropy_logits_grad_triton,
)
from .embedding import embedding_backward, embedding_backward_ref, embedding_backward_triton
from .finish import (
    finish_col_sum,
    finish_col_sum_ref,
    finish_col_sum_triton,
    finish_cross_entropy,
    finish_cross_entropy_ref,
    finish_cross_entropy_triton,
    finish_row_mean,
    finish_row_mean_ref,
    finish_row_mean_triton,
    finish_rstd,
    finish_rstd_ref,
    finish_rstd_triton,
)
from .greedy import greedy_append, greedy_append_ref, greedy_append_triton
from .kv_cache import half_split_heads, static_cache_write, static_cache_write_ref, static_cache_write_triton
from .post_norm import (
    post_norm_backward,
    post_norm_backward_ref,
    post_norm_backward_triton,
    post_norm_residual,
    post_norm_residual_ref,
    post_norm_residual_triton,
)
from .qk_norm_rope import qk_norm_rope, qk_norm_rope_ref, qk_norm_rope_triton
from .quantize import (
    GROUPINGS,
    quantize_groups,
    quantize_groups_ref,
    quantize_groups_triton,
    quantize_rowwise,
    quantize_rowwise_ref,
    quantize_rowwise_triton,
)
from .rms_norm import rms_norm_stats, rms_norm_stats_ref, rms_norm_stats_triton
from .rope import rope_backward, rope_backward_ref, rope_backward_triton
from .rope_qk_norm import (
    QK_NORM_LAUNCH,
    rope_qk_norm_backward,
    rope_qk_norm_backward_ref,
    rope_qk_norm_backward_triton,
)
from .row_dot import mean_row_dot, mean_row_dot_ref, mean_row_dot_triton
from .scale import scale_cast, scale_cast_ref, scale_cast_triton
from .softcap import softcap_backward, softcap_backward_ref, softcap_backward_triton
from .swiglu import swiglu_backward, swiglu_backward_ref, swiglu_backward_triton

__all__ = ["rms_norm_stats", "rms_norm_stats_ref", "rms_norm_stats_triton", "rope_backward", "rope_backward_ref",
           "rope_backward_triton", "rope_qk_norm_backward", "rope_qk_norm_backward_ref",
           "rope_qk_norm_backward_triton", "swiglu_backward", "swiglu_backward_ref", "swiglu_backward_triton",
           "mean_row_dot", "mean_row_dot_ref", "mean_row_dot_triton", "softcap_backward", "softcap_backward_ref",
           "softcap_backward_triton", "cross_entropy_logits_grad",
           "cross_entropy_logits_grad_ref", "cross_entropy_logits_grad_triton", "scale_cast", "scale_cast_ref",
           "scale_cast_triton", "embedding_backward", "embedding_backward_ref", "embedding_backward_triton",
           "finish_rstd", "finish_rstd_ref", "finish_rstd_triton", "finish_row_mean", "finish_row_mean_ref",
           "finish_row_mean_triton", "finish_col_sum", "finish_col_sum_ref", "finish_col_sum_triton",
           "finish_cross_entropy", "finish_cross_entropy_ref", "finish_cross_entropy_triton", "CROSS_ENTROPY_LAUNCH",
           "CROSS_ENTROPY_GROUP", "QK_NORM_LAUNCH", "static_cache_write", "static_cache_write_ref",
           "static_cache_write_triton", "half_split_heads", "greedy_append", "greedy_append_ref",
           "greedy_append_triton", "post_norm_residual", "post_norm_residual_ref", "post_norm_residual_triton",
           "post_norm_backward", "post_norm_backward_ref", "post_norm_backward_triton", "qk_norm_rope",
           "qk_norm_rope_ref", "qk_norm_rope_triton", "quantize_groups", "quantize_groups_ref",
           "quantize_groups_triton", "GROUPINGS", "quantize_rowwise", "quantize_rowwise_ref",
           "quantize_rowwise_triton"]
