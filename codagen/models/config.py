"""The shape of a LLaMA-style decoder."""
from __future__ import annotations

import dataclasses

import torch

from codagen.ops import _fp8

__all__ = ["LlamaConfig"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A pre-norm LLaMA decoder: RMSNorm, GQA attention with RoPE, SwiGLU MLP, no biases.

    ``head_dim`` defaults to ``hidden_size // num_heads``. RoPE inverse frequencies are
    ``rope_theta ** (-2i / head_dim)`` for ``i < head_dim / 2``. ``qk_norm=True`` adds Qwen3's QK-norm:
    an RMSNorm over each Q and K head (weights ``q_norm``, ``k_norm`` [head_dim], eps ``rms_norm_eps``)
    after the projection and before RoPE. ``fp8="blockwise"`` runs every projection GEMM, forward and backward, on
    e4m3 operands with blockwise scales (:mod:`codagen.ops._fp8`; bf16 parameters or autocast to bf16), as
    ``codagen.patch(model, fp8="blockwise")`` does.

    The defaults are transformers' ``LlamaConfig``'s (``rms_norm_eps=1e-6``, ``rope_theta=1e4``, untied
    embeddings, as many KV heads as heads), so a state dict moves to a default ``LlamaForCausalLM`` of the same
    sizes unchanged; a checkpoint's own values (Llama 3: ``rms_norm_eps=1e-5``, ``rope_theta=5e5``) are passed.
    """
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    fp8: str | None = None

    def __post_init__(self):
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            if self.num_heads <= 0 or self.hidden_size % self.num_heads:
                raise ValueError(f"LlamaConfig: hidden_size ({self.hidden_size}) is not a multiple of "
                                 f"num_heads ({self.num_heads}); give head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig: {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"LlamaConfig: rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"LlamaConfig: rope_theta must be > 0, got {self.rope_theta}")
        _fp8.checked_recipe(self.fp8)

    @property
    def qkv_size(self) -> int:
        """Rows of the fused QKV weight: ``(num_heads + 2 num_kv_heads) head_dim``."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def inverse_frequencies(self, device: torch.device | str | None = None) -> torch.Tensor:
        """RoPE inverse frequencies, fp32 ``[head_dim / 2]``."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.rope_theta ** exponents)

    def num_parameters(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = 2 * d + d * self.qkv_size + self.num_heads * self.head_dim * d + 3 * d * f
        per_layer += 2 * self.head_dim if self.qk_norm else 0
        return v * d * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + d
