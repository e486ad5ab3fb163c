"""A sharded training step on several GPUs: tokens/s and peak memory, codagen against transformers' own model.

Runs under ``torchrun`` (one process per GPU, NCCL). A Hugging Face Llama with ``--layers`` layers of the
``--shape`` dims in bf16 (fp32 master weights under FSDP's ``MixedPrecisionPolicy(bf16, fp32)``), per mode:

- ``fsdp``: data parallel over all ranks. codagen: ``codagen.models.sharding.fully_shard``; transformers:
  ``torch.distributed.fsdp.fully_shard`` on every decoder layer and the root, the same policy. Each rank
  steps on ``--tokens`` tokens of its own.
- ``tp``, ``tp_sp``: tensor parallel over all ranks (codagen only: ``sharding.parallelize``, bf16
  parameters), without and with sequence parallelism; every rank sees the same ``--tokens`` tokens.

A step is forward, backward and an AdamW step. Per provider and mode: the median step time over
``--steps`` steps after ``--warmup``, tokens/s over the job (data parallel: all ranks' tokens), and the
largest peak memory of a rank above its state before the step.

    torchrun --nproc-per-node 2 bench/sharded_step.py [--modes fsdp tp tp_sp] [--shape llama3-8b]
        [--layers 4] [--tokens 8192] [--out DIR]

Writes ``bench/results/<date>-sharded-step.json`` (rank 0). ``--device cpu`` runs the same on gloo, tiny
shapes only (a smoke test of the script).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from codagen.bench.common import write_results
from codagen.models import sharding

SHAPES = {"llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                            vocab_size=128256),
          "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                            vocab_size=128256),
          "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=256)}
SEQ = 4096


def build(args, device):
    config = transformers.LlamaConfig(**SHAPES[args.shape], num_hidden_layers=args.layers,
                                      max_position_embeddings=SEQ, attn_implementation="sdpa")
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).train()


def prepare(model, provider, mode, mesh):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if mode == "fsdp" and provider == "codagen":
        sharding.fully_shard(model, mesh=mesh, mp_policy=policy)
    elif mode == "fsdp":
        for layer in model.model.layers:
            torch_fully_shard(layer, mesh=mesh, mp_policy=policy)
        torch_fully_shard(model, mesh=mesh, mp_policy=policy)
    else:
        sharding.parallelize(model.bfloat16(), mesh, sequence_parallel=mode == "tp_sp")
    return model


def measure(args, model, mode, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    seq = min(args.tokens, SEQ)
    generator = torch.Generator(device).manual_seed(rank if mode == "fsdp" else 0)
    ids = torch.randint(0, model.config.vocab_size, (args.tokens // seq, seq), device=device, generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    times, peak = [], 0.0
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        dist.barrier()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = max(peak, (torch.cuda.max_memory_allocated() - before) / 2 ** 30)
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    median = statistics.median(times)
    job_tokens = args.tokens * (world if mode == "fsdp" else 1)
    return {"median_step_ms": 1e3 * median, "step_ms": [1e3 * t for t in times], "tokens_per_s": job_tokens / median,
            "peak_gib": max(peaks) if device.type == "cuda" else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", default=["fsdp", "tp", "tp_sp"], choices=["fsdp", "tp", "tp_sp"])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank (fsdp) or per step (tp)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        os.environ.setdefault("CODAGEN_TRITON_AUTOTUNE", "0")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    torch.manual_seed(0)
    base = build(args, "cpu")
    records = []
    for mode in args.modes:
        for provider in ("codagen", "transformers") if mode == "fsdp" else ("codagen",):
            model = prepare(copy.deepcopy(base).to(device), provider, mode, mesh)
            record = {"mode": mode, "provider": provider, "shape": args.shape, "layers": args.layers,
                      "tokens": args.tokens, "world": dist.get_world_size(), **measure(args, model, mode, device)}
            records.append(record)
            if dist.get_rank() == 0:
                print(f"{mode:6} {provider:12} {record['median_step_ms']:9.1f} ms "
                      f"{record['tokens_per_s']:12,.0f} tok/s  peak {record['peak_gib']} GiB", flush=True)
            del model
    if dist.get_rank() == 0:
        print(write_results("sharded-step", records, args.out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
