"""PEFT LoRA on patched models: the live adapter state of each projection, in the fused layouts.

``codagen.patch`` accepts a ``peft.PeftModel`` (it patches the ``...ForCausalLM`` inside and returns
the PeftModel) or a ``...ForCausalLM`` whose projections PEFT has wrapped, before or after patching.
Every forward reads the adapters afresh from the PEFT modules (``set_adapter``, ``disable_adapter()``,
``merge``/``unmerge`` and ``merge_and_unload`` take effect at the next forward): LoRA weights are tiny,
so rebuilding their fused layouts costs little. Each adapted projection's update ``scaling * B A``
enters its fused GEMM as a low-rank operand pair (:class:`codagen.ops.LowRank`), so the epilogues
(RMSNorm scaling, RoPE, QK-norm, SwiGLU, residual) still run on the full result.

Fused layouts, built with differentiable ops so the gradients land on the PEFT parameters:

- QKV: ``A = [A_q; A_k; A_v]`` (present adapters only) and ``B`` block-diagonal ``[N_qkv, r_q + r_k + r_v]``
  with each block scaled by its adapter's ``scaling`` and the Q/K rows in the pair order of the fused
  ``W_qkv`` (:func:`codagen.models.llama.fuse_qkv`);
- gate/up: ``A = [A_gate; A_up]``, ``B`` block-diagonal with rows interleaved like ``W_gate_up``;
- O and down: ``LowRank(A, B, scaling)`` as they are.

Refused (``NotImplementedError`` naming the feature and the module; at ``patch`` and at each forward, for
the state the model is in then), never ignored: DoRA and other
LoRA variants, ``lora_bias``, ``lora_dropout > 0`` in training mode (dropout applies to the adapter's
input, an activation-sized mask per projection; it is the identity in eval mode, which runs),
several active adapters on one module, mixed-batch ``adapter_names`` (forward hooks on LoRA layers),
``fan_in_fan_out``, LoRA on layers other than the seven projections (embeddings, LM head, norms) or
on non-``nn.Linear`` base layers, any other PEFT tuner type, ``modules_to_save`` and trainable-token
wrappers, and a PeftModel configured with ``bias != "none"`` or a non-LoRA ``peft_type``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from codagen import ops

from . import families

__all__ = ["unwrap_peft", "is_peft_module", "prepare_adapters", "qkv_low_rank", "gate_up_low_rank", "linear_low_rank",
           "Adapter"]



def _advice(patched: bool) -> str:
    """How to run the model with PEFT's own forward: ``codagen.unpatch`` once it is patched, else no patch."""
    return "call codagen.unpatch(model) to run it with PEFT" if patched else \
        "run the model without codagen.patch to use it with PEFT"


def _refuse(feature: str, patched: bool = False) -> NotImplementedError:
    return NotImplementedError(f"codagen.patch: {feature} is not supported by the fused kernels; merge the adapters "
                               f"(merge_and_unload) or {_advice(patched)}")


def is_peft_module(module: nn.Module) -> bool:
    """Whether ``module`` is one of PEFT's (FSDP2's wrapped class included)."""
    cls = type(module)
    if isinstance(module, FSDPModule):  # FSDP2's fully_shard swaps in FSDP<cls>(FSDPModule, cls), defined in torch
        cls = cls.__mro__[2]
    return cls.__module__.split(".")[0] == "peft"


def is_lora_linear(module: nn.Module) -> bool:
    """A PEFT LoRA layer (``peft.tuners.lora.Linear`` or a subclass), recognised without importing PEFT."""
    return is_peft_module(module) and hasattr(module, "lora_A") and hasattr(module, "base_layer")


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The ``...ForCausalLM`` inside a ``peft.PeftModel`` (checked against its LoRA configs), else ``model``."""
    if not (is_peft_module(model) and hasattr(model, "get_base_model") and hasattr(model, "peft_config")):
        return model
    for name, config in model.peft_config.items():
        peft_type = str(getattr(config, "peft_type", ""))
        if not peft_type.endswith("LORA") or peft_type.endswith("ADALORA"):
            raise _refuse(f"PEFT type {peft_type!r} (adapter {name!r}; only LoRA)")
        if getattr(config, "bias", "none") != "none":
            raise _refuse(f"bias={config.bias!r} (adapter {name!r})")
        if getattr(config, "modules_to_save", None):
            raise _refuse(f"modules_to_save={config.modules_to_save!r} (adapter {name!r})")
        if getattr(config, "trainable_token_indices", None):
            raise _refuse(f"trainable_token_indices (adapter {name!r})")
        if getattr(config, "use_dora", False):
            raise _refuse(f"DoRA (use_dora=True, adapter {name!r})")
        if getattr(config, "lora_bias", False):
            raise _refuse(f"lora_bias (adapter {name!r})")
    return model.get_base_model()


def prepare_adapters(model: nn.Module, modules: Sequence[tuple[str, nn.Module]] | None = None, *,
                     patched: bool = False) -> bool:
    """At patch time and before a forward reads any weight: refuse PEFT modules the fused decoder would bypass
    (any PEFT module other than a LoRA layer, with its own submodules, at one of the seven projections of a
    decoder layer) and LoRA layers it cannot compute in their present state (their training mode included);
    unmerge disabled merged layers, as PEFT's forward does. ``modules``: ``model.named_modules()`` when the
    caller has walked them already; ``patched``: whether ``model`` is patched (the refusals' advice).
    Returns whether the model holds LoRA layers."""
    modules = model.named_modules() if modules is None else modules
    peft_modules = [(path, module) for path, module in modules if is_peft_module(module)]
    if not peft_modules:
        return False
    slots = {id(getattr(getattr(layer, parent), name)) for layer in model.model.layers
             for parent, names in families.lora_slots(families.family_of(model)) for name in names}
    inside, lora_layers = (), False
    for path, module in peft_modules:
        if inside and path.startswith(inside):
            continue
        if id(module) in slots and is_lora_linear(module):
            inside, lora_layers = path + ".", True
            _check_lora_layer(module, path, patched)
            if module.disable_adapters and module.merged:
                module.unmerge()
            continue
        where = "at one of the projections" if id(module) in slots else "outside the projections"
        raise _refuse(f"the PEFT module {type(module).__name__} {where} ({path})", patched)
    return lora_layers


def _check_lora_layer(module: nn.Module, path: str, patched: bool) -> None:
    """What a LoRA layer holds that the fused GEMMs cannot compute: any adapter's kind, and the active adapter's
    state (several active ones, dropout in training mode)."""
    if module._forward_pre_hooks or module._forward_hooks:
        raise _refuse(f"forward hooks on a LoRA layer, e.g. mixed-batch adapter_names ({path})", patched)
    if type(module.base_layer) is not nn.Linear:
        raise _refuse(f"LoRA on a {type(module.base_layer).__name__} base layer ({path}; only nn.Linear)", patched)
    if getattr(module, "fan_in_fan_out", False):
        raise _refuse(f"fan_in_fan_out ({path})", patched)
    for name in module.lora_A:
        if getattr(module, "use_dora", {}).get(name, False) or name in getattr(module, "lora_variant", {}):
            raise _refuse(f"DoRA or another LoRA variant (adapter {name!r}, {path})", patched)
        if getattr(module, "lora_bias", {}).get(name, False) or getattr(module.lora_B[name], "bias", None) is not None:
            raise _refuse(f"lora_bias (adapter {name!r}, {path})", patched)
        lora_a, lora_b = module.lora_A[name], module.lora_B[name]
        if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear:
            raise _refuse(f"LoRA A/B modules of type {type(lora_a).__name__}/{type(lora_b).__name__} ({path})", patched)
        if not isinstance(module.lora_dropout[name], (nn.Dropout, nn.Identity)):
            raise _refuse(f"a lora_dropout module of type {type(module.lora_dropout[name]).__name__} ({path})", patched)
    if module.disable_adapters or module.merged:  # the base layer alone runs
        return
    names = [name for name in module.active_adapters if name in module.lora_A]
    if len(names) > 1:
        raise _refuse(f"several active adapters on one layer {names} ({path})", patched)
    dropout = module.lora_dropout[names[0]] if names else None
    if isinstance(dropout, nn.Dropout) and dropout.p > 0 and dropout.training:
        # the dropout mask of the adapter's input: an activation-sized mask per projection the fused GEMM lacks
        raise NotImplementedError(f"codagen.patch: lora_dropout={dropout.p} in training mode (adapter {names[0]!r}, "
                                  f"{path}) is not supported by the fused kernels; train with lora_dropout=0 or "
                                  f"{_advice(patched)}")


@dataclasses.dataclass(frozen=True)
class Adapter:
    """The active LoRA update of one projection: ``W + scale * b @ a``."""
    a: torch.Tensor  # lora_A.weight [r, in]
    b: torch.Tensor  # lora_B.weight [out, r]
    scale: float


def adapter(module: nn.Module) -> Adapter | None:
    """The LoRA update ``module`` applies in this forward (None for a plain Linear, disabled or merged
    adapters), read from the live PEFT state the way PEFT's own forward reads it; the layer passed
    :func:`prepare_adapters` at the start of the forward."""
    if not is_lora_linear(module) or module.disable_adapters or module.merged:  # merged: in the base weight
        return None
    names = [name for name in module.active_adapters if name in module.lora_A]
    if not names:
        return None
    name = names[0]  # one: checked by prepare_adapters
    return Adapter(module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name]))


def _adapters(parent: nn.Module, names: tuple[str, ...]) -> list[Adapter | None]:
    return [adapter(getattr(parent, name)) for name in names]


def _block_diagonal(adapters: list[Adapter | None], rows: list[int], dtype: torch.dtype):
    """``(A_cat [r_total, in], [B blocks])``: each present adapter's ``scale * B`` padded to ``r_total``
    columns at its offset; an absent one contributes zero rows of B and no rows of A."""
    ranks = [0 if ad is None else ad.a.shape[0] for ad in adapters]
    total = sum(ranks)
    a = torch.cat([ad.a.to(dtype) for ad in adapters if ad is not None], dim=0)
    blocks, offset = [], 0
    for ad, r, n in zip(adapters, ranks, rows):
        if ad is None:
            blocks.append(a.new_zeros(n, total))
        else:
            blocks.append(F.pad((ad.b * ad.scale).to(dtype), (offset, total - offset - r)))
        offset += r
    return a.contiguous(), blocks


def qkv_low_rank(attn: nn.Module, family: families.Family, head_dim: int, q_rows: int, kv_rows: int,
                 dtype: torch.dtype, qk_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 half_split_dim: int | None = None) -> ops.LowRank | None:
    """The LoRA updates of q/k/v_proj (or of one fused ``qkv_proj``, whose ``B`` rows are ``[q; k; v]``) as one
    low-rank pair of the fused QKV GEMM (module docstring); ``qk_rows`` maps the Q and K rows of ``B`` as the fused
    weight's are (a RoPE ``attention_scaling`` on the rotated channels); ``half_split_dim``: the Q/K rows' RoPE
    order, as the fused weight's (:func:`codagen.ops.rope_pairs_from_half_split`)."""
    adapters = _adapters(attn, family.qkv)
    if all(ad is None for ad in adapters):
        return None
    if len(adapters) == 1:  # one adapter over [q; k; v]: its B's row blocks
        (ad,) = adapters
        a, (b_q, b_k, b_v) = ad.a.to(dtype), (ad.b * ad.scale).to(dtype).split((q_rows, kv_rows, kv_rows))
    else:
        a, (b_q, b_k, b_v) = _block_diagonal(adapters, [q_rows, kv_rows, kv_rows], dtype)
    if qk_rows is not None:
        b_q, b_k = qk_rows(b_q), qk_rows(b_k)
    b = torch.cat((ops.rope_pairs_from_half_split(b_q, head_dim, half_split_dim),
                   ops.rope_pairs_from_half_split(b_k, head_dim, half_split_dim), b_v))
    return ops.LowRank(a.contiguous(), b.contiguous(), 1.0)


def gate_up_low_rank(mlp: nn.Module, family: families.Family, dtype: torch.dtype) -> ops.LowRank | None:
    """The LoRA updates of gate/up_proj (or of one fused ``gate_up_proj``, ``B`` rows ``[gate; up]``) as one
    low-rank pair of the fused gate/up GEMM (rows interleaved)."""
    adapters = _adapters(mlp, family.gate_up)
    if all(ad is None for ad in adapters):
        return None
    if len(adapters) == 1:
        (ad,) = adapters
        a, (b_gate, b_up) = ad.a.to(dtype), (ad.b * ad.scale).to(dtype).chunk(2)
    else:
        rows = [getattr(mlp, name).weight.shape[0] for name in family.gate_up]
        a, (b_gate, b_up) = _block_diagonal(adapters, rows, dtype)
    return ops.LowRank(a.contiguous(), ops.interleave_gate_up(b_gate, b_up), 1.0)


def linear_low_rank(module: nn.Module, dtype: torch.dtype) -> ops.LowRank | None:
    """The LoRA update of o_proj or down_proj (their GEMMs take it unchanged)."""
    ad = adapter(module)
    return None if ad is None else ops.LowRank(ad.a.to(dtype).contiguous(), ad.b.to(dtype).contiguous(), ad.scale)
