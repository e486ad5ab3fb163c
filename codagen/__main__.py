"""``codagen <command> [arguments]`` (also ``python -m codagen``); ``codagen <command> --help`` for each."""
from __future__ import annotations

import importlib
import sys

#: command -> (module whose ``main(argv)`` runs it, one-line summary)
COMMANDS = {
    "demo": ("codagen.demo", "train a small LLaMA with and without codagen (the main job)"),
    "tune": ("codagen.tune", "time the kernel configurations of a model's shapes into the tuning cache (GPU)"),
}
#: ``codagen bench <suite>``: suite -> (module whose ``main(argv)`` runs it, one-line summary)
BENCH_SUITES = {
    "kernels": ("codagen.bench.kernels", "time every fused kernel against cuBLAS and its unfused peers (GPU)"),
    "block": ("codagen.bench.block", "time one block forward+backward and a training step against peers (GPU)"),
    "checkpoint": ("codagen.bench.checkpoint",
                   "peak memory and step time of a checkpointed HF Llama, patched and unpatched (GPU)"),
    "lora": ("codagen.bench.lora", "a LoRA fine-tuning step against PEFT eager, torch.compile and Liger (GPU)"),
    "models": ("codagen.bench.models",
               "a training step (full, LoRA) of published models' configs against eager, compile and Liger (GPU)"),
    "generate": ("codagen.bench.generate",
                 "prefill and decode with a KV cache against transformers eager and compiled (GPU)"),
}


def _listing(title: str, table: dict) -> str:
    width = max(map(len, table))
    return title + "\n" + "\n".join(f"  {name:<{width}}  {summary}" for name, (_, summary) in table.items())


def _usage() -> str:
    commands = {**COMMANDS, "bench": (None, "benchmarks: codagen bench <suite>")}
    return (f"usage: codagen <command> [arguments]\n\n{_listing('commands:', commands)}\n\n"
            f"{_listing('bench suites (codagen bench <suite>):', BENCH_SUITES)}\n\n"
            "codagen <command> --help (or codagen bench <suite> --help) describes a command's arguments.")


def _run(module: str, argv: list[str]) -> int:
    return importlib.import_module(module).main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in COMMANDS:
        return _run(COMMANDS[command][0], rest)
    if command != "bench":
        print(f"{_usage()}\n\ncodagen: error: unknown command {command!r}; expected one of "
              f"{[*COMMANDS, 'bench']}", file=sys.stderr)
        return 2
    if not rest or rest[0] in ("-h", "--help"):
        print("usage: codagen bench <suite> [arguments]\n\n" + _listing("suites:", BENCH_SUITES)
              + "\n\ncodagen bench <suite> --help describes a suite's arguments.")
        return 0 if rest else 2
    if rest[0] not in BENCH_SUITES:
        print(f"codagen bench: error: unknown suite {rest[0]!r}; expected one of {list(BENCH_SUITES)}", file=sys.stderr)
        return 2
    return _run(BENCH_SUITES[rest[0]][0], rest[1:])


if __name__ == "__main__":
    sys.exit(main())
