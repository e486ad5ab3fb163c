"""The structure of every model of ``codagen bench models`` (:data:`codagen.bench.models.MODELS`) at tiny widths:
its family, head counts, head_dim, tied head, Q/K/V biases, QK-norm and RoPE scaling as published, with the
width, ffn and depth shrunk and a vocabulary that no tile divides. The patched model trains as the unpatched one
(fp32, reference backend): loss, logits and every gradient."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from codagen.models import families

from .conftest import assert_same_training, lm_inputs

transformers = pytest.importorskip("transformers")
models = pytest.importorskip("codagen.bench.models")

VOCAB = 251  # prime: not a multiple of any tile


def tiny(config: models.ModelConfig) -> torch.nn.Module:
    """``config`` with hidden 4 x heads (transformers wants a multiple of the head count), ffn 96, 2 layers and
    vocabulary 251; heads, head_dim and the rest as published. LongRoPE's factors (one per rotated pair) must match
    the rotary width transformers derives from hidden / heads: there hidden stays heads x head_dim."""
    longrope = (config.rope_scaling or {}).get("rope_type") == "longrope"
    hidden = config.num_attention_heads * (config.head_dim if longrope else 4)
    small = dataclasses.replace(config, hidden_size=hidden, intermediate_size=96, vocab_size=VOCAB,
                                num_hidden_layers=2)
    hf_config = models.hf_config(small)
    if small.rope_scaling is not None:  # the llama3 rule's wavelength band, brought into the tiny model's positions
        hf_config.rope_parameters["original_max_position_embeddings"] = 16
    for field in ("pad_token_id", "bos_token_id", "eos_token_id"):  # published ids lie outside the tiny vocabulary
        if isinstance(getattr(hf_config, field, None), int) and getattr(hf_config, field) >= VOCAB:
            setattr(hf_config, field, None)
    model_class = getattr(transformers, models._CLASSES[small.family])
    torch.manual_seed(0)
    model = model_class(hf_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))  # norm weights and biases away from their init
            elif "proj" in name:  # the activations' scale of a 4 x heads wide model, at any width
                p.normal_(0, 0.15 * (4 * config.num_attention_heads / hidden) ** 0.5)
    return model.train()


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_published_structure_trains_as_unpatched(name):
    config = models.MODELS[name]
    model = tiny(config)
    attn = model.model.layers[0].self_attn
    q_rows, kv_rows = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    (q, k, v), (q_bias, _, _) = families.qkv_projections(families.FAMILIES[config.family], attn, q_rows, kv_rows)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == config.tie_word_embeddings
    assert (q_bias is not None) == config.attention_bias
    assert hasattr(attn, "q_norm") == (config.family in ("qwen3", "gemma3"))  # per-head QK-norm
    assert (q.shape[0], k.shape[0], v.shape[0]) == (q_rows, kv_rows, kv_rows)
    torch.manual_seed(1)
    # fp32 rounding grows with the width: a 3072-wide model (LongRoPE's) differs from float64 by ~5e-6 in either run
    atol = 2e-6 * max(1.0, model.config.hidden_size / 128)
    assert_same_training(model, lm_inputs(batch=2, seq=12, vocab=VOCAB), atol=atol)


def test_matrix_covers_the_structures_the_issue_names():
    configs = models.MODELS.values()
    assert {(c.num_attention_heads, c.num_key_value_heads) for c in configs} >= {(14, 2), (12, 2), (28, 4)}
    assert {c.head_dim for c in configs} >= {64, 128}
    assert any(c.tie_word_embeddings for c in configs) and any(not c.tie_word_embeddings for c in configs)
    assert any(c.attention_bias for c in configs) and any(c.family == "qwen3" for c in configs)


def test_harness_smoke(tmp_path):
    """``codagen bench models --smoke`` runs its tiny configs on CPU and writes its records and table."""
    import json
    assert models.main(["--smoke", "--providers", "codagen", "--steps", "full", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-models-full.json")
    records = json.loads(path.read_text())["records"]
    assert {r["name"] for r in records} == set(models.SMOKE_MODELS)
    assert all(r["median_ms"] > 0 and len(r["losses"]) == 3 for r in records), records


def test_kernel_union_counts_overlaps_once():
    """The busy time of a profiled step: overlapping kernels (a copy beside a GEMM) count once, gaps not at all."""
    kernels = [(0.0, 1000.0, "gemm"), (500.0, 1500.0, "copy"), (1200.0, 1300.0, "inside"), (3000.0, 3500.0, "late")]
    assert models.kernel_union_ms(kernels) == 2.0
