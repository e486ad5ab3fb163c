"""Architecture changes after ``codagen.patch`` are checked at the next forward, as at patch time: what the
fused decoder cannot compute is refused, never run as the unmodified model."""
from __future__ import annotations

import pytest
import torch

from codagen.models import patch, unpatch

from .conftest import build, lm_inputs

transformers = pytest.importorskip("transformers")


def _down_proj_bias(model):
    model.model.layers[1].mlp.down_proj.bias = torch.nn.Parameter(torch.randn(32))


def _gelu(model):  # exact (erf) GELU: the epilogue computes SiLU and GELU-tanh only
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()


def _norm_eps(model):
    model.model.layers[0].post_attention_layernorm.variance_epsilon = 1e-3


def _wider_q_proj(model):
    model.model.layers[0].self_attn.q_proj = torch.nn.Linear(32, 48, bias=False)


@pytest.mark.parametrize("change, error, match", [
    (_down_proj_bias, NotImplementedError, r"MLP biases \(layer 1\)"),
    (_gelu, NotImplementedError, r"act_fn GELU \(layer 0; only SiLU and GELU-tanh\)"),
    (_norm_eps, NotImplementedError, r"different eps among the RMSNorms \(layer 0\)"),
    (_wider_q_proj, ValueError, r"self_attn.q_proj.weight of layer 0 is \(48, 32\)"),
])
@pytest.mark.parametrize("grad", [True, False])
def test_changes_after_patch_are_checked_at_the_next_forward(change, error, match, grad):
    model = patch(build("llama"))
    inputs = lm_inputs()
    with torch.set_grad_enabled(grad):
        model(**inputs)
        change(model)
        with pytest.raises(error, match=match):
            model(**inputs)


def test_act_fn_is_checked_at_patch():
    model = build("llama")
    _gelu(model)
    with pytest.raises(NotImplementedError,
                       match=r"act_fn GELU \(layer 0; only SiLU and GELU-tanh\).*without codagen.patch"):
        patch(model)


def test_supported_changes_after_patch_run_as_transformers():
    """An O-proj bias is one the fused decoder computes: added after patch, it enters the next forward."""
    model = patch(build("llama"))
    inputs = lm_inputs()
    with torch.no_grad():
        model(**inputs)
        model.model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.randn(32))
        got = model(**inputs)
        want = unpatch(model)(**inputs)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
