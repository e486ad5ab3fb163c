"""Attention masks for padded and packed batches, built on the device without a host sync.

A boolean SDPA mask ``[B, 1, S, S]`` (``True`` = attend) is the conjunction of

- causality: key ``j`` is visible to query ``i`` iff ``j <= i``;
- padding: key ``j`` is visible iff ``attention_mask[b, j]`` is non-zero (a 2-D ``[B, S]`` mask, as
  tokenizers and padding collators give it);
- documents: for packed rows (several documents in one row, ``position_ids`` restarting per document)
  keys of other documents are invisible. A document starts wherever a position is not its predecessor
  plus one, as ``transformers.masking_utils.find_packed_sequence_indices`` decides; the document ids
  are a cumulative sum on the device, so a row without packing gives one document and the same mask;
- a sliding window (per layer, see :func:`with_sliding_window`): key ``j`` is visible iff ``i - j < window``.

SDPA converts a boolean mask into an additive one (0 or -inf in the query dtype) on every call, and the
memory-efficient CUDA kernel keeps that copy for its backward: one ``[B, 1, S, S]`` tensor per layer.
:func:`additive` makes it once per forward; every layer without a window then reads (and keeps) the same one.

Within one document positions rise by one per token, so causality and the window by token index equal
Hugging Face's rules by position. Query rows with no visible key (left padding) come out of SDPA as
zeros, as in the unpatched model; their tokens carry no loss.
"""
from __future__ import annotations

import torch

__all__ = ["document_ids", "causal_mask", "additive", "with_sliding_window"]


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` position ids -> ``[B, S]`` document index of each token (0, 1, ... per row)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.cumsum(dim=-1) - 1


def causal_mask(batch: int, seq: int, device: torch.device, padding: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor | None:
    """The ``[B | 1, 1, S, S]`` boolean mask of causality, ``padding`` ``[B, S]`` (non-zero = a real token)
    and ``documents`` ``[B | 1, S]`` (:func:`document_ids`); ``None`` when neither is given (plain
    causal attention, for SDPA's ``is_causal``)."""
    if padding is None and documents is None:
        return None
    index = torch.arange(seq, device=device)
    mask = (index[None, :] <= index[:, None])[None, None]  # [1, 1, S, S]
    if padding is not None:
        mask = mask & padding.to(device=device, dtype=torch.bool)[:, None, None, :]
    if documents is not None:
        documents = documents.to(device)
        mask = mask & (documents[:, None, :, None] == documents[:, None, None, :])
    return mask


def additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The boolean ``mask`` as SDPA's additive mask in ``dtype``: 0 where visible, -inf elsewhere."""
    if mask is None:
        return None
    return torch.full(mask.shape, float("-inf"), dtype=dtype, device=mask.device).masked_fill_(mask, 0.0)


def with_sliding_window(mask: torch.Tensor | None, seq: int, window: int | None,
                        device: torch.device) -> torch.Tensor | None:
    """``mask`` (boolean or :func:`additive`; plain causality when ``None``) restricted to keys less than
    ``window`` tokens back; ``mask`` itself when the window covers the sequence."""
    if window is None or seq <= window:
        return mask
    index = torch.arange(seq, device=device)
    offset = index[:, None] - index[None, :]
    local = (offset >= 0) & (offset < window)
    if mask is None:
        return local
    return mask & local if mask.dtype == torch.bool else mask.masked_fill(~local, float("-inf"))
