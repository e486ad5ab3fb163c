"""``codagen bench checkpoint``: peak memory and step time of a Hugging Face Llama training step with
activation checkpointing, patched by codagen against unpatched (GPU, bf16).

Variants (the same weights and batch; ``model.gradient_checkpointing_enable`` with ``use_reentrant=False``):

- ``hf+checkpoint``: the unpatched ``LlamaForCausalLM`` (SDPA), each decoder layer checkpointed;
- ``codagen+checkpoint``: patched, each regrouped block checkpointed (keeps ``x, normed, rstd``);
- ``codagen+keep_attention``: patched, ``context_fn=codagen.models.keep_attention`` (attention's outputs kept,
  the fused GEMMs recomputed);
- ``codagen``: patched without checkpointing, for reference (``--variants`` adds ``hf``, unpatched without it).

Shape: LLaMA-3-8B layers (d 4096, ffn 14336, 32/8 heads, head_dim 128), 8 layers, vocabulary 32768
(``--vocab``), 4 x 8192 tokens, bf16 parameters, labels on every token. M = 32768 tokens has few shipped
Triton tunings at this shape: by default each kernel takes the untimed choice of the nearest shipped bucket
(``CODAGEN_TRITON_AUTOTUNE=1`` times them instead, minutes). A step is forward + backward with fresh
gradients; ``median_ms`` is the median over ``--steps`` timed steps after two warm-up steps, ``peak_mem_gib``
the peak allocation of one step above what was allocated before it (the weights). Records go to
``codagen-results/<date>-checkpoint.json`` in the current directory (``--out`` to change).
``--smoke`` runs a tiny model on CPU to check the harness.
"""
from __future__ import annotations

import copy
import os
import statistics
import sys
import time
import traceback
import warnings

import torch

from codagen._cli import command_parser
from codagen.models import keep_attention, patch

from .common import OUT_HELP, peak_gib, write_results

__all__ = ["main", "VARIANTS"]

VARIANTS = ("hf+checkpoint", "codagen+checkpoint", "codagen+keep_attention", "codagen", "hf")
DEFAULT_VARIANTS = VARIANTS[:4]


def build_model(vocab: int, layers: int, smoke: bool, device):
    from transformers import LlamaConfig, LlamaForCausalLM
    dims = (dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
            if smoke else dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128))
    config = LlamaConfig(vocab_size=vocab, num_hidden_layers=layers, rope_theta=500000.0, use_cache=False,
                         attn_implementation="sdpa", **dims)
    with torch.device(device):  # initialized where it runs (1.7B parameters at the 8B shape)
        return LlamaForCausalLM(config)


def prepare(base, variant: str):
    model = copy.deepcopy(base)
    if variant != "codagen" and variant != "hf":
        kwargs = {"use_reentrant": False}
        if variant == "codagen+keep_attention":
            kwargs["context_fn"] = keep_attention
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5.2x: a deprecated alias
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if variant.startswith("codagen"):
        patch(model)
    return model.train()


def measure(model, ids, steps: int, device) -> dict:
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        model(input_ids=ids, labels=ids).loss.backward()
    step(), step()  # warm-up: kernels compiled (and tuned, if autotuning is on)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - started))
    record = {"median_ms": statistics.median(times), "step_ms": times}
    if device.type == "cuda":
        record["peak_mem_gib"] = peak_gib(step, device, params)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("codagen bench checkpoint", __doc__)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU: checks the harness, not speed")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(DEFAULT_VARIANTS))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (default 5)")
    parser.add_argument("--out", help=OUT_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        device, dtype, batch, seq, vocab, layers = torch.device("cpu"), torch.float32, 2, 32, 128, 2
    else:
        if not torch.cuda.is_available():
            print("codagen bench checkpoint needs a CUDA GPU (use --smoke to check the harness on CPU)",
                  file=sys.stderr)
            return 2
        device, dtype, batch, seq, vocab, layers = (torch.device("cuda"), torch.bfloat16, args.batch, args.seq,
                                                    args.vocab, args.layers)
    torch.manual_seed(0)
    base = build_model(vocab, layers, args.smoke, device).to(dtype)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    c = base.config
    shape = {"hidden": c.hidden_size, "ffn": c.intermediate_size, "heads": c.num_attention_heads,
             "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "layers": layers, "vocab": vocab,
             "batch": batch, "seq": seq, "tokens": batch * seq}
    autotune = os.environ.get("CODAGEN_TRITON_AUTOTUNE", "unset (untimed choices)")
    print(f"checkpoint benchmark on {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}, {dtype}, "
          f"{shape}, CODAGEN_TRITON_AUTOTUNE={autotune}", flush=True)
    records = []
    for variant in args.variants:
        record = {"suite": "checkpoint", "variant": variant, "shape": shape, "dtype": str(dtype),
                  "triton_autotune": autotune}
        try:
            model = prepare(base, variant)
            record.update(measure(model, ids, args.steps, device))
        except Exception as error:  # noqa: BLE001 - recorded (e.g. out of memory); the other variants still run
            record.update(median_ms=None, error=f"{type(error).__name__}: {error}"[:500],
                          traceback=traceback.format_exc()[-1500:])
        model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        records.append(record)
        peak = record.get("peak_mem_gib")
        status = (f"{record['median_ms']:.1f} ms" + (f", peak {peak:.2f} GiB" if peak is not None else "")
                  if record["median_ms"] is not None else record["error"][:120])
        print(f"  {variant:<24} {status}", flush=True)
        write_results("checkpoint", records, args.out)  # after every variant: a run cut short keeps what it has
    path = write_results("checkpoint", records, args.out)
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
