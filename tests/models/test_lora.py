"""PEFT LoRA on patched Hugging Face models: the loss and every LoRA gradient match the unpatched PEFT model
(fp32, 1e-4 relative), in both orders (patch then wrap, wrap then patch), for any subset of the seven
projections, with rsLoRA, QK-norm (Qwen3), adapter switching, disabling and merging; unsupported PEFT
features are refused, never ignored."""
from __future__ import annotations

import copy

import pytest
import torch

import codagen
from codagen.models import is_patched, patch, unpatch

from .conftest import SUBSETS, build, lm_inputs, lora_config

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")


def wrap(model, config=None, adapter_name="default", boost=4.0):
    """``get_peft_model`` with ``lora_B`` scaled by ``boost``: updates large enough that dropping one would
    move the loss well past the tolerance."""
    model = peft.get_peft_model(model, config or lora_config(), adapter_name=adapter_name)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(boost)
    return model


def loss_and_grads(model, inputs, backend="reference"):
    model.zero_grad(set_to_none=True)
    with codagen.use_backend(backend):
        loss = model(**inputs).loss
        loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def relative_error(t: torch.Tensor, exact: torch.Tensor) -> float:
    return ((t.double() - exact.double()).norm() / exact.double().norm()).item()


def ulp_perturbed(model, seed: int):
    """A copy of ``model`` with every parameter moved by at most one fp32 rounding step (a random factor
    ``1 + {-1, 0, 1} * 2^-23`` per element): inputs as uncertain as fp32 storage makes them."""
    model, generator = copy.deepcopy(model), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + torch.randint(-1, 2, p.shape, generator=generator).to(p.dtype) * 2.0 ** -23)
    return model


def assert_matches(patched, reference, inputs, backend="reference", rtol=1e-4, atol=1e-6):
    """The patched model's loss and LoRA gradients equal the unpatched PEFT model's (each gradient within
    ``rtol`` in norm); frozen weights get none.

    Where fp32 rounding alone moves a gradient by more than ``rtol`` (an ill-conditioned step), the project's
    2x rule decides: the patched gradient's error against the model's float64 copy is at most twice the
    unpatched model's fp32 error, where that error is the larger of its error against float64 and how far its
    own gradient moves when the parameters move by one fp32 rounding step (two draws): a step that amplifies
    rounding that much gives any fp32 computation of it that much error, whichever order it sums in."""
    want_loss, want = loss_and_grads(reference, inputs)
    got_loss, got = loss_and_grads(patched, inputs, backend)
    torch.testing.assert_close(got_loss, want_loss, rtol=rtol, atol=atol)
    assert set(got) == set(want) and any("lora_A" in n for n in got)
    exact = perturbed = None
    for name, g in got.items():
        assert g is not None, f"{name} got no gradient"
        error = relative_error(g, want[name])
        if error > rtol:
            if exact is None:
                exact = loss_and_grads(copy.deepcopy(reference).double(), inputs)[1]
                perturbed = [loss_and_grads(ulp_perturbed(reference, seed), inputs)[1] for seed in (0, 1)]
            ours, theirs = relative_error(g, exact[name]), relative_error(want[name], exact[name])
            spread = max(relative_error(p[name], want[name]) for p in perturbed)
            assert ours <= 2 * max(theirs, spread) + 1e-6, (
                f"{name}: relative error {error:.2e} to the unpatched model; against float64 {ours:.2e}, the "
                f"unpatched model's {theirs:.2e}, its spread under one-ulp parameter changes {spread:.2e}")
    for name, p in patched.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"frozen {name} got a gradient"
    return got_loss


@pytest.mark.parametrize("family, subset", [("llama", "all"), ("qwen3", "all"), ("llama", "q_v"),
                                            ("qwen3", "gate_down")])
def test_wrap_then_patch(family, subset):
    """``codagen.patch(peft_model)`` patches the ForCausalLM inside and returns the PeftModel."""
    model = wrap(build(family), lora_config(SUBSETS[subset]))
    reference = copy.deepcopy(model)
    assert patch(model) is model and is_patched(model) and is_patched(model.get_base_model())
    inputs = lm_inputs()
    assert_matches(model, reference, inputs)
    ids = {"input_ids": inputs["input_ids"]}
    with torch.no_grad(), codagen.use_backend("reference"):
        logits = model(**ids).logits
        with reference.disable_adapter():  # the adapters move the logits far past the tolerance: not dropped
            assert (logits - reference(**ids).logits).abs().max() > 1e-2
    assert unpatch(model) is model and not is_patched(model)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_patch_then_wrap(family):
    """PEFT wraps the projections of an already patched model: the patched forward reads them at each call."""
    base = build(family)
    reference = wrap(copy.deepcopy(base), lora_config(["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]))
    model = wrap(patch(base), lora_config(["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]))
    model.load_state_dict(reference.state_dict())
    assert is_patched(model.get_base_model())
    assert_matches(model, reference, lm_inputs())


def test_patch_the_inner_model():
    model = wrap(build("llama"))
    reference = copy.deepcopy(model)
    patch(model.get_base_model())
    assert_matches(model, reference, lm_inputs())


def test_rslora_and_per_module_rank_and_alpha():
    config = lora_config(use_rslora=True, rank_pattern={"q_proj": 2, "down_proj": 6}, alpha_pattern={"v_proj": 3})
    model = wrap(build("llama"), config, boost=1.0)  # rsLoRA's scaling (8 / sqrt(2) on q_proj) is large already
    layer = model.get_base_model().model.layers[0]
    assert layer.self_attn.q_proj.scaling["default"] == pytest.approx(8 / 2 ** 0.5)
    reference = copy.deepcopy(model)
    patch(model)
    assert_matches(model, reference, lm_inputs())


def test_triton_interpreter():
    """One small case on the Triton interpreter: every fused GEMM with its low-rank pair as a generated kernel."""
    model = wrap(build("llama", num_hidden_layers=1))
    reference = copy.deepcopy(model)
    patch(model)
    assert_matches(model, reference, lm_inputs(batch=1, seq=8), backend="triton")


def test_adapter_changes_after_patching_are_honoured():
    """set_adapter, disable_adapter(), merge/unmerge: each forward reads the live PEFT state."""
    model = wrap(build("llama"))
    model.add_adapter("other", lora_config(["v_proj", "gate_proj"], r=2))
    reference = copy.deepcopy(model)
    patch(model)
    inputs = lm_inputs()
    first = assert_matches(model, reference, inputs)
    ids = {"input_ids": inputs["input_ids"]}
    with torch.no_grad(), codagen.use_backend("reference"):
        first_logits = model(**ids).logits
    for m in (model, reference):
        m.set_adapter("other")
    assert_matches(model, reference, inputs)
    with torch.no_grad(), codagen.use_backend("reference"):  # the switch moves the logits far past the tolerance
        assert (model(**ids).logits - first_logits).abs().max() > 1e-2
    with model.disable_adapter(), reference.disable_adapter():
        with codagen.use_backend("reference"):
            torch.testing.assert_close(model(**inputs).loss, reference(**inputs).loss, rtol=1e-4, atol=1e-6)
    for m in (model, reference):
        m.set_adapter("default")
        m.get_base_model().model.layers[0].self_attn.q_proj.merge()
    with torch.no_grad(), codagen.use_backend("reference"):
        torch.testing.assert_close(model(**inputs).loss, first, rtol=1e-4, atol=1e-6)  # merged: counted once
        with model.disable_adapter():  # a disabled merged layer is unmerged first, as PEFT does
            with reference.disable_adapter():
                torch.testing.assert_close(model(**inputs).loss, reference(**inputs).loss, rtol=1e-4, atol=1e-6)


def test_merge_and_unload():
    """merge_and_unload on a patched PeftModel gives the patched ForCausalLM without adapters, numerically
    equal (its weights now hold B A)."""
    model = wrap(build("qwen3"))
    patch(model)
    inputs = lm_inputs()
    with torch.no_grad(), codagen.use_backend("reference"):
        with_adapters = model(**inputs).loss
        merged = model.merge_and_unload()
        assert is_patched(merged) and not any("lora" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(**inputs).loss, with_adapters, rtol=1e-4, atol=1e-6)


def test_lora_dropout_runs_in_eval_and_is_refused_in_training():
    """A model in eval mode at patch runs (dropout is the identity); one put in training mode later is refused
    at its next forward, with a message that says what to change."""
    model = wrap(build("llama"), lora_config(lora_dropout=0.1))
    reference = copy.deepcopy(model).eval()
    patch(model.eval())
    inputs = lm_inputs()
    with torch.no_grad(), codagen.use_backend("reference"):
        torch.testing.assert_close(model(**inputs).loss, reference(**inputs).loss, rtol=1e-4, atol=1e-6)
        model.train()
        with pytest.raises(NotImplementedError, match=r"lora_dropout=0.1 in training mode \(adapter 'default', "
                                                      r"[\w.]+q_proj\) is not supported by the fused kernels; "
                                                      r"train with lora_dropout=0 or call codagen.unpatch\(model\)"):
            model(**inputs)


def test_lora_dropout_in_training_mode_is_refused_at_patch():
    model = wrap(build("llama"), lora_config(lora_dropout=0.1)).train()
    with pytest.raises(NotImplementedError, match=r"lora_dropout=0.1 in training mode .* train with lora_dropout=0 "
                                                  r"or run the model without codagen.patch") as refused:
        patch(model)
    assert "codagen.unpatch" not in str(refused.value)


@pytest.mark.parametrize("feature, config, match", [
    ("dora", dict(use_dora=True), "DoRA"),
    ("lora_bias", dict(lora_bias=True), "lora_bias"),
    ("bias", dict(bias="lora_only"), "bias='lora_only'"),
    ("modules_to_save", dict(modules_to_save=["lm_head"]), "modules_to_save"),
    ("lm_head", dict(target_modules=["q_proj", "lm_head"]), r"outside the projections \(lm_head\)"),
    ("embed_tokens", dict(target_modules=["embed_tokens"]), r"outside the projections"),
])
def test_unsupported_features_are_refused_at_patch_time(feature, config, match):
    model = wrap(build("llama"), lora_config(**config))
    with pytest.raises(NotImplementedError, match=match):
        patch(model)


def test_unsupported_features_added_after_patching_are_refused_at_forward():
    """Patch first, then wrap with DoRA / LoRA on the LM head: the forward refuses them."""
    for config, match in ((lora_config(use_dora=True), "DoRA"), (lora_config(["lm_head"]), "lm_head")):
        model = wrap(patch(build("llama")), config)
        with pytest.raises(NotImplementedError, match=match), codagen.use_backend("reference"):
            model(**lm_inputs())


def test_several_active_adapters_are_refused():
    model = wrap(build("llama"))
    model.add_adapter("other", lora_config())
    patch(model)
    model.base_model.set_adapter(["default", "other"])
    with pytest.raises(NotImplementedError, match=r"several active adapters"), codagen.use_backend("reference"):
        model(**lm_inputs())


def test_mixed_batch_adapter_names_are_refused():
    model = wrap(build("llama")).eval()  # PEFT takes adapter_names in eval mode only
    patch(model)
    inputs = lm_inputs()
    with pytest.raises(NotImplementedError, match="forward hooks on a LoRA layer"), codagen.use_backend("reference"):
        model(**inputs, adapter_names=["default", "__base__"])


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_gpu_two_x_rule(family, monkeypatch):
    """bf16 on the GPU (Triton kernels, untuned defaults): the loss within bf16 rounding of the float64 PEFT
    model's, and each LoRA gradient's relative error vs float64 at most twice that of eager PEFT in bf16."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    fields = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=1000, num_hidden_layers=2)
    if family == "qwen3":
        fields["head_dim"] = 64
    model = wrap(build(family, **fields), lora_config(r=16, lora_alpha=32)).cuda()
    inputs = {k: v.cuda() for k, v in lm_inputs(batch=2, seq=128, vocab=1000).items()}

    def rel_err(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()
    results = {}
    for name, m in (("float64", copy.deepcopy(model).double()), ("peft_bf16", copy.deepcopy(model).bfloat16()),
                    ("codagen_bf16", patch(copy.deepcopy(model).bfloat16()))):
        loss, grads = loss_and_grads(m, inputs, backend="triton")
        results[name] = {"loss": loss, **grads}
    exact = results.pop("float64")
    assert rel_err(results["codagen_bf16"].pop("loss"), exact.pop("loss")) <= 2 ** -8
    assert exact and all("lora_" in key for key in exact)
    for key in exact:
        ours, theirs = rel_err(results["codagen_bf16"][key], exact[key]), rel_err(results["peft_bf16"][key], exact[key])
        assert ours <= 2 * theirs + 1e-6, f"{key}: codagen {ours:.2e} vs PEFT bf16 {theirs:.2e}"


def test_lora_bench_smoke(tmp_path, capsys):
    """``codagen bench lora --smoke``: the harness on CPU; codagen's losses follow eager's step by step."""
    import json

    from codagen.bench import lora as bench
    assert bench.main(["--smoke", "--providers", "eager", "codagen", "liger", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-lora-step-smoke-eager-codagen-liger.json")
    records = {r["provider"]: r for r in json.loads(path.read_text())["records"]}
    assert set(records) == {"eager", "codagen", "liger"}
    for name in ("eager", "codagen"):
        r = records[name]
        assert r["median_ms"] > 0 and r["tokens_per_s"] > 0 and len(r["step_ms"]) == 3, r.get("traceback")
        assert r["trainable_params"] == records["eager"]["trainable_params"] > 0
    assert max(records["codagen"]["loss_rel_diff_vs_eager"]) < 1e-5
    assert records["codagen"]["losses"][0] != records["codagen"]["losses"][-1]  # the optimizer steps
    assert (records["liger"]["median_ms"] is None) == ("error" in records["liger"])  # Liger may be absent
    assert "| smoke |" in capsys.readouterr().out
