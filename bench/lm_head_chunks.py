"""How fast is the training LM head at a published model's width and vocabulary, for each chunk size? (GPU, bf16)

    PYTHONPATH=. python bench/lm_head_chunks.py [--models Gemma-3-1B Qwen2.5-0.5B Llama-3.2-1B Qwen2.5-7B]
        [--tokens 16384] [--budgets-mib 256 512 1024 2048 4096] [--out FILE]
    PYTHONPATH=. python bench/lm_head_chunks.py --dry-run     (CPU: tiny shapes, the harness only)

``ops.rms_lm_head_cross_entropy`` computes the loss and every gradient in its forward pass, one chunk of tokens at a
time, its logits at most ``ops.cross_entropy.CHUNK_BYTES`` (512 MiB). Each chunk's weight-gradient GEMM adds into
an fp32 ``grad_W`` [vocab, d], so every chunk reads and writes ``8 vocab d`` bytes of it for ``2 rows vocab d``
FLOPs: ``rows / 4`` FLOPs per byte of that traffic, against the ~200 at which an H200's GEMM turns from memory- to
compute-bound. At Gemma-3-1B (vocabulary 262144, d 1152) a 512 MiB chunk holds 1024 rows: 16 chunks at 16384 tokens,
38 GB of accumulator traffic. Larger chunks cut that traffic and cost their logits buffer in peak memory.

Times the op's forward + backward (the loss, ``grad_x``, the norm weight's and ``grad_W``) at each chunk budget, with
the final norm's statistics from ``ops.rms_norm_stats`` (in a model the last block's epilogue makes them),
against ``torch.compile`` of the unchunked head (RMSNorm, the logits GEMM, cross-entropy in fp32), with each run's
peak memory above its inputs. Prints a table; ``--out`` gets the JSON (GPU, versions, shapes, medians).
"""
from __future__ import annotations

import argparse
import json
from unittest import mock

import torch
import torch.nn.functional as F

from codagen import ops
from codagen.bench.common import environment, median_ms, peak_gib, wall_ms
from codagen.bench.models import MODELS, SMOKE_MODELS
from codagen.ops import cross_entropy

MIB = 2 ** 20


def inputs(tokens: int, d: int, vocab: int, device, dtype, eps: float = 1e-6) -> dict:
    """The head's leaves: the final residual stream ``x``, the final norm's weight, the head's weight, targets."""
    torch.manual_seed(0)
    return dict(x=torch.randn(tokens, d, device=device, dtype=dtype).requires_grad_(),
                norm_weight=(1 + 0.1 * torch.randn(d, device=device, dtype=dtype)).requires_grad_(),
                weight=(0.02 * torch.randn(vocab, d, device=device, dtype=dtype)).requires_grad_(),
                target=torch.randint(0, vocab, (tokens,), device=device), eps=eps)


def codagen_step(leaves: dict, budget: int):
    """One forward + backward of the fused head with chunks of at most ``budget`` bytes of logits."""
    def step():
        with mock.patch.object(cross_entropy, "CHUNK_BYTES", budget):
            normed, rstd = ops.rms_norm_stats(leaves["x"].detach(), leaves["norm_weight"].detach(), leaves["eps"])
            loss = ops.rms_lm_head_cross_entropy(leaves["x"], normed, rstd, leaves["norm_weight"], leaves["weight"],
                                                 leaves["target"])
        loss.backward()
        return loss
    return step


def reference_head(x, norm_weight, weight, target, eps):
    """transformers' final RMSNorm, the logits GEMM and the loss in fp32, as the unpatched model computes them."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = norm_weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)
    return F.cross_entropy((normed @ weight.t()).float(), target)


def compile_step(leaves: dict, compiled):
    def step():
        loss = compiled(leaves["x"], leaves["norm_weight"], leaves["weight"], leaves["target"], leaves["eps"])
        loss.backward()
        return loss
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["Gemma-3-1B", "Qwen2.5-0.5B", "Llama-3.2-1B", "Qwen2.5-7B"])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--budgets-mib", nargs="+", type=int, default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peer")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, fp32: check the harness")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, dtype, timer = torch.device("cpu"), torch.float32, wall_ms
        configs = dict(SMOKE_MODELS)
        tokens, budgets = 64, [1024, 4096, 16384]  # bytes: several chunks, then one
    else:
        device, dtype, timer = torch.device("cuda"), torch.bfloat16, median_ms
        configs = {name: MODELS[name] for name in args.models}
        tokens, budgets = args.tokens, [b * MIB for b in args.budgets_mib]
    compiled = None if args.no_compile else torch.compile(reference_head)
    records = []
    for name, config in configs.items():
        d, vocab = config.hidden_size, config.vocab_size
        leaves = inputs(tokens, d, vocab, device, dtype, config.rms_norm_eps)
        params = [leaves[k] for k in ("x", "norm_weight", "weight")]
        steps = {f"codagen_{budget // MIB if budget >= MIB else budget}"
                 f"{'mib' if budget >= MIB else 'b'}": (codagen_step(leaves, budget), budget) for budget in budgets}
        if compiled is not None:
            steps["compile"] = (compile_step(leaves, compiled), None)
        losses = {}
        for provider, (step, budget) in steps.items():
            for t in params:
                t.grad = None
            losses[provider] = float(step().detach())
            record = dict(model=name, provider=provider, tokens=tokens, hidden=d, vocab=vocab,
                          tied=config.tie_word_embeddings, budget_bytes=budget,
                          rows_per_chunk=None if budget is None else cross_entropy.chunk_rows(
                              tokens, vocab, torch.empty((), dtype=dtype).element_size(), budget),
                          ms=timer(step), peak_gib=peak_gib(step, device, params), loss=losses[provider])
            records.append(record)
            print(f"{name:14s} {provider:16s} rows/chunk {str(record['rows_per_chunk']):>6s} "
                  f"{record['ms']:9.3f} ms  peak {record['peak_gib'] if record['peak_gib'] is not None else '-'}"
                  f"  loss {record['loss']:.5f}", flush=True)
        spread = max(losses.values()) - min(losses.values())
        if spread > (1e-4 if dtype == torch.float32 else 2e-2):
            raise SystemExit(f"{name}: the providers' losses differ by {spread}: {losses}")
    result = dict(environment(), suite="lm_head_chunks", dtype=str(dtype), records=records)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
