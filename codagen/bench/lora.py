"""``codagen bench lora``: a LoRA fine-tuning step of a Hugging Face ``LlamaForCausalLM`` (GPU, bf16).

Rank 16, alpha 32, LoRA on all seven projections (q, k, v, o, gate, up, down), dropout 0, frozen base
weights, AdamW on the LoRA parameters; random weights; the loss over M = 4 x 4096 tokens of one fixed
batch. Shapes: LLaMA-3 1B (d 2048, f 8192, GQA 32/8, hd 64) and 8B (d 4096, f 14336, GQA 32/8, hd 128),
2 layers, vocabulary 32768 (``--vocab``). Providers (each builds its own model from the same seed):

- ``eager``: ``peft.get_peft_model`` on the transformers model;
- ``compile``: the same, ``torch.compile``-d;
- ``liger``: ``liger_kernel.transformers.apply_liger_kernel_to_llama()`` before the model is built (RMSNorm,
  RoPE, SwiGLU, fused linear cross-entropy), then PEFT. Liger patches transformers' module globally, so
  it runs after the other providers;
- ``codagen``: ``codagen.patch(peft_model)``: every fused GEMM carries its adapters' low-rank pair.

Per provider and shape: the model is built, ``--warmup`` steps run (torch.compile's compilation among
them), then ``--steps`` steps are timed one by one with CUDA events; the record holds the median step
time, tokens/s, the peak of ``torch.cuda.max_memory_allocated`` over the steps (the model included) and
the losses of the first and last step, compared with eager's. Records go to
``codagen-results/<date>-lora-step-<shapes>[-<providers>].json`` with a chart beside it. ``--smoke`` runs a
tiny model on CPU (fp32, wall-clock) to check the harness.
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
from codagen._cli import command_parser, preset_arg

from .common import OUT_HELP, pyplot, write_results

__all__ = ["main", "LoraShape", "SHAPES", "PROVIDERS"]

PROVIDERS = ("eager", "compile", "codagen", "liger")  # liger last: its patches are global
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclasses.dataclass(frozen=True)
class LoraShape:
    d: int
    f: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int = 2


SHAPES = {"llama3-1b": LoraShape(2048, 8192, 32, 8, 64), "llama3-8b": LoraShape(4096, 14336, 32, 8, 128)}
SMOKE_SHAPES = {"smoke": LoraShape(64, 128, 4, 2, 16)}


def build(shape: LoraShape, vocab: int, provider: str, device, dtype, rank: int, alpha: float):
    """The provider's PEFT model (seeded: every provider starts from the same weights)."""
    import peft
    import transformers
    if provider == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=shape.d, intermediate_size=shape.f, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        rope_theta=500000.0, max_position_embeddings=8192, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                       target_modules=TARGETS))
    model.train()
    if provider == "codagen":
        codagen.patch(model)
    step_model = torch.compile(model) if provider == "compile" else model
    return model, step_model


def run_provider(shape: LoraShape, vocab: int, batch: int, seq: int, provider: str, device, dtype, warmup: int,
                 steps: int, rank: int, alpha: float) -> dict:
    """Build, warm up and time one provider; a record of its step times, memory and losses."""
    record = {"provider": provider}
    started = time.perf_counter()
    model, step_model = build(shape, vocab, provider, device, dtype, rank, alpha)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    generator = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
    record["trainable_params"] = sum(p.numel() for p in params)
    cuda = device.type == "cuda"

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    losses, times = [], []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        record["model_gib"] = torch.cuda.memory_allocated() / 2 ** 30
    for i in range(warmup + steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(step())
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t = time.perf_counter()
            losses.append(step())
            elapsed = 1e3 * (time.perf_counter() - t)
        if i == warmup - 1:
            record["setup_s"] = round(time.perf_counter() - started, 2)
        if i >= warmup:
            times.append(elapsed)
    record["step_ms"] = times
    record["median_ms"] = statistics.median(times)
    record["tokens_per_s"] = batch * seq / (record["median_ms"] / 1e3)
    record["losses"] = [float(x) for x in losses]
    if cuda:
        record["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    return record


def check_losses(records: list[dict]) -> None:
    """Each provider's first and last loss relative to eager's (same weights, batch and optimizer)."""
    eager = {r["name"]: r for r in records if r["provider"] == "eager" and "losses" in r}
    for r in records:
        base = eager.get(r["name"])
        if base is None or "losses" not in r:
            continue
        r["loss_rel_diff_vs_eager"] = [abs(r["losses"][i] - base["losses"][i]) / abs(base["losses"][i])
                                       for i in (0, -1)]


def table(records: list[dict], providers: list[str]) -> str:
    """Markdown: tokens/s and peak memory per provider, codagen over the best peer."""
    rows = {}
    for r in records:
        rows.setdefault(r["name"], {})[r["provider"]] = r
    head = ("| shape | " + " | ".join(f"{p} tok/s (GiB)" for p in providers)
            + " | codagen / best peer (tok/s) | codagen peak / their lowest |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, by in rows.items():
        cells = []
        for p in providers:
            r = by.get(p, {})
            mem = f" ({r['peak_mem_gib']:.1f})" if r.get("peak_mem_gib") is not None else ""
            cells.append(f"{r['tokens_per_s']:,.0f}{mem}" if r.get("tokens_per_s") else "—")
        peers = [by[p] for p in ("eager", "compile", "liger") if by.get(p, {}).get("tokens_per_s")]
        ours = by.get("codagen", {})
        speed = f"{ours['tokens_per_s'] / max(r['tokens_per_s'] for r in peers):.3f}x" if ours.get(
            "tokens_per_s") and peers else "—"
        mems = [r["peak_mem_gib"] for r in peers if r.get("peak_mem_gib")]
        mem = f"{ours['peak_mem_gib'] / min(mems):.3f}x" if ours.get("peak_mem_gib") and mems else "—"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {speed} | {mem} |")
    return "\n".join(lines)


def plot(records: list[dict], providers: list[str], path: Path) -> Path | None:
    """Tokens/s and peak memory per shape and provider."""
    plt = pyplot()
    if plt is None:
        return None
    names = list(dict.fromkeys(r["name"] for r in records))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(providers)
    for ax, key, label in ((axes[0], "tokens_per_s", "tokens / s (higher is better)"),
                           (axes[1], "peak_mem_gib", "peak memory, GiB (lower is better)")):
        for i, provider in enumerate(providers):
            value = {r["name"]: r.get(key) for r in records if r["provider"] == provider}
            xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(names))]
            ax.bar(xs, [value.get(n) or 0 for n in names], width, label=provider)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("LoRA step (r 16, all projections, frozen base, bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("codagen bench lora", __doc__)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU: checks the harness, not speed")
    parser.add_argument("--shapes", nargs="+", type=preset_arg(list(SHAPES)), default=list(SHAPES),
                        help=f"{', '.join(SHAPES)} (default: both)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation among them)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    parser.add_argument("--out", help=OUT_HELP)
    args = parser.parse_args(argv)

    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        shapes, vocab, batch, seq = SMOKE_SHAPES, 128, 2, 32
        steps, warmup = min(args.steps, 3), min(args.warmup, 1)
    else:
        if not torch.cuda.is_available():
            print("codagen bench lora needs a CUDA GPU (use --smoke to check the harness on CPU)", file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda"), torch.bfloat16
        shapes = {n: SHAPES[n] for n in args.shapes}
        vocab, batch, seq, steps, warmup = args.vocab, args.batch, args.seq, args.steps, args.warmup
    shapes = {n: dataclasses.replace(s, layers=args.layers) for n, s in shapes.items()}
    providers = [p for p in PROVIDERS if p in args.providers]  # liger last
    print(f"LoRA step benchmark on {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}, {dtype}, "
          f"M = {batch} x {seq} tokens, r {args.rank}, alpha {args.alpha}; providers {providers}", flush=True)
    # the file names the shapes, and the providers when not all ran (separate runs keep separate files)
    suite = "lora-step-" + "-".join(shapes) + ("" if set(providers) == set(PROVIDERS) else "-" + "-".join(providers))
    records = []
    for provider in providers:  # provider-major: Liger's global patches come last
        for name, shape in shapes.items():
            base = {"suite": "lora", "name": name, "pass": "step", "dtype": str(dtype),
                    "shape": dict(dataclasses.asdict(shape), tokens=batch * seq, batch=batch, seq=seq, vocab=vocab,
                                  rank=args.rank, alpha=args.alpha, targets=TARGETS)}
            try:
                record = dict(base, **run_provider(shape, vocab, batch, seq, provider, device, dtype, warmup, steps,
                                                   args.rank, args.alpha))
                print(f"  {name:<10} {provider:<8} {record['median_ms']:8.2f} ms  {record['tokens_per_s']:>12,.0f} "
                      f"tok/s  peak {record.get('peak_mem_gib') or 0:.2f} GiB  loss {record['losses'][0]:.4f}",
                      flush=True)
            except Exception as error:  # noqa: BLE001 - recorded, the other providers still run
                record = dict(base, provider=provider, median_ms=None, error=f"{type(error).__name__}: {error}"[:500],
                              traceback=traceback.format_exc()[-1500:])
                print(f"  {name:<10} {provider:<8} failed: {record['error'][:200]}", flush=True)
            if provider == "compile":
                torch._dynamo.reset()  # its caches hold the compiled model
            gc.collect()  # a patched model's bound forward is a reference cycle
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the provider's model is gone: the next one starts from an empty GPU
            records.append(record)
            check_losses(records)
            write_results(suite, records, args.out)  # after every run: a run cut short keeps what it measured
    path = write_results(suite, records, args.out)
    chart = plot(records, providers, path.with_suffix(".png"))
    print(f"\nresults: {path}" + (f", chart: {chart}" if chart else ""))
    print(table(records, providers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
