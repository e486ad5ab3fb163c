"""torch.compile of a patched model's forwards without autograd (evaluation, the logits of a prompt): one graph,
no graph breaks (the fused weights are gathered in the graph, as in a compiled training forward), outputs equal to
the eager patched model's."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager

import codagen
from codagen.models import patch

from .conftest import build, lm_inputs

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("labels", [False, True])
def test_no_grad_forward_compiles_to_one_graph(family, labels):
    model = patch(build(family).eval())
    inputs = lm_inputs() if labels else {"input_ids": lm_inputs()["input_ids"]}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot_eager, fullgraph=True)  # raises on any graph break
    with torch.no_grad(), codagen.use_backend("reference"):
        want = model(**inputs)
        got = compiled(**inputs)
        again = compiled(**inputs)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(again.logits, want.logits, rtol=1e-5, atol=1e-6)
    if labels:
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
