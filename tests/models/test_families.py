"""Every family spec of :mod:`codagen.models.families`, at a tiny config with the published configs' structural flags:
the patched model trains (loss, logits, every gradient), evaluates and generates as the unpatched one in fp32 on CPU,
on the reference backend and the Triton interpreter, with LoRA, padding and checkpointing; its refusals name what
they refuse; on the GPU the bf16 2x rule. A family added to ``FAMILIES`` without a config here fails
``test_every_family_has_a_tiny_config``."""
from __future__ import annotations

import copy

import pytest
import torch

import codagen
from codagen.models import families, patch, sharding

from .conftest import (
    BACKENDS,
    assert_same_training,
    build,
    enable_checkpointing,
    lm_inputs,
    lora_config,
    padded_inputs,
    two_x_rule,
)
from .test_hf_generate import assert_generates_as_unpatched
from .test_lora import assert_matches, wrap

transformers = pytest.importorskip("transformers")

#: family -> the config fields that give it its published structure (the rest: tests/models/conftest.py's COMMON)
TINY = {
    "llama": dict(attention_bias=True, tie_word_embeddings=True),  # Llama-3.2: tied; Q/K/V/O biases optional
    "mistral": dict(sliding_window=5),  # a window shorter than the text
    "qwen2": {},  # Q/K/V biases (always)
    "qwen3": {},  # QK-norm per head
    "phi3": dict(sliding_window=6),  # fused qkv_proj / gate_up_proj; Phi-3-mini-4k has a 2047-token window
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                    logits_scaling=8.0, tie_word_embeddings=True),  # Granite 3.x's four multipliers (2B values)
    "smollm3": dict(num_hidden_layers=4, no_rope_layer_interval=2, tie_word_embeddings=True),  # NoPE layers 1, 3
    # x (1 + w) norms, sandwich norms, per-head QK-norm, GELU-tanh, local (sliding, base 1e4) and global (1e6)
    # layers, query_pre_attn_scalar, the scaled embedding module
    "gemma3": dict(head_dim=8, query_pre_attn_scalar=6, sliding_window=5,
                   layer_types=["sliding_attention", "full_attention"]),
    # Gemma 2: x (1 + w) and sandwich norms, GELU-tanh, local and global layers, the attention and final logit
    # soft-caps (caps small enough that the tiny model's scores and logits reach them)
    "gemma2": dict(head_dim=8, query_pre_attn_scalar=6, sliding_window=5,
                   layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0),
    # fused gate_up_proj, Q/K/V biases, RoPE on interleaved pairs of half of each head's channels
    "glm": dict(head_dim=8, attention_bias=True),
    "glm4": dict(head_dim=8, attention_bias=True),  # and sandwich norms
    # no norm before attention or the MLP, norms after both, QK-norm over the whole Q and K projections (GQA: of
    # different widths)
    "olmo2": {},
    # and local (sliding) and global layers, each layer type with its rotary module
    "olmo3": dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
}
#: the LoRA targets of every projection of a family (Phi-3's fused ones by their names)
ALL_PROJECTIONS = {name: [n for _, names in families.lora_slots(families.FAMILIES[name]) for n in names]
                   for name in families.FAMILIES}


def tiny(family: str, **overrides) -> torch.nn.Module:
    return build(family, **{**TINY[family], **overrides})


def test_every_family_has_a_tiny_config():
    assert set(TINY) == set(families.FAMILIES)
    assert codagen.models.hf.SUPPORTED_MODELS == tuple(
        name for family in families.FAMILIES.values() for name in family.model_classes)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", sorted(TINY))
def test_trains_as_unpatched(family, backend):
    assert_same_training(tiny(family), lm_inputs(), backend=backend)


@pytest.mark.parametrize("family", sorted(TINY))
def test_the_declared_features_change_the_model(family):
    """The multipliers and NoPE layers of the tiny configs are live: without them the model computes otherwise
    (so the equality above tests them)."""
    features = {"granite": dict(embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=0.25,
                                logits_scaling=1.0),
                "smollm3": dict(no_rope_layer_interval=100)}
    if family not in features:
        pytest.skip("no multiplier or NoPE layer")
    torch.manual_seed(0)
    model = tiny(family)
    torch.manual_seed(0)
    plain = tiny(family, **features[family])
    inputs = lm_inputs()
    with torch.no_grad():
        assert (model(**inputs).logits - plain(**inputs).logits).abs().max() > 1e-2


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding(family, side):
    assert_same_training(tiny(family), padded_inputs(side))


@pytest.mark.parametrize("family", sorted(TINY))
def test_checkpointing(family):
    model = tiny(family)
    reference = copy.deepcopy(model)
    enable_checkpointing(model, {"use_reentrant": False})
    inputs = lm_inputs()
    want = reference(**inputs)
    want.loss.backward()
    patch(model)
    got = model(**inputs)
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-4, atol=2e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", sorted(TINY))
def test_lora_on_every_projection(family):
    peft = pytest.importorskip("peft")  # noqa: F841
    model = wrap(tiny(family), lora_config(ALL_PROJECTIONS[family]))
    reference = copy.deepcopy(model)
    patch(model)
    assert_matches(model, reference, lm_inputs())


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", sorted(TINY))
def test_generate_matches_unpatched(family, cache):
    assert_generates_as_unpatched(tiny(family).eval(), cache)


@pytest.mark.parametrize("field, value", [("final_logit_softcapping", -1.0), ("attn_logit_softcapping", 0.0),
                                          ("final_logit_softcapping", float("inf"))])
def test_gemma2_soft_caps_that_are_not_positive_numbers_are_refused(field, value):
    with pytest.raises(ValueError, match=f"config.{field} must be a positive number or None, got {value!r}"):
        patch(tiny("gemma2", **{field: value}))


def test_gemma2_attention_dropout_with_a_soft_cap_is_refused():
    with pytest.raises(NotImplementedError, match="attention dropout together with an attention soft-cap"):
        patch(tiny("gemma2", attention_dropout=0.1))
    patch(tiny("gemma2", attention_dropout=0.1, attn_logit_softcapping=None))  # SDPA takes the dropout


def test_phi3_residual_dropout_is_refused_where_it_drops():
    model = tiny("phi3", resid_pdrop=0.1)
    with pytest.raises(NotImplementedError, match=r"dropout p=0.1 in training mode on the residual branch "
                                                  r"\(resid_attn_dropout of layer 0\)"):
        patch(model)
    model.eval()  # dropout is the identity: runs
    reference = copy.deepcopy(model)
    patch(model)
    inputs = lm_inputs()
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).loss, reference(**inputs).loss, rtol=1e-4, atol=1e-6)
    model.train()
    with pytest.raises(NotImplementedError, match="resid_pdrop=0"):
        model(**inputs)


@pytest.mark.parametrize("field", ["residual_multiplier", "logits_scaling"])
def test_granite_multipliers_must_be_finite_and_nonzero(field):
    model = tiny("granite", **{field: 0.0})
    with pytest.raises(ValueError, match=f"{field} must be a finite nonzero number, got 0.0"):
        patch(model)


def test_families_not_supported_yet_are_refused_naming_what_they_need():
    config = transformers.Qwen3MoeConfig(vocab_size=67, hidden_size=32, intermediate_size=40, moe_intermediate_size=8,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         num_experts=4, num_experts_per_tok=2, head_dim=8)
    with pytest.raises(TypeError, match=r"Qwen3MoeForCausalLM needs mixture-of-experts MLPs"):
        patch(transformers.Qwen3MoeForCausalLM(config))


@pytest.mark.parametrize("family", ["olmo2", "olmo3"])
def test_olmo_layers_have_no_pre_norm_and_whole_projection_qk_norms(family):
    """The tiny OLMo configs hold what the fused path is tested on: no norm before attention or the MLP, and
    q_norm / k_norm over every Q and every K head (4 and 2 heads of 8)."""
    layer = tiny(family).model.layers[0]
    assert not hasattr(layer, "input_layernorm") and not hasattr(layer, "pre_feedforward_layernorm")
    assert layer.self_attn.q_norm.weight.shape == (4 * 8,) and layer.self_attn.k_norm.weight.shape == (2 * 8,)


def test_olmo_qk_norms_that_do_not_span_the_projections_are_refused():
    """Without a norm before attention the QKV op needs both QK-norms, each over its whole projection."""
    model = tiny("olmo2")
    attn = model.model.layers[1].self_attn
    attn.q_norm = type(attn.q_norm)(8, eps=1e-5)  # one head's width
    with pytest.raises(NotImplementedError, match=r"QK-norm weights of shapes other than the Q and K projections' "
                                                  r"\(\(32,\), \(16,\)\) \(layer 1\)"):
        patch(model)
    model = tiny("olmo2")
    model.model.layers[0].self_attn.k_norm = None
    with pytest.raises(NotImplementedError, match=r"no norm before attention without a q_norm and a k_norm "
                                                  r"\(layer 0\)"):
        patch(model)


def test_fused_parameters_take_the_llama_layout_only():
    with pytest.raises(NotImplementedError, match="the phi3 family"):
        sharding.fuse_parameters(tiny("phi3"))


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(TINY))
def test_gpu_bf16_two_x_rule(family, monkeypatch):
    """bf16 parameters on the GPU (Triton kernels): every gradient within twice transformers' bf16 error.

    The errors are summed over three batches: some gradients are mostly rounding noise in both runs, so one
    batch's ratio of errors scatters. The K bias's gradient is zero in exact math on every channel RoPE leaves
    as is (GLM's unrotated half): adding a vector to every key shifts a query's scores by one constant, which
    softmax ignores."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    fields = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  vocab_size=1000, num_hidden_layers=4)
    if "sliding_window" in TINY[family]:
        fields["sliding_window"] = 48
    if "layer_types" in TINY[family]:  # one entry per layer
        fields["layer_types"] = TINY[family]["layer_types"] * 2
    model = tiny(family, **fields).cuda()
    batches = [{k: v.cuda() for k, v in lm_inputs(batch=2, seq=128, vocab=1000).items()} for _ in range(3)]
    two_x_rule(model, batches, lambda m, batch: m.bfloat16()(**batch).loss)
