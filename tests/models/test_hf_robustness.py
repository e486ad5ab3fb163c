"""codagen.patch on what a real run touches: pickling and copies of a patched model, hooks, sizes the
kernels cannot take (refused at patch time, naming the config field), labels outside the vocabulary."""
from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch

from codagen.models import is_patched, patch, sharding, unpatch

from .conftest import build, lm_inputs

transformers = pytest.importorskip("transformers")


def _round_trips():
    def torch_save_load(model):
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)
    return {"pickle": lambda model: pickle.loads(pickle.dumps(model)), "deepcopy": copy.deepcopy,
            "torch_save": torch_save_load}


@pytest.mark.parametrize("round_trip", list(_round_trips()))
def test_patched_model_round_trips_patched(round_trip):
    """pickle, copy.deepcopy and torch.save/load of a patched model give a patched copy bound to itself
    (not to the original), with the same loss and gradients; unpatch still works on the copy."""
    model = patch(build("qwen3", num_hidden_layers=1))
    inputs = lm_inputs()
    loss = model(**inputs).loss
    loss.backward()
    copied = _round_trips()[round_trip](model)
    assert is_patched(copied) and type(copied) is type(model)
    assert copied.forward.model is copied
    copied_loss = copied(**inputs).loss
    copied_loss.backward()
    assert torch.equal(copied_loss, loss)
    for (name, p), q in zip(model.named_parameters(), copied.parameters()):
        assert p is not q and torch.equal(p.grad, q.grad), name
    assert unpatch(copied) is copied and not is_patched(copied) and is_patched(model)
    torch.testing.assert_close(copied(**inputs).loss, loss.detach(), rtol=2e-4, atol=2e-6)  # transformers' forward


def test_patched_forward_keeps_the_signature():
    """transformers' Trainer reads ``inspect.signature(model.forward)`` to keep dataset columns."""
    model = patch(build("llama"))
    parameters = inspect.signature(model.forward).parameters
    assert list(parameters)[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert "labels" in parameters and "self" not in parameters


@pytest.mark.parametrize("where, kind", [
    ("model.layers.0", "register_forward_hook"), ("model.layers.1.self_attn", "register_forward_pre_hook"),
    ("model.layers.0.mlp.down_proj", "register_full_backward_hook"), ("lm_head", "register_forward_hook"),
    ("model.norm", "register_forward_pre_hook"), ("model", "register_forward_hook")])
def test_hooks_on_bypassed_modules_are_refused(where, kind):
    """The fused decoder never calls the submodules' forward: hooks there are refused, at patch time
    and (registered later) at the next forward, naming the module."""
    model = build("llama")
    module = model.get_submodule(where)
    handle = getattr(module, kind)(lambda *args: None)
    with pytest.raises(NotImplementedError, match=rf"hooks on submodule '{where}' \({type(module).__name__}"):
        patch(model)
    handle.remove()
    patch(model)
    handle = getattr(module, kind)(lambda *args: None)
    with pytest.raises(NotImplementedError, match=rf"hooks on submodule '{where}'"):
        model(**lm_inputs())
    handle.remove()
    model(**lm_inputs())


def test_hooks_on_the_model_and_the_embedding_run():
    """Hooks on the model run around the fused forward; hooks on the input embedding run too (it then runs
    as the module), e.g. transformers' enable_input_require_grads (PEFT with gradient checkpointing)."""
    model = build("llama")
    inputs = lm_inputs()
    want = model(**inputs).loss
    patch(model)
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append("pre"), with_kwargs=True)
    model.register_forward_hook(lambda module, args, kwargs, out: seen.append(out.loss), with_kwargs=True)
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    loss = model(**inputs).loss
    assert seen == ["pre", (2, 12, 32), loss]
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-6)
    model.requires_grad_(False)
    model.enable_input_require_grads()
    assert model(**inputs).loss.requires_grad  # through the hook, with every parameter frozen


def _mutated(family="llama", **overrides):
    """A tiny model whose config is changed after construction (transformers validates only some sizes
    at construction; checkpoints and pruned models reach the others)."""
    model = build(family)
    for name, value in overrides.items():
        setattr(model.config, name, value)
    return model


def test_sizes_refused_at_patch_time():
    """Sizes the kernels cannot take are refused by patch (ValueError naming the field), not in forward."""
    with pytest.raises(ValueError, match=r"intermediate_size must be even, got 129 \(layer 0\)"):
        patch(build("llama", intermediate_size=129))
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"):
        patch(build("llama", num_key_value_heads=3, head_dim=8))
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"):
        patch(_mutated(num_key_value_heads=3))
    odd_head = build("llama")
    for layer in odd_head.model.layers:
        layer.self_attn.head_dim = 7
    with pytest.raises(ValueError, match=r"head_dim must be a positive even number, got 7 \(layer 0\)"):
        patch(odd_head)
    wrong_q = build("llama")
    wrong_q.model.layers[1].self_attn.q_proj = torch.nn.Linear(32, 24, bias=False)
    with pytest.raises(ValueError, match=r"self_attn.q_proj.weight of layer 1 is \(24, 32\).*give \(32, 32\)"):
        patch(wrong_q)
    wrong_down = build("llama")
    wrong_down.model.layers[0].mlp.down_proj = torch.nn.Linear(38, 32, bias=False)
    with pytest.raises(ValueError, match=r"gate_proj, up_proj, down_proj weights of layer 0"):
        patch(wrong_down)
    too_wide = build("llama")  # head_dim 8: four pairs
    too_wide.model.rotary_emb.inv_freq = too_wide.model.rotary_emb.inv_freq.repeat(2)
    with pytest.raises(ValueError, match=r"rotates 16 channels; head_dim 8 \(layer 0\) takes 2 to 8"):
        patch(too_wide)


def test_even_sizes_that_look_unusual_still_run():
    """head_dim not hidden / heads, and an intermediate_size that is 2 mod 4, are supported."""
    for overrides in (dict(head_dim=6), dict(head_dim=16), dict(intermediate_size=50)):
        model = build("llama", num_hidden_layers=1, **overrides)
        inputs = lm_inputs()
        want = model(**inputs).loss
        torch.testing.assert_close(patch(model)(**inputs).loss, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("bad", [67, -5])
def test_labels_outside_the_vocabulary_are_refused(bad):
    """As transformers refuses them (IndexError on CPU), not a finite loss."""
    model = patch(build("llama"))
    inputs = lm_inputs()
    inputs["labels"][1, 4] = bad
    with pytest.raises(ValueError, match=rf"target: expected values in \[0, 67\) or ignore_index = -100, "
                                         rf"got \[{bad}\]"):
        model(**inputs)
    with torch.no_grad(), pytest.raises(ValueError, match=r"target: expected values in \[0, 67\)"):
        model(**inputs)
    unpatch(model)
    with pytest.raises(IndexError):
        model(**inputs)
    ids = inputs["input_ids"].clone()
    ids[0, 3] = bad
    with pytest.raises(ValueError, match=rf"ids: expected values in \[0, 67\), got \[{bad}\]"):
        patch(model)(input_ids=ids)


@pytest.mark.parametrize("shape", [(0, 5), (2, 0)])
@pytest.mark.parametrize("embeds", [False, True])
def test_empty_batches_are_refused(shape, embeds):
    """transformers fails on them deep inside attention (a reshape of 0 elements); the patched forward
    refuses them at its start, naming the argument and the shape, with or without labels."""
    model = patch(build("llama"))
    ids = torch.zeros(shape, dtype=torch.long)
    name = "inputs_embeds" if embeds else "input_ids"
    args = {"inputs_embeds": torch.zeros(*shape, 32)} if embeds else {"input_ids": ids}
    for labels in (None, ids):
        with pytest.raises(ValueError, match=rf"{name} must hold at least one sequence of at least one token, got "
                                             rf"shape \({shape[0]}, {shape[1]}"):
            model(**args, labels=labels)
    with torch.no_grad(), pytest.raises(ValueError, match=rf"{name} must hold at least one sequence"):
        model(**args, use_cache=True)


def test_inputs_embeds_of_the_wrong_width_are_refused():
    model = patch(build("llama"))
    with pytest.raises(ValueError, match=r"inputs_embeds must be \[batch, seq, hidden_size = 32\], got shape "
                                         r"\(2, 5, 24\)"):
        model(inputs_embeds=torch.randn(2, 5, 24))


@pytest.mark.parametrize("head_dim", [8, 48, 128, 256])
def test_every_even_qk_norm_head_dim_patches(head_dim):
    """QK-norm heads of any even head_dim: normalized in the QKV GEMM's epilogue where a sub-tile holds them whole,
    by the GEMM and a row kernel otherwise (48, 256; in fp32 also 128): the same loss either way."""
    inputs = lm_inputs()
    model = build("qwen3", head_dim=head_dim, num_hidden_layers=1)
    want = model(**inputs).loss
    torch.testing.assert_close(patch(model)(**inputs).loss, want, rtol=1e-4, atol=1e-6)


def test_refusals_advise_what_works_for_the_model():
    """At patch time the model is not patched yet: the advice is to run it without codagen.patch; at a forward
    of a patched model it is codagen.unpatch; a model with fused parameters cannot be unpatched."""
    model = build("llama")
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *args: None)
    with pytest.raises(NotImplementedError, match="run the model without codagen.patch") as refused:
        patch(model)
    assert "codagen.unpatch" not in str(refused.value)
    model = patch(build("llama"))
    with pytest.raises(NotImplementedError, match=r"call codagen.unpatch\(model\)"):
        model(**lm_inputs(), output_attentions=True)
    model = sharding.fuse_parameters(build("llama"))
    with pytest.raises(NotImplementedError, match="output_attentions") as refused:
        model(**lm_inputs(), output_attentions=True)
    assert "codagen.unpatch" not in str(refused.value) and "state_dict" in str(refused.value)
