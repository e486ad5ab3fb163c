"""codagen.patch with padded and packed batches: loss and every parameter gradient equal the unpatched model's
(SDPA, the same attention mask rules as transformers); the mask is built without reading device values."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode

from codagen.models import patch
from codagen.models.masks import causal_mask, document_ids

from .conftest import BACKENDS, assert_same_training, build, padded_inputs, two_x_rule

transformers = pytest.importorskip("transformers")


# Mistral's window (5) is shorter than the sequences, so the window, padding and documents combine
FAMILIES = {"llama": {}, "qwen3": {}, "mistral": dict(sliding_window=5, num_key_value_heads=1)}


def packed_inputs(lengths=(5, 3, 6), vocab=67):
    """What ``transformers.DataCollatorWithFlattening`` gives for documents of ``lengths``: one row,
    position_ids restarting per document, the first label of each document -100, no attention_mask.

    With ``use_cache=False``: transformers separates packed documents only without a cache, and its
    forward builds one whenever ``use_cache`` (the config's default: True) is on, gradient checkpointing
    off. codagen has no cache and always separates them."""
    collator = transformers.DataCollatorWithFlattening()
    features = [{"input_ids": torch.randint(0, vocab, (n,)).tolist()} for n in lengths]
    batch = collator(features, return_tensors="pt")
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    return {**batch, "use_cache": False}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding(family, side):
    inputs = padded_inputs(side)
    assert_same_training(build(family, **FAMILIES[family]), inputs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_sequences(family):
    inputs = packed_inputs()
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5]]
    assert_same_training(build(family, **FAMILIES[family]), inputs)


def test_packing_matters():
    """The documents are separated: with an all-ones attention_mask (transformers' rule: no separation) the
    first document's logits are the same, the later documents' differ."""
    model = patch(build("llama"))
    inputs = packed_inputs()
    del inputs["labels"]
    packed = model(**inputs).logits
    joined = model(**inputs, attention_mask=torch.ones(1, 14, dtype=torch.long)).logits
    torch.testing.assert_close(packed[:, :5], joined[:, :5], rtol=1e-5, atol=1e-6)
    assert (packed[:, 5:] - joined[:, 5:]).abs().amax() > 1e-2


@pytest.mark.parametrize("backend", [BACKENDS[1]])  # the Triton backend (the interpreter on CPU, fp32)
def test_padding_triton(backend):
    assert_same_training(build("llama", num_hidden_layers=1), padded_inputs("left", batch=2, seq=8), backend=backend)


def test_mask_rules():
    """Documents start where a position is not its predecessor + 1 (transformers' rule); padding hides keys."""
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 5, 6], [3, 4, 5, 6, 7, 8, 9]])
    assert document_ids(position_ids).tolist() == [[0, 0, 0, 1, 1, 2, 2], [0] * 7]
    from transformers.masking_utils import find_packed_sequence_indices
    assert find_packed_sequence_indices(position_ids).tolist() == document_ids(position_ids).tolist()
    padding = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    mask = causal_mask(2, 7, torch.device("cpu"), padding, document_ids(position_ids))
    assert mask.shape == (2, 1, 7, 7)
    assert not mask[0, 0, :, 0].any() and mask[0, 0, 2, 1] and not mask[0, 0, 3, 2]  # pad key; document edge
    assert causal_mask(2, 7, torch.device("cpu")) is None


@pytest.mark.parametrize("inputs", ["left", "packed"])
def test_no_host_sync(inputs):
    """The patched forward and backward run on fake tensors (shapes only), where reading a device value
    (``.item()``, ``bool(t)``, ``.tolist()``, ...) raises: the mask is built without a host sync."""
    model = patch(build("mistral", **FAMILIES["mistral"]))
    batch = padded_inputs("left") if inputs == "left" else packed_inputs()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        batch = {k: mode.from_tensor(v) if torch.is_tensor(v) else v for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        assert isinstance(loss, FakeTensor)
        assert isinstance(model.model.layers[0].self_attn.q_proj.weight.grad, FakeTensor)
        with pytest.raises(DataDependentOutputException):  # what a host sync in the forward would raise
            bool(batch["input_ids"].ne(0).all())


@pytest.fixture
def no_autotune(monkeypatch):
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")  # untuned shapes: the first viable configuration


GPU_FIELDS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=1000, num_hidden_layers=2)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("inputs", ["left", "packed"])
def test_bf16_gpu_two_x_rule(family, inputs, no_autotune):
    """bf16 parameters on the GPU (Triton kernels), padded or packed: the 2x rule against transformers."""
    fields = {**GPU_FIELDS, **FAMILIES[family], **({"head_dim": 64} if family == "qwen3" else {})}
    if family == "mistral":
        fields["sliding_window"] = 48
    model = build(family, **fields).cuda()
    batch = (padded_inputs("left", seq=128, vocab=1000) if inputs == "left"
             else packed_inputs(lengths=(70, 20, 38), vocab=1000))
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    two_x_rule(model, batch, lambda m, b: m.bfloat16()(**b).loss)


@pytest.mark.gpu
@pytest.mark.parametrize("inputs", ["left", "packed"])
def test_gpu_step_has_no_host_sync(inputs, no_autotune):
    """A padded or packed training step (after a warm-up step) runs under torch.cuda.set_sync_debug_mode("error"):
    any synchronizing call (.item(), bool(t), nonzero, a device-to-host copy) raises."""
    model = patch(build("mistral", **{**GPU_FIELDS, "sliding_window": 48}).cuda().bfloat16())
    batch = (padded_inputs("left", seq=128, vocab=1000) if inputs == "left"
             else packed_inputs(lengths=(70, 20, 38), vocab=1000))
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    model(**batch).loss.backward()  # warm-up: kernel compilation may synchronize
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(**batch).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(RuntimeError):  # the mode does catch a sync
        torch.cuda.set_sync_debug_mode("error")
        try:
            batch["input_ids"].sum().item()
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_one_additive_mask_for_all_layers(monkeypatch):
    """SDPA gets one additive mask in the compute dtype, the same tensor in every layer without a window (SDPA
    would convert a boolean mask per layer, and its CUDA kernel keep each copy for the backward)."""
    from codagen.models import llama
    masks = []
    sdpa = llama.F.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)
    monkeypatch.setattr(llama.F, "scaled_dot_product_attention", spy)
    model = patch(build("llama", num_hidden_layers=3))
    model(**padded_inputs("right")).loss.backward()
    assert len(masks) == 3 and all(m is masks[0] for m in masks)
    assert masks[0].dtype == torch.float32 and masks[0].shape == (3, 1, 14, 14)
