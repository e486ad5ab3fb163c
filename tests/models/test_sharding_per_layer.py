"""FSDP2 units per decoder layer on patched models (codagen.models.layer_units), placed by accelerate's own
``fsdp2_prepare_model``: CPU processes on gloo against one unsharded, unpatched process.

accelerate's placement (1.15): ``fully_shard`` on each module of the wrap class (``_no_split_modules``: the decoder
layers), on the input embedding (untied), on ``[final norm, LM head]`` together (``reshard_after_forward=False``)
and on the root. With PEFT the Trainer swaps in ``peft.utils.other.fsdp_auto_wrap_policy``, which accelerate's
FSDP2 path does not recognise: no unit per layer then, the LM head's unit and the root's. Each rank trains on its
own rows; loss, every trainable parameter's gradient, one AdamW step and the second step's loss agree within 1e-4
relative in fp32.
"""
from __future__ import annotations

import copy
import functools
import gc
import types
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
accelerate_fsdp = pytest.importorskip("accelerate.utils.fsdp_utils")

from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing  # noqa: E402
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy  # noqa: E402
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

import codagen  # noqa: E402
from codagen.models import fused_layers, sharding  # noqa: E402

from .conftest import (  # noqa: E402
    ALL,
    BATCH,
    assert_same,
    assert_sharded_two_x_rule,
    build,
    enable_checkpointing,
    lm_batch,
    lora_config,
    record_refusal,
    run_distributed,
)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def accelerate_prepare(model, *, peft_trainer=False, mp_policy=None, device="cpu"):
    """accelerate's ``fsdp2_prepare_model`` with its FSDP2 plugin (``transformer_based_wrap``, resharding after
    forward), given the Accelerator's attributes it reads; ``peft_trainer``: the Trainer's PEFT policy first
    (``transformers``' ``update_fsdp_plugin_peft``)."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True, mixed_precision_policy=mp_policy)
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                        parallelism_config=None, is_main_process=dist.get_rank() == 0,
                                        mixed_precision="no", device=torch.device(device))
    if peft_trainer:
        from transformers.distributed.fsdp import update_fsdp_plugin_peft
        update_fsdp_plugin_peft(model, accelerator)
    return accelerate_fsdp.fsdp2_prepare_model(accelerator, model)


def with_lora(model, **overrides):
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():  # transformers 5.2x: peft reads a deprecated alias
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(model, lora_config(**overrides))


def trainable_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
            for name, p in model.named_parameters() if p.requires_grad}


def steps(model, batch, rows):
    """Two AdamW steps of ``model`` on ``rows`` of ``batch``: both losses (averaged over the ranks in a job) and the
    first step's trainable gradients."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(2):
        loss = model(input_ids=batch["input_ids"][rows], labels=batch["labels"][rows]).loss
        loss.backward()
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        losses.append(mean)
        if step == 0:
            grads = trainable_grads(model)
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads}


def reference(model, batch):
    """The unpatched, unsharded model in this process on the whole batch."""
    return steps(copy.deepcopy(model), batch, slice(None))


def _per_layer_training(rank, world, model, batch, peft_trainer=False, fused=False, patch_after=False):
    if fused:
        sharding.fuse_parameters(model)
    if not patch_after:
        codagen.patch(model)
    accelerate_prepare(model, peft_trainer=peft_trainer)
    if patch_after:  # FSDP2 has swapped the classes for FSDP<class> subclasses
        codagen.patch(model)
    units = sorted(name for name, module in model.named_modules() if isinstance(module, FSDPModule))
    got = steps(model, batch, slice(rank * BATCH // world, (rank + 1) * BATCH // world))
    if fused:  # the gradients in Hugging Face's names and layouts (the state-dict hooks' own conversion)
        for i, layer in enumerate(model.model.layers):
            fused_layers._to_hf_layout(layer, got["grads"], f"model.layers.{i}.", None)
    return {**got, "units": units}


def decoder_layer_units(layers: int, prefix: str = "") -> list[str]:
    return [f"{prefix}model.layers.{i}" for i in range(layers)]


@pytest.mark.parametrize(("family", "overrides"), [
    ("llama", {}), ("qwen3", {}), ("llama", dict(attention_bias=True, tie_word_embeddings=True)), ("phi3", {}),
    ("granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                     logits_scaling=8.0)),
    ("gemma2", dict(head_dim=8, query_pre_attn_scalar=6, sliding_window=5,
                    layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=2.0,
                    final_logit_softcapping=3.0)),
    ("glm4", dict(head_dim=8, attention_bias=True)), ("olmo2", {})])
def test_accelerate_placement_matches_one_unpatched_process(family, overrides):
    """A unit per decoder layer, the embeddings (untied), [final norm, LM head] and the root, as accelerate places
    them, on a patched Llama, Qwen3 (QK-norm), Llama with an O bias and tied embeddings, Phi-3 (fused projections),
    Granite (multipliers: the logits' one in the final norm's unit), Gemma 2 (x (1 + w) and sandwich norms inside the
    layers' units, soft-caps), GLM-4 (sandwich norms, partial interleaved RoPE) and OLMo 2 (no norms before attention
    and the MLP: a layer's unit starts with no statistics)."""
    model, batch = build(family, **overrides), lm_batch()
    want = reference(model, batch)
    got = run_distributed(2, _per_layer_training, model, batch)
    assert_same(got, want)
    tail = ["lm_head", "model.embed_tokens", "model.norm"]
    assert got["units"] == sorted(["", *tail, *decoder_layer_units(2)]), got["units"]


def test_accelerate_placement_of_fused_parameters():
    """``sharding.fuse_parameters`` first: each layer's unit holds its fused block and its two norms."""
    model, batch = build("llama"), lm_batch()
    want = reference(model, batch)
    got = run_distributed(2, _per_layer_training, model, batch, False, True)
    assert_same(got, want)
    assert got["units"] == sorted(["", "lm_head", "model.embed_tokens", "model.norm", *decoder_layer_units(2)])


@pytest.mark.parametrize("peft_trainer", [False, True])
def test_lora_under_accelerate_placement(peft_trainer):
    """PEFT LoRA (r 4 on all seven projections) on a patched model: with accelerate's per-layer units the
    adapters sit inside each decoder layer's unit; with the Trainer's PEFT policy (no unit per layer under
    FSDP2) in the root. The adapters' gradients and the step match the unpatched PeftModel's."""
    model, batch = with_lora(build("llama"), target_modules=ALL), lm_batch()
    want = reference(model, batch)
    assert len(want["grads"]) == 2 * len(ALL) * 2  # lora_A and lora_B of seven projections in two layers
    got = run_distributed(2, _per_layer_training, model, batch, peft_trainer)
    assert_same(got, want)
    prefix = "base_model.model."
    layers = [] if peft_trainer else decoder_layer_units(2, prefix)
    assert got["units"] == sorted(["", prefix + "lm_head", prefix + "model.embed_tokens", *layers]), got["units"]


def test_lora_patched_after_accelerate_prepare():
    """``codagen.patch`` of a PeftModel that accelerate has sharded already (``FSDP<class>`` subclasses)."""
    model, batch = with_lora(build("llama"), target_modules=["q_proj", "o_proj", "up_proj"]), lm_batch()
    want = reference(model, batch)
    got = run_distributed(2, _per_layer_training, model, batch, False, False, True)
    assert_same(got, want)


@pytest.mark.parametrize(("family", "use_reentrant"), [("qwen3_lora", False), ("llama", True)])
def test_per_layer_units_with_gradient_checkpointing(family, use_reentrant):
    """Each layer checkpointed inside its unit: Qwen3 with LoRA on q/v and gate/down (non-reentrant), Llama
    (reentrant: the checkpoint saves the layer's weights as its inputs)."""
    model = build(family.removesuffix("_lora"))
    if family.endswith("_lora"):
        model = with_lora(model, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    enable_checkpointing(model, {"use_reentrant": use_reentrant})
    batch = lm_batch()
    want = reference(model, batch)
    got = run_distributed(2, _per_layer_training, model, batch)
    assert_same(got, want)


def _copies_after_forward(rank, world, model, batch, copies):
    """Two AdamW steps; in the first, which of the layers' fused-layout weight copies are alive between forward and
    backward (``copies``: weak references to them, filled by the test's wrapper of ``hf._block_weights``)."""
    codagen.patch(model)
    accelerate_prepare(model)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        loss = model(input_ids=batch["input_ids"][rows], labels=batch["labels"][rows]).loss
        if step == 0:
            gc.collect()
            alive = sorted(name for name, ref in copies if ref() is not None)
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean / world)
        if step == 0:
            grads = trainable_grads(model)
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads, "alive": alive, "made": sorted({name for name, _ in copies})}


def test_weight_copies_are_rebuilt_in_backward(monkeypatch):
    """The fused QKV and gate/up layouts a layer builds from its unsharded weights are not kept from its forward to
    its backward (FSDP frees the unsharded weights meanwhile): backward rebuilds them, with the same gradients."""
    from codagen.models import hf
    copies, block_weights = [], hf._block_weights

    def recorded(*args, **kwargs):
        blk = block_weights(*args, **kwargs)
        if torch.is_grad_enabled():
            copies.extend((name, weakref.ref(getattr(blk, name))) for name in ("qkv", "gate_up"))
        return blk
    monkeypatch.setattr(hf, "_block_weights", recorded)
    model, batch = build("llama"), lm_batch()
    want = reference(model, batch)
    got = run_distributed(2, _copies_after_forward, model, batch, copies)
    assert got["made"] == ["gate_up", "qkv"]
    assert got["alive"] == [], got["alive"]
    assert_same(got, want)


def _collectives(rank, world, model, batch, patched):
    if patched:
        codagen.patch(model)
    accelerate_prepare(model)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    with CommDebugMode() as forward:
        loss = model(input_ids=batch["input_ids"][rows], labels=batch["labels"][rows]).loss
    unsharded_after_forward = sorted(name for name, p in model.named_parameters() if not isinstance(p, DTensor))
    with CommDebugMode() as backward:
        loss.backward()
    counts = {name: {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
              for name, mode in (("forward", forward), ("backward", backward))}
    return {"counts": counts, "unsharded_after_forward": unsharded_after_forward}


def test_per_layer_units_all_gather_and_reshard_around_each_layer():
    """Three layers, the collectives of the unpatched model under the same units: forward all-gathers each layer,
    the embeddings and [norm, LM head] once (the root holds no parameter); the layers and the embeddings are
    resharded after forward and all-gathered again for backward; every unit reduce-scatters once."""
    model, batch = build("llama", num_hidden_layers=3), lm_batch()
    got = run_distributed(2, _collectives, copy.deepcopy(model), batch, True)
    want = run_distributed(2, _collectives, model, batch, False)
    assert got == want
    assert got["counts"]["forward"] == {"_allgather_base_": 3 + 2}, got["counts"]
    assert got["counts"]["backward"] == {"_allgather_base_": 3 + 1, "_reduce_scatter_base_": 3 + 2}, got["counts"]
    assert got["unsharded_after_forward"] == ["lm_head.weight", "model.norm.weight"], got["unsharded_after_forward"]


def _refusals(rank, world):
    errors = {}
    refused = functools.partial(record_refusal, errors)
    projection = codagen.patch(build("llama"))
    for layer in projection.model.layers:
        torch_fully_shard(layer.self_attn.q_proj)
    torch_fully_shard(projection)
    refused("a unit on a projection", lambda: projection(**lm_batch()))
    per_layer = codagen.patch(build("llama"))
    accelerate_prepare(per_layer)
    refused("KV cache", lambda: per_layer(lm_batch()["input_ids"], use_cache=True))
    wrapped = codagen.patch(build("llama"))
    apply_activation_checkpointing(wrapped, check_fn=lambda module: module in set(wrapped.model.layers))
    accelerate_prepare(wrapped)
    refused("checkpoint_wrapper", lambda: wrapped(**lm_batch()))
    return errors


def test_what_stays_refused():
    """A unit (or any hook) inside a decoder layer: its forward never runs; a KV cache with units per layer;
    torch's checkpoint_wrapper around the layers (accelerate's activation_checkpointing), whose forward the
    patched model does not call."""
    errors = run_distributed(1, _refusals)
    message = errors.pop("a unit on a projection")
    assert "'model.layers.0.self_attn.q_proj'" in message and "fully_shard the decoder layers" in message, message
    assert "a KV cache (generate()) with FSDP units on the decoder layers" in errors.pop("KV cache")
    assert "checkpoint_wrapper on the decoder layers" in errors.pop("checkpoint_wrapper")
    assert not errors


def _bf16_training(rank, world, model, batch, fp8=None):
    codagen.patch(model, fp8=fp8)
    accelerate_prepare(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    return steps(model, batch, slice(rank * BATCH // world, (rank + 1) * BATCH // world))


def test_per_layer_units_with_bf16_parameters():
    """accelerate's mixed precision (bf16 parameters, its default ``cast_forward_inputs``): the layers' float32
    inputs (RoPE positions and frequencies, ``rstd``) are not module arguments, so nothing is cast wrongly; the
    loss follows the fp32 model's within bf16 rounding."""
    model, batch = build("llama"), lm_batch()
    want = reference(model, batch)
    got = run_distributed(2, _bf16_training, model, batch)
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert abs(a.item() - b.item()) <= 2e-2 * abs(b.item())
    for name, g in want["grads"].items():
        cosine = torch.nn.functional.cosine_similarity(got["grads"][name].flatten().float(), g.flatten(), dim=0)
        assert cosine > 0.99, f"{name}: cosine similarity {cosine.item()} to the fp32 gradient"


def test_per_layer_units_with_fp8_gemms():
    """``codagen.patch(model, fp8="blockwise")`` under accelerate's placement with bf16 parameters: each layer's FP8
    GEMMs quantize the weights FSDP all-gathered for it (in bf16: the all-gather carries no FP8), and training follows
    the fp32 model within FP8's distance (two steps)."""
    model, batch = build("llama"), lm_batch()
    want = reference(model, batch)
    got = run_distributed(2, _bf16_training, model, batch, "blockwise")
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert abs(a.item() - b.item()) <= 5e-2 * abs(b.item())
    for name, g in want["grads"].items():
        cosine = torch.nn.functional.cosine_similarity(got["grads"][name].flatten().float(), g.flatten(), dim=0)
        assert cosine > 0.9, f"{name}: cosine similarity {cosine.item()} to the fp32 gradient"


# --- GPU (NCCL, bf16 mixed precision, Triton kernels; CODAGEN_TRITON_AUTOTUNE=0) ------------------------------
def _gpu_training(rank, world, init, out, model, batch):
    """Spawned (CUDA does not survive a fork): one GPU per rank; this rank's rows; the trainable gradients."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    try:
        model = codagen.patch(model.cuda())
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        accelerate_prepare(model, mp_policy=policy, device=f"cuda:{rank}")
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        loss = model(**{k: v[rows].cuda() for k, v in batch.items()}).loss
        loss.backward()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        grads = {name: g.cpu() for name, g in trainable_grads(model).items()}
        if rank == 0:
            torch.save({"loss": (mean / world).cpu(), "grads": grads}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "llama_lora"])
def test_gpu_per_layer_units_bf16_two_x_rule(family, monkeypatch, tmp_path):
    """accelerate's units per decoder layer on up to two GPUs (NCCL), bf16 parameters, fp32 reduction: every
    trainable gradient's relative error to a float64 run is at most twice that of transformers with bf16
    parameters (+1e-6), the loss within bf16 rounding of float64's."""
    import torch.multiprocessing as mp
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    fields = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=1000, num_hidden_layers=2, **({"head_dim": 64} if family == "qwen3" else {}))
    model = build(family.removesuffix("_lora"), **fields)
    if family.endswith("_lora"):
        model = with_lora(model, target_modules=ALL)
    ids = torch.randint(0, 1000, (BATCH, 128))
    batch = {"input_ids": ids, "labels": ids.clone()}
    world = min(2, torch.cuda.device_count())
    out = str(tmp_path / "result.pt")
    mp.start_processes(_gpu_training, args=(world, "file://" + str(tmp_path / "store"), out, model, batch),
                       nprocs=world, start_method="spawn")
    got = torch.load(out)

    assert got["grads"].keys() == {name for name, p in model.named_parameters() if p.requires_grad}
    assert_sharded_two_x_rule(got, model, batch)
