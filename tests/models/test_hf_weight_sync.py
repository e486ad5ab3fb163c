"""Weight writes between no-grad forwards (the weight sync of RL loops between generate calls): the next forward
of a patched model computes with the new weights, as the unpatched model does. Writes that bump a parameter's
version counter or replace its storage are seen; in-place writes through ``param.data`` bypass both and take
one call to :func:`codagen.refresh_weights`."""
from __future__ import annotations

import copy

import pytest
import torch

import codagen
from codagen import refresh_weights
from codagen.models import patch

from .conftest import build, lm_inputs

transformers = pytest.importorskip("transformers")


def _new_weights(model):
    """A perturbed copy of every parameter, by name."""
    g = torch.Generator().manual_seed(1)
    return {name: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for name, p in model.named_parameters()}


def _load_state_dict(model, new):
    model.load_state_dict(new, strict=False)


def _copy_under_no_grad(model, new):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(new[name])


def _assign_data(model, new):
    for name, p in model.named_parameters():
        p.data = new[name].clone()


def _new_parameters(model, new):
    """Each parameter replaced by a new one, the old one freed first: the allocator may give the new one the old
    one's memory, and a new parameter's version counter starts at 0, as an untouched old one's."""
    for name in [name for name, _ in model.named_parameters()]:  # names only: no reference keeps an old one alive
        path, _, attr = name.rpartition(".")
        module = model.get_submodule(path)
        module._parameters[attr] = None
        module._parameters[attr] = torch.nn.Parameter(new[name].clone())


def _data_copy(model, new):
    for name, p in model.named_parameters():
        p.data.copy_(new[name])


def _trl_mix(model, new, alpha=0.6):
    """TRL's SyncRefModelCallback: ``ref.data.mul_(1 - alpha).add_(policy.data, alpha=alpha)``."""
    for name, p in model.named_parameters():
        p.data.mul_(1.0 - alpha).add_(new[name], alpha=alpha)


# in place through .data: no version counter or storage change shows them
_THROUGH_DATA = (_data_copy, _trl_mix)


@pytest.mark.parametrize("write", [_load_state_dict, _copy_under_no_grad, _assign_data, _new_parameters, _data_copy,
                                   _trl_mix])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_forward_after_a_weight_write_uses_the_new_weights(write, family):
    model = build(family).eval()
    new = _new_weights(model)
    reference = copy.deepcopy(model)
    inputs = {"input_ids": lm_inputs()["input_ids"]}
    patch(model)
    with codagen.use_backend("reference"):
        with torch.no_grad():
            before = model(**inputs).logits
        write(model, new)
        if write in _THROUGH_DATA:
            refresh_weights(model)
        write(reference, new)
        with torch.no_grad():
            got = model(**inputs).logits
            want = reference(**inputs).logits
    assert (want - before).abs().max() > 1e-2  # the write changes the output
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_refresh_weights_takes_a_peft_model_and_refuses_other_models():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert refresh_weights(patch(model)) is model
    with pytest.raises(ValueError, match="refresh_weights: model is not patched by codagen.patch"):
        refresh_weights(build("llama"))
