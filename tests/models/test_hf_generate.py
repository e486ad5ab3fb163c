"""generate() and KV-cache forwards of patched Hugging Face models: tokens and per-step logits match the
unpatched model's (fp32, CPU); caches move between patched and unpatched models; training and
generation alternate on one model object; unsupported caches are refused."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import codagen
from codagen.models import hf_cache, patch, unpatch
from codagen.models.decode import GreedyDecoder
from codagen.models.hf_cache import cache_field
from codagen.ops import _checks

from .conftest import assert_same_training, build, lm_inputs, triton_backend_missing

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, StaticCache  # noqa: E402  (after the importorskip)

FAMILIES = {  # (family, config overrides): QKV bias (Qwen2), QK-norm (Qwen3), sliding window shorter than the text
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {"sliding_window": 5}),
    "qwen2_hybrid": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
                               "layer_types": ["full_attention", "sliding_attention"]}),
}
VOCAB = 67


def prompts(batch=3, seq=7, pad=(0, 2, 4)):
    """Random prompts, left-padded: row ``i`` starts with ``pad[i]`` padding tokens (mask 0)."""
    ids = torch.randint(1, VOCAB, (batch, seq))
    mask = torch.ones_like(ids)
    for row, n in enumerate(pad[:batch]):
        ids[row, :n], mask[row, :n] = 0, 0
    return ids, mask


def greedy(model, ids, mask, new_tokens=6, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True, **kwargs)


def assert_same_generation(got, want, rtol=1e-4):
    """Each step's logits within ``rtol`` and the same greedy tokens, up to a step where the two runs pick
    different tokens of a tie: there the reference's best two logits must be within the tolerance (rounding
    may pick either), and the later steps, of different prefixes, are not compared."""
    assert got.sequences.shape == want.sequences.shape
    prompt = want.sequences.shape[1] - len(want.logits)
    assert torch.equal(got.sequences[:, :prompt], want.sequences[:, :prompt])
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        atol = rtol * b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"step {step}: {m}")
        parted = got.sequences[:, prompt + step] != want.sequences[:, prompt + step]
        if parted.any():
            best_two = b[parted].topk(2, dim=-1).values
            assert (best_two[:, 0] - best_two[:, 1] <= atol).all(), \
                f"step {step}: {got.sequences} != {want.sequences} without a tie"
            return


def assert_generates_as_unpatched(model, cache: str) -> None:
    """Greedy ``generate()`` of :func:`prompts` with ``cache`` ("dynamic" or "static") gives the unpatched model's
    tokens after ``patch``."""
    ids, mask = prompts()
    impl = None if cache == "dynamic" else "static"
    want = greedy(model, ids, mask, cache_implementation=impl)
    patch(model)
    got = greedy(model, ids, mask, cache_implementation=impl)
    assert_same_generation(got, want)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("variant", list(FAMILIES))
def test_greedy_matches_unpatched(variant, cache):
    family, overrides = FAMILIES[variant]
    assert_generates_as_unpatched(build(family, **overrides).eval(), cache)


@pytest.mark.skipif(triton_backend_missing() is not None, reason=str(triton_backend_missing()))
def test_greedy_triton_interpreter():
    """One tiny case through the Triton kernels (interpreter on CPU, fp32)."""
    model = build("qwen2", num_hidden_layers=1).eval()
    ids, mask = prompts(batch=2, seq=5)
    want = greedy(model, ids, mask, new_tokens=3)
    patch(model)
    with codagen.use_backend("triton"):
        got = greedy(model, ids, mask, new_tokens=3)
    assert_same_generation(got, want)


def test_sampling_matches_unpatched():
    """Temperature, top-k and top-p (transformers' logits processors) on the patched model's logits."""
    model = build("llama").eval()
    ids, mask = prompts()
    settings = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, temperature=0.7, top_k=20, top_p=0.9,
                    pad_token_id=0)
    torch.manual_seed(1)
    want = model.generate(ids, **settings)
    patch(model)
    torch.manual_seed(1)
    got = model.generate(ids, **settings)
    assert torch.equal(got, want)


@pytest.mark.parametrize("first", ["unpatched", "patched"])
def test_cache_moves_between_patched_and_unpatched(first):
    """The cache holds K in transformers' layout: a prefix cached by one model continues in the other."""
    model = build("qwen3").eval()
    ids, mask = prompts(batch=2, seq=6)
    want = greedy(model, ids, mask, new_tokens=5)  # unpatched all the way
    full_mask = torch.cat((mask, torch.ones(2, 5, dtype=mask.dtype)), dim=1)
    if first == "patched":
        patch(model)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        logits = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
    if first == "patched":
        unpatch(model)
    else:
        patch(model)
    tokens = [logits.argmax(-1)]
    with torch.no_grad():
        for step in range(4):
            length = ids.shape[1] + step + 1
            logits = model(tokens[-1][:, None], attention_mask=full_mask[:, :length], past_key_values=cache,
                           use_cache=True).logits[:, -1]
            tokens.append(logits.argmax(-1))
    assert torch.equal(torch.stack(tokens, dim=1), want.sequences[:, ids.shape[1]:])


def test_static_cache_forward_matches_unpatched():
    """A StaticCache given by hand, 2-D padding mask, prefill then two decode steps."""
    model = build("mistral", sliding_window=4).eval()
    ids, mask = prompts(batch=2, seq=6)
    results = []
    for patched in (False, True):
        if patched:
            patch(model)
        cache = StaticCache(config=model.config, max_cache_len=10)
        steps = [model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits]
        token = steps[-1][:, -1:].argmax(-1)
        for step in range(2):
            step_mask = torch.cat((mask, torch.ones(2, step + 1, dtype=mask.dtype)), dim=1)
            steps.append(model(token, attention_mask=step_mask, past_key_values=cache, use_cache=True).logits)
            token = steps[-1][:, -1:].argmax(-1)
        results.append(steps)
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_train_generate_train():
    """One model object trains, generates and trains again without re-patching, as the unpatched model does."""
    def run(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.randint(0, VOCAB, (2, 10))
        sequences = []
        for _ in range(2):
            model.train()
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            model.eval()
            sequences.append(greedy(model, *prompts(batch=2), new_tokens=4))
        model.train()
        return model(ids, labels=ids).loss, sequences

    model = build("qwen2")
    state = torch.get_rng_state()
    want_loss, want_sequences = run(copy.deepcopy(model))
    torch.set_rng_state(state)
    got_loss, got_sequences = run(patch(model))
    for got, want in zip(got_sequences, want_sequences):
        assert_same_generation(got, want)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=1e-6)


def test_fused_weights_kept_for_inference_until_a_parameter_changes():
    model = patch(build("llama")).eval()
    ids = torch.randint(0, VOCAB, (2, 6))
    blocks = []
    fuse = hf_cache.inference_blocks

    def spy(m, dtype, build_blocks, *rest):
        blocks.append(fuse(m, dtype, build_blocks, *rest))
        return blocks[-1]
    hf_cache.inference_blocks = spy
    try:
        with torch.no_grad():
            model(ids)
            model(ids)
            assert blocks[1] is blocks[0]
            model.model.layers[1].mlp.up_proj.weight.mul_(2)
            model(ids)
            assert blocks[2] is not blocks[0]
            torch.testing.assert_close(blocks[2][1].gate_up[1::2], model.model.layers[1].mlp.up_proj.weight)
        model(ids)  # with autograd: fused afresh (differentiably), nothing kept
        assert len(blocks) == 3 and model not in hf_cache._FUSED_WEIGHTS
    finally:
        hf_cache.inference_blocks = fuse


def test_nothing_saved_for_backward_under_no_grad():
    """Prefill and decode under no_grad keep no tensors for backward (the autograd Functions save nothing)."""
    model = patch(build("llama")).eval()
    ids, mask = prompts(batch=2)
    saved = []

    def pack(t):
        saved.append(t.shape)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        greedy(model, ids, mask, new_tokens=2)
        assert saved == []
        model(ids, attention_mask=mask, use_cache=True).logits.sum().backward()  # the hook does see saves
    assert saved


class _HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that copy a device value to the host or give data-dependent shapes."""
    SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.SYNCS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_static_cache_decode_step_is_capture_safe(monkeypatch):
    """A decode step with a StaticCache and generate's 4-D mask: no host syncs, no data-dependent shapes
    (the condition for CUDA-graph capture). The id checks read values on CPU only (a device-side assert on
    CUDA), so they take their CUDA path here."""
    monkeypatch.setattr(_checks, "reads_values", lambda t: False)
    model = patch(build("qwen2", **FAMILIES["qwen2_hybrid"][1])).eval()
    ids, mask = prompts(batch=2, seq=5)
    cache = StaticCache(config=model.config, max_cache_len=8)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        step_mask = model.prepare_inputs_for_generation(
            ids[:, -1:], attention_mask=torch.cat((mask, torch.ones(2, 1, dtype=mask.dtype)), dim=1),
            **{cache_field(): cache})["attention_mask"]
        shapes = {k: v.shape for k, v in step_mask.items()} if isinstance(step_mask, dict) else step_mask.shape
        with _HostSyncs() as syncs:
            model(ids[:, -1:], attention_mask=step_mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    assert syncs.seen == [], f"host syncs in the decode step: {syncs.seen} (mask {shapes})"


def test_unsupported_caches_refused():
    model = patch(build("llama")).eval()
    ids, _ = prompts(batch=2)
    cache_utils = transformers.cache_utils
    with pytest.raises(NotImplementedError, match="KV cache DynamicCache with offloading"):
        model(ids, past_key_values=DynamicCache(offloading=True), use_cache=True)
    with pytest.raises(NotImplementedError, match="KV cache EncoderDecoderCache"):
        model(ids, past_key_values=cache_utils.EncoderDecoderCache(DynamicCache(), DynamicCache()), use_cache=True)
    with pytest.raises(NotImplementedError, match="KV cache of type tuple"):
        model(ids, past_key_values=((torch.zeros(2, 2, 3, 8), torch.zeros(2, 2, 3, 8)),), use_cache=True)
    quantized = DynamicCache()
    quantized.layers = [object.__new__(cache_utils.QuantoQuantizedLayer)]  # needs optimum-quanto to build
    with pytest.raises(NotImplementedError, match="KV cache DynamicCache with a QuantoQuantizedLayer at layer 0"):
        model(ids, past_key_values=quantized, use_cache=True)
    with pytest.raises(NotImplementedError, match="the forward argument 'output_router_logits'"):
        model(ids, output_router_logits=True)


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_greedy_decoder_matches_generate(variant, monkeypatch):
    """GreedyDecoder's step (run eagerly on CPU: the same code the GPU captures) gives generate()'s tokens;
    the id checks take their CUDA path (a device-side assert) as in a captured step."""
    monkeypatch.setattr(_checks, "reads_values", lambda t: False)
    family, overrides = FAMILIES[variant]
    model = build(family, **overrides).eval()
    model.generation_config.eos_token_id = None  # GreedyDecoder has no stopping criteria
    ids, mask = prompts()
    want = greedy(model, ids, mask, new_tokens=6, cache_implementation="static").sequences[:, ids.shape[1]:]
    decoder = GreedyDecoder(patch(model), max_cache_len=16)
    for _ in range(2):  # the second call reuses the cache (reset in place)
        assert torch.equal(decoder(ids, attention_mask=mask, max_new_tokens=6), want)
    with torch.no_grad(), _HostSyncs() as syncs:  # the step the GPU captures
        decoder._step()
    assert syncs.seen == []
    with pytest.raises(NotImplementedError, match="sliding-window layers"):
        GreedyDecoder(patch(build("mistral", sliding_window=4)), max_cache_len=16)


def test_greedy_decoder_captures_again_after_the_weights_change():
    """The captured step reads the fused weights of the model it was captured on: a kept graph (a stand-in here;
    the CPU runs the step eagerly) survives a call with the same weights and is dropped once a weight is written."""
    model = patch(build("llama").eval())
    decoder = GreedyDecoder(model, max_cache_len=16, capture=False)
    ids, mask = prompts()
    decoder(ids, attention_mask=mask, max_new_tokens=3)
    decoder.graph = captured = object()
    decoder(ids, attention_mask=mask, max_new_tokens=3)
    assert decoder.graph is captured
    with torch.no_grad():  # as an optimizer step writes it
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    decoder(ids, attention_mask=mask, max_new_tokens=3)
    assert decoder.graph is None


def test_greedy_decoder_takes_the_mask_and_token_count_by_keyword():
    decoder = GreedyDecoder(patch(build("llama").eval()), 16)
    ids, _ = prompts()
    with pytest.raises(TypeError, match="positional argument"):
        decoder(ids, 4)


def test_static_cache_decode_step_traces_for_torch_compile():
    """generate() with a StaticCache on the GPU compiles the forward (reduce-overhead): the decode step traces
    in dynamo with no graph break but the (eager) lookup of the kept fused weights."""
    model = patch(build("llama")).eval()
    ids, _ = prompts(batch=2, seq=5)
    cache = StaticCache(config=model.config, max_cache_len=8)
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_field(): cache})
        explained = torch._dynamo.explain(model.forward)(ids[:, -1:].clone(), use_cache=True, logits_to_keep=1,
                                                         **{cache_field(): cache})
    reasons = {str(b.reason).split("\n")[0] for b in explained.break_reasons}
    assert all("inference_blocks" in str(b.reason) for b in explained.break_reasons), reasons
    assert explained.graph_count >= 1


# --- GPU (bf16, Triton kernels; CODAGEN_TRITON_AUTOTUNE=0) -----------------------------------------------
GPU_FIELDS = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 1000, "num_hidden_layers": 2}


def teacher_forced_logits(model, ids, mask, steps):
    """Last-position logits of the prefill and of each decode step fed ``steps`` [batch, T], DynamicCache."""
    cache = DynamicCache(config=model.config)
    logits = [model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1, **{cache_field(): cache}).logits[:, -1]]
    for t in range(steps.shape[1]):
        mask = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)
        logits.append(model(steps[:, t:t + 1], attention_mask=mask, use_cache=True,
                            **{cache_field(): cache}).logits[:, -1])
    return torch.stack(logits, dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_gpu_bf16_cached_logits_two_x_rule(family, monkeypatch):
    """Prefill + 8 decode steps with left padding: the logits' error vs float64 is at most twice transformers' bf16."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    fields = dict(GPU_FIELDS, **({"head_dim": 64} if family == "qwen3" else {}),
                  **({"sliding_window": 48} if family == "mistral" else {}))
    model = build(family, **fields).cuda().eval()
    ids = torch.randint(1, 1000, (3, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    steps = torch.randint(1, 1000, (3, 8), device="cuda")
    with torch.no_grad():
        exact = teacher_forced_logits(copy.deepcopy(model).double(), ids, mask, steps)
        theirs = teacher_forced_logits(copy.deepcopy(model).bfloat16(), ids, mask, steps)
        ours = teacher_forced_logits(patch(copy.deepcopy(model).bfloat16()), ids, mask, steps)

    def error(x):
        return ((x.double() - exact).norm() / exact.norm()).item()
    ours, theirs = error(ours), error(theirs)
    assert ours <= 2 * theirs + 1e-6, f"codagen {ours:.3e} vs transformers bf16 {theirs:.3e}"


@pytest.mark.gpu
def test_gpu_greedy_decoder_cuda_graph(monkeypatch):
    """The captured decode step replays to the tokens of the same step run eagerly; every token is a greedy
    choice of the exact model: its float64 teacher-forced logit is within twice transformers' bf16 logit
    error of the float64 maximum. (Token equality with the unpatched bf16 ``generate()`` is no criterion:
    two bf16 computations may break a near-tie differently, and the sequences part from there.)"""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    base = build("llama", **GPU_FIELDS).cuda().eval()
    base.generation_config.eos_token_id = None  # GreedyDecoder has no stopping criteria
    model = patch(copy.deepcopy(base).bfloat16())
    ids = torch.randint(1, 1000, (4, 32), device="cuda")
    mask = torch.ones_like(ids)
    mask[2, :7] = 0
    graphed = GreedyDecoder(model, max_cache_len=64)
    eager = GreedyDecoder(model, max_cache_len=64, capture=False)
    tokens = graphed(ids, attention_mask=mask, max_new_tokens=16)
    assert graphed.graph is not None
    assert torch.equal(tokens, eager(ids, attention_mask=mask, max_new_tokens=16))
    assert torch.equal(graphed(ids, attention_mask=mask, max_new_tokens=16), tokens)  # replayed again, cache reset
    with torch.no_grad():
        exact = teacher_forced_logits(copy.deepcopy(base).double(), ids, mask, tokens[:, :-1])
        theirs = teacher_forced_logits(copy.deepcopy(base).bfloat16(), ids, mask, tokens[:, :-1])
    bf16_error = (theirs.double() - exact).abs().amax().item()
    shortfall = exact.amax(-1) - exact.gather(-1, tokens[..., None]).squeeze(-1)  # [batch, steps], 0 at argmax
    assert shortfall.max().item() <= 2 * bf16_error + 1e-6, (shortfall.max().item(), bf16_error)


@pytest.mark.gpu
def test_gpu_generate_static_cache_compiled(monkeypatch):
    """generate(cache_implementation='static') on the GPU gives the same tokens with transformers' auto-compile
    allowed and disabled: on a patched model both replay the captured decode step (test_decode_graphs.py)."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    model = patch(build("qwen3", **GPU_FIELDS, head_dim=64).cuda().bfloat16().eval())
    ids, mask = (t.cuda() for t in prompts(batch=2, seq=12))
    settings = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                    cache_implementation="static")
    want = model.generate(ids, **settings, disable_compile=True)
    assert torch.equal(model.generate(ids, **settings), want)


def test_readme_generate_example_runs():
    """The README's "Generate with a patched model" snippet runs as written."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("## Generate with a patched model", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    scope = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    assert scope["greedy"].shape[0] == 2 and scope["sampled"].shape[0] == 2  # up to 14 tokens (EOS may stop early)
    assert torch.isfinite(scope["loss"])


def test_training_forward_with_a_cache_matches_unpatched():
    """Loss, logits and every gradient with use_cache=True (a DynamicCache filled in the graph)."""
    assert_same_training(build("qwen2"), {**lm_inputs(), "use_cache": True})


@pytest.mark.gpu
def test_gpu_prefill_without_autograd_keeps_no_activations(monkeypatch):
    """A no_grad prefill's peak memory is the cache, the kept fused weights and a few live activations; with
    autograd on, every layer's saved activations come on top."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    model = patch(build("llama", **dict(GPU_FIELDS, num_hidden_layers=6)).cuda().bfloat16().eval())
    ids = torch.randint(1, 1000, (2, 1024), device="cuda")

    def peak_mib(grad: bool) -> float:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.set_grad_enabled(grad):
            out = model(ids, use_cache=True, logits_to_keep=1, **{cache_field(): DynamicCache(config=model.config)})
        torch.cuda.synchronize()
        del out
        return (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    peak_mib(False)  # kernels compiled, fused weights kept
    no_grad, with_grad = peak_mib(False), peak_mib(True)
    tokens, ffn, layers = 2048, 512, 6
    cache = layers * 2 * tokens * 2 * 64 * 2 / 2 ** 20  # K and V of 2 kv heads of 64
    live = 8 * tokens * 2 * ffn * 2 / 2 ** 20  # a few [tokens, 2 ffn] activations
    assert no_grad <= cache + live, f"no_grad prefill peak {no_grad:.1f} MiB > {cache + live:.1f} MiB"
    assert with_grad > no_grad + layers * tokens * 2 * ffn * 2 / 2 ** 20  # each layer's preact is saved
