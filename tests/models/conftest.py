"""What the model tests share: tiny Hugging Face models built from configs (no downloads), their inputs,
the check that a patched model trains like the unpatched one, the bf16 2x rule, the backends to run on."""
from __future__ import annotations

import copy

import pytest
import torch

import codagen
from codagen.models import patch

try:  # the tests that need them skip themselves without (pytest.importorskip)
    import transformers
except ImportError:
    transformers = None
try:
    import peft
except ImportError:
    peft = None


def triton_backend_missing() -> str | None:
    """Why the Triton backend cannot run here, or None."""
    try:
        from codagen.backends.triton import TritonBackend  # noqa: F401
    except ImportError as error:
        return f"codagen.backends.triton does not import yet: {error}"
    return None


BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    triton_backend_missing() is not None, reason=str(triton_backend_missing())))]


COMMON = dict(vocab_size=67, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, attn_implementation="sdpa")


def build(family: str, **overrides) -> torch.nn.Module:
    """A randomly initialized tiny ``<family>ForCausalLM`` in fp32, norm weights perturbed away from 1."""
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}[family]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM, "mistral": transformers.MistralForCausalLM}[family]
    if family == "qwen3":  # Qwen3Config's head_dim defaults to 128; 16 keeps heads whole in the interpreter's tiles
        overrides = {"head_dim": 16, **overrides}
    model = model_cls(config_cls(**{**COMMON, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))  # norm weights and biases
            elif "proj" in name:
                p.normal_(0, 0.15)  # larger than HF's 0.02 init so attention and RoPE visibly matter
    return model.train()


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


def assert_same_training(model, inputs: dict, *, rtol=2e-4, atol=2e-6, backend="reference"):
    """Loss, logits and every gradient of the patched model equal those of an unpatched copy."""
    expected = copy.deepcopy(model)
    out = expected(**inputs)
    out.loss.backward()
    patch(model)
    with codagen.use_backend(backend):
        got = model(**inputs)
        assert got.logits is None  # the fused cross-entropy never materializes logits
        got.loss.backward()
        logits = model(**{k: v for k, v in inputs.items() if k not in ("labels", "num_items_in_batch")}).logits
    torch.testing.assert_close(got.loss, out.loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(logits, out.logits, rtol=rtol, atol=atol)
    want = grads(expected)
    for name, g in grads(model).items():
        if want[name] is None:  # e.g. the embedding, when inputs_embeds are given
            assert g is None, f"{name} got a gradient transformers does not give it"
            continue
        assert g is not None, f"{name} got no gradient"
        torch.testing.assert_close(g, want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def lm_inputs(batch=2, seq=12, vocab=67, ignore=True):
    ids = torch.randint(0, vocab, (batch, seq))
    labels = ids.clone()
    if ignore:
        labels[0, :4] = -100  # prompt tokens without loss
    return {"input_ids": ids, "labels": labels}


def two_x_rule(model, inputs, codagen_bf16):
    """Each gradient's relative error vs a float64 run is at most twice that of transformers with bf16
    parameters (+1e-6), and the loss is within bf16 rounding (2^-8 relative) of the float64 loss.
    ``codagen_bf16(patched_model, batch)`` returns its loss computed in bf16. (A scalar's bf16 error can be
    luckily tiny, so the loss has an absolute bound rather than the 2x rule.) ``inputs``: one batch, or a
    list of batches whose errors are summed per gradient before the comparison."""
    batches = inputs if isinstance(inputs, list) else [inputs]
    ours_total, theirs_total = {}, {}

    def rel_err(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()
    for batch in batches:
        results = {}
        runs = {"float64": (copy.deepcopy(model).double(), lambda m: m(**batch).loss),
                "transformers_bf16": (copy.deepcopy(model).bfloat16(), lambda m: m(**batch).loss),
                "codagen_bf16": (patch(copy.deepcopy(model)), lambda m: codagen_bf16(m, batch))}
        for name, (m, loss_of) in runs.items():
            loss = loss_of(m)
            loss.backward()
            results[name] = {"loss": loss.detach(), **{n: p.grad for n, p in m.named_parameters()}}
        exact = results.pop("float64")
        assert rel_err(results["codagen_bf16"].pop("loss"), exact.pop("loss")) <= 2 ** -8
        for key in exact:
            ours_total[key] = ours_total.get(key, 0.0) + rel_err(results["codagen_bf16"][key], exact[key])
            theirs_total[key] = theirs_total.get(key, 0.0) + rel_err(results["transformers_bf16"][key], exact[key])
    for key, ours in ours_total.items():
        theirs = theirs_total[key]
        assert ours <= 2 * theirs + 1e-6, f"{key}: codagen {ours:.2e} vs transformers bf16 {theirs:.2e}"


def padded_inputs(side: str, batch=3, seq=14, vocab=67):
    """Rows of ragged lengths (the longest unpadded) padded on ``side``; labels -100 on the pads."""
    inputs = lm_inputs(batch=batch, seq=seq, vocab=vocab, ignore=False)
    lengths = [seq, 2 * seq // 3, seq // 3][:batch]
    mask = torch.zeros(batch, seq, dtype=torch.long)
    for row, length in enumerate(lengths):
        real = slice(0, length) if side == "right" else slice(seq - length, seq)
        mask[row, real] = 1
    inputs["input_ids"] = inputs["input_ids"].masked_fill(mask == 0, 0)
    inputs["labels"] = inputs["input_ids"].masked_fill(mask == 0, -100)
    inputs["attention_mask"] = mask
    return inputs


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SUBSETS = {"all": ALL, "q_v": ["q_proj", "v_proj"], "gate_down": ["gate_proj", "down_proj"]}


def lora_config(targets=ALL, **overrides) -> peft.LoraConfig:
    # init_lora_weights=False: B is random, not zero, so an adapter that is dropped changes the loss
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": targets, "init_lora_weights": False,
                              **overrides})
