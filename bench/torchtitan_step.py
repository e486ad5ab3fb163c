"""torchtitan's own training step on one GPU: codagen's blocks against torchtitan's Llama 3 model.

Every run uses torchtitan 0.3's trainer (``torchtitan.train``) with its ``llama3_8b`` config cut to ``LAYERS``
layers (Llama-3-8B dims: d 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256), sequence ``SEQ_LEN``, batch 1,
bf16 parameters (FSDP degree 1: torchtitan's ``MixedPrecisionPolicy``, fp32 reduce), ``torch.compile`` on the
model and the loss, Float8 off, no activation checkpointing, AdamW, torchtitan's ``CrossEntropyLoss`` on the
whole logits (``--loss chunked``: ``llama3_8b``'s ``ChunkedLossWrapper``, the LM head and loss per sequence chunk),
and ``training.disable_cuda_graphs`` (torchtitan 0.3 captures the whole forward + backward in a CUDA graph by
default). The tokens are random (no tokenizer or data set is read), one document per row. Configs:

- ``torchtitan_sdpa``: torchtitan's model with its ``ScaledDotProductAttention`` module
  (causal SDPA, the attention codagen's blocks run) as each layer's inner attention;
- ``torchtitan``: torchtitan's model with its default flex attention (causal block mask);
- ``codagen``: the ``torchtitan`` config converted with ``codagen.integrations.torchtitan`` (causal SDPA in its
  blocks) and the ``partial_dtensor`` SPMD backend that it needs.

With torch 2.11 and ``--loss chunked`` both torchtitan configs fail in their first backward: "The tensor has a
non-zero number of elements, but its data is not allocated yet". ``ChunkedLossWrapper`` calls ``reshard()`` on
the LM head's FSDP unit after the chunks, and torchtitan's model shares that unit with its final norm
(``fully_shard([norm, lm_head])``), whose weight the decoder's backward then reads; torch 2.13 re-gathers it, torch
2.11 does not. It reproduces on CPU without compile; the converted model keeps its final norm in the root unit
and runs. A failed config is recorded with its error; the others still run.

torchtitan's ``varlen`` attention backend needs FlashAttention 3 (``flash_attn_interface``) on Hopper, which the
H200 image does not have. On torch < 2.13 (the image has 2.11) three names torchtitan 0.3 uses are missing; this
file supplies them for these runs only: ``torch.distributed.fsdp.DataParallelMeshDims`` (imported; built only
for full-DTensor and expert meshes, which raise here), the ``separate_full_blocks`` argument of
``create_block_mask`` (torch 2.11 always separates full blocks, which is what ``True`` asks for; ``False``
raises) and ``torch.distributed.set_timeout`` (torch 2.11's ``distributed_c10d._set_pg_timeout``).

This file is a torchtitan config registry (``--config torchtitan_sdpa|torchtitan|codagen``), torchtitan's entry
point (``--train``, below) and the runner::

    python bench/torchtitan_step.py [--steps 30] [--warmup 10] [--out bench/results] [--gpus 1] [--tp 1]

runs ``torchrun --nproc-per-node 1 bench/torchtitan_step.py --train --module bench.torchtitan_step --config NAME``
(torchtitan's ``torchtitan.train`` main with this file imported first) for each config, from the repository root,
reads torchtitan's own per-step log line (``tps``, ``memory`` = peak reserved GiB),
and writes ``bench/results/<date>-torchtitan-step.json`` (``-<gpus>gpu-fsdp<n>-tp<n>`` added on several GPUs):
per model the median tps (rank 0's, per GPU) and the peak memory over the steps after ``--warmup``, with the
GPU, the versions and the shapes. ``--gpus N --tp T`` runs FSDP over ``N / T`` ranks and tensor parallelism
(with sequence parallelism) over ``T``: torchtitan's own TP plan for its model, codagen's for the converted one.
The codagen run takes the shipped Triton tuning (``CODAGEN_TRITON_AUTOTUNE=0`` unless set).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed.fsdp

if not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
    class _DataParallelMeshDims:
        """torch < 2.13 has no ``DataParallelMeshDims``. torchtitan 0.3 imports it, and builds one only for
        full-DTensor or expert meshes, which these FSDP-degree-1 runs never use."""

        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"torch {torch.__version__} has no DataParallelMeshDims (torch >= 2.13)")

    torch.distributed.fsdp.DataParallelMeshDims = _DataParallelMeshDims

import torchtitan as torchtitan_package  # noqa: E402
import torchtitan.models.common.attention as torchtitan_attention  # noqa: E402
import triton  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.config import CompileConfig  # noqa: E402
from torchtitan.config.override import derive  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import config_registry as llama3_config_registry  # noqa: E402
from torchtitan.tools.profiler import Profiler  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from codagen.integrations.torchtitan.config_registry import codagen_trainer_config  # noqa: E402

LAYERS, SEQ_LEN, STEPS = 8, 8192, 30
CONFIGS = ("torchtitan_sdpa", "torchtitan", "codagen")
LOSSES = ("cross_entropy", "chunked")
LOSS_VARIABLE = "TORCHTITAN_STEP_LOSS"  # --loss, from the runner to the configs in torchtitan's processes


if not hasattr(torch.distributed, "set_timeout"):
    torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout

if "separate_full_blocks" not in inspect.signature(torch.nn.attention.flex_attention.create_block_mask).parameters:
    _create_block_mask = torchtitan_attention._compiled_create_block_mask

    def _create_block_mask_separating_full_blocks(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise RuntimeError(f"torch {torch.__version__}'s create_block_mask always separates full blocks")
        return _create_block_mask(*args, **kwargs)

    torchtitan_attention._compiled_create_block_mask = _create_block_mask_separating_full_blocks


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
    config.training.disable_cuda_graphs = True
    config.compile = CompileConfig(enable=True, components=["model", "loss"])
    config.activation_checkpoint = None
    config.checkpoint.enable = False
    config.validator.enable = False
    config.profiler = Profiler.Config(enable_profiling=False)
    config.metrics = MetricsProcessor.Config(log_freq=1, enable_tensorboard=False)
    if os.environ.get(LOSS_VARIABLE, "cross_entropy") == "cross_entropy":  # else llama3_8b's ChunkedLossWrapper
        config.loss = CrossEntropyLoss.Config(global_vocab_size=model.vocab_size)
    return config


def torchtitan_sdpa() -> Trainer.Config:
    """:func:`torchtitan` with causal SDPA as each layer's inner attention."""
    config = torchtitan()
    spec = config.model_spec
    layers = [derive(layer, type(layer), attention=derive(layer.attention, type(layer.attention),
                                                          inner_attention=ScaledDotProductAttention.Config()))
              for layer in spec.model.layers]
    config.model_spec = dataclasses.replace(spec, model=derive(spec.model, type(spec.model), layers=layers))
    return config


def codagen() -> Trainer.Config:
    """:func:`torchtitan` with the model converted to codagen's blocks."""
    return codagen_trainer_config(torchtitan())


_STEP_LINE = re.compile(r"step:\s*(\d+).*?memory:\s*([\d.]+)\s*GiB.*?tps:\s*([\d,]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run(name: str, steps: int, gpus: int = 1, tp: int = 1,
        loss: str = "cross_entropy") -> list[tuple[int, float, float]]:
    """``(step, peak reserved GiB, tps)`` of each step of torchtitan's log (rank 0's) for the config ``name`` on
    ``gpus`` GPUs, tensor parallelism ``tp`` (with sequence parallelism) and FSDP over the rest, with ``loss``; raises
    ``RuntimeError`` with the log's tail when the run fails."""
    command = ["torchrun", "--standalone", "--nproc-per-node", str(gpus), __file__, "--train", "--module",
               "bench.torchtitan_step", "--config", name, "--training.steps", str(steps),
               "--parallelism.data_parallel_shard_degree", str(gpus // tp),
               "--parallelism.tensor_parallel_degree", str(tp)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    env[LOSS_VARIABLE] = loss
    env.setdefault("CODAGEN_TRITON_AUTOTUNE", "0")  # the shipped tuning, no minutes of autotuning in the run
    print(" ".join(command), flush=True)
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    log = _ANSI.sub("", result.stdout + result.stderr)
    if result.returncode:
        raise RuntimeError(f"{name}: torchtitan.train failed (exit {result.returncode}):\n{log[-6000:]}")
    rows = [(int(m[1]), float(m[2]), float(m[3].replace(",", ""))) for m in _STEP_LINE.finditer(log)]
    if len(rows) < steps:
        raise RuntimeError(f"{name}: {len(rows)} step lines in torchtitan's log, expected {steps}:\n{log[-6000:]}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the medians (compile, autotune)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--gpus", type=int, default=1, help="GPUs (torchrun processes); FSDP over gpus / tp")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (with sequence parallelism)")
    parser.add_argument("--loss", choices=LOSSES, default="cross_entropy",
                        help="torchtitan's CrossEntropyLoss (default) or llama3_8b's ChunkedLossWrapper")
    args = parser.parse_args()
    if args.gpus < 1 or args.tp < 1 or args.gpus % args.tp:
        parser.error(f"--gpus ({args.gpus}) must be a positive multiple of --tp ({args.tp})")
    results = {}
    for name in args.configs:
        try:
            rows = [row for row in run(name, args.steps, args.gpus, args.tp, args.loss) if row[0] > args.warmup]
        except RuntimeError as error:  # recorded; the other configs still run
            print(error, flush=True)
            results[name] = {"error": str(error)[-2000:]}
            continue
        results[name] = {"tps_median": statistics.median(tps for _, _, tps in rows),
                         "peak_reserved_gib": max(mem for _, mem, _ in rows), "steps": rows}
        print(f"{name}: {results[name]['tps_median']:,.0f} tps, {results[name]['peak_reserved_gib']:.2f} GiB")
    codagen_tps = results.get("codagen", {}).get("tps_median")
    speedups = {f"codagen/{name}": codagen_tps / result["tps_median"] for name, result in results.items()
                if name != "codagen" and codagen_tps and "tps_median" in result}
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "torchtitan": getattr(torchtitan_package, "__version__", "?"),
              "shape": {"model": "Llama-3-8B dims", "layers": LAYERS, "seq_len": SEQ_LEN, "batch": 1,
                        "dtype": "bf16 params, fp32 reduce", "compile": ["model", "loss"], "gpus": args.gpus,
                        "fsdp_degree": args.gpus // args.tp, "tp_degree": args.tp, "sequence_parallel": args.tp > 1,
                        "cuda_graphs": False,
                        "activation_checkpointing": None, "float8": False, "loss": args.loss},
              "warmup": args.warmup, "results": results, "speedups": speedups}
    os.makedirs(args.out, exist_ok=True)
    layout = "" if args.gpus == 1 else f"-{args.gpus}gpu-fsdp{args.gpus // args.tp}-tp{args.tp}"
    path = os.path.join(args.out, f"{datetime.date.today().isoformat()}-torchtitan-step{layout}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}: " + ", ".join(f"{name} = {value:.3f}" for name, value in speedups.items()))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:  # one torchtitan run (torchrun starts it), the arguments torchtitan's
        del sys.argv[1]
        from torchtitan.train import main as train
        train()
    else:
        main()
