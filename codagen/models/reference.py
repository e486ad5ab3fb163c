"""The unfused PyTorch LLaMA: the oracle for :class:`codagen.models.Llama` and the demo's baseline.

Plain eager PyTorch in the Hugging Face layout (separate q/k/v and gate/up projections, half-split
RoPE), with the same ``state_dict`` names as ``transformers``' ``LlamaForCausalLM`` (``Qwen3ForCausalLM``'s
with ``qk_norm``), so ``Llama.to_hf_state_dict()`` loads into it unchanged. Every memory-bound op is a
method so a benchmark can swap in other kernels (Liger) by subclassing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import LlamaConfig

__all__ = ["ReferenceLlama", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last axis (HF RoPE convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:  # Qwen3: RMSNorm over each Q/K head, before RoPE
            self.q_norm = _RMSNormWeight(c.head_dim)
            self.k_norm = _RMSNormWeight(c.head_dim)


class _MLP(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class _RMSNormWeight(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class _Layer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.input_layernorm = _RMSNormWeight(c.hidden_size)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _RMSNormWeight(c.hidden_size)
        self.mlp = _MLP(c)


class _Body(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_layers))
        self.norm = _RMSNormWeight(c.hidden_size)


class ReferenceLlama(nn.Module):
    """Eager LLaMA decoder; ``forward(input_ids, targets=None)`` as :class:`codagen.models.Llama`."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # --- the memory-bound ops (overridable) ---------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x * rsqrt(mean(x^2) + eps) * weight``, statistics in fp32 (as HF; fp64 for fp64 ``x``)."""
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * normed.to(x.dtype)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Half-split RoPE on ``[B, heads, S, hd]``: ``q cos + rotate_half(q) sin``."""
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def loss(self, h: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over targets != -100 of the logits ``h @ W^T``, upcast to at least fp32 (as HF)."""
        logits = F.linear(h, lm_head_weight)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits, targets.reshape(-1), ignore_index=-100)

    # ------------------------------------------------------------------------------------------
    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin ``[B, 1, S, hd]`` of angle ``position * inv_freq``: fp32 math then cast, as HF (fp64
        for fp64 activations, the oracle precision)."""
        math_dtype = torch.promote_types(dtype, torch.float32)
        inv_freq = self.config.inverse_frequencies(device=positions.device).to(math_dtype)
        angles = positions.to(math_dtype)[..., None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token loss when ``targets`` [B, S] (already shifted; -100 ignored) is given,
        else logits ``[B, S, vocab]``. ``positions`` [B, S] defaults to ``0..S-1``."""
        c = self.config
        batch, seq = input_ids.shape
        if positions is None:
            positions = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos_sin(positions, x.dtype)
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            h = self.rms_norm(x, layer.input_layernorm.weight)
            q = attn.q_proj(h).view(batch, seq, c.num_heads, c.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(batch, seq, c.num_kv_heads, c.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(batch, seq, c.num_kv_heads, c.head_dim).transpose(1, 2)
            if c.qk_norm:  # over head_dim, the last axis
                q, k = self.rms_norm(q, attn.q_norm.weight), self.rms_norm(k, attn.k_norm.weight)
            q, k = self.rope(q, k, cos, sin)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(batch, seq, -1))
            h = self.rms_norm(x, layer.post_attention_layernorm.weight)
            x = x + mlp.down_proj(self.swiglu(mlp.gate_proj(h), mlp.up_proj(h)))
        h = self.rms_norm(x, self.model.norm.weight)
        if targets is None:
            return self.lm_head(h)
        return self.loss(h.reshape(batch * seq, -1), self.lm_head.weight, targets)
