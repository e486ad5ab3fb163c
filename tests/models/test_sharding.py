"""FSDP2 on patched models (codagen.models.sharding): CPU processes on gloo against one unsharded, unpatched process.

Every test forks ``world`` processes (a few seconds each: fork, not spawn, so nothing is imported again); each
rank trains on its own rows of the batch, as data parallelism does, and the reference is the unpatched model on
the whole batch in this process. Loss, every gradient (``full_tensor()``), one AdamW step and the second
step's loss agree within 1e-4 relative in fp32.
"""
from __future__ import annotations

import copy
import functools
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

import codagen  # noqa: E402
from codagen.models import fused_layers, sharding  # noqa: E402

from .conftest import (  # noqa: E402
    BATCH,
    SEQ,
    VARIANTS,
    VOCAB,
    assert_same,
    assert_sharded_two_x_rule,
    build,
    build_model,
    enable_checkpointing,
    full_grads,
    gathered_grads,
    lm_batch,
    logits_of,
    loss_of,
    record_refusal,
    reference_training,
    rel_err,
    run_distributed,
    sharded_training,
)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("family", "world"), [("llama", 2), ("llama", 4), ("qwen3", 2), ("qwen3", 4), ("native", 2),
                                               ("native", 4), ("native_qk_norm", 2)])
def test_fully_shard_matches_one_unsharded_process(family, world):
    model, batch = build_model(family), lm_batch()
    want = reference_training(model, batch)
    got = run_distributed(world, sharded_training, model, batch)
    assert_same(got, want)
    assert got["dtypes"] == got["compute_dtypes"] == {torch.float32}


@pytest.mark.parametrize("compiled", ["blocks", "model"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "native"])
def test_compiled_sharded_model_matches_one_unsharded_process(family, compiled):
    """``torch.compile`` (``aot_eager``) of each sharded block, as torchtitan does, or of the whole sharded model:
    the same loss, gradients and AdamW step as one unsharded process."""
    model, batch = build_model(family), lm_batch()
    want = reference_training(model, batch)
    got = run_distributed(2, sharded_training, model, batch, None, compiled)
    assert got["frames"].get("ok", 0) >= 1, f"nothing was compiled: {got['frames']}"
    assert_same(got, want)


def _fsdp_tp_training(rank, world, model, fresh, batch, sequence_parallel, directory):
    """FSDP over ``dp`` x TP over ``tp`` (2 x 2): two AdamW steps on this data-parallel rank's rows, then a
    torch.distributed.checkpoint save and a load into ``fresh``, sharded the same way."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    for m in (model, fresh):
        sharding.parallelize(m, mesh["tp"], sequence_parallel=sequence_parallel)
        sharding.fully_shard(m, mesh=mesh["dp"])
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    rows = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        loss = loss_of(model, batch, rows)
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)
        losses.append(mean / 2)
        if step == 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9).full_tensor()
            grads = full_grads(model)
        optimizer.step()
        optimizer.zero_grad()
    dcp.save(model.state_dict(), checkpoint_id=directory)
    loaded = fresh.state_dict()
    dcp.load(loaded, checkpoint_id=directory)
    fresh.load_state_dict(loaded)
    with torch.no_grad():
        return {"losses": losses, "grads": grads, "grad_norm": grad_norm, "logits": logits_of(model, batch),
                "fresh_logits": logits_of(fresh, batch),
                "placements": {str(p.placements) for p in model.parameters() if isinstance(p, DTensor)}}


@pytest.mark.parametrize(("family", "sequence_parallel"), [("llama", False), ("llama", True), ("qwen3", True)])
def test_fsdp_with_tensor_parallel_on_a_2d_mesh(family, sequence_parallel, tmp_path):
    """``parallelize`` over ``mesh["tp"]``, then ``fully_shard`` over ``mesh["dp"]`` (4 processes): one unsharded
    process's losses, gradients and AdamW step; the GEMM weights sharded on both dimensions; a distributed
    checkpoint loads into a fresh 2-D model with the same outputs."""
    model, fresh, batch = build(family), build(family), lm_batch()
    want = reference_training(model, batch)
    got = run_distributed(4, _fsdp_tp_training, model, fresh, batch, sequence_parallel, str(tmp_path / "checkpoint"))
    assert_same(got, want)
    assert rel_err(got["grad_norm"], torch.nn.utils.get_total_norm(list(want["grads"].values()))) < 1e-4
    assert any(placements.count("Shard") == 2 for placements in got["placements"]), got["placements"]
    torch.testing.assert_close(got["fresh_logits"], got["logits"], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3", "native"])
def test_mixed_precision_bf16_params_fp32_reduce(family):
    """``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the blocks run in bf16 (reference backend
    on CPU), the gradients arrive sharded in float32, and the loss follows the fp32 model's."""
    model, batch = build_model(family), lm_batch()
    want = reference_training(model, batch)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    got = run_distributed(2, sharded_training, model, batch, policy)
    assert got["dtypes"] == {torch.float32}  # parameters and sharded gradients stay fp32
    assert got["compute_dtypes"] == {torch.bfloat16}
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert rel_err(a, b) <= 2e-2
    for name, g in want["grads"].items():
        cosine = torch.nn.functional.cosine_similarity(got["grads"][name].flatten(), g.flatten(), dim=0)
        assert cosine > 0.99, f"{name}: cosine similarity {cosine.item()} to the fp32 gradient"


def _collectives(rank, world, model, batch):
    """Per-step collective counts, forward and backward, and which parameters are unsharded after forward."""
    sharding.fully_shard(model)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    counts = []
    for _ in range(2):
        with CommDebugMode() as forward:
            loss = model(input_ids=batch["input_ids"][rows], labels=batch["labels"][rows]).loss
        unsharded_after_forward = sorted(name for name, p in model.named_parameters() if not isinstance(p, DTensor))
        with CommDebugMode() as backward:
            loss.backward()
        counts.append({name: {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
                       for name, mode in (("forward", forward), ("backward", backward))})
        model.zero_grad()
    return {"counts": counts, "unsharded_after_forward": unsharded_after_forward}


def test_fsdp_hooks_run_around_every_block():
    """Each block is all-gathered for its forward and again for its backward, and reduce-scattered once; the root
    (embeddings, head, norms) is gathered once and kept until its reduce-scatter. After the forward only the
    root's parameters are unsharded."""
    model, batch = build("llama", num_hidden_layers=3), lm_batch()
    got = run_distributed(2, _collectives, model, batch)
    for step in got["counts"]:
        assert step["forward"] == {"_allgather_base_": 3 + 1}, step
        assert step["backward"] == {"_allgather_base_": 3, "_reduce_scatter_base_": 3 + 1}, step
    assert all(not name.startswith("model.layers.") or "layernorm" in name for name in got["unsharded_after_forward"])
    assert "model.layers.0.input_layernorm.weight" in got["unsharded_after_forward"]


def _checkpoint_round_trip(rank, world, model, fresh, batch, directory):
    """Train one step, save with torch.distributed.checkpoint, load into a fresh sharded model."""
    sharding.fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model, batch).backward()
    optimizer.step()
    state = model.state_dict()
    dcp.save(state, checkpoint_id=directory)
    sharding.fully_shard(fresh)
    loaded = fresh.state_dict()
    dcp.load(loaded, checkpoint_id=directory)
    fresh.load_state_dict(loaded)
    with torch.no_grad():
        return {"loss": loss_of(model, batch), "fresh_loss": loss_of(fresh, batch),
                "logits": logits_of(model, batch), "fresh_logits": logits_of(fresh, batch),
                "saved": {key: value.full_tensor() for key, value in state.items()},
                "placements": {value.placements for value in state.values()}}


@pytest.mark.parametrize("family", ["llama", "qwen3", "native"])
def test_distributed_checkpoint_round_trip(family, tmp_path):
    """The saved state dict has the model's own names (Hugging Face's names and layouts for a patched model),
    sharded; it loads into a fresh sharded model with identical outputs, and into an unpatched model as a plain
    state dict."""
    model, fresh, batch = build_model(family), build_model(family), lm_batch()
    got = run_distributed(2, _checkpoint_round_trip, model, fresh, batch, str(tmp_path / "checkpoint"))
    assert torch.equal(got["loss"], got["fresh_loss"]) and torch.equal(got["logits"], got["fresh_logits"])
    assert got["placements"] == {(Shard(0),)}
    assert got["saved"].keys() == model.state_dict().keys()
    model.load_state_dict(got["saved"])  # the unsharded (HF: unpatched) model, trained one step by the sharded one
    with torch.no_grad():
        assert rel_err(logits_of(model, batch), got["logits"]) <= 1e-4


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_fully_shard_with_gradient_checkpointing(use_reentrant):
    """``gradient_checkpointing_enable()`` checkpoints each fused block's module call; FSDP's hooks see the
    recomputation (the block is unsharded for it) and the gradients still match."""
    model, batch = build("llama"), lm_batch()
    want = reference_training(model, batch)
    enable_checkpointing(model, {"use_reentrant": use_reentrant})
    got = run_distributed(2, sharded_training, model, batch)
    assert_same(got, want)


def _refusals(rank, world):
    errors = {}
    refused = functools.partial(record_refusal, errors)
    root_only = build("llama")
    torch_fully_shard(root_only)
    refused("fused after sharding", lambda: sharding.fuse_parameters(root_only))
    fused = sharding.fuse_parameters(build("llama"))
    refused("unpatch", lambda: codagen.unpatch(fused))
    refused("KV cache", lambda: fused(lm_batch()["input_ids"], use_cache=True))
    return errors


def test_refused_combinations():
    errors = run_distributed(1, _refusals)
    assert "fuse its parameters before fully_shard" in errors.pop("fused after sharding")
    assert "the model's projections are fused" in errors.pop("unpatch")
    assert "a KV cache (generate()) on a model with fused parameters" in errors.pop("KV cache")
    assert not errors


def test_peft_model_refused():
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():  # transformers 5.2x: peft reads a deprecated alias
        warnings.simplefilter("ignore", FutureWarning)
        model = peft.get_peft_model(build("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(NotImplementedError, match="PEFT models are not supported .* fully_shard its decoder layers"):
        sharding.fuse_parameters(model)


def _run_snippet(rank, world, code):
    exec(compile(code, "docs/sharding.md python block", "exec"), {"__name__": "__docs__"})
    return sorted(os.listdir("checkpoint"))


def test_docs_snippet_runs(tmp_path, monkeypatch):
    (code,) = re.findall(r"^```python\n(.*?)^```$", (ROOT / "docs" / "sharding.md").read_text(), flags=re.S | re.M)
    monkeypatch.chdir(tmp_path)
    assert ".metadata" in run_distributed(2, _run_snippet, code)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fuse_parameters_matches_unpatched(variant):
    """One process, no sharding: the fused parameters give the unpatched model's loss and gradients, with a
    padding mask, and the state dict round-trips bitwise."""
    family, overrides = VARIANTS[variant]
    model = build(family, **overrides)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    ids = torch.randint(0, VOCAB, (3, SEQ))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    want = copy.deepcopy(model)
    want_loss = want(**batch).loss
    want_loss.backward()
    sharding.fuse_parameters(model)
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())
    loss = model(**batch).loss
    loss.backward()
    assert rel_err(loss, want_loss) <= 1e-4
    grads = {name: p.grad for name, p in model.named_parameters()}
    for i, layer in enumerate(model.model.layers):
        fused_layers._to_hf_layout(layer, grads, f"model.layers.{i}.", None)
    for name, p in want.named_parameters():
        assert rel_err(grads[name], p.grad) <= 1e-4, name


@pytest.mark.parametrize("variant", ["qwen2_bias", "llama_o_bias_tied", "qwen3_sliding_layer"])
def test_fully_shard_variants(variant):
    family, overrides = VARIANTS[variant]
    model, batch = build(family, **overrides), lm_batch()
    want = reference_training(model, batch)
    got = run_distributed(2, sharded_training, model, batch)
    assert_same(got, want)


# --- GPU (NCCL, bf16 mixed precision, Triton kernels; CODAGEN_TRITON_AUTOTUNE=0) ------------------------------
def _gpu_training(rank, world, init, out, model, batch):
    """Spawned (CUDA does not survive a fork): one GPU per rank; this rank's rows; gradients in HF layout."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    try:
        model = model.cuda()
        sharding.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                   reduce_dtype=torch.float32))
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        loss = model(**{k: v[rows].cuda() for k, v in batch.items()}).loss
        loss.backward()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        grads = {name: g.cpu() for name, g in gathered_grads(model).items()}
        if rank == 0:
            torch.save({"loss": (mean / world).cpu(), "grads": grads}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gpu_fully_shard_bf16_two_x_rule(family, monkeypatch, tmp_path):
    """FSDP2 on up to two GPUs (NCCL), bf16 parameters in the blocks, fp32 reduction: every gradient's relative
    error to a float64 run is at most twice that of transformers with bf16 parameters (+1e-6), the loss within
    bf16 rounding of float64's."""
    monkeypatch.setenv("CODAGEN_TRITON_AUTOTUNE", "0")
    fields = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=1000, num_hidden_layers=2, **({"head_dim": 64} if family == "qwen3" else {}))
    model = build(family, **fields)
    ids = torch.randint(0, 1000, (BATCH, 128))
    batch = {"input_ids": ids, "labels": ids.clone()}
    world = min(2, torch.cuda.device_count())
    out = str(tmp_path / "result.pt")
    mp.start_processes(_gpu_training, args=(world, "file://" + str(tmp_path / "store"), out, model, batch),
                       nprocs=world, start_method="spawn")
    got = torch.load(out)

    assert_sharded_two_x_rule(got, model, batch)
