"""What the model tests share: tiny Hugging Face models built from configs (no downloads), their inputs,
the check that a patched model trains like the unpatched one, the bf16 2x rule, the backends to run on."""
from __future__ import annotations

import copy
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Shard

import codagen
from codagen.models import Llama, LlamaConfig, fused_layers, patch, sharding

try:  # the tests that need them skip themselves without (pytest.importorskip)
    import transformers
except ImportError:
    transformers = None
try:
    import peft
except ImportError:
    peft = None


def triton_backend_missing() -> str | None:
    """Why the Triton backend cannot run here, or None."""
    try:
        from codagen.backends.triton import TritonBackend  # noqa: F401
    except ImportError as error:
        return f"codagen.backends.triton does not import yet: {error}"
    return None


BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    triton_backend_missing() is not None, reason=str(triton_backend_missing())))]


COMMON = dict(vocab_size=67, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, attn_implementation="sdpa")


#: the transformers class prefix of each family spec (codagen.models.families.FAMILIES)
CLASS_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3",
                "granite": "Granite", "smollm3": "SmolLM3", "gemma2": "Gemma2", "gemma3": "Gemma3", "glm": "Glm",
                "glm4": "Glm4", "olmo2": "Olmo2", "olmo3": "Olmo3"}
#: config classes not named after the model class (``<prefix>Config``)
CONFIG_CLASS = {"gemma3": "Gemma3TextConfig"}


def build(family: str, **overrides) -> torch.nn.Module:
    """A randomly initialized tiny ``<family>ForCausalLM`` in fp32, norm weights perturbed away from 1."""
    prefix = CLASS_PREFIX[family]
    config_cls = getattr(transformers, CONFIG_CLASS.get(family, prefix + "Config"))
    model_cls = getattr(transformers, prefix + "ForCausalLM")
    if family == "qwen3":  # Qwen3Config's head_dim defaults to 128; 16 keeps heads whole in the interpreter's tiles
        overrides = {"head_dim": 16, **overrides}
    if family == "gemma2":  # transformers runs Gemma 2's soft-capped attention eagerly (SDPA has no soft-cap)
        overrides = {"attn_implementation": "eager", **overrides}
    if family in ("phi3", "smollm3", "glm", "glm4", "olmo2", "olmo3"):  # their token ids lie outside a tiny vocabulary
        overrides = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **overrides}
    model = model_cls(config_cls(**{**COMMON, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))  # norm weights and biases
            elif "proj" in name:
                p.normal_(0, 0.15)  # larger than HF's 0.02 init so attention and RoPE visibly matter
    return model.train()


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


def assert_same_training(model, inputs: dict, *, rtol=2e-4, atol=2e-6, backend="reference"):
    """Loss, logits and every gradient of the patched model equal those of an unpatched copy."""
    expected = copy.deepcopy(model)
    out = expected(**inputs)
    out.loss.backward()
    patch(model)
    with codagen.use_backend(backend):
        got = model(**inputs)
        assert got.logits is None  # the fused cross-entropy never materializes logits
        got.loss.backward()
        logits = model(**{k: v for k, v in inputs.items() if k not in ("labels", "num_items_in_batch")}).logits
    torch.testing.assert_close(got.loss, out.loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(logits, out.logits, rtol=rtol, atol=atol)
    want = grads(expected)
    for name, g in grads(model).items():
        if want[name] is None:  # e.g. the embedding, when inputs_embeds are given
            assert g is None, f"{name} got a gradient transformers does not give it"
            continue
        assert g is not None, f"{name} got no gradient"
        torch.testing.assert_close(g, want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def lm_inputs(batch=2, seq=12, vocab=67, ignore=True):
    ids = torch.randint(0, vocab, (batch, seq))
    labels = ids.clone()
    if ignore:
        labels[0, :4] = -100  # prompt tokens without loss
    return {"input_ids": ids, "labels": labels}


def two_x_rule(model, inputs, codagen_bf16):
    """Each gradient's relative error vs a float64 run is at most twice that of transformers with bf16
    parameters (+1e-6), and the loss is within bf16 rounding (2^-8 relative) of the float64 loss.
    ``codagen_bf16(patched_model, batch)`` returns its loss computed in bf16. (A scalar's bf16 error can be
    luckily tiny, so the loss has an absolute bound rather than the 2x rule.) ``inputs``: one batch, or a
    list of batches whose errors are summed per gradient before the comparison."""
    batches = inputs if isinstance(inputs, list) else [inputs]
    ours_total, theirs_total = {}, {}

    def rel_err(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()
    for batch in batches:
        results = {}
        runs = {"float64": (copy.deepcopy(model).double(), lambda m: m(**batch).loss),
                "transformers_bf16": (copy.deepcopy(model).bfloat16(), lambda m: m(**batch).loss),
                "codagen_bf16": (patch(copy.deepcopy(model)), lambda m: codagen_bf16(m, batch))}
        for name, (m, loss_of) in runs.items():
            loss = loss_of(m)
            loss.backward()
            results[name] = {"loss": loss.detach(), **{n: p.grad for n, p in m.named_parameters()}}
        exact = results.pop("float64")
        assert rel_err(results["codagen_bf16"].pop("loss"), exact.pop("loss")) <= 2 ** -8
        for key in exact:
            ours_total[key] = ours_total.get(key, 0.0) + rel_err(results["codagen_bf16"][key], exact[key])
            theirs_total[key] = theirs_total.get(key, 0.0) + rel_err(results["transformers_bf16"][key], exact[key])
    for key, ours in ours_total.items():
        theirs = theirs_total[key]
        assert ours <= 2 * theirs + 1e-6, f"{key}: codagen {ours:.2e} vs transformers bf16 {theirs:.2e}"


def assert_sharded_two_x_rule(got: dict, model, batch: dict, device="cuda"):
    """The 2x rule for a sharded run's ``got = {"loss", "grads": {name: full gradient}}`` (gradients in the
    unpatched model's names; of the trainable parameters, for a model with frozen ones such as LoRA's base): each
    gradient's relative error to a float64 run of ``model`` on ``batch`` is at most twice that of transformers with
    bf16 parameters (+1e-6), the loss within bf16 rounding (2^-8)."""
    def rel_norm(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()
    results = {}
    for name, dtype in (("float64", torch.float64), ("bf16", torch.bfloat16)):
        m = copy.deepcopy(model).to(device, dtype)
        loss = m(**{k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        results[name] = {"loss": loss.detach().cpu(),
                         **{n: p.grad.cpu() for n, p in m.named_parameters() if p.requires_grad}}
    exact, theirs = results["float64"], results["bf16"]
    assert rel_norm(got["loss"], exact["loss"]) <= 2 ** -8
    for name, g in got["grads"].items():
        assert rel_norm(g, exact[name]) <= 2 * rel_norm(theirs[name], exact[name]) + 1e-6, name


def padded_inputs(side: str, batch=3, seq=14, vocab=67):
    """Rows of ragged lengths (the longest unpadded) padded on ``side``; labels -100 on the pads."""
    inputs = lm_inputs(batch=batch, seq=seq, vocab=vocab, ignore=False)
    lengths = [seq, 2 * seq // 3, seq // 3][:batch]
    mask = torch.zeros(batch, seq, dtype=torch.long)
    for row, length in enumerate(lengths):
        real = slice(0, length) if side == "right" else slice(seq - length, seq)
        mask[row, real] = 1
    inputs["input_ids"] = inputs["input_ids"].masked_fill(mask == 0, 0)
    inputs["labels"] = inputs["input_ids"].masked_fill(mask == 0, -100)
    inputs["attention_mask"] = mask
    return inputs


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SUBSETS = {"all": ALL, "q_v": ["q_proj", "v_proj"], "gate_down": ["gate_proj", "down_proj"]}


def lora_config(targets=ALL, **overrides) -> peft.LoraConfig:
    # init_lora_weights=False: B is random, not zero, so an adapter that is dropped changes the loss
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": targets, "init_lora_weights": False,
                              **overrides})


def enable_checkpointing(model, kwargs):
    with warnings.catch_warnings():  # transformers 5.2x: gradient_checkpointing_enable is a deprecated alias
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


# --- sharded training on forked gloo processes (test_sharding, test_tensor_parallel) ----------------------
BATCH, SEQ, VOCAB = 4, 12, 67


def _run(rank: int, world: int, init: str, out: str, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def run_distributed(world: int, fn, *args):
    """``fn(rank, world, *args)`` on ``world`` forked processes joined by gloo; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(_run, args=(world, "file://" + os.path.join(tmp, "store"), out, fn, args), nprocs=world,
                           start_method="fork")
        return torch.load(out, weights_only=False)


def record_refusal(errors: dict[str, str], name: str, fn) -> None:
    """``fn()``; when it raises ``NotImplementedError`` or ``ValueError``, ``errors[name]`` is ``"Type: message"``
    (a distributed test returns the dict to the test process, which checks each message)."""
    try:
        fn()
    except (NotImplementedError, ValueError) as error:
        errors[name] = f"{type(error).__name__}: {error}"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def is_native(model) -> bool:
    return isinstance(getattr(model, "_orig_mod", model), Llama)  # a torch.compile wrapper's model too


def loss_of(model, batch, rows=slice(None)):
    """The mean next-token loss on ``rows`` of ``batch``: ``Llama``'s targets are the shifted labels."""
    if is_native(model):
        ids = batch["input_ids"][rows]
        return model(ids, torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100))
    return model(input_ids=batch["input_ids"][rows], labels=batch["labels"][rows]).loss


def logits_of(model, batch) -> torch.Tensor:
    return model(batch["input_ids"]) if is_native(model) else model(batch["input_ids"]).logits


def gathered_grads(model) -> dict[str, torch.Tensor]:
    """:func:`full_grads` of an FSDP model, whose every parameter and gradient is sharded by rows."""
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), f"{name}: expected a sharded parameter and grad"
        assert p.grad.placements == (Shard(0),), f"{name}: gradient placements {p.grad.placements}"
    return full_grads(model)


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every gradient, sharded ones gathered (``full_tensor()``, any mesh); a patched model's under Hugging Face
    names and layouts (the state-dict hooks' own conversion)."""
    grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
             for name, p in model.named_parameters()}
    if not is_native(model):
        for i, layer in enumerate(model.model.layers):
            fused_layers._to_hf_layout(layer, grads, f"model.layers.{i}.", None)
    return grads


def sharded_training(rank, world, model, batch, mp_policy=None, compiled=None):
    """Two steps of AdamW on the sharded ``model``, this rank's rows of ``batch``: losses (averaged over the
    ranks), the first step's gradients, the parameters' and gradients' dtypes, the dtypes the blocks compute in,
    and Dynamo's frame and graph-break counters. ``compiled``: ``"blocks"`` compiles each sharded block
    (torchtitan's recipe), ``"model"`` the whole sharded model (``torch.compile``, ``aot_eager``)."""
    from torch._dynamo.utils import counters
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    sharding.fully_shard(model, **kwargs)
    counters.clear()
    if compiled == "blocks":
        for block in sharding.blocks_of(model):
            block.compile(backend="aot_eager")
    run = torch.compile(model, backend="aot_eager") if compiled == "model" else model
    compute_dtypes = set()  # what each block's forward sees: its input and its (unsharded) QKV weight
    for block in sharding.blocks_of(model):
        block.register_forward_pre_hook(lambda block, args: compute_dtypes.update(
            {args[0].dtype, (block.qkv if is_native(model) else block.qkv_proj.weight).dtype}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    losses = []
    for step in range(2):
        loss = loss_of(run, batch, rows)
        loss.backward()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean / world)
        if step == 0:
            grads = gathered_grads(model)
            dtypes = {p.grad.dtype for p in model.parameters()} | {p.dtype for p in model.parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads, "dtypes": dtypes, "compute_dtypes": compute_dtypes,
            "frames": dict(counters["frames"]), "graph_breaks": dict(counters["graph_break"])}


def reference_training(model, batch):
    """The unsharded model in this process (HF: unpatched) on the whole batch: both losses and the first
    step's gradients."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        loss = loss_of(model, batch)
        loss.backward()
        losses.append(loss.detach())
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads}


def build_model(family: str, **overrides):
    """A tiny fp32 model: ``transformers``' ``family`` (``llama``, ``qwen3``) or ``native`` / ``native_qk_norm``
    (:class:`codagen.models.Llama`, norm weights perturbed away from 1)."""
    if not family.startswith("native"):
        return build(family, **overrides)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=4,
                         num_kv_heads=2, qk_norm=family == "native_qk_norm", **overrides)
    model = Llama(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


def lm_batch():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids.clone()}


def assert_same(got, want, rtol=1e-4):
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert rel_err(a, b) <= rtol, f"step {step + 1} loss {a.item()} vs {b.item()}"
    assert got["grads"].keys() == want["grads"].keys()
    for name, g in want["grads"].items():
        assert rel_err(got["grads"][name], g) <= rtol, f"{name}: relative error {rel_err(got['grads'][name], g)}"


# variants whose fused blocks differ: QKV bias (Qwen2), an O-proj bias and tied embeddings (Llama), sliding windows
# on some layers (Qwen3 layer_types) and on all (Mistral)
VARIANTS = {"qwen2_bias": ("qwen2", {}),
            "llama_o_bias_tied": ("llama", dict(attention_bias=True, tie_word_embeddings=True)),
            "qwen3_sliding_layer": ("qwen3", dict(use_sliding_window=True, sliding_window=5,
                                                  layer_types=["sliding_attention", "full_attention"])),
            "mistral_sliding": ("mistral", dict(sliding_window=5, num_key_value_heads=1))}
