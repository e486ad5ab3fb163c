"""torchtitan's own training step on one GPU: codagen's blocks against torchtitan's Llama 3 model.

Both runs use torchtitan 0.3's trainer (``torchtitan.train``) with its ``llama3_8b`` config cut to ``LAYERS``
layers (Llama-3-8B dims: d 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256), sequence ``SEQ_LEN``, batch 1,
bf16 parameters (FSDP degree 1: torchtitan's ``MixedPrecisionPolicy``, fp32 reduce), ``torch.compile`` on the
model and the loss, Float8 off, no activation checkpointing, AdamW, torchtitan's chunked cross-entropy. The
tokens are random (no tokenizer or data set is read): each row is one document, so torchtitan's model runs its
default flex attention with a causal mask and codagen's blocks run causal SDPA. The codagen run converts the model
with ``codagen.integrations.torchtitan`` and the ``partial_dtensor`` SPMD backend that it needs; torchtitan's run
keeps the defaults.

This file is a torchtitan config registry (``--config torchtitan`` / ``--config codagen``) and the runner::

    python bench/torchtitan_step.py [--steps 30] [--warmup 10] [--out bench/results]

runs ``torchrun --nproc-per-node 1 -m torchtitan.train --module bench.torchtitan_step --config NAME`` for both
(from the repository root), reads torchtitan's own per-step log line (``tps``, ``memory`` = peak reserved GiB),
and writes ``bench/results/<date>-torchtitan-step.json``: per model the median tps and the peak memory over the
steps after ``--warmup``, with the GPU, the versions and the shapes. The codagen run takes the shipped Triton
tuning (``CODAGEN_TRITON_AUTOTUNE=0`` unless set).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass

import torch
import torchtitan as torchtitan_package
import triton
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import CompileConfig
from torchtitan.config.override import derive
from torchtitan.models.llama3 import config_registry as llama3_config_registry
from torchtitan.tools.profiler import Profiler
from torchtitan.trainer import Trainer

from codagen.integrations.torchtitan.config_registry import codagen_trainer_config

LAYERS, SEQ_LEN, STEPS = 8, 8192, 30


class RandomTokenizer(BaseTokenizer):
    """A tokenizer of ``vocab_size`` ids that the random loader never calls (torchtitan's trainer builds one)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 128256

    def __init__(self, config: Config, **kwargs):
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("RandomTokenizer has no text encoding")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("RandomTokenizer has no text decoding")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class _RandomTokens(IterableDataset):
    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed)
        positions = torch.arange(self.seq_len)
        while True:
            ids = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)
            yield {"input": ids[:-1], "positions": positions}, ids[1:]


class RandomTokensLoader(ParallelAwareDataloader):
    """Rows of uniformly random token ids, one document per row (positions ``0 .. seq_len - 1``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        vocab_size: int = 128256

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int, local_batch_size: int,
                 **kwargs):
        super().__init__(_RandomTokens(config.vocab_size, seq_len, seed=dp_rank), dp_rank=dp_rank,
                         dp_world_size=dp_world_size, batch_size=local_batch_size)


def torchtitan() -> Trainer.Config:
    """torchtitan's ``llama3_8b`` with ``LAYERS`` layers, compiled, on random tokens."""
    config = llama3_config_registry.llama3_8b()
    spec = config.model_spec
    model = derive(spec.model, type(spec.model), layers=spec.model.layers[:LAYERS])
    config.model_spec = dataclasses.replace(spec, model=model)
    config.tokenizer = RandomTokenizer.Config(vocab_size=model.vocab_size)
    config.dataloader = RandomTokensLoader.Config(vocab_size=model.vocab_size)
    config.training.seq_len, config.training.local_batch_size, config.training.steps = SEQ_LEN, 1, STEPS
    config.compile = CompileConfig(enable=True, components=["model", "loss"])
    config.activation_checkpoint = None
    config.checkpoint.enable = False
    config.validator.enable = False
    config.profiler = Profiler.Config(enable_profiling=False)
    config.metrics = MetricsProcessor.Config(log_freq=1, enable_tensorboard=False)
    return config


def codagen() -> Trainer.Config:
    """:func:`torchtitan` with the model converted to codagen's blocks."""
    return codagen_trainer_config(torchtitan())


_STEP_LINE = re.compile(r"step:\s*(\d+).*?memory:\s*([\d.]+)\s*GiB.*?tps:\s*([\d,]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run(name: str, steps: int) -> list[tuple[int, float, float]]:
    """``(step, peak reserved GiB, tps)`` of each step of torchtitan's log for the config ``name``."""
    command = ["torchrun", "--standalone", "--nproc-per-node", "1", "-m", "torchtitan.train", "--module",
               "bench.torchtitan_step", "--config", name, "--training.steps", str(steps)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    env.setdefault("CODAGEN_TRITON_AUTOTUNE", "0")  # the shipped tuning, no minutes of autotuning in the run
    print(" ".join(command), flush=True)
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    log = _ANSI.sub("", result.stdout + result.stderr)
    if result.returncode:
        sys.exit(f"{name}: torchtitan.train failed (exit {result.returncode}):\n{log[-6000:]}")
    rows = [(int(m[1]), float(m[2]), float(m[3].replace(",", ""))) for m in _STEP_LINE.finditer(log)]
    if len(rows) < steps:
        sys.exit(f"{name}: {len(rows)} step lines in torchtitan's log, expected {steps}:\n{log[-6000:]}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the medians (compile, autotune)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    results = {}
    for name in ("torchtitan", "codagen"):
        rows = [row for row in run(name, args.steps) if row[0] > args.warmup]
        results[name] = {"tps_median": statistics.median(tps for _, _, tps in rows),
                         "peak_reserved_gib": max(mem for _, mem, _ in rows), "steps": rows}
        print(f"{name}: {results[name]['tps_median']:,.0f} tps, {results[name]['peak_reserved_gib']:.2f} GiB")
    results["codagen_speedup"] = results["codagen"]["tps_median"] / results["torchtitan"]["tps_median"]
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "torchtitan": getattr(torchtitan_package, "__version__", "?"),
              "shape": {"model": "Llama-3-8B dims", "layers": LAYERS, "seq_len": SEQ_LEN, "batch": 1,
                        "dtype": "bf16 params, fp32 reduce", "compile": ["model", "loss"], "fsdp_degree": 1,
                        "activation_checkpointing": None, "float8": False, "loss": "torchtitan ChunkedLossWrapper"},
              "warmup": args.warmup, "results": results}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{datetime.date.today().isoformat()}-torchtitan-step.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}: codagen / torchtitan = {results['codagen_speedup']:.3f}")


if __name__ == "__main__":
    main()
