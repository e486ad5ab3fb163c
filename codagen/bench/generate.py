"""``codagen bench generate``: prefill and decode of a Hugging Face Llama with a KV cache (GPU, bf16).

Models: LLaMA-3 1B dims (d 2048, ffn 8192, 32/8 heads, hd 64, vocab 128256) and 8B dims (d 4096,
ffn 14336, 32/8 heads, hd 128, vocab 128256) as ``LlamaForCausalLM`` with random weights; the layer
count is a flag (default 16 for 1B, all of it, and 8 for 8B, a quarter, so that the whole run fits in
about six minutes; each record says how many layers ran).

Cases: prefill of 1 x 8192 and 8 x 2048 tokens (one forward writing the cache, logits of the last
position); decode at batch 1, 8 and 64 after a 2048-token prompt, ``--new-tokens`` greedy tokens
(default 256). A decode step's time is ``(t(T) - t(1)) / (T - 1)`` for a run of ``T`` new tokens
against a run of one (both include the prefill, which cancels).

Providers (the same model object and weights):

- ``eager``: transformers' forward with a ``DynamicCache``, one Python loop step per token;
- ``compile_static``: transformers' forward with a ``StaticCache``, decode steps through
  ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), prefill through ``torch.compile`` (default mode);
- ``codagen_eager``: the patched model (:func:`codagen.patch`) with a ``DynamicCache``, the same decode loop
  as eager (no prefill record: its prefill is codagen's);
- ``codagen``: the patched model; prefill with a ``DynamicCache``, decode through
  :class:`codagen.models.decode.GreedyDecoder` (``StaticCache``, each decode step one CUDA graph replay);
- ``generate``, ``generate_static``: the unpatched model's own ``model.generate()`` (greedy, no EOS token: every
  run makes ``max_new_tokens``, as the loops do), with its default ``DynamicCache`` and with
  ``cache_implementation="static"`` (transformers then compiles the forward, ``mode="reduce-overhead"``);
- ``codagen_generate``: the same call on the patched model, as given (on the GPU a ``StaticCache`` and
  :mod:`codagen.models.generate_loop`'s decode loop, each token one CUDA graph replay); ``codagen_generate_static``
  and ``codagen_generate_dynamic``: with ``cache_implementation="static"`` (the same path, named) and ``"dynamic"``
  (transformers' ``DynamicCache`` and loop, eager steps);
- ``generate_sample``, ``generate_static_sample``, ``codagen_generate_sample``: ``generate``, ``generate_static``
  and ``codagen_generate`` sampling with LLaMA-3's settings (:data:`SAMPLING`: temperature 0.6, top-p 0.9).

``--rl`` adds the RL-shaped case (:func:`bench_rl`): sample ``8 x 256`` tokens with top-p from a 512-token prompt,
then one AdamW training step on the samples, repeated; ``rl_compile`` runs the unpatched model (``generate()`` with a
``StaticCache``, which transformers compiles, and a ``torch.compile``'d training step), ``rl_codagen`` the patched
one (``generate()`` as called, the eager patched training step).

The physical limit of a decode step: it reads every weight (layers and LM head) and the KV cache of
the context once. Each decode record has ``bytes_per_step`` (at the mean context of the run), the
measured device copy bandwidth ``copy_gbps`` (read + write of a 2 GiB copy), ``limit_ms`` = bytes /
bandwidth and ``of_limit`` = limit_ms / median_ms; where the GPU's datasheet bandwidth is known
(:data:`SPEC_GBPS`), ``spec_gbps`` and ``of_spec`` = bytes / spec bandwidth / median_ms, the figure published
comparisons give. Records go to ``codagen-results/<date>-generate.json``
with a chart beside it. ``--smoke`` runs a tiny model on CPU in seconds (it checks the harness, not speed).
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import codagen
from codagen._cli import command_parser, preset_arg
from codagen.models import generate_loop
from codagen.models.decode import GreedyDecoder
from codagen.models.hf_cache import cache_field

from .common import OUT_HELP, median_ms, pyplot, wall_ms, write_results

__all__ = ["main", "ModelShape", "MODELS"]

PROVIDERS = ("eager", "compile_static", "codagen_eager", "codagen", "generate", "generate_static", "codagen_generate",
             "codagen_generate_static", "codagen_generate_dynamic", "generate_sample", "generate_static_sample",
             "codagen_generate_sample")
#: the sampling providers' settings: LLaMA-3's generation_config (temperature 0.6, top-p 0.9)
SAMPLING = dict(do_sample=True, temperature=0.6, top_p=0.9)
#: datasheet memory bandwidth (GB/s) by GPU name: ``of_spec`` in the decode records
SPEC_GBPS = {"NVIDIA H200": 4800, "NVIDIA H100 80GB HBM3": 3350, "NVIDIA A100-SXM4-80GB": 2039}
#: the providers that call model.generate(); their prefill is another provider's forward (no prefill record)
GENERATE_PROVIDERS = PROVIDERS[4:]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int = 128256

    def config(self, layers: int):
        from transformers import LlamaConfig
        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
                           num_hidden_layers=layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, head_dim=self.head_dim, rope_theta=500000.0,
                           max_position_embeddings=131072, attn_implementation="sdpa", use_cache=True)

    def weight_bytes(self, layers: int, element: int = 2) -> int:
        """Every weight a decode step reads: the layers' projections and norms, the final norm, the LM head."""
        d, f = self.hidden, self.ffn
        qkv = d * (self.heads + 2 * self.kv_heads) * self.head_dim
        per_layer = qkv + self.heads * self.head_dim * d + 3 * d * f + 2 * d
        return element * (layers * per_layer + d + self.vocab * d)

    def kv_bytes(self, layers: int, batch: int, context: float, element: int = 2) -> float:
        return element * 2 * layers * batch * context * self.kv_heads * self.head_dim


MODELS = {
    "llama3-1b": ModelShape(2048, 8192, 32, 8, 64, layers=16),
    "llama3-8b": ModelShape(4096, 14336, 32, 8, 128, layers=8),  # 8 of its 32 layers: time and compile budget
}
SMOKE_MODEL = ModelShape(64, 128, 4, 2, 16, layers=2, vocab=256)


def _cache_kwargs(cache) -> dict:
    return {cache_field(): cache}


def copy_bandwidth_gbps(device, nbytes: int = 2 << 30) -> float:
    """Read + write bytes per second of a device-to-device copy of ``nbytes`` (the decode step's roofline)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


# --- providers ---------------------------------------------------------------------------------------------
def _loop_generate(forward: Callable, make_cache: Callable, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy tokens by a Python loop over ``forward`` (prefill, then one token per step)."""
    cache = make_cache()
    logits = forward(ids, use_cache=True, logits_to_keep=1, **_cache_kwargs(cache)).logits
    token = logits[:, -1].argmax(-1, keepdim=True)
    tokens = [token]
    for _ in range(new_tokens - 1):
        logits = forward(token, use_cache=True, logits_to_keep=1, **_cache_kwargs(cache)).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    return torch.cat(tokens, dim=1)


class Providers:
    """The four ways to run one model (see the module docstring); switches the model's patch state."""

    def __init__(self, model, max_cache_len: int, device):
        from transformers import DynamicCache, StaticCache
        self.model, self.device = model, device
        self.dynamic = lambda: DynamicCache(config=model.config)
        self._static = {}  # (batch, length) -> StaticCache (reset per run: cudagraphs keep its addresses)

        def static(batch, length=max_cache_len):
            cache = self._static.get((batch, length))
            if cache is None:
                cache = self._static[batch, length] = StaticCache(config=model.config, max_cache_len=length)
            cache.reset()
            return cache
        self.static = static
        self.compiled_decode = self.compiled_prefill = None
        self.decoder = None
        self.max_cache_len = max_cache_len

    def _state(self, patched: bool):
        if patched != codagen.is_patched(self.model):
            (codagen.patch if patched else codagen.unpatch)(self.model)

    def prefill(self, name: str) -> Callable[[torch.Tensor], object]:
        model = self.model
        if name in ("eager", "codagen"):
            def run(ids):
                self._state(name != "eager")
                return model(ids, use_cache=True, logits_to_keep=1, **_cache_kwargs(self.dynamic())).logits
            return run
        if self.compiled_prefill is None:
            self._state(False)
            self.compiled_prefill = torch.compile(model.forward)

        def run(ids):
            self._state(False)
            return self.compiled_prefill(ids, use_cache=True, logits_to_keep=1,
                                         **_cache_kwargs(self.static(*ids.shape))).logits
        return run

    def generate(self, name: str) -> Callable[[torch.Tensor, int], torch.Tensor]:
        model = self.model
        if name in GENERATE_PROVIDERS:
            settings = dict(SAMPLING) if name.endswith("_sample") else dict(do_sample=False)
            base = name.removesuffix("_sample")
            if base.endswith(("_static", "_dynamic")):
                settings["cache_implementation"] = base.rsplit("_", 1)[1]

            def run(ids, new_tokens):
                self._state(name.startswith("codagen"))
                sequences = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                           pad_token_id=0, **settings)
                return sequences[:, ids.shape[1]:]
            return run
        if name in ("eager", "codagen_eager"):
            def run(ids, new_tokens):
                self._state(name == "codagen_eager")
                return _loop_generate(model, self.dynamic, ids, new_tokens)
            return run
        if name == "compile_static":
            if self.compiled_decode is None:
                self._state(False)
                self.compiled_decode = torch.compile(model.forward, mode="reduce-overhead")

            def run(ids, new_tokens):
                self._state(False)
                cache = self.static(ids.shape[0])
                logits = model(ids, use_cache=True, logits_to_keep=1, **_cache_kwargs(cache)).logits  # eager prefill
                token = logits[:, -1].argmax(-1, keepdim=True)
                tokens = [token]
                for _ in range(new_tokens - 1):
                    logits = self.compiled_decode(token.clone(), use_cache=True, logits_to_keep=1,
                                                  **_cache_kwargs(cache)).logits
                    token = logits[:, -1].argmax(-1, keepdim=True)
                    tokens.append(token)
                return torch.cat(tokens, dim=1)
            return run

        def run(ids, new_tokens):
            self._state(True)
            if self.decoder is None:
                self.decoder = GreedyDecoder(model, max_cache_len=self.max_cache_len)
            return self.decoder(ids, max_new_tokens=new_tokens)
        return run


# --- driver ----------------------------------------------------------------------------------------------
def _timer(device) -> Callable[[Callable], float]:
    if device.type != "cuda":
        return lambda fn: wall_ms(fn, reps=1)

    def run_ms(fn, reps: int = 2) -> float:  # whole runs (seconds each): CUDA events around each, median
        fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    return run_ms


def _error(record: dict, error: Exception) -> None:
    record["median_ms"] = None
    record["error"] = f"{type(error).__name__}: {error}"[:500]
    record["traceback"] = traceback.format_exc()[-1500:]


def random_model(shape: ModelShape, layers: int, device, dtype):
    """A ``LlamaForCausalLM`` of ``shape`` with random weights (seed 0) and no EOS token (random weights: every run
    makes all the tokens asked for). Dynamo is reset first: transformers' forward wrapper is one function for every
    model, so each model gets a fresh recompilation budget (else the second model's compiled decode steps run
    eagerly once Dynamo's recompile limit is reached)."""
    from transformers import LlamaForCausalLM
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(shape.config(layers)).to(dtype)
    model.generation_config.eos_token_id = None
    return model


def bench_model(name: str, shape: ModelShape, layers: int, providers: list[str], device, dtype, prefill_cases,
                decode_cases, context: int, new_tokens: int, bandwidth_gbps: float | None,
                records: list[dict], save: Callable[[], object]) -> None:
    """Appends one record per (case, provider) to ``records`` and calls ``save`` after each case, so a run cut
    short keeps what it measured."""
    model = random_model(shape, layers, device, dtype).eval()
    runs = Providers(model, max_cache_len=context + new_tokens, device=device)
    timer = _timer(device)
    base = {"suite": "generate", "name": name, "shape": dict(dataclasses.asdict(shape), layers=layers),
            "dtype": str(dtype)}
    with torch.no_grad():
        for batch, seq in prefill_cases:
            ids = torch.randint(0, shape.vocab, (batch, seq), device=device)
            for provider in [p for p in providers if p != "codagen_eager" and p not in GENERATE_PROVIDERS]:
                record = dict(base, case=f"prefill {batch}x{seq}", pass_="prefill", provider=provider,
                              batch=batch, tokens=batch * seq)
                try:
                    run = runs.prefill(provider)
                    started = time.perf_counter()
                    run(ids)
                    record["setup_s"] = round(time.perf_counter() - started, 2)
                    record["median_ms"] = (median_ms(lambda: run(ids)) if device.type == "cuda"
                                           else wall_ms(lambda: run(ids), reps=1))
                except Exception as error:  # noqa: BLE001 - recorded, the other providers still run
                    _error(record, error)
                records.append(record)
                _print(record)
            save()
        for batch in decode_cases:
            ids = torch.randint(0, shape.vocab, (batch, context), device=device)
            reference = None
            for provider in providers:
                bytes_per_step = shape.weight_bytes(layers, dtype.itemsize) + shape.kv_bytes(
                    layers, batch, context + new_tokens / 2, dtype.itemsize)
                record = dict(base, case=f"decode b{batch}", pass_="decode", provider=provider, batch=batch,
                              context=context, new_tokens=new_tokens, bytes_per_step=bytes_per_step)
                counts = _loop_counts(model)  # the decode loop's captures and replays so far (codagen_generate*)
                try:
                    run = runs.generate(provider)
                    started = time.perf_counter()
                    tokens = run(ids, new_tokens)  # warm-up: compiles, captures
                    record["setup_s"] = round(time.perf_counter() - started, 2)
                    full = timer(lambda: run(ids, new_tokens))
                    one = timer(lambda: run(ids, 1))
                    record["median_ms"] = (full - one) / (new_tokens - 1)
                    record["run_ms"], record["prefill_and_first_ms"] = full, one
                    record["tokens_per_s"] = 1e3 * batch / record["median_ms"]
                    if provider.startswith("codagen_generate") and not provider.endswith("_dynamic"):
                        captures, replays = _loop_counts(model)
                        record["loop_captures"], record["loop_replays"] = captures - counts[0], replays - counts[1]
                    if not provider.endswith("_sample"):  # the greedy providers' tokens against the first one's
                        if reference is None:
                            reference = tokens
                        record["tokens_equal_first_provider"] = float((tokens == reference).float().mean())
                    if bandwidth_gbps:
                        record["copy_gbps"] = bandwidth_gbps
                        record["limit_ms"] = bytes_per_step / bandwidth_gbps / 1e6
                        record["of_limit"] = record["limit_ms"] / record["median_ms"]
                    spec = SPEC_GBPS.get(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
                    if spec:
                        record["spec_gbps"] = spec
                        record["of_spec"] = bytes_per_step / spec / 1e6 / record["median_ms"]
                except Exception as error:  # noqa: BLE001
                    _error(record, error)
                records.append(record)
                _print(record)
            save()
    del runs, model
    if device.type == "cuda":
        torch.cuda.empty_cache()


#: the RL-shaped case's providers (see the module docstring)
RL_PROVIDERS = ("rl_compile", "rl_codagen")


def bench_rl(shape: ModelShape, layers: int, providers: list[str], device, dtype, records: list[dict],
             save: Callable[[], object], batch: int = 8, prompt: int = 512, new_tokens: int = 256,
             iterations: int = 3) -> None:
    """The RL-shaped case: ``generate()`` samples ``batch x new_tokens`` tokens with top-p (:data:`SAMPLING`) from a
    ``prompt``-token prompt, then one AdamW step trains on the samples (loss on the sampled tokens), repeated; the
    weights change every iteration, so every ``generate()`` reads new weights. One record per provider: the median
    iteration, its generate and train parts, and the first iteration (compiles, captures) as ``setup_s``."""
    for provider in providers:
        record = {"suite": "generate", "name": f"rl {batch}x{new_tokens}", "case": f"rl {batch}x{new_tokens}",
                  "pass_": "rl", "provider": provider, "batch": batch, "prompt": prompt, "new_tokens": new_tokens,
                  "shape": dict(dataclasses.asdict(shape), layers=layers), "dtype": str(dtype),
                  "sampling": SAMPLING, "optimizer": "AdamW (fused on CUDA)"}
        try:
            _rl_iterations(record, shape, layers, device, dtype, batch, prompt, new_tokens, iterations)
        except Exception as error:  # noqa: BLE001
            _error(record, error)
        records.append(record)
        _print(record)
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _rl_iterations(record: dict, shape: ModelShape, layers: int, device, dtype, batch: int, prompt: int,
                   new_tokens: int, iterations: int) -> None:
    """One provider's RL iterations (:func:`bench_rl`), timed into ``record``."""
    model = random_model(shape, layers, device, dtype)
    patched = record["provider"] == "rl_codagen"
    if patched:
        codagen.patch(model)
    train_forward = model if patched else torch.compile(model)
    settings = dict(SAMPLING, **({} if patched else {"cache_implementation": "static"}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    ids = torch.randint(0, shape.vocab, (batch, prompt), device=device)

    def iteration() -> tuple[float, float]:
        model.eval()
        started = time.perf_counter()
        sequences = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   pad_token_id=0, **settings)
        _sync(device)
        sampled = time.perf_counter()
        model.train()
        labels = sequences.clone()
        labels[:, :prompt] = -100
        train_forward(input_ids=sequences, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        return 1e3 * (sampled - started), 1e3 * (time.perf_counter() - sampled)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    iteration()
    record["setup_s"] = round(time.perf_counter() - started, 2)
    parts = [iteration() for _ in range(iterations)]
    record["median_ms"] = statistics.median(g + t for g, t in parts)
    record["generate_ms"] = statistics.median(g for g, _ in parts)
    record["train_ms"] = statistics.median(t for _, t in parts)
    record["iterations"] = iterations
    if device.type == "cuda":
        record["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loop_counts(model) -> tuple[int, int]:
    loops = generate_loop.loops_of(model).values()
    return sum(loop.captures for loop in loops), sum(loop.replays for loop in loops)


def _print(r: dict) -> None:
    if r["median_ms"] is None:
        status = r["error"][:120]
    elif r["pass_"] == "rl":
        status = f"{r['median_ms']:.1f} ms/iteration (generate {r['generate_ms']:.1f}, train {r['train_ms']:.1f})"
    elif r["pass_"] == "decode":
        status = f"{r['median_ms']:.3f} ms/step  {r['tokens_per_s']:.0f} tok/s" + (
            f"  {100 * r['of_limit']:.0f}% of limit" if "of_limit" in r else "") + (
            f" ({100 * r['of_spec']:.0f}% of spec)" if "of_spec" in r else "")
    else:
        status = f"{r['median_ms']:.3f} ms"
    print(f"  {r['name']:<10} {r['case']:<15} {r['provider']:<15} {status}", flush=True)


def plot(records: list[dict], providers: list[str], path: Path) -> Path | None:
    """Decode: fraction of the physical limit per provider; prefill: time relative to compile_static."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for ax, pass_ in zip(axes, ("decode", "prefill")):
        cases = list(dict.fromkeys((r["name"], r["case"]) for r in records if r["pass_"] == pass_))
        width = 0.8 / len(providers)
        for i, provider in enumerate(providers):
            values = []
            for name, case in cases:
                rows = {r["provider"]: r for r in records if (r["name"], r["case"]) == (name, case)}
                mine = rows.get(provider, {})
                if pass_ == "decode":
                    values.append(mine.get("of_limit") or 0)
                else:
                    ref = rows.get("compile_static", {}).get("median_ms") or rows.get("eager", {}).get("median_ms")
                    values.append(ref / mine["median_ms"] if mine.get("median_ms") and ref else 0)
            xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(cases))]
            ax.bar(xs, values, width, label=provider)
        ax.set_xticks(range(len(cases)), [f"{n}\n{c}" for n, c in cases], fontsize=7)
        ax.set_ylabel("fraction of the bandwidth limit" if pass_ == "decode" else "speed vs compile_static (or eager)")
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_title(f"{pass_} (higher is better)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("codagen bench generate", __doc__)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU: checks the harness, not speed")
    parser.add_argument("--quick", action="store_true", help="64 new tokens instead of 256")
    parser.add_argument("--models", nargs="+", type=preset_arg(list(MODELS)), default=list(MODELS),
                        help=f"{', '.join(MODELS)} (default: both)")
    parser.add_argument("--layers", type=int, nargs="+", help="layers per model (default: 16 for 1B, 8 for 8B)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS,
                        help="default: all (without compile_static under --smoke: minutes of CPU compilation)")
    parser.add_argument("--new-tokens", type=int, help="decode tokens per run (default 256; 64 with --quick)")
    parser.add_argument("--rl", action="store_true",
                        help="add the RL-shaped case (sample, then train), at llama3-1b dims")
    parser.add_argument("--rl-only", action="store_true", help="only the RL-shaped case")
    parser.add_argument("--out", help=OUT_HELP)
    args = parser.parse_args(argv)
    providers = list(args.providers or PROVIDERS)
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        models = {"smoke": (SMOKE_MODEL, SMOKE_MODEL.layers)}
        prefill_cases, decode_cases, context = [(1, 64), (2, 32)], [1, 2], 32
        new_tokens = args.new_tokens or 4
        if args.providers is None:
            compiling = ("compile_static", "generate_static", "generate_static_sample")
            providers = [p for p in providers if p not in compiling]
        bandwidth = None
    else:
        if not torch.cuda.is_available():
            print("codagen bench generate needs a CUDA GPU (use --smoke to check the harness on CPU)", file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda"), torch.bfloat16
        layers = args.layers or [MODELS[m].layers for m in args.models]
        if len(layers) != len(args.models):
            parser.error("--layers: give one count per model")
        models = {m: (MODELS[m], n) for m, n in zip(args.models, layers)}
        prefill_cases, decode_cases, context = [(1, 8192), (8, 2048)], [1, 8, 64], 2048
        new_tokens = args.new_tokens or (64 if args.quick else 256)
        bandwidth = copy_bandwidth_gbps(device)
        print(f"device copy bandwidth: {bandwidth:.0f} GB/s (read + write)", flush=True)
    if new_tokens < 2:
        parser.error("--new-tokens: at least 2 (a step's time is the difference of two runs)")
    print(f"generate benchmark on {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}, {dtype}; "
          f"providers {providers}", flush=True)
    started = time.perf_counter()
    records = []
    save = lambda: write_results("generate", records, args.out)  # noqa: E731
    for name, (shape, layers) in ({} if args.rl_only else models).items():
        bench_model(name, shape, layers, providers, device, dtype, prefill_cases, decode_cases, context, new_tokens,
                    bandwidth, records, save)
    if args.rl or args.rl_only:
        if args.smoke:  # no CPU compile: seconds, not minutes
            bench_rl(SMOKE_MODEL, SMOKE_MODEL.layers, ["rl_codagen"], device, dtype, records, save, batch=2,
                     prompt=16, new_tokens=4, iterations=1)
        else:
            shape = MODELS["llama3-1b"]
            bench_rl(shape, shape.layers, list(RL_PROVIDERS), device, dtype, records, save)
    path = write_results("generate", records, args.out)
    chart = plot([r for r in records if r["pass_"] != "rl"], providers, path.with_suffix(".png"))
    print(f"\n{time.perf_counter() - started:.0f} s; results: {path}" + (f", chart: {chart}" if chart else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
