"""A patched model is freed with its last reference: what codagen keeps per model (the module walk, the checked
structure, fused inference weights, RoPE frequencies, traced signatures, decode graphs and loops) lives on the model
(:mod:`codagen.models.per_model`), not in a global that would keep it alive. On the GPU its memory comes back."""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import codagen
from codagen.models import per_model

from .conftest import build, enable_checkpointing, lm_inputs, lora_config

transformers = pytest.importorskip("transformers")


def _train(model):
    model(**lm_inputs(batch=2, seq=16)).loss.backward()


def _checkpointed(model):
    enable_checkpointing(model, {"use_reentrant": False})
    _train(model)


def _evaluate(model):
    with torch.no_grad():
        model(input_ids=lm_inputs(batch=2, seq=16)["input_ids"])


def _generate(cache):
    def run(model):
        model.eval()
        ids = torch.randint(3, 67, (2, 5), device=model.device)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                           cache_implementation=cache, pad_token_id=0)
    return run


def _freed_after(use, make) -> bool:
    """Whether the patched ``make()`` is freed once ``use(model)`` returns and the last reference goes."""
    model = codagen.patch(make())
    use(model)
    ref = weakref.ref(model)
    del model
    gc.collect()  # a patched model is a reference cycle (its forward holds it)
    return ref() is None


USES = {"patch": lambda m: None, "train": _train, "checkpointing": _checkpointed, "evaluate": _evaluate,
        "generate": _generate(None), "generate_static": _generate("static")}


@pytest.mark.parametrize("use", sorted(USES))
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_a_patched_model_is_freed(family, use):
    torch.manual_seed(0)
    freed = _freed_after(USES[use], lambda: build(family, **({"head_dim": 8} if family == "gemma3" else {})))
    assert freed  # (not inside the assert: pytest keeps an assert's operands for its message)


def test_a_patched_lora_model_is_freed():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    freed = _freed_after(_train, lambda: peft.get_peft_model(build("llama"), lora_config()))
    assert freed


def test_a_copy_starts_with_nothing_kept():
    slot = per_model.PerModel("test_slot")
    model = build("llama")
    slot.set(model, [model])  # a value that names its model, as a walk of named_modules() does
    assert model in slot and slot.get(copy.deepcopy(model)) is None
    slot.pop(model)
    assert model not in slot and slot.get(model) is None


@pytest.mark.gpu
@pytest.mark.parametrize("use", ["train", "generate", "generate_static"])
def test_gpu_a_patched_model_gives_its_memory_back(use, monkeypatch):
    """Triton kernels, decode graphs and the generate loop: once the model goes, the allocator holds what it held before
    the model was built, up to what the process keeps for any model (workspaces, made by a first model, which runs
    first). The model's bf16 parameters alone are 73 MiB."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    inputs = {k: v.cuda() for k, v in lm_inputs(batch=2, seq=64, vocab=32768).items()}
    run = (lambda m: m(**inputs).loss.backward()) if use == "train" else USES[use]
    leftover = []
    for _ in range(2):
        torch.manual_seed(0)
        gc.collect()
        before = torch.cuda.memory_allocated()
        freed = _freed_after(run, lambda: build("llama", hidden_size=512, intermediate_size=1024,
                                                vocab_size=32768).cuda().bfloat16())
        assert freed
        leftover.append(torch.cuda.memory_allocated() - before)
    assert leftover[1] <= 2**20, leftover
