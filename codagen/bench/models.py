"""``codagen bench models``: one training step of the models people fine-tune, at their real configs (GPU, bf16).

Each model is built by ``transformers`` from its own ``config.json`` values (:data:`MODELS`: width, ffn,
heads / KV heads, head_dim, vocabulary, tied embeddings, Q/K/V biases, QK-norm, RoPE theta and scaling), with
random weights and its decoder trimmed to ``--layers`` layers. Steps (``--steps``):

- ``full``: every parameter trains, AdamW (fused on the GPU, the Trainer's default), bf16 parameters;
- ``lora-all-r16``: PEFT LoRA r 16 (alpha 32) on all seven projections, frozen base, AdamW on the adapters;
- ``lora-qv-r8``: PEFT LoRA r 8 (alpha 16) on ``q_proj`` and ``v_proj``.

LoRA runs with PEFT's default adapter dtype (``--adapter-dtype peft``: ``autocast_adapter_dtype=True``, float32
adapters on the bf16 base) or with bf16 adapters (``bf16``); the record says which. codagen computes every
adapter in the compute dtype (bf16), whatever dtype the adapter parameters are stored in.

Providers: ``eager`` (transformers, or PEFT for LoRA), ``compile`` (the same, ``torch.compile``-d), ``liger``
(``liger_kernel.transformers.apply_liger_kernel_to_<family>()`` before the model is built: global patches, so it
runs last), ``codagen`` (``codagen.patch``), ``codagen_compile`` (``codagen.patch`` then ``torch.compile``) and
``codagen_compile_graphs`` (``codagen.patch`` then ``torch.compile(mode="reduce-overhead")``: the compiled forward and
backward replayed as CUDA graphs). FP8, run when named in ``--providers`` (:data:`FP8_PROVIDERS`): ``codagen_fp8``
and ``codagen_fp8_compile`` (``codagen.patch(model, fp8="blockwise")``, then compiled), ``torchao_fp8`` and
``torchao_fp8_compile`` (torchao's ``convert_to_float8_training`` with its ``rowwise`` recipe on every projection,
the LM head excluded as torchtitan does, then compiled); always bf16 (``--smoke`` included).

Per model, step, token shape and provider: ``--warmup`` untimed steps (compilation among them; the first step's
wall time is recorded as ``first_step_s``), ``--timed`` steps timed one by one with CUDA events (the median is
``median_ms``), the peak of ``torch.cuda.max_memory_allocated`` over them, and the GPU's idle share of a step:
one minus the union of the kernels' intervals in one more step, profiled, over that step's wall time. Records go to
``<out>/<date>-models-<steps>.json`` with a chart beside it. ``--smoke`` runs a tiny config on CPU (fp32) to check
the harness.
"""
from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

import codagen
from codagen._cli import command_parser

from .common import pyplot, write_results

__all__ = ["main", "ModelConfig", "MODELS", "PROVIDERS", "FP8_PROVIDERS", "STEPS", "hf_config", "idle_share",
           "kernel_union_ms", "profiled_kernels", "training_step"]

# liger last: its patches are global
PROVIDERS = ("eager", "compile", "codagen", "codagen_compile", "codagen_compile_graphs", "liger")
#: FP8 training, run only when named: codagen's blockwise recipe and torchao's rowwise Float8 (the peer)
FP8_PROVIDERS = ("codagen_fp8", "codagen_fp8_compile", "torchao_fp8", "torchao_fp8_compile")
STEPS = {"full": None,
         "lora-all-r16": (16, 32.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
         "lora-qv-r8": (8, 16.0, ("q_proj", "v_proj"))}
_LIGER = {"llama": "apply_liger_kernel_to_llama", "mistral": "apply_liger_kernel_to_mistral",
          "qwen2": "apply_liger_kernel_to_qwen2", "qwen3": "apply_liger_kernel_to_qwen3",
          "phi3": "apply_liger_kernel_to_phi3", "granite": "apply_liger_kernel_to_granite",
          "smollm3": "apply_liger_kernel_to_smollm3", "gemma2": "apply_liger_kernel_to_gemma2",
          "gemma3": "apply_liger_kernel_to_gemma3_text", "glm4": "apply_liger_kernel_to_glm4"}
_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM",
            "smollm3": "SmolLM3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
            "glm4": "Glm4ForCausalLM"}
#: LoRA targets by the projections Phi-3 fuses (PEFT adapts the fused module: q/v -> all of qkv_proj)
_FUSED_TARGETS = {"phi3": {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The ``config.json`` values of one published model that shape its step (the rest are transformers'
    defaults, which those files do not change)."""
    family: str  # a key of codagen.models.families.FAMILIES
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    num_hidden_layers: int  # the published depth; the benchmark trims it (--layers)
    rope_scaling: dict | None = None
    attention_bias: bool = False  # biases on q/k/v (Qwen2's and GLM's configs have no such field: always there)
    fields: tuple = ()  # the family's own config.json fields, as (name, value) pairs (Granite's multipliers, ...)


_LLAMA3_SCALING = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

#: microsoft/Phi-4-mini-instruct's rope_scaling.long_factor
_PHI4_MINI_LONG_FACTOR = [
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
    2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
    6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6,
    32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77]

#: published models (Hugging Face ``config.json`` of each), by their hub names
MODELS = {
    "Llama-3.2-1B": ModelConfig("llama", 2048, 8192, 32, 8, 64, 128256, True, 500000.0, 1e-5, 16,
                                dict(_LLAMA3_SCALING, factor=32.0)),
    "Llama-3.2-3B": ModelConfig("llama", 3072, 8192, 24, 8, 128, 128256, True, 500000.0, 1e-5, 28,
                                dict(_LLAMA3_SCALING, factor=32.0)),
    "Llama-3.1-8B": ModelConfig("llama", 4096, 14336, 32, 8, 128, 128256, False, 500000.0, 1e-5, 32,
                                dict(_LLAMA3_SCALING, factor=8.0)),
    "Qwen3-0.6B": ModelConfig("qwen3", 1024, 3072, 16, 8, 128, 151936, True, 1000000.0, 1e-6, 28),
    "Qwen3-4B": ModelConfig("qwen3", 2560, 9728, 32, 8, 128, 151936, True, 1000000.0, 1e-6, 36),
    "Qwen3-8B": ModelConfig("qwen3", 4096, 12288, 32, 8, 128, 151936, False, 1000000.0, 1e-6, 36),
    "Qwen2.5-0.5B": ModelConfig("qwen2", 896, 4864, 14, 2, 64, 151936, True, 1000000.0, 1e-6, 24,
                                attention_bias=True),
    "Qwen2.5-1.5B": ModelConfig("qwen2", 1536, 8960, 12, 2, 128, 151936, True, 1000000.0, 1e-6, 28,
                                attention_bias=True),
    "Qwen2.5-7B": ModelConfig("qwen2", 3584, 18944, 28, 4, 128, 152064, False, 1000000.0, 1e-6, 28,
                              attention_bias=True),
    "Mistral-7B-v0.3": ModelConfig("mistral", 4096, 14336, 32, 8, 128, 32768, False, 1000000.0, 1e-5, 32),
    "SmolLM2-1.7B": ModelConfig("llama", 2048, 8192, 32, 32, 64, 49152, True, 130000.0, 1e-5, 24),
    "Phi-3-mini-4k": ModelConfig("phi3", 3072, 8192, 32, 32, 96, 32064, False, 10000.0, 1e-5, 32,
                                 fields=(("sliding_window", 2047),)),
    # LongRoPE (48 factors: the 96 rotated channels of each 128-wide head), tied head, vocabulary 200064
    "Phi-4-mini": ModelConfig("phi3", 3072, 8192, 24, 8, 128, 200064, True, 10000.0, 1e-5, 32,
                              dict(rope_type="longrope", long_factor=_PHI4_MINI_LONG_FACTOR, short_factor=[1.0] * 48),
                              fields=(("partial_rotary_factor", 0.75), ("original_max_position_embeddings", 4096),
                                      ("max_position_embeddings", 131072), ("sliding_window", 262144))),
    "Granite-3.1-2B": ModelConfig("granite", 2048, 8192, 32, 8, 64, 49155, True, 5000000.0, 1e-5, 40,
                                  fields=(("embedding_multiplier", 12.0), ("residual_multiplier", 0.22),
                                          ("attention_multiplier", 0.015625), ("logits_scaling", 8.0))),
    "Granite-3.1-8B": ModelConfig("granite", 4096, 12800, 32, 8, 128, 49155, True, 10000000.0, 1e-5, 40,
                                  fields=(("embedding_multiplier", 12.0), ("residual_multiplier", 0.22),
                                          ("attention_multiplier", 0.0078125), ("logits_scaling", 16.0))),
    "SmolLM3-3B": ModelConfig("smollm3", 2048, 11008, 16, 4, 128, 128256, True, 5000000.0, 1e-6, 36,
                              fields=(("no_rope_layer_interval", 4),)),
    # sandwich norms, Q/K/V biases, RoPE on interleaved pairs of half of each head's channels
    "GLM-4-9B-0414": ModelConfig("glm4", 4096, 13696, 32, 2, 128, 151552, False, 10000.0, 1e-5, 40,
                                 attention_bias=True, fields=(("partial_rotary_factor", 0.5),)),
    # every second layer local (sliding window 4096), soft-caps 50 (attention) and 30 (final logits)
    "Gemma-2-2B": ModelConfig("gemma2", 2304, 9216, 8, 4, 256, 256000, True, 10000.0, 1e-6, 26,
                              fields=(("sliding_window", 4096), ("query_pre_attn_scalar", 256),
                                      ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
                                      ("sliding_window_pattern", 2))),
    # five local layers (window 512, RoPE base 10000) to one global (base 1e6)
    "Gemma-3-1B": ModelConfig("gemma3", 1152, 6912, 4, 1, 256, 262144, True, 1000000.0, 1e-6, 26,
                              fields=(("sliding_window", 512), ("query_pre_attn_scalar", 256),
                                      ("sliding_window_pattern", 6), ("rope_local_base_freq", 10000.0))),
}
#: the CPU check of the harness: a tiny config with every structural feature of the matrix
SMOKE_MODELS = {"smoke-qwen2": ModelConfig("qwen2", 64, 128, 4, 2, 16, 250, True, 1000000.0, 1e-6, 2,
                                           attention_bias=True),
                "smoke-qwen3": ModelConfig("qwen3", 64, 128, 4, 2, 16, 250, False, 1000000.0, 1e-6, 2)}


def hf_config(model: ModelConfig, layers: int | None = None):
    """The ``transformers`` config of ``model`` with ``layers`` decoder layers (default: the published depth)."""
    import transformers
    kwargs = dict(vocab_size=model.vocab_size, hidden_size=model.hidden_size,
                  intermediate_size=model.intermediate_size, num_hidden_layers=layers or model.num_hidden_layers,
                  num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_key_value_heads,
                  head_dim=model.head_dim, tie_word_embeddings=model.tie_word_embeddings,
                  rms_norm_eps=model.rms_norm_eps, max_position_embeddings=32768, attn_implementation="sdpa")
    rope = dict(model.rope_scaling or {"rope_type": "default"}, rope_theta=model.rope_theta)
    config_class = getattr(transformers, _CLASSES[model.family].replace("ForCausalLM", "Config"))
    if model.family == "gemma2":  # transformers runs its soft-capped attention eagerly (SDPA has no soft-cap)
        kwargs["attn_implementation"] = "eager"
    fields = dict(model.fields)
    if "sliding_window_pattern" in fields:  # Gemma: the last layer of each pattern is global, the others local
        pattern = fields.pop("sliding_window_pattern")
        kwargs["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                 for i in range(kwargs["num_hidden_layers"])]
    if "rope_local_base_freq" in fields:  # Gemma 3: RoPE per layer type
        rope = {"full_attention": rope, "sliding_attention": {"rope_type": "default",
                                                              "rope_theta": fields.pop("rope_local_base_freq")}}
    if model.family == "gemma3":
        config_class = transformers.Gemma3TextConfig
    # the family's fields at construction: the config derives from some of them (Phi's partial rotary factor and
    # LongRoPE lengths enter rope_parameters)
    config = config_class(**{**kwargs, **fields}, rope_parameters=rope)
    if model.family == "llama":
        config.attention_bias = model.attention_bias
    if model.family == "mistral":
        config.sliding_window = None  # Mistral-7B-v0.3's config.json; MistralConfig's default is 4096
    if model.family == "smollm3":  # its layers read no_rope_layers, which the config derives from the interval
        config.no_rope_layers = [int((i + 1) % config.no_rope_layer_interval != 0)
                                 for i in range(config.num_hidden_layers)]
    return config


def build(model: ModelConfig, layers: int, step: str, adapter_dtype: str, provider: str, device, dtype):
    """The provider's model (seeded: every provider starts from the same weights) and the module to call."""
    import transformers
    if provider == "liger":
        import liger_kernel.transformers as liger
        getattr(liger, _LIGER[model.family])()
    config = hf_config(model, layers)
    torch.manual_seed(0)
    with torch.device(device):
        hf_model = getattr(transformers, _CLASSES[model.family])(config).to(dtype)
    if STEPS[step] is not None:
        import peft
        rank, alpha, targets = STEPS[step]
        fused = _FUSED_TARGETS.get(model.family, {})
        targets = dict.fromkeys(fused.get(name, name) for name in targets)  # in order, once each
        hf_model = peft.get_peft_model(hf_model, peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                                 target_modules=list(targets)),
                                       autocast_adapter_dtype=adapter_dtype == "peft")
    hf_model.train()
    if provider.startswith("codagen"):
        codagen.patch(hf_model, fp8="blockwise" if provider.startswith("codagen_fp8") else None)
    if provider.startswith("torchao_fp8"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(hf_model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=lambda module, name: "lm_head" not in name)
    if provider.endswith("compile_graphs"):  # CUDA graphs of the compiled forward and backward: no host gaps
        return hf_model, torch.compile(hf_model, mode="reduce-overhead")
    return hf_model, torch.compile(hf_model) if provider.endswith("compile") else hf_model


def profiled_kernels(step) -> tuple[list[tuple[float, float, str]], float, object]:
    """One ``step()`` under ``torch.profiler`` (CUDA): the GPU's kernels and copies as ``(start_us, end_us, name)``
    in start order (not the GPU spans of ``record_function`` regions, such as the optimizer step's, which cover the
    gaps inside them), the step's wall time in ms (CUDA events around it), and the profile."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation)
    return kernels, start.elapsed_time(end), prof


def idle_share(step, device) -> tuple[float, float] | None:
    """One profiled ``step()`` (:func:`profiled_kernels`): ``(kernel_ms, idle share)``, the union of its kernels'
    intervals and the share of the step's wall time that no kernel covers; ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    kernels, wall_ms, _ = profiled_kernels(step)
    kernel_ms = kernel_union_ms(kernels)
    return kernel_ms, max(0.0, 1 - kernel_ms / wall_ms)


def training_step(hf_model, step_model, ids: torch.Tensor, provider: str):
    """``(step, optimizer name)``: one training step of ``step_model`` on ``ids`` (labels = ids) with AdamW on
    ``hf_model``'s trainable parameters, returning the loss. The optimizer is the Trainer's default
    (TrainingArguments.optim "adamw_torch_fused" with torch >= 2.8) on the GPU, foreach AdamW on CPU."""
    params = [p for p in hf_model.parameters() if p.requires_grad]
    fused = ids.device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=1e-5, **({"fused": True} if fused else {"foreach": True}))
    graphs = provider.endswith("graphs")

    def step() -> torch.Tensor:
        if graphs:  # a new iteration: the graphs' output buffers of the last one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return loss.detach().clone()  # kept across steps: not a view of a graph's output buffer
    return step, "AdamW(fused=True)" if fused else "AdamW(foreach=True)"


def kernel_union_ms(kernels: list[tuple[float, float, str]]) -> float:
    """Milliseconds of the union of the ``(start_us, end_us, name)`` intervals (sorted by start)."""
    busy, covered_to = 0.0, float("-inf")
    for begin, stop, _ in kernels:
        if stop > covered_to:
            busy += stop - max(begin, covered_to)
            covered_to = stop
    return busy / 1e3


def run_provider(model: ModelConfig, layers: int, step_name: str, adapter_dtype: str, batch: int, seq: int,
                 provider: str, device, dtype, warmup: int, timed: int) -> dict:
    """Build, warm up and time one provider; a record of its step times, memory, idle share and losses."""
    record = {"provider": provider}
    if provider in FP8_PROVIDERS:  # FP8 GEMMs store bf16: the FP8 recipes train bf16 models
        dtype = torch.bfloat16
    started = time.perf_counter()
    hf_model, step_model = build(model, layers, step_name, adapter_dtype, provider, device, dtype)
    params = [p for p in hf_model.parameters() if p.requires_grad]
    record["trainable_params"] = sum(p.numel() for p in params)
    record["adapter_param_dtype"] = (None if STEPS[step_name] is None else
                                     str(next(p.dtype for n, p in hf_model.named_parameters() if "lora_A" in n)))
    generator = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, model.vocab_size, (batch, seq), generator=generator).to(device)
    step, record["optimizer"] = training_step(hf_model, step_model, ids, provider)
    cuda = device.type == "cuda"

    def timed_step() -> tuple[torch.Tensor, float]:
        if not cuda:
            t = time.perf_counter()
            loss = step()
            return loss, 1e3 * (time.perf_counter() - t)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        end.synchronize()
        return loss, start.elapsed_time(end)

    losses, times = [], []
    for i in range(warmup):
        losses.append(timed_step()[0])
        if i == 0:
            record["first_step_s"] = round(time.perf_counter() - started, 2)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(timed):
        loss, ms = timed_step()
        losses.append(loss)
        times.append(ms)
    record["step_ms"] = times
    record["median_ms"] = statistics.median(times)
    record["tokens_per_s"] = batch * seq / (record["median_ms"] / 1e3)
    record["losses"] = [float(x) for x in losses]
    if cuda:
        record["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        # CUDA graphs replay into a private pool reserved while recording (in warm-up): it shows as reserved memory
        record["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2 ** 30
        record["kernel_ms"], record["idle_share"] = idle_share(step, device)
    return record


def _percent(share: float | None) -> str:
    return "—" if share is None else f"{100 * share:.1f}%"


def table(records: list[dict], providers: list[str]) -> str:
    """Markdown: step ms (peak GiB, idle share) per provider; codagen's best over the best peer."""
    rows = {}
    for r in records:
        rows.setdefault((r["name"], r["step"], r["adapter_dtype"], r["shape"]["tokens_shape"]), {})[r["provider"]] = r
    fp8 = any(p in FP8_PROVIDERS for p in providers)
    head = ("| model | step | tokens | " + " | ".join(providers) + " | codagen best / best peer | peak vs lowest peer |"
            + (" codagen fp8 / torchao fp8 | peak vs torchao fp8 |" if fp8 else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (name, step, adapter_dtype, tokens), by in rows.items():
        cells = []
        for p in providers:
            r = by.get(p, {})
            cells.append(f"{r['median_ms']:.1f} ({r.get('peak_mem_gib') or 0:.1f} GiB, "
                         f"{_percent(r.get('idle_share'))} idle)" if r.get("median_ms") else "—")
        speed, mem = _best_over_peers(by, ("codagen", "codagen_compile", "codagen_compile_graphs"),
                                      ("eager", "compile", "liger"))
        fp8_speed, fp8_mem = _best_over_peers(by, ("codagen_fp8", "codagen_fp8_compile"),
                                              ("torchao_fp8", "torchao_fp8_compile"))
        step_label = step if step == "full" else f"{step} ({adapter_dtype} adapters)"
        lines.append(f"| {name} | {step_label} | {tokens} | " + " | ".join(cells) + f" | {speed} | {mem} |"
                     + (f" {fp8_speed} | {fp8_mem} |" if fp8 else ""))
    return "\n".join(lines)


def _best_over_peers(by: dict[str, dict], ours: tuple[str, ...], peers: tuple[str, ...]) -> tuple[str, str]:
    """``(speed-up, peak-memory ratio)`` of the fastest of ``ours`` over the fastest and the leanest of ``peers``,
    as table cells ("—" where either side has no time)."""
    peer_runs = [by[p] for p in peers if by.get(p, {}).get("median_ms")]
    our_runs = [by[p] for p in ours if by.get(p, {}).get("median_ms")]
    if not (peer_runs and our_runs):
        return "—", "—"
    best = min(our_runs, key=lambda r: r["median_ms"])
    speed = f"{min(r['median_ms'] for r in peer_runs) / best['median_ms']:.3f}x"
    mems = [r["peak_mem_gib"] for r in peer_runs if r.get("peak_mem_gib")]
    mem = f"{best['peak_mem_gib'] / min(mems):.3f}x" if mems and best.get("peak_mem_gib") else "—"
    return speed, mem


def plot(records: list[dict], providers: list[str], path: Path) -> Path | None:
    """Step time per model and provider, one panel per step kind and token shape."""
    plt = pyplot()
    if plt is None:
        return None
    panels = list(dict.fromkeys((r["step"], r["adapter_dtype"], r["shape"]["tokens_shape"]) for r in records))
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.2 * len(panels)), squeeze=False)
    width = 0.8 / len(providers)
    for ax, (step, adapter_dtype, tokens) in zip(axes[:, 0], panels):
        chosen = [r for r in records if (r["step"], r["adapter_dtype"], r["shape"]["tokens_shape"])
                  == (step, adapter_dtype, tokens)]
        names = list(dict.fromkeys(r["name"] for r in chosen))
        for i, provider in enumerate(providers):
            value = {r["name"]: r.get("median_ms") for r in chosen if r["provider"] == provider}
            xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(names))]
            ax.bar(xs, [value.get(n) or 0 for n in names], width, label=provider)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_title(f"{step}{'' if step == 'full' else f' ({adapter_dtype} adapters)'}, {tokens} tokens: "
                     "step ms (lower is better)", fontsize=9)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("codagen bench models", __doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny configs on CPU: checks the harness, not speed")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--steps", nargs="+", choices=list(STEPS), default=["full"])
    parser.add_argument("--adapter-dtype", nargs="+", choices=["peft", "bf16"], default=["peft"],
                        help="LoRA steps: PEFT's default (float32 adapters) and/or bf16 adapters")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS + FP8_PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", nargs="+", default=["4x4096", "8x2048"], help="batch x sequence shapes")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation among them)")
    parser.add_argument("--timed", type=int, default=8, help="timed steps (the median is reported)")
    parser.add_argument("--out", help="results folder")
    args = parser.parse_args(argv)

    token_shapes = []
    for text in args.tokens:
        batch, _, seq = text.partition("x")
        if not (batch.isdigit() and seq.isdigit()):
            parser.error(f"--tokens: expected BATCHxSEQ such as 4x4096, got {text!r}")
        token_shapes.append((int(batch), int(seq)))
    if args.smoke:
        device, dtype, models = torch.device("cpu"), torch.float32, SMOKE_MODELS
        token_shapes, warmup, timed = [(2, 16)], 1, 2
    else:
        if not torch.cuda.is_available():
            print("codagen bench models needs a CUDA GPU (use --smoke to check the harness on CPU)", file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda"), torch.bfloat16
        models = {name: MODELS[name] for name in args.models}
        warmup, timed = args.warmup, args.timed
    # liger last: its patches are global
    providers = [p for p in (*PROVIDERS[:-1], *FP8_PROVIDERS, "liger") if p in args.providers]
    print(f"model benchmark on {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}, {dtype}, "
          f"{args.layers} layers; providers {providers}", flush=True)
    suite = "models-" + "-".join(args.steps)
    records = []
    for provider in providers:  # provider-major: Liger's global patches come last
        for name, model in models.items():
            if provider == "liger" and model.family not in _LIGER:
                continue
            for step in args.steps:
                for adapter_dtype in (["-"] if step == "full" else args.adapter_dtype):
                    for batch, seq in token_shapes:
                        base = {"suite": "models", "name": name, "pass": "step", "step": step,
                                "adapter_dtype": adapter_dtype, "dtype": str(dtype),
                                "shape": dict(dataclasses.asdict(model), layers=args.layers, batch=batch, seq=seq,
                                              tokens=batch * seq, tokens_shape=f"{batch}x{seq}")}
                        try:
                            record = dict(base, **run_provider(model, args.layers, step, adapter_dtype, batch, seq,
                                                               provider, device, dtype, warmup, timed))
                            print(f"  {name:<16} {step:<13} {adapter_dtype:<4} {batch}x{seq:<5} {provider:<16} "
                                  f"{record['median_ms']:8.2f} ms  peak {record.get('peak_mem_gib') or 0:6.2f} GiB  "
                                  f"idle {_percent(record.get('idle_share'))}  first step "
                                  f"{record['first_step_s']:.1f} s", flush=True)
                        except Exception as error:  # noqa: BLE001 - recorded, the other providers still run
                            record = dict(base, provider=provider, median_ms=None,
                                          error=f"{type(error).__name__}: {error}"[:500],
                                          traceback=traceback.format_exc()[-1500:])
                            print(f"  {name:<16} {step:<13} {provider:<16} failed: {record['error'][:200]}",
                                  flush=True)
                        if provider.endswith("compile"):
                            torch._dynamo.reset()  # its caches hold the compiled model
                        gc.collect()  # a patched model's bound forward is a reference cycle
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                        records.append(record)
                        write_results(suite, records, args.out)  # a run cut short keeps what it measured
    path = write_results(suite, records, args.out)
    chart = plot(records, providers, path.with_suffix(".png"))
    print(f"\nresults: {path}" + (f", chart: {chart}" if chart else ""))
    print(table(records, providers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
