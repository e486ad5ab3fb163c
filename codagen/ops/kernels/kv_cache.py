"""A decode step's write into a ``transformers`` ``StaticLayer``: the new K and V into their cache slots and Q
permuted to the cache's head order, one launch.

For token ``(b, t)`` (row ``b * seq + t`` of the token-major inputs), head ``g`` and the layer's length
``L = cumulative_length`` (read on the device):

- ``keys[b, g, L + t, :] = half_split(k[b * seq + t, g * hd : (g + 1) * hd])``,
- ``values[b, g, L + t, :] = v[b * seq + t, g * hd : (g + 1) * hd]``,
- ``q_out[b, h, t, :] = half_split(q[b * seq + t, h * hd : (h + 1) * hd])``, ``q_out`` a new contiguous
  ``[batch, heads, seq, hd]`` tensor,

where ``half_split`` takes a head from the fused QKV GEMM's adjacent-pair order to Hugging Face's half-split
RoPE order: pair-order channel ``2i`` is HF channel ``i``, ``2i + 1`` is HF channel ``i + hd / 2``
(:func:`half_split_heads`). Then ``cumulative_length += seq``, as ``StaticLayer.update`` advances it: in the
kernel, by the last of its programs to finish (:mod:`codagen.backends.triton.arrivals`), after every program
has read the old length. The ``_ref`` twin is ``StaticLayer.update``'s ``torch.arange(seq) +
cumulative_length``, two ``index_copy_`` calls and the ``add_``. The kernel drops writes to slots past
``max_cache_len`` (no out-of-bounds store; callers check lengths on the host), where ``index_copy_`` raises.
"""
from __future__ import annotations

import torch

from ._launch import arrivals, cdiv, dispatcher, last_to_arrive, launch_kernel, launcher, next_power_of_2, tl, triton

__all__ = ["static_cache_write", "static_cache_write_ref", "static_cache_write_triton", "half_split_heads"]

#: widest column block of the write: 4 warps x 8 values per thread
_WRITE_MAX_BLOCK = 1024


@triton.jit
def _static_cache_write_kernel(q_ptr, k_ptr, v_ptr, keys_ptr, values_ptr, q_out_ptr, length_ptr, arrivals_ptr,
                               q_row_stride, q_col_stride, k_row_stride, k_col_stride, v_row_stride, v_col_stride,
                               seq, heads, kv_heads, max_cache_len, HEAD_DIM: tl.constexpr, HALF_SPLIT: tl.constexpr,
                               BLOCK: tl.constexpr):
    """Program (r, c): token row ``r = b * seq + t``, BLOCK columns of the row's ``[q | k | v]`` heads from
    column ``c * BLOCK``. Each column is read once, in order, and stored to its head's slot: q to ``q_out``,
    k to ``keys`` and v to ``values`` at slot ``cumulative_length + t``. The last program to finish advances
    ``cumulative_length`` by ``seq``."""
    row = tl.program_id(0).to(tl.int64)
    b, t = row // seq, row % seq
    slot = tl.load(length_ptr) + t
    in_cache = (slot >= 0) & (slot < max_cache_len)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    head, channel = cols // HEAD_DIM, cols % HEAD_DIM
    # pair-order channel 2i is HF channel i, 2i + 1 is HF channel i + HALF_SPLIT / 2, among the first HALF_SPLIT
    # (the rotated ones of a partial rotary embedding; all of them by default); the others keep their place
    if HALF_SPLIT == HEAD_DIM:
        hf_channel = channel // 2 + (channel % 2) * (HEAD_DIM // 2)
    else:
        hf_channel = tl.where(channel < HALF_SPLIT, channel // 2 + (channel % 2) * (HALF_SPLIT // 2), channel)

    is_q = head < heads
    q = tl.load(q_ptr + row * q_row_stride + cols * q_col_stride, mask=is_q)
    tl.store(q_out_ptr + ((b * heads + head) * seq + t) * HEAD_DIM + hf_channel, q, mask=is_q)

    k_head = head - heads
    is_k = (k_head >= 0) & (k_head < kv_heads)
    k = tl.load(k_ptr + row * k_row_stride + (cols - heads * HEAD_DIM) * k_col_stride, mask=is_k)
    tl.store(keys_ptr + ((b * kv_heads + k_head) * max_cache_len + slot) * HEAD_DIM + hf_channel, k,
             mask=is_k & in_cache)

    v_head = k_head - kv_heads
    is_v = (v_head >= 0) & (v_head < kv_heads)
    v = tl.load(v_ptr + row * v_row_stride + (cols - (heads + kv_heads) * HEAD_DIM) * v_col_stride, mask=is_v)
    tl.store(values_ptr + ((b * kv_heads + v_head) * max_cache_len + slot) * HEAD_DIM + channel, v,
             mask=is_v & in_cache)

    # every program has read the length once it arrives: the last one may advance it
    if last_to_arrive(arrivals_ptr, tl.num_programs(0) * tl.num_programs(1)):
        tl.store(length_ptr, tl.load(length_ptr) + seq)


def half_split_heads(t: torch.Tensor, batch: int, seq: int, heads: int, head_dim: int,
                     half_split_dim: int | None = None) -> torch.Tensor:
    """Token-major ``[batch * seq, heads * head_dim]`` heads in adjacent-pair order -> ``[batch, heads, seq,
    head_dim]`` in HF's half-split order (pair-order channel ``2i`` is HF channel ``i``, ``2i+1`` is ``i + hd/2``);
    with ``half_split_dim`` (partial rotary embeddings: the rotated channels; 0 for interleaved RoPE) only each
    head's first ``half_split_dim`` channels move, within themselves."""
    split = head_dim if half_split_dim is None else half_split_dim
    t = t.view(batch, seq, heads, head_dim)
    if split == head_dim:
        t = t.view(batch, seq, heads, head_dim // 2, 2).transpose(-1, -2).reshape(batch, seq, heads, head_dim)
    elif split:
        rotated = t[..., :split].unflatten(-1, (split // 2, 2)).transpose(-1, -2).flatten(-2)
        t = torch.cat((rotated, t[..., split:]), dim=-1)
    return t.transpose(1, 2)


def _check_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 cumulative_length: torch.Tensor, batch: int, seq: int, heads: int, kv_heads: int,
                 head_dim: int) -> None:
    """Refuse, naming the argument, what the write cannot take (before any launch)."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim: expected a positive even number (channel pairs), got {head_dim}")
    rows = batch * seq
    for name, t, cols, desc in (("q", q, heads * head_dim, "heads * head_dim"),
                                ("k", k, kv_heads * head_dim, "kv_heads * head_dim"),
                                ("v", v, kv_heads * head_dim, "kv_heads * head_dim")):
        if tuple(t.shape) != (rows, cols):
            raise ValueError(f"{name}: expected shape [batch * seq, {desc}] = {(rows, cols)}, got {tuple(t.shape)}")
    if keys.dim() != 4 or tuple(keys.shape[:2]) != (batch, kv_heads) or keys.shape[3] != head_dim:
        raise ValueError(f"keys: expected shape [batch, kv_heads, max_cache_len, head_dim] = "
                         f"{(batch, kv_heads, '*', head_dim)}, got {tuple(keys.shape)}")
    if values.shape != keys.shape:
        raise ValueError(f"values: expected the shape of keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    for name, t in (("k", k), ("v", v), ("keys", keys), ("values", values)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected dtype {q.dtype} (that of q), got {t.dtype}")
    for name, t in (("k", k), ("v", v), ("keys", keys), ("values", values), ("cumulative_length", cumulative_length)):
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (that of q), got {t.device}")
    for name, t in (("keys", keys), ("values", values)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())} for shape "
                             f"{tuple(t.shape)}")
    if cumulative_length.dim() != 0 or cumulative_length.dtype != torch.int64:
        raise ValueError(f"cumulative_length: expected a 0-d torch.int64 tensor, got shape "
                         f"{tuple(cumulative_length.shape)} of {cumulative_length.dtype}")


def static_cache_write_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                           values: torch.Tensor, cumulative_length: torch.Tensor, batch: int, seq: int, heads: int,
                           kv_heads: int, head_dim: int, half_split_dim: int | None = None) -> torch.Tensor:
    """The step's ``k``, ``v`` (token-major, pair order for ``k``) into ``keys``, ``values`` [batch, kv_heads,
    max_cache_len, head_dim] at slots ``cumulative_length + t`` and ``cumulative_length += seq``, as
    ``StaticLayer.update`` does; returns ``q`` as a contiguous ``[batch, heads, seq, head_dim]`` tensor in
    half-split order (``half_split_dim``: as in :func:`half_split_heads`)."""
    _check_write(q, k, v, keys, values, cumulative_length, batch, seq, heads, kv_heads, head_dim)
    slots = torch.arange(seq, device=keys.device) + cumulative_length
    key_states = half_split_heads(k, batch, seq, kv_heads, head_dim, half_split_dim)
    value_states = v.view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    try:
        keys.index_copy_(2, slots, key_states)
        values.index_copy_(2, slots, value_states)
    except NotImplementedError:  # transformers' fallback where index_copy_ is missing (MPS)
        keys[:, :, slots] = key_states
        values[:, :, slots] = value_states
    cumulative_length.add_(seq)
    return half_split_heads(q, batch, seq, heads, head_dim, half_split_dim).contiguous()


@launcher
def static_cache_write_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                              values: torch.Tensor, cumulative_length: torch.Tensor, batch: int, seq: int, heads: int,
                              kv_heads: int, head_dim: int, half_split_dim: int | None = None) -> torch.Tensor:
    """:func:`static_cache_write_ref` as one kernel launch (fp16/bf16/fp32): ``q``, ``k``, ``v`` read in place
    (any strides: column views of the QKV GEMM's output), ``cumulative_length`` read on the device (no host
    sync: capturable in a CUDA graph) and advanced in the same launch; writes to slots past ``max_cache_len``
    are dropped."""
    _check_write(q, k, v, keys, values, cumulative_length, batch, seq, heads, kv_heads, head_dim)
    q_out = torch.empty(batch, heads, seq, head_dim, dtype=q.dtype, device=q.device)
    rows, width = batch * seq, (heads + 2 * kv_heads) * head_dim
    if rows and width:
        block = min(next_power_of_2(width), _WRITE_MAX_BLOCK)
        launch_kernel(_static_cache_write_kernel, (rows, cdiv(width, block)),
            q, k, v, keys, values, q_out, cumulative_length, arrivals.counters(q.device, 1), *q.stride(), *k.stride(),
            *v.stride(), seq, heads, kv_heads, keys.shape[2], HEAD_DIM=head_dim,
            HALF_SPLIT=head_dim if half_split_dim is None else half_split_dim, BLOCK=block)
    else:  # nothing to write: the length still advances, as StaticLayer.update's
        cumulative_length.add_(seq)
    return q_out


static_cache_write = dispatcher(static_cache_write_ref, static_cache_write_triton)
