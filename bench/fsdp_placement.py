"""Where the FSDP2 units go: a training step of a patched model under codagen's regrouped units against the units
per decoder layer that accelerate's FSDP2 plugin places, on one GPU (a world-size-1 NCCL group).

A Hugging Face Llama of ``--shape`` dims (``bench/sharded_step.py``'s shapes) with ``--layers`` layers, fp32
parameters under ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, ``--batch`` x ``--seq`` tokens;
a step is forward, backward and AdamW. Configurations:

- ``regrouped``: ``codagen.models.sharding.fully_shard`` (fused parameters, a unit per regrouped block, the norms
  in the root);
- ``per_layer``: ``codagen.patch``, then accelerate 1.15's placement (:func:`accelerate_placement`: a unit per
  decoder layer, the embeddings, ``[final norm, LM head]`` without resharding after forward, the root), which runs
  the layer-aligned forward (``codagen.models.layer_units``);
- ``per_layer_transformers``: the unpatched model, the same placement;
- ``lora_per_layer``, ``lora_per_layer_transformers``: PEFT LoRA r ``--lora-rank`` on all seven projections of
  every layer (frozen base), patched and unpatched, the same placement.

Each configuration's model is built once; the rounds time one step of each in a rotating order
(``codagen.bench.common.timed_rounds``) after ``--warmup`` steps. Writes JSON to ``--out``: the GPU and versions,
the shapes, per configuration the median step time, its rounds and the peak memory of one step.

    CODAGEN_TRITON_AUTOTUNE=0 python bench/fsdp_placement.py --out fsdp-placement.json
    python bench/fsdp_placement.py --smoke --out /tmp/fsdp-placement.json    # CPU, gloo, tiny dims
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharded_step import SHAPES  # noqa: E402

import codagen  # noqa: E402
from codagen.bench.common import environment, peak_gib, timed_rounds  # noqa: E402
from codagen.models import sharding  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = ("regrouped", "per_layer", "per_layer_transformers", "lora_per_layer", "lora_per_layer_transformers")


def accelerate_placement(model, policy: MixedPrecisionPolicy):
    """accelerate 1.15's ``fsdp2_prepare_model`` calls for a Llama (transformer-based wrap of
    ``_no_split_modules``, resharding after forward): each decoder layer, the input embedding (untied),
    ``[final norm, LM head]`` with ``reshard_after_forward=False``, then the root with torch's default.
    ``tests/models/test_sharding_per_layer.py`` runs accelerate's own function."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in inner.model.layers:
        fully_shard(layer, reshard_after_forward=True, mp_policy=policy)
    fully_shard(inner.model.embed_tokens, reshard_after_forward=True, mp_policy=policy)
    fully_shard([inner.model.norm, inner.lm_head], reshard_after_forward=False, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def prepare(base, name: str, lora_rank: int, device: torch.device):
    """The model of configuration ``name``, on ``device``, sharded."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = copy.deepcopy(base).to(device)
    if name == "regrouped":
        return sharding.fully_shard(model, mp_policy=policy)
    if name.startswith("lora"):
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                                                           target_modules=PROJECTIONS, lora_dropout=0.0))
    if not name.endswith("transformers"):
        codagen.patch(model)
    return accelerate_placement(model, policy)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama3-1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny dims, 2 rounds")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.layers, args.batch, args.seq, args.rounds, args.warmup = "tiny", 2, 2, 64, 2, 1
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if args.smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        os.environ.setdefault("CODAGEN_TRITON_AUTOTUNE", "0")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPES[args.shape], num_hidden_layers=args.layers,
                                      max_position_embeddings=args.seq, attn_implementation="sdpa")
    base = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)

    steps, peaks = {}, {}
    for name in args.configs:
        model = prepare(base, name, args.lora_rank, device)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")

        def step(model=model, optimizer=optimizer):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for _ in range(args.warmup):
            step()
        peaks[name] = peak_gib(step, device, params)
        steps[name] = step
        print(f"{name}: ready (peak {peaks[name]} GiB)", flush=True)

    def timer(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start)
    times = timed_rounds(steps, args.rounds, timer)
    tokens = args.batch * args.seq
    records = []
    for name, rounds in times.items():
        median = statistics.median(rounds)
        records.append({"config": name, "median_step_ms": median, "round_ms": rounds, "tokens_per_s": tokens / median
                        * 1e3, "peak_gib": peaks[name]})
        print(f"{name:28s} {median:9.2f} ms  {tokens / median * 1e3:12,.0f} tok/s  peak {peaks[name]} GiB", flush=True)
    result = {"env": {**environment(), "transformers": transformers.__version__},
              "shape": {"name": args.shape, **SHAPES[args.shape], "layers": args.layers, "batch": args.batch,
                        "seq": args.seq, "lora_rank": args.lora_rank, "device": str(device),
                        "param_dtype": "bfloat16", "reduce_dtype": "float32"},
              "records": records}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
