"""Kernel benchmark: every fused library kernel against cuBLAS and its unfused PyTorch peers (GPU).

    python -m codagen bench kernels [--quick] [--out DIR] [--models d2048,llama3-8b] [--dtype bf16]

Providers, per kernel and shape (the GEMM has the kernel's exact M, N, K and operand layout):

``cublas_gemm``    the bare cuBLAS GEMM (``torch.mm``): the speed of light of a fused kernel;
``eager``          cuBLAS GEMM + the same epilogue as separate eager PyTorch ops (fp32 math);
``compile``        cuBLAS GEMM + ``torch.compile`` of that epilogue;
``codagen``        the fused Triton kernel (one launch, outputs preallocated, tuned config);
``codagen_gemm``   (diagnostic) our mainloop with a plain store: the plain-GEMM program of the same
                   shape and layout, so ``codagen - codagen_gemm`` is what the epilogue costs.

Unfused peers compute the natural unfused form of each reduction (a whole-row sum / logsumexp, a
whole-column sum) rather than per-tile partials. Times are medians of CUDA-event timings with the L2
flushed between runs (``codagen.bench.common.median_ms``), taken in interleaved rounds whose order
rotates (``--rounds``, default 3): ``median_ms`` is the median of the round medians, ``round_ms`` keeps them.
Shapes: M = 16384 tokens, hidden d in {2048, 4096, 8192} with f = round_up(8d/3, 256) and MHA (head_dim 128),
vocab 32768 (the CODA paper's), and LLaMA-3-8B (d 4096, f 14336, GQA 32/8 heads, head_dim 128).
"""
from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from codagen._cli import command_parser, dtype_arg, preset_arg
from codagen.backends import get_backend
from codagen.backends.reference import evaluate_epilogue
from codagen.bench.common import OUT_HELP, environment, median_ms, timed_rounds, wall_ms, write_results
from codagen.epilogue import library
from codagen.epilogue.bind import bind
from codagen.epilogue.ir import (
    Accumulator,
    ColPartial,
    ColVector,
    Program,
    RowPartial,
    RowVector,
    ScalarInput,
    Store,
    TileInput,
)

__all__ = ["main", "eager_epilogue", "random_inputs", "MODELS", "kernel_cases"]

TOKENS = 16384
VOCAB = 32768


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class Model:
    name: str
    d: int
    f: int
    heads: int
    kv_heads: int
    head_dim: int = 128

    @property
    def qkv(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


def _paper(d: int) -> Model:
    return Model(f"d{d}", d, round_up(8 * d // 3, 256), d // 128, d // 128)


MODELS = {m.name: m for m in (_paper(2048), _paper(4096), _paper(8192), Model("llama3-8b", 4096, 14336, 32, 8))}


@dataclass(frozen=True)
class Case:
    name: str
    pass_: str
    program: Program
    m: int
    n: int
    k: int


def kernel_cases(model: Model, m: int = TOKENS, vocab: int = VOCAB) -> list[Case]:
    """The fused GEMMs of one block (docs/method.md F1-F4, B2/B4/B6) and the LM head, with their shapes."""
    d, f, qkv = model.d, model.f, model.qkv
    return [
        Case("o_proj_residual_rms", "fwd", library.residual_rms_stats(), m, d, d),
        Case("gate_up_swiglu", "fwd", library.rms_gate_up_swiglu(), m, 2 * f, d),
        Case("down_residual_rms", "fwd", library.residual_rms_stats(), m, d, f),
        Case("qkv_rope", "fwd", library.rms_qkv_rope(), m, qkv, d),
        Case("lm_head_ce", "fwd", library.rms_lm_head_cross_entropy(), m, vocab, d),
        Case("qkv_rms_norm_bwd", "bwd", library.rms_norm_backward(), m, d, qkv),
        Case("down_swiglu_bwd", "bwd", library.swiglu_backward(), m, f, d),
        Case("gate_up_rms_norm_bwd", "bwd", library.rms_norm_backward(), m, d, 2 * f),
        Case("lm_head_ce_bwd", "bwd", library.rms_lm_head_cross_entropy_backward(), m, vocab, d),
        Case("down_weight_grad", "bwd", library.weight_grad(), d, f, m),
    ]


# --------------------------------------------------------------------------------------------------
# Inputs and the unfused epilogue
# --------------------------------------------------------------------------------------------------
def random_inputs(program: Program, m: int, n: int, k: int, dtype: torch.dtype, device, *,
                  ignore_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Fresh random operands and inputs of realistic scale (never zeros).

    ``a`` ~ N(0, 1), ``b`` ~ N(0, 1/K) (so ``acc`` ~ N(0, 1)); rstd-like row vectors in [0.5, 1.5);
    positions 0..M-1 and RoPE frequencies ``10000^(-2j/128)``; targets uniform with a fraction of
    ignore_index (-100); tile inputs ~ N(0, 1) in the operand dtype.
    """
    a_shape, b_shape = program.gemm.shapes(m, n, k)
    a = torch.randn(a_shape, device=device).to(dtype)
    b = (torch.randn(b_shape, device=device) / math.sqrt(max(k, 1))).to(dtype)
    tensors: dict[str, torch.Tensor] = {}
    for name, e in program.inputs.items():
        if isinstance(e, RowVector):
            if e.index:
                t = torch.randint(0, max(n, 1), (m,), device=device)
                t[torch.rand(m, device=device) < ignore_fraction] = -100
            elif name == "positions":
                t = torch.arange(m, device=device, dtype=torch.float32)
            else:
                t = torch.rand(m, device=device) + 0.5
        elif isinstance(e, ColVector):
            cols = e.width.columns(n)
            if name == "frequencies":
                t = 10000.0 ** (-(torch.arange(cols, device=device) % 64).float() / 64)
            else:
                t = torch.rand(cols, device=device) + 0.5
        elif isinstance(e, ScalarInput):
            t = torch.rand((), device=device) + 0.5
        else:
            assert isinstance(e, TileInput)
            t = torch.randn(m, e.width.columns(n), device=device).to(dtype)
        tensors[name] = t
    for name in program.accumulated_outputs():
        store = next(o for o in program.outputs if o.name == name)
        tensors[name] = torch.randn(m, store.value.width.columns(n), device=device)
    return a, b, tensors


def gemm(program: Program, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``op(A) @ op(B)`` through cuBLAS (torch.mm), in the operand dtype."""
    a = a if program.gemm.a_layout == "mk" else a.t()
    b = b.t() if program.gemm.b_layout == "nk" else b
    return torch.mm(a, b)


def eager_epilogue(program: Program, acc: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The program's epilogue as plain PyTorch ops on a GEMM output ``acc`` (fp32 math).

    Reductions are whole-row / whole-column (``RowPartial`` -> [M, 1], ``ColPartial`` -> [1, N*w]):
    what an unfused implementation computes. Accumulated stores add into ``tensors[name]`` in place.
    """
    values = evaluate_epilogue(program, acc.float(), tensors)
    outs = {}
    for o in program.outputs:
        v = values[o.value]
        if isinstance(o, Store):
            if o.accumulate:
                target = tensors[o.name]
                target.copy_(target.float() + v)
                outs[o.name] = target
            else:
                dtype = acc.dtype if o.dtype == "input" else getattr(torch, o.dtype)
                outs[o.name] = v.to(dtype)
        elif isinstance(o, RowPartial):
            outs[o.name] = v.sum(-1, keepdim=True) if o.reduction == "sum" else torch.logsumexp(v, -1, keepdim=True)
        else:
            assert isinstance(o, ColPartial)
            outs[o.name] = v.sum(0, keepdim=True)
    return outs


@functools.cache
def _compiled_epilogue(program: Program):
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(functools.partial(eager_epilogue, program), dynamic=True)


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------
def _plain_program(program: Program) -> Program:
    layouts = (program.gemm.a_layout, program.gemm.b_layout)
    return {("mk", "nk"): library.linear(), ("mk", "kn"): library.input_grad(),
            ("km", "kn"): library.weight_grad()}[layouts]


def run_case(case: Case, model: Model, dtype: torch.dtype, providers: list[str], backend, *,
             warmup_ms: float, rep_ms: float, rounds: int = 3, device="cuda", log=print) -> list[dict]:
    """Time ``providers`` on one kernel case. Each is built and run once first (compilation, tuning),
    then all are timed in ``rounds`` interleaved rounds whose order rotates (``common.timed_rounds``).
    ``median_ms`` is the median of the round medians; ``round_ms`` keeps them. A
    provider that fails is recorded with ``error``; the others still run. On a CPU ``device`` (a harness
    check, not speed) the timer is wall-clock."""
    program = case.program
    dev = torch.device(device)
    a, b, tensors = random_inputs(program, case.m, case.n, case.k, dtype, dev)
    shape = {"model": model.name, "M": case.m, "N": case.n, "K": case.k, "dtype": str(dtype).replace("torch.", ""),
             "program": program.name}
    flops = 2.0 * case.m * case.n * case.k
    fused = any(not (isinstance(o, Store) and isinstance(o.value, Accumulator)) for o in program.outputs)
    base = {"suite": "kernels", "name": case.name, "pass": case.pass_, "shape": shape}
    failures = []

    def failed(provider: str, exc: Exception) -> None:
        log(f"  {case.name} {provider}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
        failures.append({**base, "provider": provider, "median_ms": None,
                         "error": f"{type(exc).__name__}: {str(exc)[:300]}"})

    runs = {}  # provider -> (zero-argument function, extra record fields)
    for provider in providers:
        try:
            if provider == "cublas_gemm":
                runs[provider] = (lambda: gemm(program, a, b)), {}
            elif provider in ("eager", "compile"):
                if not fused:
                    continue
                epi = functools.partial(eager_epilogue, program) if provider == "eager" else _compiled_epilogue(program)
                work = {k: v.clone() for k, v in tensors.items()}
                runs[provider] = (lambda epi=epi, work=work: epi(gemm(program, a, b), work)), {}
            elif provider in ("codagen", "codagen_gemm"):
                if provider == "codagen_gemm" and not fused:
                    continue
                bound = (bind(program, a, b, {k: v.clone() for k, v in tensors.items()}) if provider == "codagen"
                         else bind(_plain_program(program), a, b, {}))
                launch, _, cfg = backend.launcher(bound)
                runs[provider] = launch, {"config": cfg.short()}
            else:
                raise ValueError(f"unknown provider {provider!r}; expected cublas_gemm, eager, compile, codagen "
                                 "or codagen_gemm")
            runs[provider][0]()  # compile, tune, warm up
        except Exception as exc:  # noqa: BLE001 - one failing provider must not end the run
            runs.pop(provider, None)
            failed(provider, exc)
    timer = (lambda fn: median_ms(fn, warmup_ms, rep_ms)) if dev.type == "cuda" else wall_ms
    round_ms = timed_rounds({provider: fn for provider, (fn, _) in runs.items()}, rounds, timer, failed)
    records = []
    for provider, times in round_ms.items():
        ms = statistics.median(times)
        records.append({**base, "provider": provider, "median_ms": ms, "tflops": flops / ms / 1e9,
                        "round_ms": times, **runs[provider][1]})
    return records + failures


def markdown(records: list[dict]) -> str:
    """One row per (kernel, shape): times and ratios."""
    rows: dict[tuple, dict] = {}
    for r in records:
        key = (r["shape"]["model"], r["pass"], r["name"], r["shape"]["M"], r["shape"]["N"], r["shape"]["K"])
        rows.setdefault(key, {})[r["provider"]] = r
    lines = ["| model | pass | kernel | M x N x K | cuBLAS GEMM ms | codagen ms | codagen / cuBLAS throughput | "
             "eager ms | compile ms | speed-up vs compile | epilogue cost (codagen - our plain GEMM) | config |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(r):
        return r["median_ms"] if r and r.get("median_ms") else None

    for key, prov in rows.items():
        model, pass_, name, m, n, k = key
        providers = ("cublas_gemm", "codagen", "eager", "compile", "codagen_gemm")
        cub, cod, eag, com, plain = (ms(prov.get(p)) for p in providers)
        fmt = lambda x: f"{x:.3f}" if x else "-"  # noqa: E731
        ratio = f"{cub / cod:.2f}x" if cub and cod else "-"
        vs_compile = f"{com / cod:.2f}x" if com and cod else "-"
        epi = f"{(cod - plain) / plain * 100:+.0f}%" if cod and plain else "-"
        cfg = prov.get("codagen", {}).get("config", "")
        lines.append(f"| {model} | {pass_} | {name} | {m} x {n} x {k} | {fmt(cub)} | {fmt(cod)} | {ratio} | "
                     f"{fmt(eag)} | {fmt(com)} | {vs_compile} | {epi} | {cfg} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("codagen bench kernels", __doc__)
    parser.add_argument("--quick", action="store_true", help="LLaMA-3-8B shapes only, shorter timing")
    parser.add_argument("--out", default=None, help=OUT_HELP)
    parser.add_argument("--models", default=None, help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--kernels", default=None, help="comma-separated subset of kernel names")
    parser.add_argument("--providers", default="cublas_gemm,codagen,codagen_gemm,eager,compile")
    parser.add_argument("--dtype", type=dtype_arg("bfloat16", "float16"), default=torch.bfloat16,
                        help="operand dtype: bf16 (default) or fp16")
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved timing rounds per kernel, in rotating order (default 3; 1 with --quick)")
    args = parser.parse_args(argv)
    preset = preset_arg(list(MODELS))
    try:
        names = [preset(m) for m in args.models.split(",")] if args.models else None
    except argparse.ArgumentTypeError as error:
        parser.error(f"--models: {error}")
    if not torch.cuda.is_available():
        print("codagen bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    models = [MODELS[m] for m in names] if names else ([MODELS["llama3-8b"]] if args.quick else list(MODELS.values()))
    warmup_ms, rep_ms = (10, 50) if args.quick else (25, 150)
    providers = args.providers.split(",")
    dtype = args.dtype
    backend = get_backend("triton")
    env = environment()
    print(f"# kernels on {env['gpu']}: torch {env['torch']}, triton {env['triton']}, {dtype}", flush=True)
    records = []
    for model in models:
        for case in kernel_cases(model, m=args.tokens):
            if args.kernels and case.name not in args.kernels.split(","):
                continue
            recs = run_case(case, model, dtype, providers, backend, warmup_ms=warmup_ms, rep_ms=rep_ms,
                            rounds=args.rounds or (1 if args.quick else 3))
            torch.cuda.empty_cache()  # the case's tensors are gone: hand their memory back between shapes
            records += recs
            summary = "  ".join(f"{r['provider']} {r['median_ms']:.3f}" for r in recs if r.get("median_ms"))
            print(f"{model.name:10s} {case.pass_} {case.name:22s} {case.m}x{case.n}x{case.k}: {summary}", flush=True)
    path = write_results("kernels", records, args.out)
    table = markdown(records)
    Path(path).with_suffix(".md").write_text(f"GPU: {env['gpu']}; torch {env['torch']}; triton {env['triton']}; "
                                             f"{dtype}; results: {path.name}\n\n{table}\n")
    print(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
