"""codagen.models.Llama against the eager ReferenceLlama: loss, logits, every gradient; layouts; errors."""
from __future__ import annotations

import copy

import pytest
import torch

import codagen
from codagen import ops
from codagen.models import Llama, LlamaConfig, ReferenceLlama

from .conftest import BACKENDS


def tiny_config(**overrides) -> LlamaConfig:
    fields = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  rms_norm_eps=1e-5, rope_theta=500.0)
    fields.update(overrides)
    return LlamaConfig(**fields)


def perturbed(model: torch.nn.Module, scale: float = 0.3) -> torch.nn.Module:
    """Norm weights away from 1 so the RMSNorm-weight gradients and scalings are exercised."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(scale * torch.randn_like(p))
    return model


def pair(config: LlamaConfig, dtype=torch.float32) -> tuple[Llama, ReferenceLlama]:
    fused = perturbed(Llama(config, dtype=dtype))
    reference = ReferenceLlama(config).to(dtype)
    reference.load_state_dict(fused.to_hf_state_dict())
    return fused, reference


def hf_grads(model: Llama) -> dict[str, torch.Tensor]:
    """``model``'s gradients in HF names and layouts (layout changes are row permutations, so the
    gradient converts like the weight)."""
    grads = copy.deepcopy(model)
    for g, p in zip(grads.parameters(), model.parameters()):
        assert p.grad is not None, "a parameter got no gradient"
        g.data = p.grad
    return grads.to_hf_state_dict()


def assert_close_dicts(actual: dict, expected: dict, **tol):
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], **tol, msg=lambda m: f"{key}: {m}")


def batch(config, b=2, s=12):
    ids = torch.randint(0, config.vocab_size, (b, s))
    targets = torch.randint(0, config.vocab_size, (b, s))
    targets[0, :3] = -100  # ignored positions
    return ids, targets


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["gqa", "mha_tied", "qk_norm"])
def test_llama_matches_reference(backend, variant):
    config = {"gqa": tiny_config(), "mha_tied": tiny_config(num_kv_heads=4, tie_word_embeddings=True),
              "qk_norm": tiny_config(qk_norm=True, head_dim=16)}[variant]  # whole heads in the interpreter's tiles
    fused, reference = pair(config)
    ids, targets = batch(config)
    with codagen.use_backend(backend):
        loss = fused(ids, targets)
        loss.backward()
        logits = fused(ids)
    ref_loss = reference(ids, targets)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, reference(ids), rtol=1e-4, atol=1e-5)
    ref_grads = {name: p.grad for name, p in reference.state_dict(keep_vars=True).items()}
    assert_close_dicts(hf_grads(fused), ref_grads, rtol=1e-4, atol=1e-6)


def test_llama_positions_and_float64():
    """Explicit positions (packed sequences restart at 0) in float64."""
    config = tiny_config(num_layers=1)
    fused, reference = pair(config, torch.float64)
    fused.reset_parameters(std=0.5)  # large enough q.k that positions visibly matter
    reference.load_state_dict(fused.to_hf_state_dict())
    ids, targets = batch(config, b=1, s=10)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    loss = fused(ids, targets, positions=positions)
    ref = reference(ids, targets, positions=positions)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    # and positions matter: the default ones give a different loss
    assert not torch.allclose(fused(ids, targets), loss)


def test_state_dict_round_trip():
    config = tiny_config()
    model = perturbed(Llama(config))
    hf = model.to_hf_state_dict()
    assert hf["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 8, 32)
    assert hf["model.layers.0.mlp.gate_proj.weight"].shape == (48, 32)
    back = Llama.from_hf_state_dict(config, hf)
    for (name, p), q in zip(model.named_parameters(), back.parameters()):
        assert torch.equal(p, q), name
    torch.testing.assert_close(back.frequencies, model.frequencies)
    # the fused layout really is a permutation: gate rows sit at even rows of gate_up
    assert torch.equal(model.layers[0].gate_up[0::2], hf["model.layers.0.mlp.gate_proj.weight"])
    assert not torch.equal(model.layers[0].qkv[:32], hf["model.layers.0.self_attn.q_proj.weight"])


def test_state_dict_round_trip_qk_norm():
    """QK-norm weights: Qwen3's names, HF channel order outside, pair order inside (like the Q/K rows)."""
    config = tiny_config(qk_norm=True)
    model = perturbed(Llama(config))
    hf = model.to_hf_state_dict()
    q_norm = hf["model.layers.1.self_attn.q_norm.weight"]
    assert q_norm.shape == (8,) and "model.layers.0.self_attn.k_norm.weight" in hf
    assert torch.equal(model.layers[1].q_norm, ops.rope_pairs_from_half_split(q_norm, 8))
    back = Llama.from_hf_state_dict(config, hf)
    for (name, p), q in zip(model.named_parameters(), back.parameters()):
        assert torch.equal(p, q), name
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    with pytest.raises(KeyError, match="q_norm"):
        Llama.from_hf_state_dict(tiny_config(), hf)


def test_from_hf_state_dict_errors():
    config = tiny_config()
    hf = Llama(config).to_hf_state_dict()
    missing = {k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(KeyError, match="up_proj"):
        Llama.from_hf_state_dict(config, missing)
    with pytest.raises(KeyError, match="q_proj.bias"):
        Llama.from_hf_state_dict(config, {**hf, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32)})
    tied = tiny_config(tie_word_embeddings=True)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        Llama.from_hf_state_dict(tied, hf)


@pytest.mark.parametrize("field, value, match", [
    ("num_kv_heads", 3, "multiple of num_kv_heads"), ("head_dim", 7, "even"), ("vocab_size", 0, "vocab_size"),
    ("rms_norm_eps", 0.0, "rms_norm_eps"), ("hidden_size", 30, "head_dim explicitly")])
def test_config_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**{field: value})


def test_llama_bad_input():
    model = Llama(tiny_config(num_layers=1))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(5, dtype=torch.long))


def test_default_config_matches_transformers_defaults():
    """A default-configured Llama (sizes only) is a default-configured transformers ``LlamaForCausalLM`` of the
    same sizes: every default (``rms_norm_eps``, ``rope_theta``, ``tie_word_embeddings``, the KV heads and the
    head size) is transformers', so the state dict moves across with equal logits."""
    transformers = pytest.importorskip("transformers")
    sizes = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4)
    fused = Llama(LlamaConfig(**sizes))
    hf_config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    hf.load_state_dict(fused.to_hf_state_dict())
    ids = torch.randint(0, 61, (2, 24))
    with codagen.use_backend("reference"), torch.no_grad():
        torch.testing.assert_close(fused(ids), hf(ids).logits, rtol=1e-4, atol=1e-6)
