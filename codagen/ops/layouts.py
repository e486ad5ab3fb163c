"""Conversions between standard (Hugging Face LLaMA) weights and the fused layouts the ops expect.

- gate/up: the F2 epilogue applies SwiGLU to adjacent output columns, so the fused weight interleaves
  rows ``g0, u0, g1, u1, ...`` (``gate_up_weight[2j] = gate_weight[j]``, ``gate_up_weight[2j+1] = up_weight[j]``).
- RoPE: the F4 epilogue rotates adjacent column pairs ``(2i, 2i+1)``. Hugging Face rotates ``(i, i + hd/2)``
  ("half split", ``rotate_half``); permuting the Q and K weight rows inside each head maps one onto the
  other. Attention is unchanged: ``q . k`` is invariant under a common permutation of head_dim channels,
  and V (not permuted) carries the output. With partial rotary embeddings only the first ``rotary_dim``
  channels of a head rotate, in half-split order over those channels (``half_split_dim = rotary_dim``); the rest
  keep their order (and rotate by frequency 0). Interleaved RoPE (GLM) rotates ``(2i, 2i+1)`` already:
  ``half_split_dim = 0``, no permutation.
"""
from __future__ import annotations

import torch

from . import _checks as check

__all__ = ["interleave_gate_up", "split_gate_up", "rope_pairs_from_half_split", "rope_half_split_from_pairs",
           "rope_frequencies"]


def interleave_gate_up(gate_weight: torch.Tensor, up_weight: torch.Tensor) -> torch.Tensor:
    """``[F, d], [F, d] -> [2F, d]`` with rows ``g0, u0, g1, u1, ...``."""
    gate_weight, up_weight = check.tensor("gate_weight", gate_weight), check.tensor("up_weight", up_weight)
    if up_weight.dtype != gate_weight.dtype:
        raise ValueError(f"up_weight: expected dtype {gate_weight.dtype} (that of gate_weight), "
                         f"got {up_weight.dtype}")
    if up_weight.device != gate_weight.device:
        raise ValueError(f"up_weight: expected device {gate_weight.device} (that of gate_weight), "
                         f"got {up_weight.device}")
    if gate_weight.shape != up_weight.shape:
        raise ValueError(f"up_weight: expected the shape of gate_weight {tuple(gate_weight.shape)}, "
                         f"got {tuple(up_weight.shape)}")
    if gate_weight.dim() < 1:
        raise ValueError("gate_weight: expected at least one dimension (rows = FFN features)")
    return torch.stack((gate_weight, up_weight), dim=1).flatten(0, 1).contiguous()


def split_gate_up(gate_up_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_gate_up`: ``[2F, d] -> ([F, d], [F, d])``."""
    gate_up_weight = check.tensor("gate_up_weight", gate_up_weight)
    if gate_up_weight.dim() < 1 or gate_up_weight.shape[0] % 2:
        raise ValueError(f"gate_up_weight: expected an even number of rows, got shape {tuple(gate_up_weight.shape)}")
    return gate_up_weight[0::2].contiguous(), gate_up_weight[1::2].contiguous()


def _heads(weight: torch.Tensor, head_dim: int, name: str = "weight") -> int:
    """The head count of Q or K projection rows ``[heads * head_dim, ...]``, checked."""
    check.tensor(name, weight)
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim: expected a positive even int, got {head_dim!r}")
    if weight.dim() < 1 or weight.shape[0] % head_dim:
        raise ValueError(f"{name}: expected a row count that is a multiple of head_dim = {head_dim}, "
                         f"got shape {tuple(weight.shape)}")
    return weight.shape[0] // head_dim


def _half_split_dim(head_dim: int, half_split_dim: int | None) -> int:
    if half_split_dim is None:
        return head_dim
    if isinstance(half_split_dim, bool) or not isinstance(half_split_dim, int) or not 0 <= half_split_dim <= head_dim \
            or half_split_dim % 2:
        raise ValueError(f"half_split_dim: expected an even int in [0, head_dim = {head_dim}], got {half_split_dim!r}")
    return half_split_dim


def _permute_heads(weight: torch.Tensor, head_dim: int, half_split_dim: int | None, to_pairs: bool) -> torch.Tensor:
    heads, split = _heads(weight, head_dim), _half_split_dim(head_dim, half_split_dim)
    if split == 0:
        return weight
    order = (2, split // 2) if to_pairs else (split // 2, 2)
    per_head = weight.reshape(heads, head_dim, *weight.shape[1:])
    rotated = per_head[:, :split].reshape(heads, *order, *weight.shape[1:]).transpose(1, 2)
    if split == head_dim:  # one strided copy
        return rotated.reshape(weight.shape)
    rotated = rotated.reshape(heads, split, *weight.shape[1:])
    return torch.cat((rotated, per_head[:, split:]), dim=1).reshape(weight.shape)


def rope_pairs_from_half_split(weight: torch.Tensor, head_dim: int, half_split_dim: int | None = None) -> torch.Tensor:
    """Permute Q or K projection rows (``[heads * head_dim, ...]``) from half-split RoPE to adjacent pairs.

    New row ``2i`` of a head is its old row ``i``, new row ``2i + 1`` its old row ``i + hd/2``: each head's rows,
    seen as ``[2, hd/2]``, transposed. One strided copy, whose backward is the transposed copy (no index
    kernels), so fusing the weights on every forward (``codagen.patch``) costs one pass over them each way.
    ``half_split_dim`` (default ``head_dim``): only each head's first ``half_split_dim`` rows are in half-split
    order (partial rotary embeddings); the rest stay where they are (0: nothing moves)."""
    return _permute_heads(weight, head_dim, half_split_dim, to_pairs=True)


def rope_half_split_from_pairs(weight: torch.Tensor, head_dim: int, half_split_dim: int | None = None) -> torch.Tensor:
    """Inverse of :func:`rope_pairs_from_half_split`."""
    return _permute_heads(weight, head_dim, half_split_dim, to_pairs=False)


def kv_heads_of(qkv_features: int, head_dim: int, num_heads: int) -> int:
    """The K (= V) head count of a fused ``[Q | K | V]`` projection of ``qkv_features`` columns with
    ``num_heads`` Q heads of ``head_dim`` (callers have checked that it divides)."""
    return (qkv_features // head_dim - num_heads) // 2


def rope_frequencies(num_heads: int, num_kv_heads: int, head_dim: int, base: float = 10000.0,
                     inv_freq: torch.Tensor | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies of a fused QKV output, float32 ``[(h + 2 kv) * hd / 2]``.

    Columns are ``[Q heads | K heads | V heads]``; pair ``i`` of every Q and K head rotates with
    ``inv_freq[i] = base ** (-2i / hd)`` (Hugging Face's formula), V pairs get 0 (no rotation).
    ``inv_freq`` [hd/2] overrides the default (Hugging Face RoPE scaling variants compute their own).
    Built on ``device`` (default: ``inv_freq``'s, else the CPU), so no host-to-device copy is needed,
    e.g. inside CUDA-graph capture.
    """
    for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim: expected a positive even int, got {head_dim!r}")
    if inv_freq is None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        inv_freq = 1.0 / (base ** exponents)
    elif tuple(check.tensor("inv_freq", inv_freq).shape) != (head_dim // 2,):
        raise ValueError(f"inv_freq: expected shape [head_dim / 2] = ({head_dim // 2},), got {tuple(inv_freq.shape)}")
    inv_freq = inv_freq.to(device=device if device is not None else inv_freq.device, dtype=torch.float32)
    v_pairs = inv_freq.new_zeros(num_kv_heads * head_dim // 2)
    return torch.cat((inv_freq.repeat(num_heads), inv_freq.repeat(num_kv_heads), v_pairs)).contiguous()
