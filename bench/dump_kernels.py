"""Write the generated kernel source of every library program to a directory, to diff two revisions.

The shipped tuning table (``codagen/backends/triton/tuned.json``) is keyed by a hash of the generated
kernels (``kernel_hash``); a refactoring of the generators keeps the tuned choices exactly when this dump
is unchanged. One file per program, schedule and dtype set:

    <program key digest>.<name>.<schedule>.<dtypes>.py    the source ``load_kernel`` writes and loads
    hashes.json                                          program text -> ``name:kernel_hash``

    python bench/dump_kernels.py /tmp/kernels-base
    ... change the generators ...
    python bench/dump_kernels.py /tmp/kernels-head && diff -r /tmp/kernels-base /tmp/kernels-head

Nothing runs: the sources are generated on the CPU. The ping-pong schedule is dumped where the installed
Triton has Gluon and the schedule takes the program.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from codagen.backends.triton import program_source
from codagen.backends.triton.gluon_support import pingpong_unsupported
from codagen.epilogue import library

try:  # the ping-pong schedule's own refusal (a low-rank GEMM, a segment sum); kernel_hash keys the table
    from codagen.backends.triton.pingpong import refusal
    from codagen.backends.triton.tuning import kernel_hash
except ImportError:  # a tree from before the backend was split by concern
    from codagen.backends.triton.backend import kernel_hash
    from codagen.backends.triton.pingpong_codegen import refusal

#: the dtype sets the kernel cache keys on (``a`` and the program's tensors): the source differs only
#: in its header, which the dump keeps so a change there shows too
DTYPES = ("a:bf16", "a:fp16", "a:fp32")


def programs():
    """Every library program the tuning table may hold, with and without the low-rank operand pair."""
    base = [factory() for factory in library.PROGRAMS.values()]
    base += [library.rms_qkv_rope(head_dim, 1e-6) for head_dim in (64, 128)]
    base += [library.rms_norm_backward(grad) for grad in ("add", "accumulate", "none")]
    base += [library.weight_grad(accumulate, dtype) for accumulate in (False, True) for dtype in ("input", "float32")]
    try:  # the inference programs (a tree from before them has none)
        base += [library.rms_gate_up_swiglu(save_preact=False)]
        base += [library.rms_qkv_rope(head_dim, 1e-6, save_preact=False) for head_dim in (64, 128)]
    except TypeError:
        pass
    unique = list(dict.fromkeys(base))
    return unique + [p.with_low_rank() for p in unique]


def _digest(program) -> str:
    return hashlib.sha256(f"{program.gemm!r}|{program.outputs!r}".encode()).hexdigest()[:10]


def dump(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    pingpong = pingpong_unsupported() is None
    written, hashes = 0, {}
    for program in programs():
        stem = f"{_digest(program)}.{program.name}{'.low_rank' if program.gemm.low_rank else ''}"
        schedules = ["persistent"] + (["pingpong"] if pingpong and refusal(program) is None else [])
        for schedule in schedules:
            for dtypes in DTYPES:
                source = program_source(program, dtypes=dtypes, arch="sm_90", schedule=schedule)
                (out / f"{stem}.{schedule}.{dtypes.replace(':', '-')}.py").write_text(source)
                written += 1
        hashes[stem] = f"{program.name}:{kernel_hash(program)}"
    (out / "hashes.json").write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write the sources to")
    args = parser.parse_args()
    print(f"{dump(args.out)} kernel sources written to {args.out}")


if __name__ == "__main__":
    main()
