"""Run Hugging Face ``transformers`` causal LMs on codagen kernels, in place.

::

    model = LlamaForCausalLM(config)        # or another family of codagen.models.families
    codagen.patch(model)                     # model.forward runs the fused CODA decoder
    loss = model(input_ids, labels=labels).loss
    codagen.unpatch(model)                   # back to the transformers forward

``patch`` replaces ``forward`` on this one instance (the class is untouched) by a picklable callable
(:class:`_PatchedForward`: pickle, ``copy.deepcopy`` and ``torch.save`` give a patched copy) and
``unpatch`` removes it. No parameter is replaced or copied: the optimizer keeps working on the model's own
``nn.Parameter``\\s. The fused layouts the kernels need (``[W_q; W_k; W_v]`` with Q/K rows permuted
to adjacent RoPE pairs, gate/up rows interleaved) are built from those parameters on every forward,
as differentiable gathers, so gradients land on the original parameters. The trade-off: one extra
copy of the QKV and gate/up weights per step (saved for backward), and two weight-sized gathers per
step; small next to the activations of a training step. :class:`codagen.models.Llama` stores the
fused layout directly and pays neither.

What runs differently, and what is refused (``NotImplementedError`` naming the feature; never a silent
approximation):

- With ``labels`` and autograd on (training) the loss is the fused LM-head cross-entropy and ``logits`` is
  ``None`` (never materialized: no ``[tokens, vocab]`` tensor is stored for backward). Without autograd
  (``torch.no_grad``: evaluation, ``Trainer.evaluate`` / ``predict``) ``labels`` give the logits and the
  loss from them in fp32, as transformers does: one LM-head GEMM whose ``[tokens, vocab]`` output is
  materialized. ``shift_labels`` without ``labels`` give logits and no loss (transformers' rule); with
  ``labels`` they are the targets.
- Under autocast everything runs in the autocast dtype (weights cast once per forward).
- On a GPU, an eager forward with autograd at a new shape first runs the step once on fake tensors, so that its
  kernels compile in parallel before the real step launches them (:mod:`.compile_ahead`).
- Handled exactly: Q/K/V biases (Qwen2; RoPE is linear, so the rotated bias is added after the fused
  kernel), QK-norm (Qwen3, Gemma 3: per-head RMSNorm of Q and K before RoPE, for any even ``head_dim``: in the QKV
  GEMM's epilogue where an epilogue sub-tile holds whole heads, ``head_dim`` dividing 128 in fp16/bf16 and 64 in
  fp32; otherwise, as Gemma 3's 256, the GEMM stores its output and one row kernel normalizes and rotates it:
  :func:`codagen.ops.qkv.qk_norm_in_epilogue`; the q_norm/k_norm weights are permuted to pair order like the Q/K
  rows), O-proj bias (folded into the residual add), tied embeddings, ``position_ids``,
  ``inputs_embeds``, padding in a 2-D ``attention_mask`` and packed sequences (``position_ids``
  restarting per document, no ``attention_mask``), by transformers' rules
  (:mod:`codagen.models.masks`), sliding-window attention, attention dropout, ``num_items_in_batch``,
  ``shift_labels``, ``logits_to_keep`` without labels, RoPE types ``default``, ``linear``, ``llama3``, ``yarn``,
  ``longrope`` and ``dynamic`` (the rotary module's ``attention_scaling`` folded into the Q/K rows; the last two pick
  their frequencies per forward by the rotary module's own update, and their decode steps run eagerly),
  ``model.gradient_checkpointing_enable()`` (each regrouped block checkpointed in its layer's place:
  :mod:`codagen.models.checkpoint`).
- KV cache and ``generate()`` (``past_key_values`` / ``cache``, ``use_cache=True``; padding masks with
  a cache): :mod:`.hf_cache` (``DynamicCache``, ``StaticCache``; other cache kinds refused). On a GPU a decode
  step with a ``StaticCache`` (``generate(cache_implementation="static")``) replays one CUDA graph
  (:mod:`.decode_graphs`); transformers' auto-compile of the forward is then off, and a greedy or sampling
  ``generate()`` on a GPU that names no cache gets a ``StaticCache`` (``cache_implementation="dynamic"`` keeps
  transformers' ``DynamicCache``). A greedy or sampling ``generate()`` with a ``StaticCache`` runs
  :mod:`.generate_loop` (each token one CUDA graph replay, processors and stopping included). All through instance
  attributes (``_valid_auto_compile_criteria``, ``_prepare_cache_for_generation``, ``generate``) that ``unpatch``
  removes.
- Without autograd the fused QKV and gate/up weights are built once and kept while the parameters keep
  their storage and version counters (:func:`.hf_cache.inference_blocks`): ``load_state_dict``, ``copy_``
  under ``no_grad``, optimizer steps and ``p.data = w`` are seen; after in-place writes through
  ``param.data`` call :func:`refresh_weights`. Under ``torch.compile`` a forward without a KV cache gathers
  them in its graph (no graph break); a KV-cache forward reads the kept copy at one graph break.
- Refused at patch time (``ValueError`` naming the config field): sizes the kernels cannot take (odd
  ``intermediate_size`` or ``head_dim``, heads not a multiple of KV heads, projection shapes that do not
  match the config). These checks and the architecture refusals below run again at the first forward after
  the structure they read changes (a module swapped, a bias added, an eps changed; a comparison of module
  identities and parameter shapes per forward, outside ``torch.compile``). Refused at patch time and at each
  forward: hooks on any submodule but the input embedding (the fused decoder never calls their ``forward``); hooks
  on the model itself run. FSDP2 units on the decoder layers, the final norm and the LM head (accelerate's placement)
  run: each layer is then computed on its own parameters in its own module call (:mod:`.layer_units`).
  Refused at the forward (``ValueError``): empty batches (transformers fails on them inside attention) and
  ``inputs_embeds`` whose width is not the hidden size.
- The families (:mod:`.families`) differ by spec: where the projections live, the norms' placement and form,
  the activation (SiLU or GELU-tanh), multipliers, soft-caps, RoPE per layer or per layer type, interleaved and
  partial rotary embeddings.
- Refused: MLP biases, activations other than SiLU and GELU-tanh (``hidden_act`` and each layer's ``act_fn``),
  Q/K/V biases together with QK-norm (the bias would enter before the norm), QK-norm eps
  unequal to the RMSNorm eps, other RoPE types, 4-D ``attention_mask``,
  flash-attention varlen kwargs (``cu_seq_lens_q``, ...), ``output_attentions`` / ``output_hidden_states``,
  extra attention kwargs. Run the model unpatched for those (``unpatch`` a patched model whose parameters
  are its own; at patch time, do not patch it).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from codagen import ops
from codagen.ops import _fp8
from codagen.ops._checks import index_range

from . import (
    compile_ahead,
    decode_graphs,
    families,
    fused_layers,
    generate_loop,
    hf_cache,
    layer_units,
    lora,
    module_changes,
    tensor_parallel,
)
from .llama import AttentionSpec, BlockWeights, decoder_stack, fuse_qkv, head_normed, lm_head
from .masks import additive, causal_mask, document_ids
from .per_model import PerModel

__all__ = ["patch", "unpatch", "is_patched", "refresh_weights", "fp8_recipe", "SUPPORTED_MODELS"]

SUPPORTED_MODELS = tuple(name for family in families.FAMILIES.values() for name in family.model_classes)
#: RoPE types whose rotary module gives inv_freq and attention_scaling (cos and sin multiplied by it: folded into
#: the Q and K rows, since rope(s z) = s rope(z)); "dynamic" and "longrope" choose inv_freq per forward from the
#: largest position, by the rotary module's own update (families.ROPE_FROM_POSITIONS)
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
#: the config names of the MLP activations the gate/up epilogue computes (codagen.models.families.activation_of)
_HIDDEN_ACTS = ("silu", "swish", "gelu_pytorch_tanh", "gelu_new")
_FLASH_ATTENTION_KWARGS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}
# rotary module -> {what the frequencies were built from: the fused QKV's per-pair frequencies}
_FREQUENCIES = PerModel("rope_frequencies")
# model -> the _structure its patch-time checks last passed
_CHECKED_STRUCTURE = PerModel("checked_structure")


def _advice(model: nn.Module | None) -> str:
    """How to run a refused feature, for the model's state: ``codagen.unpatch`` works on a patched model
    whose projections are its own; before patching, or with fused parameters, it does not."""
    if model is None or not is_patched(model):
        return "run the model without codagen.patch to use it with transformers"
    if fused_layers.is_fused(model):
        return ("its fused parameters (codagen.models.sharding) have no transformers forward: load its state_dict() "
                "(Hugging Face names and layouts) into an unpatched model to run it with transformers")
    return "call codagen.unpatch(model) to run it with transformers"


def _refuse(feature: str, model: nn.Module | None = None) -> NotImplementedError:
    return NotImplementedError(f"codagen.patch: {feature} is not supported by the fused kernels; {_advice(model)}")


def _check_model(model: nn.Module) -> None:
    """Refuse, at patch time, architectures the fused decoder would compute differently."""
    family = families.family_of(model)
    config = model.config
    if getattr(config, "hidden_act", "silu") not in _HIDDEN_ACTS:
        raise _refuse(f"hidden_act={config.hidden_act!r} (supported: {_HIDDEN_ACTS})", model)
    for field in family.unset_config:
        if getattr(config, field, None) not in (None, False):
            raise _refuse(f"config.{field}={getattr(config, field)!r} (the fused decoder computes it only unset)",
                          model)
    for rope_type in families.rope_types(model):
        if rope_type not in _ROPE_TYPES:
            raise _refuse(f"rope_type={rope_type!r} (supported: {_ROPE_TYPES})", model)
    for layer in model.model.layers:
        scaling = families.attention_scaling(family, model, layer)
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling) \
                or scaling <= 0:
            raise _refuse(f"the rotary attention_scaling {scaling!r} (a positive number)", model)
    if family.rope_per_layer_type and (families.rope_from_positions(model) or any(
            families.attention_scaling(family, model, layer) != 1.0 for layer in model.model.layers)):
        raise _refuse(f"RoPE per layer type with the rope types {families.rope_types(model)} (supported: static "
                      f"frequencies without an attention_scaling)", model)
    families.scales(family, model)  # ValueError naming a multiplier that is not a finite nonzero number
    families.softcap(config, family.logits_softcap)  # ValueError naming a soft-cap that is not a positive number
    if families.softcap(config, family.attention_softcap) is not None and config.attention_dropout:
        raise _refuse("attention dropout together with an attention soft-cap", model)
    scalings = {getattr(layer.self_attn, "scaling", None) for layer in model.model.layers}
    if len(scalings) > 1:
        raise _refuse(f"attention scalings that differ between layers ({sorted(scalings, key=str)})", model)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        act_fn = getattr(mlp, family.act_fn)
        if families.activation_of(act_fn) is None:
            raise _refuse(f"{family.act_fn} {type(act_fn).__name__} (layer {i}; only SiLU and GELU-tanh)", model)
        if any(getattr(mlp, n).bias is not None for n in (*family.gate_up, "down_proj")):
            raise _refuse(f"MLP biases (layer {i})", model)
        qkv_bias = [getattr(attn, n).bias is not None for n in family.qkv]  # one fused projection: all or none
        if any(qkv_bias) and not all(qkv_bias):
            raise _refuse(f"biases on only some of q/k/v_proj (layer {i})", model)
        layer_norms = [norm for norm in families.norms(family, layer).values() if norm is not None]
        if len({families.norm_eps(norm) for norm in (*layer_norms, model.model.norm)}) != 1:
            raise _refuse(f"different eps among the RMSNorms (layer {i})", model)
        if family.post_attn_norm is not None and attn.o_proj.bias is not None:
            raise _refuse(f"an o_proj bias with a norm after attention (layer {i})", model)
        qk_norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
        if family.attn_norm is None and any(norm is None for norm in qk_norms):
            raise _refuse(f"no norm before attention without a q_norm and a k_norm (layer {i})", model)
        if any(norm is not None for norm in qk_norms):
            if any(norm is None for norm in qk_norms):
                raise _refuse(f"a norm on only one of q and k (layer {i})", model)
            if any(qkv_bias):
                raise _refuse(f"Q/K/V biases together with QK-norm (layer {i})", model)
            if family.qk_norm_over_projection:
                shapes = ((config.num_attention_heads * attn.head_dim,), (config.num_key_value_heads * attn.head_dim,))
                if tuple(tuple(norm.weight.shape) for norm in qk_norms) != shapes:
                    raise _refuse(f"QK-norm weights of shapes other than the Q and K projections' {shapes} "
                                  f"(layer {i})", model)
            elif any(tuple(norm.weight.shape) != (attn.head_dim,) for norm in qk_norms):
                raise _refuse(f"QK-norm weights of shape other than [head_dim] = ({attn.head_dim},) (layer {i})", model)
            if any(families.norm_eps(norm) != families.norm_eps(layer_norms[0]) for norm in qk_norms):
                raise _refuse(f"a QK-norm eps different from the RMSNorm eps (layer {i})", model)
    _check_residual_dropout(model, family)
    lora.prepare_adapters(model, patched=is_patched(model))


def _check_residual_dropout(model: nn.Module, family: families.Family) -> None:
    """Refuse dropout on the residual branches (Phi-3's ``resid_pdrop``) where it drops: in training mode (an
    activation-sized mask the fused epilogues lack). At patch time and on every forward (the mode can change)."""
    for i, layer in enumerate(model.model.layers):
        for name in families.residual_dropout(family, layer):
            module = getattr(layer, name)
            what = (f"dropout p={module.p} in training mode" if isinstance(module, nn.Dropout)
                    else f"a {type(module).__name__} module")
            raise NotImplementedError(f"codagen.patch: {what} on the residual branch ({name} of layer {i}) is not "
                                      f"supported by the fused kernels; train with resid_pdrop=0 or "
                                      f"{_advice(model)}")


def _check_shapes(model: nn.Module) -> None:
    """Refuse, at patch time, sizes the fused kernels cannot take (``ValueError`` naming the config field).

    Any positive even ``head_dim`` is taken, with QK-norm too: one QKV GEMM normalizes the heads in its epilogue
    where an epilogue sub-tile holds them whole (``head_dim`` dividing 128 in fp16/bf16, 64 in fp32), else the GEMM
    and one row kernel do (:func:`codagen.ops.qkv.qk_norm_in_epilogue`, decided per call from the dtype)."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"codagen.patch: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                         f"({kv_heads})")
    hidden = model.model.norm.weight.shape[0]
    family = families.family_of(model)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        head_dim = attn.head_dim
        if head_dim <= 0 or head_dim % 2:  # RoPE and the fused layouts work on pairs of columns
            raise ValueError(f"codagen.patch: head_dim must be a positive even number, got {head_dim} (layer {i})")
        expected = dict(zip(family.qkv, [((heads + 2 * kv_heads) * head_dim, hidden)] if len(family.qkv) == 1 else
                            [(heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden)]))
        expected["o_proj"] = (hidden, heads * head_dim)
        for name, shape in expected.items():
            got = tuple(getattr(attn, name).weight.shape)
            if got != shape:
                raise ValueError(f"codagen.patch: self_attn.{name}.weight of layer {i} is {got}; num_attention_heads "
                                 f"= {heads}, num_key_value_heads = {kv_heads}, head_dim = {head_dim} and "
                                 f"hidden_size = {hidden} give {shape}")
        ffn = getattr(mlp, family.gate_up[0]).weight.shape[0] // (3 - len(family.gate_up))  # [gate; up]: 2 ffn rows
        if ffn % 2:  # the down projection's backward epilogue works on (gate, up) column pairs
            raise ValueError(f"codagen.patch: intermediate_size must be even, got {ffn} (layer {i})")
        names = (*family.gate_up, "down_proj")
        got = tuple(tuple(getattr(mlp, n).weight.shape) for n in names)
        want = (*([(ffn, hidden)] * 2 if len(family.gate_up) == 2 else [(2 * ffn, hidden)]), (hidden, ffn))
        if got != want:
            raise ValueError(f"codagen.patch: {', '.join(names)} weights of layer {i} are {got}; "
                             f"intermediate_size = {ffn} and hidden_size = {hidden} give {want}")
        rotary_pairs = families.inv_freq(family, model, layer).shape[0]
        if not 0 < rotary_pairs <= head_dim // 2:
            raise ValueError(f"codagen.patch: the rotary embedding rotates {2 * rotary_pairs} channels; head_dim "
                             f"{head_dim} (layer {i}) takes 2 to {head_dim}")
        if family.rope_per_layer_type and rotary_pairs != families.inv_freq(family, model).shape[0]:
            raise _refuse(f"rotary embeddings of different widths per layer type (layer {i})", model)


@dataclasses.dataclass(frozen=True)
class _Walk:
    """One walk of a model's modules and what the per-forward checks read of them, valid while
    :func:`.module_changes.version` stays ``version``."""
    version: tuple[int, int]
    modules: tuple[tuple[str, nn.Module], ...]
    peft_modules: tuple[tuple[str, nn.Module], ...]  # what lora.prepare_adapters reads
    tree: tuple  # each module's identity and its parameters' presence and shapes
    scalar_modules: tuple[nn.Module, ...]  # the modules holding an eps or a head_dim (plain attributes)
    layers: tuple[nn.Module, ...]  # the decoder layers, and their attention modules (read without nn.Module lookups)
    attentions: tuple[nn.Module | None, ...]  # None for a fused block (codagen.models.sharding) or a wrapper


#: the last walk of each patched model (outside torch.compile, which guards what it traced itself); on the model, as a
#: walk names the model (per_model)
_WALKS = PerModel("walk")


def _walk(model: nn.Module, version: tuple[int, int] | None = None) -> _Walk:
    modules = tuple(model.named_modules())
    return _Walk(module_changes.version() if version is None else version, modules,
                 tuple((path, m) for path, m in modules if lora.is_peft_module(m)),
                 tuple((id(m), tuple(None if p is None else p.shape for p in m._parameters.values()))
                       for _, m in modules),
                 tuple(m for _, m in modules if families.norm_eps(m) is not None or "head_dim" in m.__dict__),
                 tuple(model.model.layers), tuple(layer._modules.get("self_attn") for layer in model.model.layers))


def _current_walk(model: nn.Module) -> tuple[_Walk, bool]:
    """``(walk, new)``: the model's last walk while nothing was registered since (:mod:`.module_changes`), else a new
    one."""
    version = module_changes.version()
    walk = _WALKS.get(model)
    if walk is not None and walk.version == version:
        return walk, False
    walk = _walk(model, version)
    _WALKS.set(model, walk)
    return walk, True


def _structure(model: nn.Module, walk: _Walk) -> tuple:
    """What :func:`_check_model` and :func:`_check_shapes` read, in a form cheap to compare on every forward: each
    module's identity (a projection or ``act_fn`` swapped) and its parameters' presence and shapes (a bias added), from
    ``walk``; the eps and ``head_dim`` attributes, the family's multipliers and attention scalings, and the config and
    rotary fields, read now."""
    config = model.config
    family = families.family_of(model)
    fields = [getattr(model.model, family.embedding_multiplier, None) if family.embedding_multiplier else None,
              getattr(config, family.logits_divisor, None) if family.logits_divisor else None,
              *(getattr(layer, family.residual_multiplier, None)
                for layer in walk.layers if family.residual_multiplier),
              *(vars(attn).get("scaling") for attn in walk.attentions if attn is not None)]
    # the rotary embedding per layer type (one for most families): its attention factor and rotated width
    rotary_layers = {vars(attn).get(family.layer_type_attr): layer
                     for layer, attn in zip(walk.layers, walk.attentions) if attn is not None}.values()
    return (walk.tree, tuple((families.norm_eps(m), m.__dict__.get("head_dim")) for m in walk.scalar_modules),
            tuple(fields), getattr(config, "hidden_act", None), config.num_attention_heads, config.num_key_value_heads,
            families.rope_types(model), tuple((families.attention_scaling(family, model, layer),
                                               families.inv_freq(family, model, layer).shape)
                                              for layer in rotary_layers))


def _check_before_forward(model: nn.Module) -> tuple[_Walk, bool]:
    """What a patched forward checks before it computes; ``(walk, whether the model holds LoRA layers)``.

    PEFT wrappers and adapter states can change after patching (fused parameters take none: sharding.py), hooks can
    be added: checked on one walk of the modules, re-walked only after a registration (:mod:`.module_changes`)."""
    compiling = torch.compiler.is_compiling()
    if compiling:  # Dynamo guards what it traced: no structure check, no kept walk
        walk, new_walk = _walk(model, version=(0, 0)), True
    else:
        walk, new_walk = _current_walk(model)
    fused = fused_layers.is_fused(model)
    adapters = not fused and lora.prepare_adapters(model, walk.peft_modules, patched=True)
    if new_walk:  # a hook is registered through a new handle: a walk of the same version has seen them all
        _check_hooks(model, walk.modules)
    if not fused and not compiling:
        _check_structure(model, walk)
        _check_residual_dropout(model, families.family_of(model))  # the training mode can change without a patch
    return walk, adapters


def _check_structure(model: nn.Module, walk: _Walk) -> None:
    """:func:`_check_model` and :func:`_check_shapes` again when :func:`_structure` differs from the one they last
    passed: a bias added or ``act_fn`` replaced after patching is refused, never computed as the unmodified model."""
    structure = _structure(model, walk)
    if _CHECKED_STRUCTURE.get(model) != structure:
        _check_model(model)
        _check_shapes(model)
        _CHECKED_STRUCTURE.set(model, structure)


def patch(model: nn.Module, *, fp8: str | None = None) -> nn.Module:
    """Make a ``transformers`` ``...ForCausalLM`` of a family in :mod:`.families` run on codagen kernels; returns it.

    Undo with :func:`unpatch`. Patching twice is a no-op, except that it sets ``fp8`` anew. See the module docstring
    for what is handled and what is refused. A ``peft.PeftModel`` (LoRA) is accepted: the ``...ForCausalLM`` inside
    it is patched and the PeftModel returned (:mod:`codagen.models.lora`).

    ``fp8="blockwise"``: every projection GEMM of the decoder layers, forward and backward, runs on e4m3 operands
    scaled per group of 128 along K, weights per 128 x 128 block (:mod:`codagen.ops._fp8`), in
    training, evaluation and ``generate()`` alike; the LM head and the embeddings stay in the model's dtype. It needs
    bf16 compute (a bf16 model, or ``torch.autocast`` to bf16); LoRA adapters and fused parameters
    (:mod:`codagen.models.sharding`) are refused.
    """
    inner = lora.unwrap_peft(model)
    if fused_layers.is_fused(inner):  # checked and patched by codagen.models.sharding.fuse_parameters
        if fp8 is not None:
            raise _refuse(f"fp8={fp8!r} on a model with fused parameters (codagen.models.sharding)", inner)
        return model
    hf_cache.load_transformers()
    _check_model(inner)
    _check_shapes(inner)
    _CHECKED_STRUCTURE.set(inner, _structure(inner, _walk(inner)))
    _check_hooks(inner)
    fp8 = _checked_fp8(model, fp8)
    if is_patched(inner) and fp8_recipe(inner) != fp8:  # the kept inference weights and decode graphs ran the other
        hf_cache.drop_inference_blocks(inner)
        _drop_decode_graphs(inner)
    # a plain attribute, unlike the per-model caches: copies and pickles of the model keep it
    inner.__dict__[_FP8_RECIPE] = fp8
    if not is_patched(inner):
        inner.forward = _PatchedForward(inner)
        for name, hook in _GENERATE_HOOKS.items():  # transformers' generate() steps, where this version has them
            if hasattr(type(inner), name):
                setattr(inner, name, hook(inner))
    return model


_FP8_RECIPE = "_codagen_fp8"


def fp8_recipe(model: nn.Module) -> str | None:
    """The FP8 recipe ``model`` was patched with (``patch``'s ``fp8``), None for none."""
    return lora.unwrap_peft(model).__dict__.get(_FP8_RECIPE)


def _checked_fp8(model: nn.Module, fp8) -> str | None:
    """``patch``'s ``fp8`` (:func:`codagen.ops._fp8.checked_recipe`), refused where the FP8 block ops cannot take the
    model."""
    if _fp8.checked_recipe(fp8) is None:
        return None
    inner = lora.unwrap_peft(model)
    if inner is not model or any(lora.is_peft_module(module) for module in inner.modules()):
        raise _refuse(f"fp8={fp8!r} with LoRA adapters", inner)
    return fp8


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: ``model.forward`` is the ``transformers`` one again; returns the model."""
    inner = lora.unwrap_peft(model)
    if not is_patched(inner):
        raise ValueError("codagen.unpatch: model is not patched by codagen.patch")
    if fused_layers.is_fused(inner):
        raise ValueError("codagen.unpatch: the model's projections are fused (codagen.models.sharding."
                         "fuse_parameters) and transformers' forward needs them separate; load its state_dict() "
                         "(Hugging Face names and layouts) into an unpatched model instead")
    del inner.forward
    for name in (*_GENERATE_HOOKS, _FP8_RECIPE):
        inner.__dict__.pop(name, None)
    _drop_decode_graphs(inner)
    return model


def is_patched(model: nn.Module) -> bool:
    return isinstance(lora.unwrap_peft(model).__dict__.get("forward"), _PatchedForward)


def refresh_weights(model: nn.Module) -> nn.Module:
    """Make the next forward read every parameter afresh; returns the model. Call it after writing weights in
    place through ``param.data`` (``p.data.copy_(w)``, TRL's ``ref.data.mul_(1 - a).add_(p.data, alpha=a)``)
    between forwards without autograd.

    A forward without autograd (evaluation, ``generate()``) keeps the fused QKV and gate/up weights it builds,
    and the RoPE frequencies, for the next one while each parameter keeps its storage and version counter
    (:func:`.hf_cache.inference_blocks`). Every other write is seen: ``load_state_dict``, ``copy_`` or an
    optimizer step under ``torch.no_grad`` (they bump the version counter), ``p.data = w`` (new storage), a
    module swap. In-place writes through ``.data`` change neither: the kept copies would stay stale.
    """
    inner = lora.unwrap_peft(model)
    if not is_patched(inner):
        raise ValueError("codagen.models.hf.refresh_weights: model is not patched by codagen.patch")
    hf_cache.drop_inference_blocks(inner)
    _drop_decode_graphs(inner)
    _FREQUENCIES.pop(inner.model.rotary_emb)
    return model


def _drop_decode_graphs(model: nn.Module) -> None:
    """Forget ``model``'s captured decode steps and loops (their graphs read the fused inference weights)."""
    decode_graphs.drop(model)
    generate_loop.drop(model)


class _PatchedForward:
    """``model.forward`` of a patched model: :func:`_forward` bound to the model. Unlike a bound method of
    a function defined here, it pickles (``torch.save``) and deep-copies: it holds nothing but the
    model, and reduces to ``_PatchedForward(model)``, so a copy of the model is patched too."""
    __slots__ = ("model",)

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        replayed = decode_graphs.replay(self.model, _forward, args, kwargs)  # a static-cache decode step
        if replayed is not None:
            return replayed
        compile_ahead.trace_first_step(self.model, _forward, args, kwargs)  # a new shape's kernels, in parallel
        return _forward(self.model, *args, **kwargs)

    def __reduce__(self):
        return _PatchedForward, (self.model,)

    def __repr__(self) -> str:
        return f"<codagen.patch forward of {type(self.model).__name__}>"


class _AutoCompileCriteria:
    """``model._valid_auto_compile_criteria`` of a patched model (transformers' test of whether ``generate()``
    compiles the forward): false where the decode step replays as a CUDA graph (:mod:`.decode_graphs`), whose
    replay a compiled graph would only wrap; elsewhere transformers' own test. Picklable like
    :class:`_PatchedForward`."""
    __slots__ = ("model",)

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, model_kwargs, generation_config):
        decided = decode_graphs.compiles_forward(self.model, model_kwargs)
        if decided is not None:
            return decided
        return type(self.model)._valid_auto_compile_criteria(self.model, model_kwargs, generation_config)

    def __reduce__(self):
        return _AutoCompileCriteria, (self.model,)


class _CacheForGeneration:
    """``model._prepare_cache_for_generation`` of a patched model: a greedy or sampling ``generate()`` on a GPU that
    names no cache gets a ``StaticCache``, whose decode steps replay as CUDA graphs
    (:func:`.decode_graphs.default_static_cache`; set on the call's copy of the generation config), then
    transformers prepares the cache."""
    __slots__ = ("model",)

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, generation_config, model_kwargs, generation_mode, *args, **kwargs):
        model = self.model
        if (not any(_sliding_window(model, layer) is not None for layer in model.model.layers)
                and decode_graphs.default_static_cache(model, generation_config, model_kwargs, generation_mode)):
            generation_config.cache_implementation = "static"
        return type(model)._prepare_cache_for_generation(model, generation_config, model_kwargs, generation_mode,
                                                        *args, **kwargs)

    def __reduce__(self):
        return _CacheForGeneration, (self.model,)


class _Generate:
    """``model.generate`` of a patched model: transformers' ``generate()``, whose greedy and sampling decode loop is
    :mod:`.generate_loop`'s (each token one CUDA graph replay) where that loop can take the call, passed as
    transformers' ``custom_generate`` callable (:func:`.generate_loop.takes`). Picklable like
    :class:`_PatchedForward`."""
    __slots__ = ("model",)

    def __init__(self, model: nn.Module):
        self.model = model

    @property
    def __wrapped__(self):  # inspect.signature(model.generate) shows transformers' signature
        return type(self.model).generate.__get__(self.model)

    def __call__(self, *args, **kwargs):
        if generate_loop.takes(self.model, args, kwargs):
            kwargs["custom_generate"] = generate_loop.decode
        return type(self.model).generate(self.model, *args, **kwargs)

    def __reduce__(self):
        return _Generate, (self.model,)


#: instance attributes patch() sets on the model (unpatch() removes them): transformers' generate() calls them
_GENERATE_HOOKS = {"_valid_auto_compile_criteria": _AutoCompileCriteria,
                   "_prepare_cache_for_generation": _CacheForGeneration,
                   "generate": _Generate}


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
                or module._backward_hooks)


def _check_hooks(model: nn.Module, modules: Sequence[tuple[str, nn.Module]] | None = None) -> None:
    """Refuse hooks the fused decoder would silently skip: it never calls the decoder's submodules'
    ``forward`` (the layers, their projections and norms, the final norm, the LM head), so hooks on any of
    them would not run. Hooks on ``model`` itself run (``model(...)`` calls them around the fused forward),
    and so do hooks on the input embedding (it then runs as the module: :func:`_embed`) and on fused blocks.
    FSDP2 units on the decoder layers, the final norm and the LM head run too: each is then called as a
    module, on codagen's arguments (:mod:`.layer_units`); other hooks there stay refused, since they would see
    codagen's arguments and outputs rather than ``transformers``'. Checked at patch time and on every forward
    (a dictionary test per module; ``modules``: ``model.named_modules()`` when the caller has walked them
    already)."""
    if any("_checkpoint_wrapped_module" in layer._modules for layer in model.model.layers):  # forward never called
        raise _refuse("torch's checkpoint_wrapper on the decoder layers (e.g. accelerate's FSDP "
                      "activation_checkpointing); model.gradient_checkpointing_enable() checkpoints each layer of the "
                      "patched model", model)
    called = {id(model), id(model.model.embed_tokens)}
    units = {id(module) for module in (*model.model.layers, model.model.norm, model.lm_head)}
    for name, module in model.named_modules() if modules is None else modules:
        # a fused block is called as a module (its FSDP unit's hooks run around it)
        if (id(module) not in called and not isinstance(module, fused_layers.FusedBlock)
                and not (id(module) in units and isinstance(module, FSDPModule)) and _has_hooks(module)):
            kinds = [kind for kind, hooks in (("forward pre-hooks", module._forward_pre_hooks),
                                              ("forward hooks", module._forward_hooks),
                                              ("backward pre-hooks", module._backward_pre_hooks),
                                              ("backward hooks", module._backward_hooks)) if hooks]
            fsdp = (" (FSDP2: fully_shard the decoder layers and the root, as accelerate does, or call "
                    "codagen.models.sharding.fully_shard(model), which places the units on the fused blocks)"
                    if isinstance(module, FSDPModule) else "")
            raise _refuse(f"{' and '.join(kinds)} on submodule {name!r} ({type(module).__name__}: the fused decoder "
                          f"never calls its forward; hooks on the model itself run){fsdp}", model)


def _block_weights(layer: nn.Module, family: families.Family, spec: AttentionSpec, sliding_window: int | None,
                   residual_scale: float, qk_scale: float, rotary_dim: int, frequencies: torch.Tensor | None,
                   dtype: torch.dtype, fp8: bool = False) -> BlockWeights:
    """One HF decoder layer's parameters in the fused layout and ``dtype`` (differentiable gathers and
    casts, see the module docstring), with its PEFT LoRA updates (:mod:`codagen.models.lora`). ``residual_scale``
    (Granite's residual multiplier) is folded into the O and down projections: ``x + m (a W^T) = x + a (m W)^T``.
    ``qk_scale`` (the rotary module's ``attention_scaling``: YaRN, LongRoPE) multiplies the rotated Q and K, as
    transformers' scaled cos and sin do; RoPE is linear, so it is folded into the Q/K rows (their biases and LoRA
    updates), or with QK-norm into the norms' weights (the norm would undo a scale before it), on the ``rotary_dim``
    channels of each head that RoPE rotates. ``frequencies``: the layer's own RoPE frequencies (None: the model's).
    ``fp8``: the block's GEMMs in FP8 (``patch(fp8="blockwise")``)."""
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = spec.head_dim
    q_rows, kv_rows = spec.num_heads * head_dim, spec.num_kv_heads * head_dim

    def cast(t):
        return None if t is None else t.to(dtype)
    qk_norm = getattr(attn, "q_norm", None) is not None
    def rotated_scaled(t):  # Q or K rows (or a QK-norm weight), HF order: the rotated channels times qk_scale
        return _rotated_scaled(t, qk_scale, head_dim, rotary_dim)

    def q_k_scaled(tensors):  # (q, k, v): the rotated channels of Q and K times qk_scale (without QK-norm)
        q, k, v = (cast(t) for t in tensors)
        return (q, k, v) if qk_norm else (rotated_scaled(q), rotated_scaled(k), v)
    weights, biases = families.qkv_projections(family, attn, q_rows, kv_rows)
    split = spec.half_split_dim
    qkv = fuse_qkv(*q_k_scaled(weights), head_dim, split)
    qkv_bias = None if biases[0] is None else fuse_qkv(*q_k_scaled(biases), head_dim, split)
    # QK-norm (Qwen3): each head's channels permuted to pair order, like the Q/K rows of qkv
    q_norm, k_norm = (None if not qk_norm else ops.rope_pairs_from_half_split(
        rotated_scaled(cast(families.norm_weight(family, getattr(attn, n)))), head_dim, split)
        for n in ("q_norm", "k_norm"))
    norms = {role: None if norm is None else cast(families.norm_weight(family, norm))
             for role, norm in families.norms(family, layer).items()}
    (gate, up), _ = families.gate_up_projections(family, mlp)

    def branch(projection, post_norm):  # (weight, bias, LoRA update, post-norm weight), residual_scale in one
        low_rank = lora.linear_low_rank(projection, dtype)
        if post_norm is not None:  # the multiplier scales the norm's weight: the norm would undo it on the weight
            return cast(projection.weight), cast(projection.bias), low_rank, _scaled(post_norm, residual_scale)
        if low_rank is not None and residual_scale != 1.0:
            low_rank = dataclasses.replace(low_rank, scale=low_rank.scale * residual_scale)
        bias = None if projection.bias is None else _scaled(cast(projection.bias), residual_scale)
        return _scaled(cast(projection.weight), residual_scale), bias, low_rank, None
    o, o_bias, o_low_rank, post_attn = branch(attn.o_proj, norms["post_attn"])
    down, _, down_low_rank, post_mlp = branch(mlp.down_proj, norms["post_mlp"])
    return BlockWeights(
        attn_norm=norms["attn"], qkv=qkv, qkv_bias=qkv_bias, o=o, o_bias=o_bias,
        mlp_norm=norms["mlp"], gate_up=ops.interleave_gate_up(cast(gate), cast(up)), down=down,
        q_norm=q_norm, k_norm=k_norm, sliding_window=sliding_window, frequencies=frequencies,
        post_attn_norm=post_attn, post_mlp_norm=post_mlp,
        activation=families.activation_of(getattr(mlp, family.act_fn)),
        qkv_low_rank=lora.qkv_low_rank(attn, family, head_dim, q_rows, kv_rows, dtype,
                                       None if qk_norm or qk_scale == 1.0 else rotated_scaled, split),
        o_low_rank=o_low_rank,
        gate_up_low_rank=lora.gate_up_low_rank(mlp, family, dtype), down_low_rank=down_low_rank, fp8=fp8)


def _scaled(t: torch.Tensor, scale: float) -> torch.Tensor:
    return t if scale == 1.0 else t * scale


def _rotated_scaled(t: torch.Tensor, scale: float, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Rows ``[heads * head_dim, ...]`` (or one head's ``[head_dim]``) with each head's first ``rotary_dim`` rows
    (the channels RoPE rotates, in HF's order) times ``scale``."""
    if scale == 1.0 or rotary_dim == 0:
        return t
    if rotary_dim == head_dim:
        return t * scale
    per_channel = torch.ones(head_dim, dtype=t.dtype, device=t.device)
    per_channel[:rotary_dim] = scale
    heads = t.reshape(-1, head_dim, *t.shape[1:])
    return (heads * per_channel.view(head_dim, *([1] * (t.dim() - 1)))).reshape(t.shape)


def _sliding_window(model: nn.Module, layer: nn.Module) -> int | None:
    # Qwen2/Qwen3 set it per layer (layer_types); Mistral has one for all layers; Llama has none.
    if hasattr(layer.self_attn, "sliding_window"):
        return layer.self_attn.sliding_window
    return getattr(model.config, "sliding_window", None)


def _forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
             labels=None, use_cache=None, logits_to_keep=0, output_attentions=None, output_hidden_states=None,
             return_dict=None, num_items_in_batch=None, shift_labels=None, **kwargs):
    """codagen's replacement of ``...ForCausalLM.forward`` (same arguments; see the module docstring)."""
    walk, adapters = _check_before_forward(self)
    modules = walk.modules
    if kwargs.keys() & _FLASH_ATTENTION_KWARGS:
        raise _refuse(f"flash-attention varlen arguments {sorted(kwargs.keys() & _FLASH_ATTENTION_KWARGS)} (packed "
                      f"documents come from position_ids: DataCollatorWithFlattening(return_flash_attn_kwargs=False))",
                      self)
    # transformers 5.2x names the cache `cache` (`past_key_values` before) and derives positions from it;
    # before, a given cache_position also gives the positions
    cache = kwargs.pop("cache", None) if past_key_values is None else past_key_values
    cache_position = kwargs.pop("cache_position", None)
    if position_ids is None and cache_position is not None:
        position_ids = cache_position[None]
    if kwargs:
        names = ", ".join(repr(name) for name in sorted(kwargs))
        raise _refuse(f"the forward argument {names}" if len(kwargs) == 1 else f"each of the forward arguments {names}",
                      self)
    if cache is None and use_cache:
        cache = hf_cache.new_dynamic_cache(self.config)
    if cache is not None:
        if fused_layers.is_fused(self):
            raise _refuse("a KV cache (generate()) on a model with fused parameters (codagen.models.sharding)", self)
        hf_cache.check_cache(cache)
    if output_attentions or output_hidden_states:
        raise _refuse("output_attentions / output_hidden_states", self)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("codagen.patch: give exactly one of input_ids or inputs_embeds")
    given, inputs = ("input_ids", input_ids) if inputs_embeds is None else ("inputs_embeds", inputs_embeds)
    if inputs.dim() != (2 if inputs_embeds is None else 3):
        raise ValueError(f"codagen.patch: expected [batch, seq] input_ids or [batch, seq, hidden_size] inputs_embeds, "
                         f"got {given} of shape {tuple(inputs.shape)}")
    if 0 in inputs.shape[:2]:  # transformers fails on them inside attention
        raise ValueError(f"codagen.patch: {given} must hold at least one sequence of at least one token, got shape "
                         f"{tuple(inputs.shape)}")
    hidden_size = self.model.norm.weight.shape[0]
    if inputs_embeds is not None and inputs_embeds.shape[-1] != hidden_size:
        raise ValueError(f"codagen.patch: inputs_embeds must be [batch, seq, hidden_size = {hidden_size}], got shape "
                         f"{tuple(inputs_embeds.shape)}")
    x = _embed(self.model.embed_tokens, input_ids) if inputs_embeds is None else inputs_embeds
    family = families.family_of(self)
    scales = families.scales(family, self)
    x = _scaled(x, scales.embedding)  # Granite's embedding multiplier, on given inputs_embeds too (as transformers)
    batch, seq, hidden = x.shape
    # with a KV cache the mask spans the cached tokens too (transformers' mask functions read it, a
    # prepared 4-D one as given); without one it is the [batch, seq] padding mask
    if cache is None and attention_mask is not None and attention_mask.dim() != 2:
        raise _refuse(f"a {attention_mask.dim()}-D attention_mask (give the 2-D [batch, seq] padding mask)", self)
    if cache is None and attention_mask is not None and tuple(attention_mask.shape) != (batch, seq):
        raise ValueError(f"codagen.patch: attention_mask must be [batch, seq] = {(batch, seq)}, "
                         f"got shape {tuple(attention_mask.shape)}")
    # Under autocast (e.g. fp32 master weights, bf16 compute) everything runs in the autocast dtype,
    # cast once here; autocast itself is then switched off so SDPA keeps the dtype the fused ops expect.
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    with torch.autocast(device_type, enabled=False):
        return _decoder_forward(self, family, scales, x.to(dtype), dtype, attention_mask, position_ids, labels,
                                shift_labels, logits_to_keep, num_items_in_batch, return_dict, cache, adapters, modules)

# the signature of ...ForCausalLM.forward without self: transformers' Trainer reads it to keep dataset columns
_PatchedForward.__signature__ = inspect.Signature(list(inspect.signature(_forward).parameters.values())[1:])


def _embed(embed_tokens: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """A plain ``nn.Embedding`` runs as :func:`codagen.ops.embedding` (deterministic backward); anything else
    (max_norm, scale_grad_by_freq, sparse, a scaled or custom embedding module, or one with hooks, such as
    ``enable_input_require_grads``' for PEFT) runs as the module."""
    if (type(embed_tokens) is nn.Embedding and embed_tokens.max_norm is None and not embed_tokens.scale_grad_by_freq
            and not embed_tokens.sparse and not _has_hooks(embed_tokens)):
        return ops.embedding(input_ids, tensor_parallel.local(embed_tokens.weight), embed_tokens.padding_idx)
    return embed_tokens(input_ids)


def _rope_frequencies(rotary: nn.Module, inv_freq: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                      device: torch.device) -> torch.Tensor:
    """:func:`codagen.ops.rope_frequencies` of ``inv_freq`` (a buffer of ``rotary``) on ``device``, kept while
    ``inv_freq`` keeps its storage and version (outside ``torch.compile``): a decode step then builds none of it."""
    def build():  # a partial rotary embedding's other pairs rotate by frequency 0 (its inv_freq covers the rotated)
        per_head = nn.functional.pad(inv_freq.to(device), (0, head_dim // 2 - inv_freq.shape[0]))
        return ops.rope_frequencies(num_heads, num_kv_heads, head_dim, inv_freq=per_head)
    if torch.compiler.is_compiling() or compile_ahead.tracing():  # nothing kept from a trace's fake tensors
        return build()
    key = (inv_freq.data_ptr(), inv_freq._version, num_heads, num_kv_heads, head_dim, device)
    kept = _FREQUENCIES.get(rotary)
    if kept is None:
        kept = {}
        _FREQUENCIES.set(rotary, kept)
    if key not in kept:
        if len(kept) >= 8:  # a buffer replaced, or updated in place (LongRoPE): the old entries go
            kept.clear()
        # inv_freq is kept with what it built: while it is, no new buffer (dynamic RoPE registers one as the
        # sequence grows) can take its address and find its entry
        kept[key] = (inv_freq, build())
    return kept[key][1]


def _decoder_forward(self, family, scales, x, dtype, attention_mask, position_ids, labels, shift_labels,
                     logits_to_keep, num_items_in_batch, return_dict, cache=None, adapters=False, modules=None):
    """The checked forward: embeddings ``x`` [B, S, d] in ``dtype`` through the fused decoder and head;
    with ``cache`` (a checked ``transformers`` cache) the KV-cache forward of :mod:`.hf_cache`; ``adapters``:
    the model holds LoRA layers (:func:`.lora.prepare_adapters`); ``modules``: ``self.named_modules()``;
    ``family``, ``scales``: the model's :class:`.families.Family` and its :class:`.families.Scales`."""
    batch, seq, hidden = x.shape
    config = self.config
    # As transformers: a padding mask when given, else documents from position_ids (packed rows); both on the
    # device, so that no value is read on the host. Positions stay 0..S-1 under padding, as transformers'.
    # With a cache, the cached tokens come first and transformers' own mask functions build the masks.
    documents = None
    if position_ids is None:
        length = cache.get_seq_length() if cache is not None else 0
        if torch.is_tensor(length) and seq == 1:
            # a decode step's one position is the cache length (a view: read below, before any layer advances it)
            position_ids = length.reshape(1, 1)
        else:
            position_ids = torch.arange(seq, device=x.device) + length
            position_ids = position_ids if cache is None else position_ids[None]
    elif attention_mask is None and cache is None:
        documents = document_ids(position_ids.expand(batch, seq))
    mask = None if cache is not None else causal_mask(batch, seq, x.device, attention_mask, documents)
    # in the dtype the QKV epilogue computes angles in: cast once here, not by every layer's op
    positions = position_ids.expand(batch, seq).reshape(-1).to(torch.float64 if dtype == torch.float64
                                                                else torch.float32).contiguous()

    rotary = self.model.rotary_emb
    if families.rope_from_positions(self) and not compile_ahead.tracing():  # as transformers' forward: the rotary
        with torch.no_grad():  # module's update picks inv_freq from the largest position (a trace's are fake)
            rotary(x[:1, :1], position_ids.reshape(-1).max().reshape(1, 1))
    qk_scale = float(families.attention_scaling(family, self))  # YaRN's, LongRoPE's: cos and sin times it
    fused = fused_layers.is_fused(self)
    layer0 = self.model.layers[0] if len(self.model.layers) else None
    attn0 = None if layer0 is None else layer0.fused if fused else layer0.self_attn
    head_dim = (attn0.head_dim if attn0 is not None
                else getattr(config, "head_dim", hidden // config.num_attention_heads))
    def frequencies_of(inv_freq):
        return _rope_frequencies(rotary, inv_freq, config.num_attention_heads, config.num_key_value_heads, head_dim,
                                 x.device)
    inv_freq = families.inv_freq(family, self)
    frequencies = frequencies_of(inv_freq)
    rotary_dim = 2 * inv_freq.shape[0]  # of each head's channels (HF order: the first ones)

    def layer_frequencies(layer):  # None: the model's; a NoPE layer rotates by 0, Gemma 3's by its layer type's
        if not families.uses_rope(family, layer):
            return torch.zeros_like(frequencies)
        return frequencies_of(families.inv_freq(family, self, layer)) if family.rope_per_layer_type else None
    scaling = None if fused or attn0 is None else getattr(attn0, "scaling", None)  # SDPA's default: head_dim^-0.5
    spec = AttentionSpec(batch, seq, config.num_attention_heads, config.num_key_value_heads, head_dim,
                         dropout=config.attention_dropout if self.training else 0.0, mask=additive(mask, dtype),
                         scale=None if scaling is None or scaling == head_dim ** -0.5 else float(scaling),
                         half_split_dim=None if fused else families.half_split_dim(family, rotary_dim, head_dim),
                         softcap=families.softcap(config, family.attention_softcap))
    # a tuple, not a slice of the ModuleList: that would be a new ModuleList, whose modules register again
    layers = tuple(self.model.layers)[: config.num_hidden_layers]
    if compile_ahead.tracing():  # a layer of each structure launches every kernel the others of it would
        layers = compile_ahead.one_of_each(layers, lambda layer: _sliding_window(self, layer))
    # FSDP units on the decoder layers or the final norm (accelerate's placement; _check_hooks refuses other hooks
    # there): each layer reads only its own parameters, inside its own module call (codagen.models.layer_units)
    layer_aligned = any(_has_hooks(module) for module in (*layers, self.model.norm))

    layer_index = {id(layer): i for i, layer in enumerate(self.model.layers)}
    recipe = self.__dict__.get(_FP8_RECIPE)
    fp8 = recipe is not None
    if fp8 and dtype != torch.bfloat16:
        raise _refuse(f"fp8={recipe!r} with {dtype} compute (the FP8 GEMMs store bfloat16: run the model in "
                      f"torch.bfloat16, or under torch.autocast with dtype=torch.bfloat16)", self)

    def weights(layer):
        residual_scale = scales.residual[layer_index[id(layer)]]
        return _block_weights(layer, family, spec, _sliding_window(self, layer), residual_scale, qk_scale, rotary_dim,
                              layer_frequencies(layer), dtype, fp8)

    def fuse():
        return [weights(layer) for layer in layers]
    # adapters switch (set_adapter, disable_adapter) without touching a parameter: fused on every forward
    if layer_aligned:
        if cache is not None:
            raise _refuse("a KV cache (generate()) with FSDP units on the decoder layers or the final norm", self)
        if fused and layers[0].fused.parallel is not None:
            raise _refuse("FSDP units on the decoder layers or the final norm of a tensor-parallel model (FSDP "
                          "with tensor parallelism: codagen.models.sharding.fully_shard(model, mesh=...))", self)
        blocks = None  # each layer reads its own parameters inside its module call
    elif fused:
        blocks = None  # each fused block reads its own parameters inside its module call
    elif torch.is_grad_enabled() or adapters or (cache is None and torch.compiler.is_compiling()):
        # differentiable gathers, rebuilt every forward (traceable: no graph break); a copy kept by an
        # earlier forward without autograd is dropped. Under torch.compile only a KV-cache forward (a decode
        # step, where the gathers would cost as much as its GEMMs) reads the kept copy, at one graph break
        if not torch.compiler.is_compiling():  # the decode graphs read the kept copy: they go with it
            hf_cache.drop_inference_blocks(self)
            _drop_decode_graphs(self)
        blocks = fuse()
    else:
        blocks = hf_cache.inference_blocks(self, dtype, fuse, modules)
    # under tensor parallelism these are replicated DTensors (codagen.models.sharding.parallelize); layer-aligned,
    # the final norm's module call reads its weight. A logits multiplier (Granite's 1 / logits_scaling) is folded
    # into the final norm's weight, which only the head reads: rstd (x (g s)) W^T = s logits
    eps = families.norm_eps(self.model.norm)
    logits_softcap = families.softcap(config, family.logits_softcap)
    norm_weight = None if layer_aligned else _scaled(
        tensor_parallel.local(families.norm_weight(family, self.model.norm)).to(dtype), scales.logits)
    if layer_aligned or _has_hooks(self.lm_head):  # the head reads its weights inside the LM head's module call
        def head(h, normed, rstd, targets, reduction="mean"):
            return layer_units.head(self.lm_head, self.model.norm, h, normed, rstd, targets, reduction, scales.logits,
                                    family.norm_offset, logits_softcap)
    else:
        head_weight = tensor_parallel.local(self.lm_head.weight).to(dtype)

        def head(h, normed, rstd, targets, reduction="mean"):
            return lm_head(h, normed, rstd, norm_weight, head_weight, targets, reduction, logits_softcap)
    if cache is None:
        # model.gradient_checkpointing_enable() gives each layer its checkpoint function (torch.utils.checkpoint
        # with the kwargs it was given); the patched model checkpoints the regrouped block in that layer's place.
        checkpoints = [layer._gradient_checkpointing_func if getattr(layer, "gradient_checkpointing", False)
                       and self.training and torch.is_grad_enabled() else None for layer in layers]
        x = x.reshape(batch * seq, hidden).contiguous()
        if layer_aligned:
            h, normed, rstd = layer_units.decoder_stack(x, layers, self.model.norm, None if fused else weights, eps,
                                                        spec, positions, frequencies, checkpoints, scales.logits,
                                                        family.norm_offset)
        elif fused:
            h, normed, rstd = fused_layers.decoder_stack(x, layers, norm_weight, eps, spec, positions, frequencies,
                                                         checkpoints)
        else:
            h, normed, rstd = decoder_stack(x, blocks, norm_weight, eps, spec, positions, frequencies, checkpoints)
    else:
        masks = hf_cache.attention_masks(config, x, attention_mask, cache, position_ids.expand(batch, seq))
        h, normed, rstd = hf_cache.decoder_stack_with_cache(x.reshape(batch * seq, hidden).contiguous(), blocks,
                                                            norm_weight, eps, spec, positions, frequencies, cache,
                                                            masks)
    if not layer_aligned:  # the head recomputes its norm itself in the layer-aligned forward
        normed = head_normed(h, normed, norm_weight)

    loss = logits = None
    if labels is not None:  # as transformers: shift_labels alone give no loss; with labels they are the targets
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise _refuse("logits_to_keep together with labels", self)
        if shift_labels is None:  # tokens < n predict n; the last position has no target
            shift_labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        targets = shift_labels.reshape(-1).to(x.device).contiguous()
        if targets.shape[0] != batch * seq:
            raise ValueError(f"codagen.patch: labels must be [batch, seq] = {(batch, seq)}, got "
                             f"{tuple(shift_labels.shape)} shifted")
        reduction = "mean" if num_items_in_batch is None else "sum"
        if torch.is_grad_enabled():  # training: the fused cross-entropy, no logits stored
            loss = head(h, normed, rstd, targets, reduction)
        else:  # evaluation: the logits (what compute_metrics reads) and, as transformers, the fp32 loss from them
            index_range("target", targets, config.vocab_size, -100)  # as the fused loss checks them
            logits = head(h, normed, rstd, None)
            loss = nn.functional.cross_entropy(logits.float(), targets, ignore_index=-100, reduction=reduction)
            logits = logits.view(batch, seq, config.vocab_size)
        if num_items_in_batch is not None:
            loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                           else num_items_in_batch)
    else:
        if isinstance(logits_to_keep, int):  # the last logits_to_keep positions of each sequence (0: all)
            kept = seq if logits_to_keep == 0 else min(logits_to_keep, seq)
            if kept != seq:
                h, normed, rstd = (t.view(batch, seq, *t.shape[1:])[:, seq - kept:].reshape(batch * kept, *t.shape[1:])
                                   .contiguous() for t in (h, normed, rstd))
        else:
            keep = logits_to_keep.to(x.device)
            if keep.numel() != seq:  # the head's rows, gathered per sequence
                rows = (torch.arange(batch, device=x.device)[:, None] * seq + keep[None, :]).reshape(-1)
                h, normed, rstd = h[rows].contiguous(), normed[rows].contiguous(), rstd[rows].contiguous()
        logits = head(h, normed, rstd, None).view(batch, -1, config.vocab_size)
    output = hf_cache.output(loss, logits, cache)
    return output if return_dict is None or return_dict else output.to_tuple()
