"""``codagen tune``: time the fused kernels' configurations for a model's training steps, ahead (GPU).

    codagen tune --model llama3-8b --tokens 4096,8192,16384,32768 [--layers 1] [--seq 4096]
                 [--table PATH] [--retune]

Without it, a shape no tuned entry covers runs an untimed choice (the nearest tuned bucket, else a
heuristic; docs/triton.md), within a few percent of the tuned one. This command makes those shapes
exact: for each token count it builds the model (``--model``: a preset below, or a Hugging Face
``config.json``) with ``--layers`` decoder layers (every layer runs the same GEMMs, so one is enough)
and random weights in bf16 on the GPU, patches it (``codagen.patch``) and runs one training step with
tuning on. Every fused GEMM whose tuning key (program, dtypes, M/N/K power-of-two bucket) has no entry
yet is timed over its candidate configurations and the fastest is written to the tuning cache
(``$CODAGEN_CACHE_DIR/triton/tuning.json``, or ``--table``); keys that have one (the cache's or the
shipped table's) are skipped, so an interrupted run resumes where it stopped, and a second run times
nothing. ``--retune`` times them all again.

Presets (Hugging Face dims; vocabularies as shipped): d2048 (the Llama of the benchmarks: d 2048, ffn
8192, 32/8 heads, vocab 32768), llama3-1b, llama3-3b, llama3-8b, qwen3-14b, qwen3-32b, llama3-70b.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from codagen._cli import command_parser, preset_name
from codagen.backends import get_backend, use_backend
from codagen.backends.triton.configs import TuningCache
from codagen.models import patch

__all__ = ["PRESETS", "model_config", "tune_steps", "main"]

_LLAMA3 = dict(model_type="llama", vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
               rms_norm_eps=1e-5)
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960,
              rms_norm_eps=1e-6)
#: model name -> Hugging Face config fields
PRESETS = {
    "d2048": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=32768, max_position_embeddings=32768),
    "llama3-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=64, tie_word_embeddings=True),
    "llama3-3b": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
                      head_dim=128, tie_word_embeddings=True),
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8),
    "qwen3-14b": dict(_QWEN3, hidden_size=5120, intermediate_size=17408, num_attention_heads=40, num_key_value_heads=8),
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8),
    "llama3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                       num_key_value_heads=8),
}


def model_config(model: str, layers: int):
    """The ``transformers`` config of a preset name (``llama3-8b``, or ``llama3_8b``) or a ``config.json`` path,
    with ``layers`` layers."""
    import transformers
    if preset_name(model) in PRESETS:
        fields = dict(PRESETS[preset_name(model)])
    else:
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        try:
            fields = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"--model: expected a preset ({', '.join(PRESETS)}) or a Hugging Face config.json, "
                             f"got {model!r} ({error})") from None
        if "model_type" not in fields:
            raise ValueError(f"--model: {path} has no model_type")
    fields["num_hidden_layers"] = layers
    if isinstance(fields.get("layer_types"), list):  # Qwen2/Qwen3 config.json list one type per published layer
        fields["layer_types"] = fields["layer_types"][:layers]
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def _token_counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"--tokens: expected comma-separated positive token counts such as 4096,8192, got {text!r}")
    return counts


def tune_steps(model: torch.nn.Module, counts: list[int], seq: int, backend) -> list[dict]:
    """One training step of the patched ``model`` per token count on the Triton ``backend`` with tuning
    on; prints a progress line per step and returns, per step, how many kernel keys it met for the
    first time and how many of them it timed."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    autotune, backend.autotune = backend.autotune, True
    start, steps = time.perf_counter(), []
    try:
        with use_backend("triton"):
            for i, tokens in enumerate(counts):
                length = min(tokens, seq)
                ids = torch.randint(0, vocab, (tokens // length, length), device=device)
                seen, t0 = set(backend.choices), time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                new = [source for key, source in backend.choices.items() if key not in seen]
                steps.append({"tokens": tokens, "new_keys": len(new), "timed": new.count("timed"),
                              "seconds": time.perf_counter() - t0})
                print(f"[{i + 1}/{len(counts)}] {tokens} tokens: {len(new)} new kernel keys, "
                      f"{new.count('timed')} timed, {len(new) - new.count('timed')} already tuned "
                      f"({steps[-1]['seconds']:.0f} s; {time.perf_counter() - start:.0f} s in all)", flush=True)
    finally:
        backend.autotune = autotune
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("codagen tune", __doc__)
    parser.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}) or a config.json path")
    parser.add_argument("--tokens", required=True, help="comma-separated tokens per step, e.g. 4096,8192,16384")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers to build (default 1: all layers match)")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length; a step is tokens / seq sequences")
    parser.add_argument("--table", help="write to this JSON file instead of the user's tuning cache")
    parser.add_argument("--retune", action="store_true", help="time keys that already have an entry too")
    args = parser.parse_args(argv)
    try:
        counts = _token_counts(args.tokens)
        config = model_config(args.model, args.layers)
    except ValueError as error:
        parser.error(str(error))
    if args.layers < 1:
        parser.error("--layers must be at least 1")
    for tokens in counts:
        if tokens > args.seq and tokens % args.seq:
            parser.error(f"--tokens: {tokens} is not a multiple of --seq {args.seq}")
    if not torch.cuda.is_available():
        print("codagen tune: error: needs a CUDA GPU (it times kernels on the GPU that will run them)",
              file=sys.stderr)
        return 2
    import transformers

    backend = get_backend("triton")
    if args.table:
        backend.tuning = TuningCache(path=args.table)
    if args.retune:
        os.environ["CODAGEN_TRITON_RETUNE"] = "1"
    with torch.device("cuda"):
        model = patch(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train())
    print(f"codagen tune: {args.model} ({config.hidden_size} hidden, {args.layers} layer(s)) on "
          f"{torch.cuda.get_device_name()}, tokens {counts}; cache {backend.tuning.path}", flush=True)
    tune_steps(model, counts, args.seq, backend)
    print(f"wrote {backend.tuning.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
