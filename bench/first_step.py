"""The first training step at shapes the shipped tuning table does not hold: untimed default vs tuned (GPU).

Per shape (a patched Hugging Face Llama, bf16, eager, ``--layers`` layers), each in a fresh process with
its own codagen cache directory:

1. ``default`` cold: an empty Triton cache; ``CODAGEN_TRITON_AUTOTUNE`` unset (no timing: the nearest
   tuned bucket or the heuristic). First step (kernel compilation + choice + run) and the steady step;
2. ``default`` warm: the same again with the Triton cache of 1 (the kernels compiled): its first step
   minus the steady one is what choosing configurations costs;
3. ``codagen tune --model <config.json> --tokens <T>`` into that cache directory, capped at
   ``--tune-timeout`` seconds (a capped run keeps the keys it finished);
4. ``tuned``: first and steady step with the tuned entries;
5. ``ab``: in one process, the steady step with the default's configurations and with the tuned ones,
   alternating in ``--rounds`` rounds (the same kernels, allocations and clocks for both: what the
   configurations alone are worth by step).

Records each phase's seconds, the steady step times and ``default / tuned`` steady-step speed (wanted: >=
0.97; ``default_speed_vs_tuned`` across processes, ``ab_default_speed_vs_tuned`` in one process), where each
kernel's configuration came from, and per kernel (``per_kernel``) the default's config against the fastest
that ``codagen tune`` timed for its key (``slowdown``, slowest first). Shapes: the d 2048 Llama (ffn 8192,
32/8 heads, vocab 32768) at 8192 and 12288 tokens, and Llama-3.2-3B dims (d 3072, ffn 8192, 24/8 heads,
vocab 32768 here) at 16384.

    PYTHONPATH=. python bench/first_step.py [--shapes d2048-8k d2048-12k 3b-16k] [--layers 2]
        [--tune-timeout 180]

Writes ``bench/results/<date>-first-step.json``. About 1 minute per shape without tuning; ``codagen tune``
adds what its output reports (minutes for a new model's first shape, while Triton compiles every
candidate; seconds per later token count).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from codagen.bench.common import write_results

D2048 = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=32768, max_position_embeddings=16384)
D3072 = dict(D2048, hidden_size=3072, num_attention_heads=24, head_dim=128)
SHAPES = {"d2048-8k": (D2048, 8192), "d2048-12k": (D2048, 12288), "3b-16k": (D3072, 16384)}
SEQ = 4096


def training_step(config_path: str, tokens: int, layers: int):
    """A patched model of ``config_path`` with ``layers`` layers on the GPU and one training step of ``tokens``
    tokens on it (forward, backward, gradients cleared; not synchronized)."""
    import torch
    import transformers

    import codagen
    from codagen.tune import model_config
    config = model_config(config_path, layers)
    with torch.device("cuda"):
        model = codagen.patch(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train())
    seq = min(tokens, SEQ)
    ids = torch.randint(0, config.vocab_size, (tokens // seq, seq), device="cuda")

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def _count_compiles() -> dict:
    """Counts Triton's compilations from here on: ``compiled`` (cache misses), ``cached`` (loaded from the disk
    cache) and ``compile_s``, the sum of the compilations' own times (the wall time they took one after another)."""
    from triton import knobs
    counts = {"compiled": 0, "cached": 0, "compile_s": 0.0}

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        counts["cached" if cache_hit else "compiled"] += 1
        counts["compile_s"] += times.total / 1e6
    knobs.compilation.listener = listener
    return counts


def worker(config_path: str, tokens: int, layers: int, steps: int) -> dict:
    import torch

    from codagen.backends import get_backend
    compiles = _count_compiles()
    training = training_step(config_path, tokens, layers)

    def step():
        training()
        torch.cuda.synchronize()

    start = time.perf_counter()
    step()
    first_s = time.perf_counter() - start
    first_compiles = dict(compiles)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - start))
    backend = get_backend("triton")
    sources = list(backend.choices.values())
    return {"first_step_s": first_s, "first_step_compiles": first_compiles,
            "steady_step_ms": statistics.median(times), "step_ms": times,
            "kernel_choices": {s: sources.count(s) for s in sorted(set(sources))},
            "configs": {key: [backend.choices[key], cfg.short()] for key, cfg in backend.chosen.items()}}


def ab_worker(config_path: str, tokens: int, layers: int, steps: int, rounds: int) -> dict:
    """The steady step with the untimed default's configurations and with the tuned ones, in one process: each
    variant's plans (config per call signature) are made once, then swapped in for alternating rounds."""
    import torch

    from codagen.backends import get_backend
    from codagen.backends.triton.configs import TuningCache
    step = training_step(config_path, tokens, layers)
    backend = get_backend("triton")
    plans = {}
    for variant, tuning in (("default", TuningCache(path=os.devnull)), ("tuned", TuningCache())):
        backend.tuning, backend._plans = tuning, {}
        for _ in range(2):
            step()
        plans[variant] = backend._plans
    medians = {variant: [] for variant in plans}
    for _ in range(rounds):
        for variant in plans:
            backend._plans = plans[variant]
            step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            medians[variant].append(1e3 * (time.perf_counter() - start) / steps)
    return {"round_ms": medians, **{f"{v}_step_ms": statistics.median(ms) for v, ms in medians.items()}}


def per_kernel(default: dict, tuning_path: str) -> list[dict]:
    """Per tuning key the default run chose for: its source and config, and, where ``codagen tune`` timed the key,
    that config's time against the fastest candidate's (``default_ms / best_ms``), slowest first."""
    try:
        with open(tuning_path) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return []
    rows = []
    for key, (source, config) in default.get("configs", {}).items():
        timings = {name: ms for name, ms in entries.get(key, {}).get("timings_ms", {}).items() if ms == ms}
        if not timings:
            continue
        best = min(timings, key=timings.get)
        rows.append({"program": key.split("|")[2].split(":")[0], "shape": key.rsplit("|", 1)[-1], "source": source,
                     "default": config, "default_ms": timings.get(config), "best": best, "best_ms": timings[best],
                     "slowdown": timings[config] / timings[best] if config in timings else None})
    return sorted(rows, key=lambda row: -(row["slowdown"] or 0))


def run(command: list[str], env: dict, timeout: int) -> tuple[dict | None, str, float]:
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        output, ok = done.stdout + done.stderr, done.returncode == 0
    except subprocess.TimeoutExpired as expired:
        output, ok = f"(stopped after {timeout} s)\n{expired.stdout or ''}", False
    seconds = time.perf_counter() - start
    lines = [line for line in output.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if ok and lines else None), output, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None)
    parser.add_argument("--models", nargs="+", default=[],
                        help="published configs of codagen.bench.models.MODELS, each at --tokens tokens")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step of the --models")
    parser.add_argument("--no-tune", action="store_true", help="only the default's cold and warm runs")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tune-timeout", type=int, default=180, help="seconds codagen tune may run per shape")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per measuring process")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of the in-process comparison")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--ab-worker", nargs=2, metavar=("CONFIG", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help="results folder (default: bench/results)")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.layers, args.steps)), flush=True)
        return 0
    if args.ab_worker:
        print(json.dumps(ab_worker(args.ab_worker[0], int(args.ab_worker[1]), args.layers, args.steps, args.rounds)),
              flush=True)
        return 0
    from codagen.bench.models import MODELS, hf_config
    cases = {name: SHAPES[name] for name in (args.shapes or ([] if args.models else SHAPES))}
    for name in args.models:
        fields = hf_config(MODELS[name]).to_dict()
        cases[name] = ({k: v for k, v in fields.items() if k != "transformers_version"}, args.tokens)
    records = []
    for name, (fields, tokens) in cases.items():
        with tempfile.TemporaryDirectory() as scratch:
            config_path = os.path.join(scratch, "config.json")
            with open(config_path, "w") as f:
                json.dump(fields, f)
            env = {k: v for k, v in os.environ.items() if k not in ("CODAGEN_TRITON_AUTOTUNE", "CODAGEN_TRITON_RETUNE")}
            env.update(CODAGEN_CACHE_DIR=os.path.join(scratch, "codagen"),
                       TRITON_CACHE_DIR=os.path.join(scratch, "triton"))
            measure = [sys.executable, __file__, "--worker", config_path, str(tokens), "--layers", str(args.layers),
                       "--steps", str(args.steps)]
            record = dict(suite="first-step", name=name, shape=dict(fields, tokens=tokens, layers=args.layers),
                          dtype="bfloat16")
            for phase in ("default_cold", "default_warm"):
                record[phase], output, record[f"{phase}_process_s"] = run(measure, env, args.timeout)
                if record[phase] is None:
                    record[f"{phase}_error"] = output[-2000:]
            if args.no_tune:
                records.append(record)
                print(f"{name}: " + "; ".join(f"{phase} first {r['first_step_s']:.1f} s {r['first_step_compiles']} "
                                              f"steady {r['steady_step_ms']:.1f} ms" for phase, r in
                                              (("cold", record["default_cold"]), ("warm", record["default_warm"]))
                                              if r), flush=True)
                write_results("first-step", records, args.out)
                continue
            tune = [sys.executable, "-m", "codagen", "tune", "--model", config_path, "--tokens", str(tokens),
                    "--seq", str(SEQ)]
            _, output, record["tune_s"] = run(tune, env, args.tune_timeout)
            record["tune_output"] = output[-3000:]
            record["tuned"], output, record["tuned_process_s"] = run(measure, env, args.timeout)
            if record["tuned"] is None:
                record["tuned_error"] = output[-2000:]
            ab = [sys.executable, __file__, "--ab-worker", config_path, str(tokens), "--layers", str(args.layers),
                  "--steps", str(args.steps), "--rounds", str(args.rounds)]
            record["ab"], output, record["ab_process_s"] = run(ab, env, args.timeout)
            if record["ab"] is None:
                record["ab_error"] = output[-2000:]
            else:
                record["ab_default_speed_vs_tuned"] = record["ab"]["tuned_step_ms"] / record["ab"]["default_step_ms"]
            if record["default_warm"]:
                record["per_kernel"] = per_kernel(record["default_warm"],
                                                  os.path.join(scratch, "codagen", "triton", "tuning.json"))
        default, warm, tuned = record["default_cold"], record["default_warm"], record["tuned"]
        if default and tuned:
            record["default_speed_vs_tuned"] = tuned["steady_step_ms"] / default["steady_step_ms"]
        if warm:
            record["warm_first_step_vs_steady"] = 1e3 * warm["first_step_s"] / warm["steady_step_ms"]
        records.append(record)
        print(f"{name}: " + "; ".join(
            f"{phase} first {r['first_step_s']:.1f} s steady {r['steady_step_ms']:.1f} ms {r['kernel_choices']}"
            for phase, r in (("default cold", default), ("default warm", warm), ("tuned", tuned)) if r)
            + f"; tune {record['tune_s']:.0f} s"
            + (f"; default/tuned speed {record['default_speed_vs_tuned']:.3f}" if "default_speed_vs_tuned" in record
               else "")
            + (f"; in one process {record['ab_default_speed_vs_tuned']:.3f}" if "ab_default_speed_vs_tuned" in record
               else ""), flush=True)
        write_results("first-step", records, args.out)
    path = write_results("first-step", records, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
