"""Programmatic dependent launch of the decode kernels: which launches take it, and that it changes no bit."""
from __future__ import annotations

import copy

import pytest
import torch

from codagen import patch
from codagen.backends import get_backend, triton_available
from codagen.models.decode import GreedyDecoder

from .conftest import build

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")


def test_dependent_launch_only_for_decode_rows_on_cuda(monkeypatch):
    """Up to SMALL_M_ROWS rows (the decode pool), on CUDA devices of sm_90 or newer."""
    from codagen.backends.triton import dependent_launch
    from codagen.backends.triton.configs import SMALL_M_ROWS
    monkeypatch.setattr(dependent_launch, "capability", lambda device: (9, 0))
    monkeypatch.setattr(dependent_launch, "DEPENDENT_LAUNCH_ROWS", SMALL_M_ROWS)  # the default
    cuda = torch.device("cuda", 0)
    rows = SMALL_M_ROWS
    assert dependent_launch.enabled(1, cuda) and dependent_launch.enabled(rows, cuda)
    assert not dependent_launch.enabled(rows + 1, cuda)  # training and prefill shapes: plain stream order
    assert not dependent_launch.enabled(1, torch.device("cpu"))  # the interpreter
    monkeypatch.setattr(dependent_launch, "capability", lambda device: (8, 0))
    assert not dependent_launch.enabled(1, cuda)  # griddepcontrol needs sm_90
    # the kernel's constexpr and Triton's launch option go together; a plain launch passes neither option
    assert dependent_launch.launch_options(True) == {"PDL": True, "launch_pdl": True}
    assert dependent_launch.launch_options(False) == {"PDL": False}


def test_dependent_launch_off_switch():
    """``CODAGEN_DEPENDENT_LAUNCH=0`` (read at import): no launch is a programmatic dependent."""
    import os
    import subprocess
    import sys
    code = "from codagen.backends.triton import dependent_launch as d; print(d.DEPENDENT_LAUNCH_ROWS)"
    env = dict(os.environ, CODAGEN_DEPENDENT_LAUNCH="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"


def _decode(model, ids, rows: int, prefetch_k: int):
    """Greedy tokens and the final KV cache of a captured decode with the given launch settings."""
    from codagen.backends.triton import dependent_launch
    dependent_launch.DEPENDENT_LAUNCH_ROWS, dependent_launch.PREFETCH_K = rows, prefetch_k
    get_backend("triton").clear_plans()  # plan (and capture) again under these settings
    decoder = GreedyDecoder(model, max_cache_len=96)
    tokens = decoder(ids, max_new_tokens=24)
    assert decoder.graph is not None
    return tokens, [(layer.keys.clone(), layer.values.clone()) for layer in decoder.cache.layers]


@pytest.mark.gpu
def test_gpu_dependent_launch_decode_is_bitwise_stream_order(monkeypatch):
    """The captured decode step with every decode GEMM, split-K pass and finisher launched as a programmatic
    dependent (with and without the weight prefetch) gives bitwise the tokens and the KV cache of plain stream
    order: a kernel that reads its predecessor's output before the predecessor finished would differ.
    Widths where the untimed decode configurations split K (N <= 8192 with few column tiles) run both passes."""
    from codagen.backends.triton import dependent_launch
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    saved = dependent_launch.DEPENDENT_LAUNCH_ROWS, dependent_launch.PREFETCH_K
    model = patch(copy.deepcopy(build("llama", hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=4096, num_hidden_layers=3)).cuda()
                  .bfloat16().eval())
    try:
        for batch in (1, 5):
            ids = torch.randint(1, 4096, (batch, 40), device="cuda")
            plain_tokens, plain_cache = _decode(model, ids, 0, 0)
            for prefetch_k in (0, 512):
                tokens, cache = _decode(model, ids, 64, prefetch_k)
                assert torch.equal(tokens, plain_tokens), (batch, prefetch_k)
                for (keys, values), (plain_keys, plain_values) in zip(cache, plain_cache):
                    assert torch.equal(keys, plain_keys) and torch.equal(values, plain_values), (batch, prefetch_k)
    finally:
        dependent_launch.DEPENDENT_LAUNCH_ROWS, dependent_launch.PREFETCH_K = saved
        get_backend("triton").clear_plans()
