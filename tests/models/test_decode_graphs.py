"""generate() with a StaticCache on a patched model: each decode step replays one CUDA graph
(codagen.models.decode_graphs).

The graph runs the same kernels on the same inputs as the eager step, so the replayed generation must give the
eager one's tokens and logits bitwise (greedy and sampling with a seeded generator, EOS stopping, left padding,
num_return_sequences), and weights changed between generate() calls must be read."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from codagen.models import decode_graphs, patch, unpatch

from .conftest import build

transformers = pytest.importorskip("transformers")

GPU_FIELDS = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 1000, "num_hidden_layers": 2}


HOOKS = ("_valid_auto_compile_criteria", "_prepare_cache_for_generation", "generate")


def test_patch_installs_the_generate_hooks_and_unpatch_removes_them():
    model = patch(build("llama").eval())
    assert all(model.__dict__[name].model is model for name in HOOKS)
    copied = copy.deepcopy(model)
    assert all(getattr(copied, name).model is copied for name in HOOKS)
    restored = pickle.loads(pickle.dumps(model))
    assert all(getattr(restored, name).model is restored for name in HOOKS)
    unpatch(model)
    assert not any(name in model.__dict__ for name in HOOKS)


def test_default_cache_on_a_gpu_is_static(monkeypatch):
    """A greedy or sampling generate() that names no cache gets a StaticCache on a GPU (faked here: the decision
    reads model.device); not with a cache or cache_implementation given, beam search, use_cache=False, PEFT
    modules, sliding-window layers, or on the CPU."""
    from transformers import DynamicCache, GenerationConfig
    from transformers.generation.configuration_utils import GenerationMode  # what generate() passes
    model = patch(build("llama").eval())
    assert not decode_graphs.default_static_cache(model, GenerationConfig(), {}, GenerationMode.SAMPLE)  # CPU
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    for mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        assert decode_graphs.default_static_cache(model, GenerationConfig(), {}, mode)
    assert not decode_graphs.default_static_cache(model, GenerationConfig(), {}, GenerationMode.BEAM_SEARCH)
    assert not decode_graphs.default_static_cache(model, GenerationConfig(cache_implementation="dynamic"), {},
                                                  GenerationMode.SAMPLE)
    assert not decode_graphs.default_static_cache(model, GenerationConfig(use_cache=False), {}, GenerationMode.SAMPLE)
    assert not decode_graphs.default_static_cache(
        model, GenerationConfig(), {"past_key_values": DynamicCache(config=model.config)}, GenerationMode.SAMPLE)
    mistral = patch(build("mistral", sliding_window=4).eval())
    monkeypatch.setattr(type(mistral), "device", property(lambda self: torch.device("cuda")))
    assert decode_graphs.default_static_cache(mistral, GenerationConfig(), {}, GenerationMode.SAMPLE)  # but it slides:
    config = GenerationConfig()
    mistral._prepare_cache_for_generation(config, {}, GenerationMode.SAMPLE, 1, 16)
    assert config.cache_implementation is None
    # the hook as generate() calls it: transformers prepares the cache from the call's config, now static
    seen = []
    monkeypatch.setattr(type(model), "_prepare_cache_for_generation",
                        lambda self, config, *args: seen.append(config.cache_implementation))
    model._prepare_cache_for_generation(GenerationConfig(), {}, GenerationMode.GREEDY_SEARCH, 1, 16)
    assert seen == ["static"]


def test_cpu_default_generate_keeps_the_dynamic_cache():
    model = patch(build("llama").eval())
    out = model.generate(torch.randint(1, 60, (2, 5)), max_new_tokens=3, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    assert type(out.past_key_values).__name__ == "DynamicCache"


def test_cpu_steps_run_eagerly():
    """On the CPU nothing is captured: generate() with a static cache runs the eager forward."""
    model = patch(build("llama").eval())
    ids = torch.randint(1, 60, (2, 5))
    model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert decode_graphs.graphs_of(model) == {}


def test_auto_compile_left_to_transformers_without_a_replay():
    """compiles_forward decides only for a CUDA model with a static cache of full-attention layers."""
    from transformers import DynamicCache, StaticCache
    model = patch(build("llama").eval())
    assert decode_graphs.compiles_forward(model, {"past_key_values": StaticCache(config=model.config,
                                                                                  max_cache_len=8)}) is None  # CPU
    assert decode_graphs.compiles_forward(model, {"past_key_values": DynamicCache(config=model.config)}) is None


# --- GPU ------------------------------------------------------------------------------------------------------
def gpu_model(family="llama", **fields):
    return patch(build(family, **GPU_FIELDS, **fields).cuda().bfloat16().eval())


def left_padded(batch=3, seq=12, device="cuda", pads=(3, 7)):
    """Random prompts; rows 1, 2, ... start with ``pads`` padding tokens (mask 0)."""
    ids = torch.randint(1, 1000, (batch, seq), device=device)
    mask = torch.ones_like(ids)
    for row, pad in zip(range(1, batch), pads):
        mask[row, :pad] = 0
    return ids, mask


def generate_both(model, ids, monkeypatch, seed=None, **settings):
    """(replayed, eager) outputs of the same static-cache generate() call; the eager one with replays off."""
    def run():
        if seed is not None:
            torch.manual_seed(seed)
        return model.generate(ids, cache_implementation="static", return_dict_in_generate=True, output_logits=True,
                              **settings)
    replayed = run()
    with monkeypatch.context() as m:
        m.setattr(decode_graphs, "replay", lambda *args: None)
        eager = run()
    return replayed, eager


def assert_bitwise_same(replayed, eager):
    assert torch.equal(replayed.sequences, eager.sequences)
    assert len(replayed.logits) == len(eager.logits)
    for step, (a, b) in enumerate(zip(replayed.logits, eager.logits)):
        assert torch.equal(a, b), f"step {step}"


def replays(model) -> int:
    return sum(step.replays for step in decode_graphs.graphs_of(model).values())


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_gpu_greedy_replays_the_eager_steps(family, monkeypatch):
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    model = gpu_model(family, **({"head_dim": 64} if family == "qwen3" else {}))
    ids, mask = left_padded()
    replayed, eager = generate_both(model, ids, monkeypatch, attention_mask=mask, max_new_tokens=10,
                                    min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert replays(model) == 10 - 2  # the prefill and the first decode step run eagerly
    assert_bitwise_same(replayed, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("keep_first", [False, True])
def test_gpu_a_new_cache_per_call(keep_first, monkeypatch):
    """transformers makes a new StaticCache per generate() call. Where it lands at the first call's addresses the
    first graph replays; where the first call's cache is still held (keep_first: its output returns it), the new
    one lies elsewhere and its first decode step is captured again (no eager step). Either way the tokens and
    logits are the eager ones."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    model = gpu_model()
    ids, mask = left_padded()
    settings = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    first = generate_both(model, ids, monkeypatch, **settings)
    if not keep_first:
        del first
    replayed, eager = generate_both(model, torch.randint(1, 1000, ids.shape, device="cuda"), monkeypatch,
                                    **settings)
    assert_bitwise_same(replayed, eager)
    (step,) = decode_graphs.graphs_of(model).values()
    assert step.replays == (8 - 2) + (8 - 1)
    assert step.captures == 2 if keep_first else step.captures in (1, 2)


@pytest.mark.gpu
def test_gpu_sampling_stopping_and_return_sequences(monkeypatch):
    """Temperature, top-k, top-p, repetition penalty and EOS stopping (transformers' loop after the graph), two
    sequences per prompt."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    model = gpu_model()
    ids, mask = left_padded(batch=2)
    settings = dict(attention_mask=mask, max_new_tokens=24, do_sample=True, temperature=0.8, top_k=50, top_p=0.9,
                    repetition_penalty=1.3, num_return_sequences=2, pad_token_id=0, eos_token_id=[3, 7, 11])
    replayed, eager = generate_both(model, ids, monkeypatch, seed=1234, **settings)
    assert replayed.sequences.shape[0] == 4
    assert replays(model) > 0
    assert_bitwise_same(replayed, eager)


@pytest.mark.gpu
def test_gpu_new_weights_between_calls_are_read(monkeypatch):
    """An optimizer step between two generate() calls (an RL loop): the second call generates from the new
    weights, as the eager forward does."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    model = gpu_model()
    ids, mask = left_padded()
    settings = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    first, _ = generate_both(model, ids, monkeypatch, **settings)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    replayed, eager = generate_both(model, ids, monkeypatch, **settings)
    assert_bitwise_same(replayed, eager)
    assert not all(torch.equal(a, b) for a, b in zip(first.logits, replayed.logits))


@pytest.mark.gpu
def test_gpu_default_generate_replays_and_dynamic_opts_out(monkeypatch):
    """generate() naming no cache replays on a StaticCache, giving the explicit static call's tokens and logits;
    cache_implementation="dynamic" runs the DynamicCache eagerly."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    model = gpu_model()
    ids, mask = left_padded()
    settings = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                    return_dict_in_generate=True, output_logits=True)
    default = model.generate(ids, **settings)
    assert type(default.past_key_values).__name__ == "StaticCache" and replays(model) == 8 - 2
    with monkeypatch.context() as m:
        m.setattr(decode_graphs, "replay", lambda *args: None)
        assert_bitwise_same(default, model.generate(ids, **settings, cache_implementation="static"))
    dynamic = model.generate(ids, **settings, cache_implementation="dynamic")
    assert type(dynamic.past_key_values).__name__ == "DynamicCache" and replays(model) == 8 - 2
