"""Activation checkpointing of a patched model: ``model.gradient_checkpointing_enable()`` (reentrant or not)
gives the unpatched model's loss and gradients, keeps fewer activations, and recomputes the forward bitwise;
``keep_attention`` keeps attention's outputs and recomputes only the fused GEMMs."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import codagen
from codagen.models import keep_attention, patch

from .conftest import assert_same_training, build, enable_checkpointing, grads, lm_inputs, padded_inputs, two_x_rule

transformers = pytest.importorskip("transformers")


KWARGS = {"default": None, "reentrant": {"use_reentrant": True}, "non_reentrant": {"use_reentrant": False},
          "keep_attention": {"use_reentrant": False, "context_fn": keep_attention}}


@pytest.mark.parametrize("kwargs", sorted(KWARGS))
def test_matches_unpatched(kwargs):
    """The unpatched reference runs without checkpointing (its loss and gradients are the same with it)."""
    model = build("qwen3")
    reference = copy.deepcopy(model)
    enable_checkpointing(model, KWARGS[kwargs])
    inputs = padded_inputs("right")
    want = reference(**inputs)
    want.loss.backward()
    patch(model)
    got = model(**inputs)
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-4, atol=2e-6)
    expected = grads(reference)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, expected[name], rtol=2e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")


def test_unpatched_with_checkpointing_agrees():
    """The same comparison through assert_same_training, the unpatched copy checkpointing too."""
    assert_same_training(enable_checkpointing(build("mistral", sliding_window=5), None), padded_inputs("left"))


def saved_bytes(model, inputs) -> int:
    """Bytes of the distinct storages autograd saves during the forward (seen by saved_tensors_hooks)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**inputs).loss
    loss.backward()
    return sum(storages.values())


@pytest.mark.parametrize("kwargs", ["reentrant", "non_reentrant"])
def test_fewer_saved_activations(kwargs):
    """Checkpointed blocks keep their inputs only: the saved bytes drop to a third here (the weights are
    saved too, hence a long sequence). keep_attention's cache is not a saved tensor; see the next test."""
    model = patch(build("llama", hidden_size=64, intermediate_size=128, vocab_size=32, num_hidden_layers=3))
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(True)  # gradients flow through the blocks to the embedding
    inputs = lm_inputs(batch=2, seq=256, vocab=32, ignore=False)
    plain = saved_bytes(model, inputs)
    checkpointed = saved_bytes(enable_checkpointing(model, KWARGS[kwargs]), inputs)
    assert checkpointed < 0.4 * plain, (checkpointed, plain)


class _CountAttention(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kwargs,recomputed", [("non_reentrant", 2), ("keep_attention", 0)])
def test_keep_attention_skips_attention_in_backward(kwargs, recomputed):
    model = patch(enable_checkpointing(build("llama"), KWARGS[kwargs]))
    loss = model(**lm_inputs()).loss
    with _CountAttention() as counter:
        loss.backward()
    assert counter.calls == recomputed  # one attention forward per layer when the block is recomputed


def test_every_n_layers():
    """transformers' every_n_layers marks which layers checkpoint; the patched model follows the marks."""
    model = build("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False},
                                                every_n_layers=2)
        except TypeError:
            pytest.skip("this transformers has no every_n_layers")
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]
    loss = patch(model)(**lm_inputs()).loss
    with _CountAttention() as counter:
        loss.backward()
    assert counter.calls == 1


@pytest.mark.parametrize("kwargs", sorted(KWARGS))
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_recompute_is_bitwise(kwargs, dropout):
    """With and without checkpointing the patched model gives bitwise the same loss and gradients (the
    recomputed forward equals the first, attention dropout included: torch.utils.checkpoint restores the RNG)."""
    model = patch(build("llama", attention_dropout=dropout))
    inputs = padded_inputs("left")
    results = []
    for m in (model, enable_checkpointing(copy.deepcopy(model), KWARGS[kwargs])):
        patch(m)
        torch.manual_seed(0)
        with codagen.use_backend("reference"):
            loss = m(**inputs).loss
            loss.backward()
        results.append((loss.detach(), grads(m)))
    (loss, want), (loss_ckpt, got) = results
    assert torch.equal(loss, loss_ckpt)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    if dropout:  # dropout is on: another seed gives another loss
        torch.manual_seed(1)
        assert not torch.equal(model(**inputs).loss.detach(), loss)


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", ["non_reentrant", "keep_attention"])
def test_bf16_gpu_two_x_rule_checkpointed(kwargs, monkeypatch):
    """bf16 on the GPU (Triton kernels), padded, checkpointed: the 2x rule against transformers (checkpointed too)."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    model = build("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=1000, num_hidden_layers=2).cuda()
    enable_checkpointing(model, KWARGS[kwargs])
    batch = {k: v.cuda() for k, v in padded_inputs("left", seq=128, vocab=1000).items()}
    two_x_rule(model, batch, lambda m, b: m.bfloat16()(**b).loss)
