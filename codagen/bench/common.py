"""What every benchmark shares: timing, environment record, the JSON results schema.

Schema (one file per run under ``--out``, by default ``codagen-results/`` in the current directory)::

    {"env": {"gpu", "torch", "triton", "codagen", "date", ...},
     "records": [{"suite", "name", "pass": "fwd"|"bwd"|"fwd+bwd"|"step", "shape": {...},
                  "provider", "median_ms", ...}]}
"""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import codagen

__all__ = ["environment", "median_ms", "wall_ms", "timed_rounds", "ratio_records", "load_module",
           "write_results", "RESULTS_DIR", "OUT_HELP"]

#: where results go without ``--out``: relative, so in the directory the command runs in (never inside the
#: installed package or the checkout's tracked ``bench/results``)
RESULTS_DIR = Path("codagen-results")
#: the help of every suite's ``--out``
OUT_HELP = f"results folder (default: {RESULTS_DIR}/ in the current directory)"


def environment() -> dict:
    """GPU name and library versions, recorded with every result file."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "codagen": codagen.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def median_ms(fn: Callable[[], object], warmup_ms: float = 100, rep_ms: float = 500, min_reps: int = 20) -> float:
    """Median time of ``fn`` in milliseconds, measured with CUDA events after warm-up.

    ``triton.testing.do_bench`` clears the L2 cache between runs, so repeated runs over the same
    buffers do not measure the cache. It repeats ``fn`` for about ``rep_ms``; for slow functions (a
    140 ms training step would get two runs) the budget is raised to at least ``min_reps`` runs.
    """
    import triton.testing
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    rep_ms = max(rep_ms, min_reps * start.elapsed_time(end))
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def wall_ms(fn: Callable[[], object], reps: int = 3) -> float:
    """Median wall-clock time of ``fn`` in milliseconds after one warm-up run: the CPU smoke runs' timer
    (it checks a harness, not speed)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def timed_rounds(functions: dict, rounds: int, timer: Callable[[Callable], float],
                 on_error: Callable[[object, Exception], None] | None = None) -> dict[object, list[float]]:
    """``timer(function)`` of each of ``functions`` once per round for ``rounds`` rounds, each round
    starting one place later in the order: at the power cap the GPU's clock drifts within a round, and
    in a fixed order two builds of identical code read up to 8% apart (docs/notes/pingpong-handoff.md). Returns the
    times by name. A function that raises goes to ``on_error`` (raised again without one) and is not
    timed again."""
    times = {name: [] for name in functions}
    order = list(functions)
    for index in range(rounds):
        shift = index % max(len(order), 1)
        for name in order[shift:] + order[:shift]:
            if name not in times:
                continue
            try:
                times[name].append(timer(functions[name]))
            except Exception as error:  # noqa: BLE001 - reported to on_error
                if on_error is None:
                    raise
                del times[name]
                on_error(name, error)
    return times


def ratio_records(suite: str, shape: str, times: dict[str, list[float]], reference: str) -> list[dict]:
    """One record per name of ``times`` (round times from :func:`timed_rounds`): the median of its rounds,
    the rounds, and that median over ``reference``'s; each also printed as a line."""
    base = statistics.median(times[reference])
    records = []
    for name, rounds in times.items():
        ms = statistics.median(rounds)
        records.append({"suite": suite, "shape": shape, "provider": name, "median_ms": ms, "round_ms": rounds,
                        f"vs_{reference}": ms / base})
        print(f"{shape:10s} {name:22s} {ms:7.3f} ms  {ms / base:.3f}x {reference}  rounds "
              + " ".join(f"{r:.3f}" for r in rounds), flush=True)
    return records


def load_module(name: str, path: str | os.PathLike):
    """Import the file ``path`` as module ``name`` (registered in ``sys.modules``): a saved copy of one of
    codagen's modules named as its sibling (``codagen.ops.kernels_baseline``), so that its relative imports
    resolve, for an A/B beside today's; or generated source that ``@jit`` must read from a file."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def write_results(suite: str, records: list[dict], out_dir: str | os.PathLike | None = None) -> Path:
    """Write ``{"env", "records"}`` to ``<out_dir>/<date>-<suite>.json`` and return the path."""
    env = environment()
    out_dir = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{env['date'][:10]}-{suite}.json"
    path.write_text(json.dumps({"env": env, "records": records}, indent=1) + "\n")
    return path


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` (with a note) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return None
    return plt


def peak_gib(step: Callable[[], object], device: torch.device, params=()) -> float | None:
    """Peak memory of one ``step`` above what was allocated before it (activations, gradients), GiB; None
    off CUDA. The ``params``' gradients are released first: a step frees the previous ones itself, and
    counting them in the baseline would hide as much of its own peak."""
    if device.type != "cuda":
        return None
    for t in params:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 30
