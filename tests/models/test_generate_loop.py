"""generate()'s decode loop on a patched model with a StaticCache (codagen.models.generate_loop): each token one CUDA
graph replay of the step, transformers' logits processors, sampling and EOS stopping.

On the CPU the loop runs its steps eagerly, so the tests here check what it computes against the unpatched model's
generate() in fp32: the same tokens for greedy decoding and for sampling from the same seed (temperature, top-k,
top-p, min-p, repetition penalty), EOS stopping, left padding, num_return_sequences, where it stops and the cache
it leaves; and which calls it leaves to transformers' loop. On the GPU a replayed loop gives the eager loop's
tokens bitwise."""
from __future__ import annotations

import copy

import pytest
import torch

from codagen.models import decode_graphs, generate_loop, patch
from codagen.models.hf_cache import cache_field
from codagen.ops import _checks

from .conftest import build
from .test_decode_graphs import gpu_model, left_padded
from .test_hf_generate import _HostSyncs, prompts

transformers = pytest.importorskip("transformers")

from transformers import StaticCache  # noqa: E402  (after the importorskip)

SETTINGS = {
    "greedy": dict(do_sample=False),
    "greedy_eos": dict(do_sample=False, eos_token_id=[5, 9, 17, 30, 44]),
    "sampling": dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3),
    "sampling_eos": dict(do_sample=True, temperature=1.5, min_p=0.02, eos_token_id=[5, 9, 17, 30, 40, 41, 42]),
    "return_sequences": dict(do_sample=True, top_p=0.8, num_return_sequences=2, eos_token_id=[3, 11, 12]),
}


def loop_runs(model) -> int:
    """Calls the loop took (its kinds' first-token choices are not counted: every step after the prefill)."""
    return len(generate_loop.loops_of(model))


def generate(model, ids, mask, seed=1, cache=None, **settings):
    """``model.generate`` with a StaticCache: ``cache``, else one transformers makes."""
    torch.manual_seed(seed)
    settings = {"cache_implementation": "static", **settings} if cache is None else {cache_field(): cache, **settings}
    return model.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, **settings)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_loop_gives_the_unpatched_tokens(name, family):
    model = build(family).eval()
    reference = copy.deepcopy(model)
    patch(model)
    ids, mask = prompts()
    for seed in (1, 2):
        want = generate(reference, ids, mask, seed, **SETTINGS[name])
        got = generate(model, ids, mask, seed, **SETTINGS[name])
        assert torch.equal(got, want), f"seed {seed}:\n{got}\n{want}"
    assert loop_runs(model) == 1  # one loop kind served both calls


@pytest.mark.parametrize("check_every", [1, 3, 64])
def test_stops_where_transformers_stops(check_every, monkeypatch):
    """However late the host reads "every row finished", the sequences are cut after the step at which every row
    had finished, and a cache passed in holds what transformers' loop leaves in it."""
    monkeypatch.setattr(generate_loop, "CHECK_EVERY", check_every)
    model = build("llama").eval()
    reference = copy.deepcopy(model)
    patch(model)
    ids, mask = prompts()
    settings = dict(do_sample=True, temperature=3.0, eos_token_id=list(range(2, 40)))
    for seed in range(4):
        want_cache, got_cache = (StaticCache(config=m.config, max_cache_len=24) for m in (reference, model))
        want = generate(reference, ids, mask, seed, cache=want_cache, **settings)
        got = generate(model, ids, mask, seed, cache=got_cache, **settings)
        assert want.shape[1] < ids.shape[1] + 12, "no early stop: pick other EOS tokens"
        assert torch.equal(got, want)
        assert int(got_cache.get_seq_length()) == int(want_cache.get_seq_length())
    assert loop_runs(model) == 1


def test_calls_it_does_not_take_run_transformers_loop():
    """A streamer, per-step outputs, a processor that reads the sequence's length (min_new_tokens), a stop string
    or a dynamic cache: transformers' own loop, with the same tokens."""
    model = build("llama").eval()
    reference = copy.deepcopy(model)
    patch(model)
    ids, mask = prompts()

    class Streamer:
        def __init__(self):
            self.put_calls = 0

        def put(self, value):
            self.put_calls += 1

        def end(self):
            pass

    streamer = Streamer()
    for settings in (dict(streamer=streamer), dict(min_new_tokens=4), dict(cache_implementation="dynamic"),
                     dict(return_dict_in_generate=True, output_scores=True)):
        want, got = generate(reference, ids, mask, **settings), generate(model, ids, mask, **settings)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want), settings
        else:
            assert torch.equal(got.sequences, want.sequences), settings
    assert streamer.put_calls > 0
    assert loop_runs(model) == 0


def test_takes_only_greedy_and_sampling():
    model = patch(build("llama").eval())
    ids, mask = prompts()
    assert generate_loop.takes(model, (ids,), dict(attention_mask=mask, max_new_tokens=4, do_sample=True))
    assert generate_loop.takes(model, (ids,), dict(attention_mask=mask, max_new_tokens=4))
    assert not generate_loop.takes(model, (ids,), dict(max_new_tokens=4, num_beams=2))
    assert not generate_loop.takes(model, (ids,), dict(max_new_tokens=4, streamer=object()))
    assert not generate_loop.takes(model, (ids,), dict(max_new_tokens=4, custom_generate=lambda *a, **k: None))
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, pad_token_id=0,
                           cache_implementation="static")
    assert beams.shape == (3, ids.shape[1] + 3) and loop_runs(model) == 0


def test_decode_step_has_no_host_sync(monkeypatch):
    """Every step after the first (the forward, the processors, the sample, EOS and padding) runs without a host
    sync or a data-dependent shape: the condition for capturing it. The id checks take their CUDA path (a
    device-side assert)."""
    monkeypatch.setattr(_checks, "reads_values", lambda t: False)
    model = patch(build("qwen3").eval())
    ids, mask = prompts()
    seen = []

    def watched(loop, step, cache_tensors, remaining):
        with _HostSyncs() as syncs:
            step()
        seen.extend(syncs.seen)
    monkeypatch.setattr(generate_loop, "_run_step", watched)
    monkeypatch.setattr(generate_loop, "CHECK_EVERY", 10 ** 6)
    generate(model, ids, mask, **SETTINGS["sampling_eos"], repetition_penalty=1.2, top_k=10)
    assert seen == []


def test_processor_tensors_are_the_loops_own():
    """A graph reads the tensors it was captured with, and each call makes new processors: their tensors (the
    per-row prompt padding of the repetition penalty), the EOS and the pad tokens are copied into the loop's."""
    model = patch(build("llama").eval())
    ids, mask = prompts()
    generate(model, ids, mask, **SETTINGS["greedy_eos"], repetition_penalty=1.2)
    (loop,) = generate_loop.loops_of(model).values()
    kept = dict(loop.bound)
    assert {"eos", "pad"} <= kept.keys()
    other = prompts(pad=(1, 0, 3))
    generate(model, *other, **SETTINGS["greedy_eos"], repetition_penalty=1.2)
    assert all(loop.bound[name] is tensor for name, tensor in kept.items())
    assert torch.equal(loop.bound["pad"], torch.tensor(0))


def test_each_call_reuses_the_kinds_cache_tensors():
    """transformers makes a new StaticCache per call; its layers get the tensors the loop kind kept from the last call
    (the ones a graph was captured on), and the tokens stay the unpatched model's (test_loop_gives_the_unpatched_tokens
    runs two calls per kind)."""
    model = patch(build("llama").eval())
    ids, mask = prompts()
    generate(model, ids, mask, **SETTINGS["greedy"])
    (loop,) = generate_loop.loops_of(model).values()
    first = [tuple(t.data_ptr() for t in layer) for layer in loop.cache_layers]
    generate(model, *prompts(pad=(2, 0, 1)), **SETTINGS["greedy"])
    assert [tuple(t.data_ptr() for t in layer) for layer in loop.cache_layers] == first


def test_a_training_forward_drops_the_loops_and_graphs():
    """A forward with autograd drops the fused weights kept for inference, which the captured steps read: the loops
    (their graphs and kept caches) and the per-step graphs go with them, and the weights key changes."""
    model = patch(build("llama").eval())
    ids, mask = prompts()
    generate(model, ids, mask, **SETTINGS["greedy"])
    key = decode_graphs.weights_key(model)
    assert generate_loop.loops_of(model)
    model.train()
    model(ids, labels=ids).loss.backward()
    assert generate_loop.loops_of(model) == {}
    model.eval()
    with torch.no_grad():
        model(ids)  # rebuilds the fused weights: parameters and modules as before, a new build
    assert decode_graphs.weights_key(model) != key


def test_patched_generate_keeps_its_signature():
    import inspect
    model = build("llama").eval()
    want = inspect.signature(model.generate)
    patch(model)
    assert inspect.signature(model.generate) == want
    assert decode_graphs.graphs_of(model) == {}


# --- GPU ------------------------------------------------------------------------------------------------------
def replayed_and_eager(model, ids, mask, monkeypatch, seed=0, **settings):
    """The same generate() call through the replayed loop and through the loop run eagerly."""
    def run():
        torch.manual_seed(seed)
        return model.generate(ids, attention_mask=mask, pad_token_id=0, **settings)
    replayed = run()
    with monkeypatch.context() as m:
        m.setattr(generate_loop, "_run_step", lambda loop, step, cache_tensors, remaining: step())
        eager = run()
    return replayed, eager


def replays(model) -> int:
    return sum(loop.replays for loop in generate_loop.loops_of(model).values())


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("name", ["greedy", "sampling_eos", "return_sequences"])
def test_gpu_replayed_loop_gives_the_eager_tokens(name, family, monkeypatch):
    """A default generate() (no cache named: a StaticCache on the GPU) replays the loop; the tokens are the eager
    loop's, for sampling too (the graph draws the eager step's random numbers)."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    model = gpu_model(family, **({"head_dim": 64} if family == "qwen3" else {}))
    ids, mask = left_padded()
    settings = dict(SETTINGS[name], max_new_tokens=20)
    settings.pop("eos_token_id", None) if name == "greedy" else None
    replayed, eager = replayed_and_eager(model, ids, mask, monkeypatch, **settings)
    assert replays(model) > 0 and decode_graphs.graphs_of(model) == {}
    assert torch.equal(replayed, eager)


@pytest.mark.gpu
def test_gpu_new_cache_padding_and_weights_between_calls(monkeypatch):
    """An RL loop's pattern: calls with other prompts and padding (new processor tensors, a new cache) and an
    optimizer step between them. Each call gives the eager loop's tokens, from the current weights."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    model = gpu_model()
    settings = dict(max_new_tokens=16, do_sample=True, top_p=0.9, repetition_penalty=1.2, eos_token_id=[3, 7])
    outputs = []
    for call, pads in enumerate([(3, 7), (0, 5), (1, 1)]):
        ids, mask = left_padded(pads=pads)
        replayed, eager = replayed_and_eager(model, ids, mask, monkeypatch, seed=call, **settings)
        assert torch.equal(replayed, eager), f"call {call}"
        outputs.append(replayed)
        if call == 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.5)
    (loop,) = generate_loop.loops_of(model).values()
    assert loop.captures >= 1 and loop.replays > 0


@pytest.mark.gpu
def test_gpu_compile_config_runs_the_loop(monkeypatch):
    """transformers' compiled generation (generation_config.compile_config) on a patched model replays the loop;
    nothing is compiled by Dynamo."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    from transformers import CompileConfig
    model = gpu_model()
    ids, mask = left_padded()
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["frames"]
    before = frames["ok"]
    model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                   cache_implementation="static", compile_config=CompileConfig())
    assert replays(model) == 6 - 2  # the prefill's token and an eager step; the captured step replays
    assert frames["ok"] == before
