"""hf_cache.cached_attention on a ``StaticCache``: the one-launch write (``static_cache_write``) leaves the cache,
its length and the attention output as transformers' ``StaticCache.update`` of half-split K does; layers it
cannot take keep that update; on the GPU the Triton launch equals its twin, also replayed from a CUDA graph."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from codagen.models import hf_cache
from codagen.models.llama import AttentionSpec
from codagen.ops import kernels
from codagen.ops.kernels._launch import use_triton

from .conftest import COMMON

transformers = pytest.importorskip("transformers")

from transformers import StaticCache  # noqa: E402  (after the importorskip)

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 16, 2


def config(**overrides):
    return transformers.LlamaConfig(**{**COMMON, "hidden_size": HEADS * HEAD_DIM, "num_attention_heads": HEADS,
                                       "num_key_value_heads": KV_HEADS, "num_hidden_layers": LAYERS, **overrides})


def filled_cache(cfg, batch: int, prefix: int, max_len: int = 9, dtype=torch.float32, device="cpu"):
    """A StaticCache whose layers hold ``prefix`` random tokens (allocated by transformers' own update)."""
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    for layer_idx in range(LAYERS):
        states = torch.randn(2, batch, KV_HEADS, prefix, HEAD_DIM, device=device).to(dtype)
        cache.update(states[0], states[1], layer_idx)
    return cache


def step_inputs(batch: int, seq: int, dtype=torch.float32, device="cpu"):
    """The step's q, k, v in pair order: column views of one QKV row block, as the fused QKV GEMM gives them."""
    widths = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
    return torch.randn(batch * seq, sum(widths), device=device).to(dtype).split(widths, dim=1)


def step_mask(batch: int, seq: int, length: int, max_len: int, dtype=torch.float32, device="cpu"):
    """Additive [batch, 1, seq, max_len] mask: query t sees slots <= length + t."""
    slots = torch.arange(max_len, device=device)
    visible = slots[None, :] <= length + torch.arange(seq, device=device)[:, None]
    mask = torch.zeros(seq, max_len, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    return mask.expand(batch, 1, seq, max_len)


def transformers_attention(q, k, v, spec: AttentionSpec, cache, layer_idx: int, mask):
    """The attention of a step through ``cache.update`` (transformers' StaticLayer.update) of half-split K."""
    b, s, h, kv, hd = spec.batch, spec.seq, spec.num_heads, spec.num_kv_heads, spec.head_dim
    keys, values = cache.update(hf_cache.half_split_heads(k, b, s, kv, hd), v.view(b, s, kv, hd).transpose(1, 2),
                                layer_idx)
    out = F.scaled_dot_product_attention(hf_cache.half_split_heads(q, b, s, h, hd), keys, values,
                                         attn_mask=mask[:, :, :, : keys.shape[-2]], enable_gqa=kv != h)
    return out.transpose(1, 2).reshape(b * s, h * hd)


@pytest.mark.parametrize("batch, seq", [(1, 1), (3, 1), (3, 2)])
def test_static_cache_write_matches_transformers_update(batch, seq, monkeypatch):
    """Two steps into layer 1 of a StaticCache holding 3 tokens: keys, values, cumulative_length and the attention
    output as transformers' update gives them (fp32, CPU: the dispatcher runs the PyTorch twin)."""
    writes = []

    def spy(*args):
        writes.append(args[7])  # seq
        return kernels.static_cache_write(*args)
    monkeypatch.setattr(hf_cache, "static_cache_write", spy)
    prefix, max_len, layer_idx = 3, 9, 1
    ours = filled_cache(config(), batch, prefix, max_len)
    theirs = copy.deepcopy(ours)
    spec = AttentionSpec(batch, seq, HEADS, KV_HEADS, HEAD_DIM)
    for step in range(2):
        q, k, v = step_inputs(batch, seq)
        mask = step_mask(batch, seq, prefix + step * seq, max_len)
        got = hf_cache.cached_attention(q, k, v, spec, ours, layer_idx, mask)
        want = transformers_attention(q, k, v, spec, theirs, layer_idx, mask)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert writes == [seq, seq]
    for mine, hf in zip(ours.layers, theirs.layers):
        assert torch.equal(mine.keys, hf.keys) and torch.equal(mine.values, hf.values)
        assert torch.equal(mine.cumulative_length, hf.cumulative_length)
    assert int(ours.layers[layer_idx].cumulative_length) == prefix + 2 * seq
    assert int(ours.layers[0].cumulative_length) == prefix


def test_layers_the_write_cannot_take_keep_transformers_update(monkeypatch):
    """The write takes an allocated full-attention StaticLayer outside torch.compile only."""
    cache = filled_cache(config(), 1, 2)
    assert hf_cache._static_layer(cache, 0) is cache.layers[0]
    assert hf_cache._static_layer(StaticCache(config=config(), max_cache_len=9), 0) is None  # not allocated yet
    sliding = StaticCache(config=config(sliding_window=4, layer_types=["sliding_attention"] * LAYERS),
                          max_cache_len=9)
    for layer_idx in range(LAYERS):
        sliding.update(torch.randn(1, KV_HEADS, 2, HEAD_DIM), torch.randn(1, KV_HEADS, 2, HEAD_DIM), layer_idx)
    assert type(sliding.layers[0]).__name__ == "StaticSlidingWindowLayer"
    assert hf_cache._static_layer(sliding, 0) is None
    assert hf_cache._static_layer(transformers.DynamicCache(config=config()), 0) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert hf_cache._static_layer(cache, 0) is None


def test_static_cache_write_refuses_mismatched_inputs():
    """Shape, dtype and device mismatches are refused before any launch, naming the argument."""
    batch, seq = 2, 1
    q, k, v = step_inputs(batch, seq)
    keys = torch.zeros(batch, KV_HEADS, 5, HEAD_DIM)
    length = torch.tensor(0)
    args = (batch, seq, HEADS, KV_HEADS, HEAD_DIM)
    for bad, match in (((q, k[:, :-1], v, keys, keys.clone(), length), r"k: expected shape \[batch \* seq"),
                       ((q, k, v, keys[:1], keys[:1].clone(), length), r"keys: expected shape"),
                       ((q, k, v, keys, keys[:, :, :4].clone(), length), r"values: expected the shape of keys"),
                       ((q, k, v, keys, keys.half(), length), r"values: expected dtype torch.float32"),
                       ((q, k, v, keys, keys.transpose(2, 3).contiguous().transpose(2, 3), length),
                        r"values: expected a contiguous tensor"),
                       ((q, k, v, keys, keys.clone(), length.int()), r"cumulative_length: expected a 0-d torch.int64"),
                       ((q, k, v, keys, keys.clone(), length[None]), r"cumulative_length: expected a 0-d torch.int64")):
        with pytest.raises(ValueError, match=match):
            kernels.static_cache_write_triton(*bad, *args)
    with pytest.raises(ValueError, match="head_dim: expected a positive even number"):
        kernels.static_cache_write_triton(q, k, v, keys, keys.clone(), length, batch, seq, HEADS, KV_HEADS, 15)


# --- GPU (bf16, the Triton launch) -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("batch, seq", [(1, 1), (3, 2)])
def test_gpu_static_cache_write_matches_ref(batch, seq):
    """bf16 on CUDA: the launch writes exactly the twin's keys, values and q (a copy: bitwise) and advances the
    length as the twin does, twice in a row (the arrival counter is left at zero)."""
    max_len, length = 64, 37
    q, k, v = step_inputs(batch, seq, torch.bfloat16, "cuda")
    keys = torch.randn(batch, KV_HEADS, max_len, HEAD_DIM, device="cuda").bfloat16()
    values = torch.randn_like(keys)
    want_keys, want_values = keys.clone(), values.clone()
    got_length, want_length = torch.tensor(length, device="cuda"), torch.tensor(length, device="cuda")
    args = (batch, seq, HEADS, KV_HEADS, HEAD_DIM)
    for step in (1, 2):
        got_q = kernels.static_cache_write_triton(q, k, v, keys, values, got_length, *args)
        want_q = kernels.static_cache_write_ref(q, k, v, want_keys, want_values, want_length, *args)
        assert torch.equal(got_q, want_q) and torch.equal(keys, want_keys) and torch.equal(values, want_values)
        assert int(got_length) == int(want_length) == length + step * seq


@pytest.mark.gpu
def test_gpu_cached_attention_captures_in_a_cuda_graph(monkeypatch):
    """cached_attention on a bf16 StaticCache captured in a CUDA graph and replayed twice: cumulative_length
    advances by 2, and each replay writes the cache as transformers' update does and attends as it (eagerly)."""
    launches = []

    def spy(*args):
        launches.append(use_triton(args[0]))
        return kernels.static_cache_write(*args)
    monkeypatch.setattr(hf_cache, "static_cache_write", spy)
    batch, prefix, max_len, layer_idx = 2, 5, 16, 0
    spec = AttentionSpec(batch, 1, HEADS, KV_HEADS, HEAD_DIM)
    ours = filled_cache(config(), batch, prefix, max_len, torch.bfloat16, "cuda")
    theirs = copy.deepcopy(ours)
    q, k, v = step_inputs(batch, 1, torch.bfloat16, "cuda")
    slots = torch.arange(max_len, device="cuda")
    layer = ours.layers[layer_idx]

    def step():  # the mask from the device length, as a decode step builds it
        visible = (slots <= layer.cumulative_length)[None, None, None, :].expand(batch, 1, 1, max_len)
        mask = torch.zeros(visible.shape, dtype=torch.bfloat16, device="cuda").masked_fill_(~visible, float("-inf"))
        return hf_cache.cached_attention(q, k, v, spec, ours, layer_idx, mask)

    warm = copy.deepcopy(ours)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the kernel compiles outside the capture, on a copy of the cache
        hf_cache.cached_attention(q, k, v, spec, warm, layer_idx, step_mask(batch, 1, prefix, max_len,
                                                                           torch.bfloat16, "cuda"))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    assert int(layer.cumulative_length) == prefix  # captured, not run
    assert launches == [True, True]  # the Triton launch: warm-up, capture
    for replay in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        want = transformers_attention(q, k, v, spec, theirs, layer_idx,
                                      step_mask(batch, 1, prefix + replay, max_len, torch.bfloat16, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert int(layer.cumulative_length) == prefix + replay + 1
        assert torch.equal(layer.keys, theirs.layers[layer_idx].keys)
        assert torch.equal(layer.values, theirs.layers[layer_idx].values)
        torch.testing.assert_close(out, want)
