"""``codagen <command>`` (also ``python -m codagen``).

  demo            train a small LLaMA with and without codagen (the main job)
  bench kernels   time every fused kernel against cuBLAS and its unfused peers (GPU)
  bench block     time one block forward+backward and a training step against peers (GPU)
  bench lora      time a PEFT LoRA fine-tuning step against PEFT eager, torch.compile and Liger (GPU)
"""
from __future__ import annotations

import argparse
import importlib
import sys

_BENCH_SUITES = ("kernels", "block", "lora")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="codagen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("demo", "bench"))
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the command")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from codagen.demo import main as demo
        return demo(args.rest)
    if not args.rest or args.rest[0] not in _BENCH_SUITES:
        parser.error(f"bench needs a suite: one of {_BENCH_SUITES}")
    module = importlib.import_module(f"codagen.bench.{args.rest[0]}")
    return module.main(args.rest[1:])


if __name__ == "__main__":
    sys.exit(main())
