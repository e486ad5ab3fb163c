"""codagen.patch on tiny Hugging Face models built from configs (no downloads): loss, logits and every
parameter gradient match the unpatched model; unsupported features are refused."""
from __future__ import annotations

import pytest
import torch

import codagen
from codagen.models import is_patched, patch, unpatch

from .conftest import BACKENDS, assert_same_training, build, lm_inputs, two_x_rule

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("backend", BACKENDS)
def test_llama(backend):
    assert_same_training(build("llama"), lm_inputs(), backend=backend)


def test_llama_biases_tied_llama3_rope():
    """attention_bias (q/k/v/o), tied embeddings and llama3 RoPE scaling, handled exactly."""
    model = build("llama", attention_bias=True, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_same_training(model, lm_inputs())


def test_llama_embedding_padding_idx(monkeypatch):
    """The embedding runs as codagen.ops.embedding; its padding row gets no gradient, as nn.Embedding's."""
    calls = []
    embedding = codagen.ops.embedding
    monkeypatch.setattr(codagen.ops, "embedding", lambda *args: calls.append(args[2]) or embedding(*args))
    model = build("llama", pad_token_id=3)
    inputs = lm_inputs()
    inputs["input_ids"][:, :3] = 3
    assert_same_training(model, inputs)
    assert calls and set(calls) == {3}  # the padding index reached the op
    assert model.model.embed_tokens.weight.grad[3].abs().max() == 0


def test_qwen2_qkv_bias():
    model = build("qwen2")
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert_same_training(model, lm_inputs())


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen3_qk_norm(backend):
    """QK-norm (per-head RMSNorm of q and k before RoPE) runs in the QKV GEMM's epilogue; q_norm and k_norm
    get their gradients through the pair-order permutation."""
    model = build("qwen3")
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (16,) and attn.q_proj.bias is None
    assert_same_training(model, lm_inputs(), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [96, 256])
def test_qwen3_qk_norm_heads_no_epilogue_sub_tile_holds(backend, head_dim):
    """QK-norm of heads that no epilogue sub-tile of the QKV GEMM holds whole (Gemma 3's head_dim 256; 96): the
    GEMM stores the projection and the row kernel ``qk_norm_rope`` normalizes and rotates its heads; it trains as
    transformers does."""
    model = build("qwen3", head_dim=head_dim, num_key_value_heads=1)
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (head_dim,)
    assert_same_training(model, lm_inputs(), backend=backend)


def test_qwen3_sliding_window_and_gqa():
    model = build("qwen3", num_key_value_heads=1, use_sliding_window=True, sliding_window=5,
                  layer_types=["sliding_attention", "full_attention"])
    assert model.model.layers[0].self_attn.sliding_window == 5
    assert_same_training(model, lm_inputs(seq=14))


def test_mistral_sliding_window():
    """A window shorter than the sequence needs an explicit mask; checked against transformers' own."""
    model = build("mistral", sliding_window=5, num_key_value_heads=1)
    assert_same_training(model, lm_inputs(seq=14))


def test_position_ids_embeds_and_num_items():
    model = build("llama")
    inputs = lm_inputs(batch=1, seq=10, ignore=False)
    embeds = model.model.embed_tokens(inputs.pop("input_ids")).detach()
    inputs.update(inputs_embeds=embeds, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6]]),
                  num_items_in_batch=torch.tensor(7), attention_mask=torch.ones(1, 10, dtype=torch.long))
    assert_same_training(model, inputs)


def test_parameters_kept_and_unpatch():
    model = build("llama")
    params = list(model.parameters())
    inputs = lm_inputs()
    before = model(**inputs).loss
    assert patch(model) is model and is_patched(model)
    assert patch(model) is model  # idempotent
    assert all(p is q for p, q in zip(model.parameters(), params))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(**inputs).loss.backward()
    assert all(p.grad is not None for p in params)
    expected = [p.detach().add(p.grad, alpha=-0.1) for p in params]
    opt.step()  # the optimizer updates the model's own parameters
    for p, want in zip(params, expected):
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=0)
    assert unpatch(model) is model and not is_patched(model)
    assert "forward" not in model.__dict__
    after = model(**inputs).loss  # transformers' forward again, on the updated weights
    assert after != before
    with pytest.raises(ValueError, match="not patched"):
        unpatch(model)


def test_refused_at_patch():
    with pytest.raises(NotImplementedError, match="MLP biases"):
        patch(build("llama", mlp_bias=True))
    with pytest.raises(NotImplementedError, match="hidden_act"):
        patch(build("llama", hidden_act="gelu"))
    unknown_rope = build("llama")
    unknown_rope.model.rotary_emb.rope_type = "proportional"  # a type whose frequencies codagen does not read
    with pytest.raises(NotImplementedError, match="rope_type='proportional'"):
        patch(unknown_rope)
    with pytest.raises(TypeError, match="model must be one of"):
        patch(torch.nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match="Q/K/V biases together with QK-norm"):
        patch(build("qwen3", attention_bias=True))
    odd_eps = build("qwen3")
    odd_eps.model.layers[1].self_attn.k_norm.variance_epsilon = 1e-3
    with pytest.raises(NotImplementedError, match=r"a QK-norm eps different from the RMSNorm eps \(layer 1\)"):
        patch(odd_eps)


def test_refused_at_forward():
    model = patch(build("llama"))
    inputs = lm_inputs()
    with pytest.raises(NotImplementedError, match="4-D attention_mask"):
        model(**inputs, attention_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, seq\] = \(2, 12\)"):
        model(**inputs, attention_mask=torch.ones(2, 11, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="output_hidden_states"):
        model(inputs["input_ids"], output_hidden_states=True)
    with pytest.raises(NotImplementedError, match=r"flash-attention varlen arguments \['cu_seq_lens_q'\]"):
        model(inputs["input_ids"], cu_seq_lens_q=torch.tensor([0, 12]))


def test_logits_to_keep_and_tuple_output():
    model = build("qwen2")
    ids = lm_inputs()["input_ids"]
    want = model(ids, logits_to_keep=3).logits
    patch(model)
    got = model(ids, logits_to_keep=3, return_dict=False)
    assert isinstance(got, tuple)
    torch.testing.assert_close(got[0], want, rtol=2e-4, atol=2e-6)


def test_autocast_bf16_cpu():
    """fp32 parameters under ``torch.autocast(bfloat16)`` (the usual mixed-precision set-up). Under
    autocast transformers keeps the residual stream in fp32; the fused ops keep it in bf16, so the
    yardstick is transformers with bf16 parameters.

    Errors are summed over three batches: the K bias's gradient is nearly zero in exact arithmetic
    (softmax ignores a score shift shared by every key; only RoPE's rotation of the bias breaks that),
    so on one batch both bf16 errors are noise around a tiny norm and their ratio passed 2 in about 1%
    of draws (codagen's median ratio to transformers' was 0.86 over 1000 draws; 0 failures in 1000 with
    three batches)."""
    model = build("qwen2", hidden_size=64, intermediate_size=96)

    def autocast_loss(m, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(**batch).loss
    two_x_rule(model, [lm_inputs(batch=2, seq=16) for _ in range(3)], autocast_loss)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_bf16_gpu_two_x_rule(family):
    """bf16 parameters on the GPU (Triton kernels)."""
    fields = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=1000, num_hidden_layers=2)
    if family == "qwen3":
        fields["head_dim"] = 64
    model = build(family, **fields).cuda()
    inputs = {k: v.cuda() for k, v in lm_inputs(batch=2, seq=128, vocab=1000).items()}
    two_x_rule(model, inputs, lambda m, batch: m.bfloat16()(**batch).loss)
