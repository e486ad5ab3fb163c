"""A/B of the fused kernels of two git revisions on one GPU, interleaved, in one call.

    python bench/ab.py --base <rev> --head <rev> --out bench/results/<date>-ab-<what>.json
    python bench/ab.py --base HEAD~1 --head HEAD --dry-run --out /tmp/ab.json     # CPU: tiny shapes, interpreter
    python bench/ab.py --base /tmp/tree-a --head /tmp/tree-b --out ...   # trees exported beforehand (git archive)

Each revision is exported (``git archive``) into a temporary tree and imported by a worker process of its
own (``PYTHONPATH`` = that tree, a kernel cache directory of its own, ``CODAGEN_TRITON_AUTOTUNE=0`` so both
take their shipped tuned choices). The workers build every kernel case of ``codagen bench kernels`` (M =
16384 tokens; ``--models``, default LLaMA-3-8B as ``--quick``), then this process asks them in turn for a
timing of each case, ``--rounds`` times, the order of the two rotating each round: at the power cap the
clock drifts, and timing one revision after the other reads differences that are not there. A timing is
the median of ``triton.testing.do_bench`` (L2 flushed between runs); the JSON holds, per case, both
medians of the round medians, every round, the configuration each revision chose, each revision's
``kernel_hash`` (the key of its tuned choices), whether both generate the same kernel sources
(``same_source``), ``head / base`` and whether it is within ``--tolerance`` (1%).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_REPLY = "@@ab "

# The worker: runs in a revision's tree, imports its codagen, answers one JSON request per line.
_WORKER = r'''
import hashlib, json, sys, time, statistics
import torch
from codagen.backends.triton import TritonBackend, program_source
from codagen.bench.kernels import MODELS, Model, kernel_cases, random_inputs
from codagen.epilogue.bind import bind
try:
    from codagen.backends.triton.tuning import kernel_hash
except ImportError:  # a tree from before the backend was split by concern
    from codagen.backends.triton.backend import kernel_hash

REPLY = sys.argv[1]
dry = sys.argv[2] == "dry"
device = "cpu" if dry else "cuda"
backend = TritonBackend()
runs = {}


def reply(value):
    print(REPLY + json.dumps(value), flush=True)


def cases(request):
    if dry:  # the interpreter: a tiny model, a few rows
        model = Model("tiny", 64, 128, 2, 2, 32)
        return model, kernel_cases(model, m=48, vocab=256)
    model = MODELS[request["model"]]
    return model, kernel_cases(model, m=request["tokens"])


def timing(fn, warmup_ms, rep_ms):
    if dry:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


for line in sys.stdin:
    request = json.loads(line)
    if request["op"] == "cases":
        model, found = cases(request)
        reply([{"name": c.name, "model": model.name, "program": c.program.name, "M": c.m, "N": c.n, "K": c.k,
                "pass": c.pass_} for c in found])
    elif request["op"] == "build":
        torch.manual_seed(0)
        model, found = cases(request)
        case = next(c for c in found if c.name == request["name"])
        dtype = getattr(torch, request["dtype"])
        a, b, tensors = random_inputs(case.program, case.m, case.n, case.k, dtype, device)
        launch, outs, cfg = backend.launcher(bind(case.program, a, b, tensors))
        launch()  # compile
        runs[(model.name, case.name)] = launch
        sources = [program_source(case.program)]
        try:
            sources.append(program_source(case.program, schedule="pingpong"))
        except ValueError:  # a program the ping-pong schedule does not take
            pass
        reply({"config": cfg.short(), "kernel_hash": kernel_hash(case.program),
               "source_sha256": hashlib.sha256("\n".join(sources).encode()).hexdigest()})
    elif request["op"] == "time":
        launch = runs[(request["model"], request["name"])]
        reply(timing(launch, request["warmup_ms"], request["rep_ms"]))
    elif request["op"] == "drop":
        runs.clear()
        if not dry:
            torch.cuda.empty_cache()
        reply(None)
'''


def export(rev: str, into: Path) -> str:
    """``rev``'s tree under ``into`` (``git archive``: no worktree metadata is written); its commit. A ``rev``
    that is a directory is a tree exported beforehand (for a machine without the repository's history):
    it is used in place, and its ``COMMIT`` file names the commit."""
    if Path(rev).is_dir():
        into.symlink_to(Path(rev).resolve(), target_is_directory=True)
        commit = Path(rev) / "COMMIT"
        return commit.read_text().strip() if commit.exists() else "unknown"
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return sha


class Worker:
    """One revision's process."""

    def __init__(self, tree: Path, cache: Path, dry: bool):
        env = dict(os.environ, PYTHONPATH=str(tree), CODAGEN_CACHE_DIR=str(cache), CODAGEN_TRITON_AUTOTUNE="0",
                   CODAGEN_POISON_OUTPUTS="0")
        self.process = subprocess.Popen([sys.executable, "-c", _WORKER, _REPLY, "dry" if dry else "gpu"], cwd=tree,
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, **request):
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith(_REPLY):
                return json.loads(line[len(_REPLY):])
            sys.stderr.write(line)
        raise RuntimeError(f"worker exited with {self.process.wait()}")

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def environment(dry: bool) -> dict:
    probe = ("import json, torch, triton; print(json.dumps({'torch': torch.__version__, 'triton': triton.__version__,"
             " 'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))")
    env = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)
    return {**env, "python": platform.python_version(), "dry_run": dry}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision A, or a directory holding its exported tree")
    parser.add_argument("--head", required=True, help="git revision B, or a directory holding its exported tree")
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--models", default="llama3-8b", help="comma-separated models of codagen.bench.kernels")
    parser.add_argument("--kernels", default=None, help="comma-separated subset of kernel case names")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup-ms", type=float, default=25)
    parser.add_argument("--rep-ms", type=float, default=150)
    parser.add_argument("--tolerance", type=float, default=0.01, help="|head / base - 1| counted as equal")
    parser.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes in the Triton interpreter")
    args = parser.parse_args(argv)
    dtype = "float16" if args.dry_run else args.dtype  # the interpreter's bf16 dot is wrong

    with tempfile.TemporaryDirectory(prefix="codagen-ab-") as tmp:
        sides = {}
        for side, rev in (("base", args.base), ("head", args.head)):
            sha = export(rev, Path(tmp) / side)
            sides[side] = {"rev": rev, "commit": sha, "worker": Worker(Path(tmp) / side, Path(tmp) / f"{side}-cache",
                                                                        args.dry_run)}
        records = []
        try:
            for model in (["tiny"] if args.dry_run else args.models.split(",")):
                request = {"model": model, "tokens": args.tokens}
                cases = sides["base"]["worker"].ask(op="cases", **request)
                names = [c["name"] for c in cases if not args.kernels or c["name"] in args.kernels.split(",")]
                for case in (c for c in cases if c["name"] in names):
                    record = {**case, "dtype": dtype}
                    for side in ("base", "head"):
                        built = sides[side]["worker"].ask(op="build", name=case["name"], dtype=dtype, **request)
                        record[side] = {**built, "round_ms": []}
                    for index in range(args.rounds):
                        order = ("base", "head") if index % 2 == 0 else ("head", "base")
                        for side in order:
                            ms = sides[side]["worker"].ask(op="time", model=case["model"], name=case["name"],
                                                           warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
                            record[side]["round_ms"].append(ms)
                    for side in ("base", "head"):
                        record[side]["median_ms"] = statistics.median(record[side]["round_ms"])
                        sides[side]["worker"].ask(op="drop")
                    record["head_over_base"] = record["head"]["median_ms"] / record["base"]["median_ms"]
                    record["within_tolerance"] = abs(record["head_over_base"] - 1) <= args.tolerance
                    record["same_source"] = record["head"]["source_sha256"] == record["base"]["source_sha256"]
                    records.append(record)
                    print(f"{case['model']:10s} {case['name']:22s} {case['M']}x{case['N']}x{case['K']}: base "
                          f"{record['base']['median_ms']:.4f} ms  head {record['head']['median_ms']:.4f} ms  "
                          f"head/base {record['head_over_base']:.4f}", flush=True)
        finally:
            for side in sides.values():
                side["worker"].close()

    result = {"env": environment(args.dry_run), "base": {k: v for k, v in sides["base"].items() if k != "worker"},
              "head": {k: v for k, v in sides["head"].items() if k != "worker"},
              "settings": {"rounds": args.rounds, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
                           "tolerance": args.tolerance, "tokens": args.tokens, "dtype": dtype},
              "all_within_tolerance": all(r["within_tolerance"] for r in records),
              "worst_head_over_base": max((r["head_over_base"] for r in records), default=None),
              "records": records}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}: every case within {args.tolerance:.0%}: {result['all_within_tolerance']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
