"""Loss curves of sharded training on the demo corpus: codagen against the same engine without codagen, and
codagen on N processes against codagen in one.

Runs under ``torchrun --nproc-per-node N`` (one process per GPU, NCCL). A Hugging Face Llama of the
``--shape`` dims, bf16 parameters, trains ``--steps`` AdamW steps on ``codagen.demo``'s corpus (its
character tokenizer, its batch windows and learning-rate schedule), from the same initialization, on the
same global batches in the same order, in each mode:

- ``fsdp``: FSDP2 over the N ranks, each rank on its ``batch / N`` rows of the global batch; the loss is the
  mean over the ranks. codagen: ``codagen.models.sharding.fully_shard``; transformers: the unpatched model
  under torch's ``fully_shard`` on every decoder layer and the root.
- ``tp``: tensor parallel over the N ranks with sequence parallelism, every rank on the whole global batch.
  codagen: ``sharding.parallelize(..., sequence_parallel=True)``; transformers: the unpatched model under the
  config's ``base_model_tp_plan`` (column-parallel QKV and gate/up, row-parallel O and down) and
  transformers' LM-head plan (column-parallel, gathered output), with the norms and the residual stream split
  by sequence (torch's ``SequenceParallel``), through ``parallelize_module``.
- ``single``: one process on the whole global batch (``codagen.patch`` and the unpatched model); every rank
  runs it on its own device, rank 0's losses are recorded.

Writes ``<out>/<date>-sharded-convergence-<modes>.json`` (rank 0, rewritten after each mode): ``env`` (GPU per
rank, versions, world size, the codagen backend, the NVLink multicast switches), ``config``, ``records`` (per
mode and provider: the per-step losses, the parameter values rank 0 holds, the run's wall time) and
``comparisons`` (the largest per-step loss difference of codagen against transformers in each mode, of each
provider on N ranks against one process, and the step where it occurs); at the end, beside it, a ``.png`` of the curves
and their differences. NVLink multicast stays off: the script refuses to start unless ``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` are set in its environment.

    torchrun --nproc-per-node 2 bench/sharded_convergence.py [--modes single fsdp tp] [--shape d512]
        [--steps 200] [--out bench/results]

``--dry-run``: gloo on CPU, float32, the ``tiny`` shape, 5 steps (``tests/models/test_sharded_convergence.py``).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import codagen
from codagen import demo
from codagen.backends import resolve_backend_name
from codagen.bench.common import RESULTS_DIR, environment, pyplot
from codagen.models import sharding

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MODES = ("single", "fsdp", "tp")
PROVIDERS = ("codagen", "transformers")
CORPUS_CHARS = 400_000


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    batch: int  # global batch, rows
    seq: int


SHAPES = {"d512": Shape(hidden=512, intermediate=1536, layers=4, heads=8, kv_heads=4, batch=16, seq=512),
          "d1024": Shape(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=8, batch=16, seq=1024),
          "tiny": Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, batch=4, seq=32)}


def check_multicast_off() -> dict[str, str]:
    """The NVLink multicast switches, as this process sees them; refuses to run with any of them missing."""
    wrong = {name: os.environ.get(name) for name, value in MULTICAST_OFF.items() if os.environ.get(name) != value}
    if wrong:
        want = " ".join(f"{name}={value}" for name, value in MULTICAST_OFF.items())
        raise SystemExit(f"sharded_convergence: NVLink multicast must be off in every process: export {want} "
                         f"(this process has {wrong})")
    return {name: os.environ[name] for name in MULTICAST_OFF}


def build(shape: Shape, vocab: int, seed: int) -> transformers.LlamaForCausalLM:
    """The float32 model every run starts from (initialized on the CPU: the same values in every process)."""
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                                      num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.seq,
                                      attn_implementation="sdpa")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).train()


def transformers_tp_plan(model: transformers.PreTrainedModel) -> dict:
    """transformers' tensor-parallel plan for ``model`` as torch styles, with sequence parallelism: the residual
    stream between the GEMMs is split by sequence (``Shard(1)``) from the first decoder layer to the final norm."""
    styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(output_layouts=Shard(1))}
    plan = {}
    for name, style in model.config.base_model_tp_plan.items():
        if style not in styles:
            raise ValueError(f"transformers_tp_plan: base_model_tp_plan[{name!r}] is {style!r}; expected one of "
                             f"{sorted(styles)}")
        plan[f"model.{name}"] = styles[style]
    sequence, replicated = (Shard(1),), (Replicate(),)
    return {**plan,
            "model.layers.0": PrepareModuleInput(input_layouts=replicated, desired_input_layouts=sequence,
                                                 use_local_output=True),
            "model.layers.*.input_layernorm": SequenceParallel(),
            "model.layers.*.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                           desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                           use_local_output=True),
            "model.layers.*.post_attention_layernorm": SequenceParallel(),
            "model.layers.*.mlp": PrepareModuleInput(input_layouts=sequence, desired_input_layouts=replicated,
                                                     use_local_output=True),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}


def prepare(model: torch.nn.Module, mode: str, provider: str, mesh) -> torch.nn.Module:
    if mode == "single":
        return codagen.patch(model) if provider == "codagen" else model
    if mode == "fsdp" and provider == "codagen":
        return sharding.fully_shard(model, mesh=mesh)
    if mode == "fsdp":
        for layer in model.model.layers:
            torch_fully_shard(layer, mesh=mesh)
        return torch_fully_shard(model, mesh=mesh)
    if provider == "codagen":
        return sharding.parallelize(model, mesh, sequence_parallel=True)
    return parallelize_module(model, mesh, transformers_tp_plan(model))


def train(model, data: torch.Tensor, shape: Shape, mode: str, args, device) -> list[float]:
    """The demo's AdamW run over ``args.steps`` global batches; the per-step losses (one host sync, at the end)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * shape.batch // world, (rank + 1) * shape.batch // world) if mode == "fsdp" else slice(None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for step, (inputs, _) in enumerate(demo.batches(data, shape.batch, shape.seq, args.steps, args.seed, "cpu")):
        for group in optimizer.param_groups:
            group["lr"] = demo.lr_schedule(step, args.steps, args.lr)
        ids = inputs[rows].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    losses = torch.stack(losses)
    if mode == "fsdp":  # each rank's mean over the same number of tokens: their mean is the global batch's
        dist.all_reduce(losses)
        losses /= world
    return losses.tolist()


def largest_difference(name: str, got: list[float], want: list[float]) -> dict:
    diffs = [abs(a - b) for a, b in zip(got, want, strict=True)]
    step = max(range(len(diffs)), key=diffs.__getitem__)
    return {"name": name, "max_abs_diff": diffs[step], "max_rel_diff": max(d / abs(b) for d, b in zip(diffs, want)),
            "step": step + 1}


def comparisons(losses: dict[tuple[str, str], list[float]], world: int) -> list[dict]:
    """codagen against transformers per mode; each provider on ``world`` ranks against one process."""
    found = []
    for mode in MODES:
        if (mode, "codagen") in losses:
            found.append(largest_difference(f"{mode}: codagen vs transformers", losses[mode, "codagen"],
                                            losses[mode, "transformers"]))
    for mode in MODES[1:]:
        for provider in PROVIDERS:
            if (mode, provider) in losses and ("single", provider) in losses:
                found.append(largest_difference(f"{provider}: {mode} on {world} ranks vs single",
                                                losses[mode, provider], losses["single", provider]))
    return found


def plot(result: dict, path: Path) -> Path | None:
    """Per mode: both providers' loss curves (top) and the per-step loss differences (bottom, log scale)."""
    plt = pyplot()
    if plt is None:
        return None
    losses = {(r["mode"], r["provider"]): r["losses"] for r in result["records"]}
    modes = list(dict.fromkeys(mode for mode, _ in losses))
    world = result["env"]["world_size"]
    fig, axes = plt.subplots(2, len(modes), figsize=(5 * len(modes), 6), squeeze=False, sharex=True)
    # the curves coincide: a wide translucent line under a thin dashed one keeps both visible
    styles = {"codagen": dict(linewidth=3.0, alpha=0.45), "transformers": dict(linewidth=1.0, linestyle="--")}
    for column, mode in enumerate(modes):
        top, bottom = axes[0][column], axes[1][column]
        pairs = [("codagen - transformers", (mode, "codagen"), (mode, "transformers"))]
        if mode != "single":
            pairs += [(f"{provider}: {world} ranks - 1", (mode, provider), ("single", provider))
                      for provider in PROVIDERS]
        for provider, style in styles.items():
            if (mode, provider) in losses:
                top.plot(range(1, len(losses[mode, provider]) + 1), losses[mode, provider], label=provider, **style)
        for label, got, want in pairs:
            if got in losses and want in losses:
                diffs = [abs(a - b) for a, b in zip(losses[got], losses[want])]
                bottom.plot(range(1, len(diffs) + 1), diffs, label=label, linewidth=1.0)
        top.set_title(mode if mode == "single" else f"{mode}, {world} ranks")
        top.set_ylabel("training loss (nats/char)")
        bottom.set_yscale("log")
        bottom.set_xlabel("step")
        bottom.set_ylabel("|loss difference|")
        top.legend(fontsize=8)
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: d512 (tiny with --dry-run)")
    parser.add_argument("--steps", type=int, default=None, help="default: 200 (5 with --dry-run)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="gloo on CPU, float32, the tiny shape, 5 steps")
    parser.add_argument("--out", default=None, help=f"folder for the JSON (default: {RESULTS_DIR})")
    args = parser.parse_args(argv)
    args.shape = args.shape or ("tiny" if args.dry_run else "d512")
    args.steps = args.steps or (5 if args.dry_run else 200)
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    return args


def main(argv=None) -> dict:
    """Runs every mode and provider; returns what it writes (rank 0's; the other ranks return it too). Joins the
    process group torchrun describes unless one exists already."""
    args = parse_args(argv)
    multicast = check_multicast_off()
    device_type, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        os.environ.setdefault("CODAGEN_TRITON_AUTOTUNE", "0")
    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(device_type, (world,))
    shape = SHAPES[args.shape]
    if shape.batch % world or shape.heads % world or shape.kv_heads % world or shape.intermediate % world:
        raise SystemExit(f"sharded_convergence: shape {args.shape} ({shape}) does not split over {world} ranks")

    text = demo.make_corpus(CORPUS_CHARS, seed=args.seed)
    tokenizer = demo.CharTokenizer(text)
    data = tokenizer.encode(text)
    vocab = 64 * math.ceil(len(tokenizer.chars) / 64)  # the LM head splits over the ranks; the extra ids never occur
    base = build(shape, vocab, args.seed)
    gpus = [None] * world
    dist.all_gather_object(gpus, torch.cuda.get_device_name(device) if device_type == "cuda" else None)
    result = {"env": {**environment(), "transformers": transformers.__version__, "world_size": world, "gpus": gpus,
                      "backend": resolve_backend_name(device), "dtype": str(dtype).removeprefix("torch."),
                      "multicast": multicast, "dry_run": args.dry_run},
              "config": {"shape": args.shape, **dataclasses.asdict(shape), "vocab": vocab,
                         "corpus_chars": CORPUS_CHARS, "steps": args.steps, "lr": args.lr, "seed": args.seed,
                         "parameters": sum(p.numel() for p in base.parameters()),
                         "optimizer": "AdamW(betas=(0.9, 0.95), weight_decay=0.1), demo.lr_schedule"},
              "records": [], "comparisons": []}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    path = Path(args.out or RESULTS_DIR) / f"{date}-sharded-convergence-{'-'.join(args.modes)}.json"
    losses = {}
    for mode in args.modes:
        for provider in PROVIDERS:
            model = prepare(copy.deepcopy(base).to(device, dtype), mode, provider, mesh)
            held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
            start = time.perf_counter()
            losses[mode, provider] = train(model, data, shape, mode, args, device)
            seconds = time.perf_counter() - start
            del model
            result["records"].append({"mode": mode, "provider": provider, "world": 1 if mode == "single" else world,
                                      "rank0_parameters": held, "losses": losses[mode, provider], "wall_s": seconds})
            if rank == 0:
                run = losses[mode, provider]
                print(f"{mode:6} {provider:12} loss {run[0]:.4f} -> {run[-1]:.4f}  ({seconds:.1f} s)", flush=True)
        result["comparisons"] = comparisons(losses, world)
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1) + "\n")
    if rank == 0:
        plot(result, path.with_suffix(".png"))
        for comparison in result["comparisons"]:
            print(f"{comparison['name']:42} largest per-step difference {comparison['max_abs_diff']:.3e} "
                  f"({comparison['max_rel_diff']:.2e} rel) at step {comparison['step']}")
        print(path, flush=True)
    if joined:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
