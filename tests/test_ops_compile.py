"""A model built from codagen.ops compiles with torch.compile(fullgraph=True): no graph breaks."""
from __future__ import annotations

import pytest
import torch

from .test_ops_block import Config, forward_backward, fused_model, make_inputs, make_params, reference_tiles


@pytest.mark.slow  # ~40 s of Inductor compilation on 2 CPU cores; kept in the default run
def test_compiled_block_fullgraph_matches_eager_ops():
    cfg = Config(batch=2, seq=4, hidden=16, heads=2, kv_heads=1, head_dim=8, ffn=16, vocab=24, layers=1)
    params = make_params(cfg, dtype=torch.float32)
    x, positions, target, probe = make_inputs(cfg, dtype=torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(fused_model, fullgraph=True)  # raises on any graph break
    with reference_tiles():
        want = forward_backward(fused_model, params, x, positions, target, probe, cfg)
        got = forward_backward(compiled, params, x, positions, target, probe, cfg)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for key in want[2]:
        torch.testing.assert_close(got[2][key], want[2][key], rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
