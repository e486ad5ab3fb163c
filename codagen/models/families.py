"""Decoder families as specs: how a ``transformers`` family's modules map onto the fused decoder.

Every family :func:`codagen.patch` takes is a pre-norm decoder whose blocks the fused programs compute
(``codagen.models.llama``). What separates one family from another is declared in its :class:`Family`:

- where the projections live: ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``, or one fused
  ``qkv_proj`` (rows ``[q; k; v]``) and ``gate_up_proj`` (rows ``[gate; up]``), as Phi-3 stores them;
- the norms: which modules normalize before attention and before the MLP, which (if any) normalize the attention's
  and the MLP's outputs before their residual adds (Gemma's sandwich norms), and the norm's form, ``x (offset + w)``
  (Gemma's offset is 1);
- the MLP's activation attribute (``act_fn``, Phi-3's ``activation_fn``), SiLU or GELU-tanh by its module;
- multipliers (Granite): the embeddings times ``model.model.<embedding_multiplier>``, both residual branches
  times ``layer.<residual_multiplier>``, the logits divided by ``config.<logits_divisor>``; the attention's own
  ``scaling`` is SDPA's scale in every family;
- layers without RoPE (SmolLM3): ``self_attn.<rope_flag>`` false; RoPE frequencies per layer type (Gemma 3's local
  and global bases): the rotary module's ``<layer_type>_inv_freq``; RoPE on interleaved pairs ``(2i, 2i + 1)``
  (GLM) rather than half-split ones ``(i, i + d/2)``;
- tanh soft-caps on the attention logits and the final logits (Gemma 2), by config field;
- config fields the fused decoder does not compute, refused unless unset;
- dropout on the residual branches (Phi-3): the layer's ``nn.Dropout`` modules, refused when they drop.

Everything else is read from the module tree, the same way for every family: Q/K/V and O biases, QK-norm per head
(``q_norm``/``k_norm`` modules), sliding windows, tied embeddings, eps, head counts and sizes.

How each declared feature runs (exact in real arithmetic; the tests hold them to the unpatched model):

- fused HF projections: row slices of the one weight (views), gathered into the fused layouts per forward;
  a LoRA adapter on the fused projection becomes the slices of its ``B``;
- multipliers: the residual multiplier is folded into the O and down projection weights (and the O bias)
  when the fused weights are built (``x + m (a W^T) = x + a (m W)^T``); the logits divisor into the final norm's
  weight (``rstd (x (g / s)) W^T = logits / s``); the embedding multiplier is one elementwise product, as in
  ``transformers``; the attention scale is SDPA's ``scale``;
- a layer without RoPE rotates its Q/K pairs by the angle 0 (``cos 0 = 1``, ``sin 0 = 0``: the identity), and so
  do the channels a partial rotary embedding leaves alone; the fused QKV weight's Q/K rows are permuted to adjacent
  pairs over the rotated channels only (none for interleaved RoPE), and the KV cache gets HF's order back;
- ``x (1 + w)`` norms: the weight ``1 + w`` enters where ``w`` does (a vector per norm);
- no norm before attention and the MLP (OLMo 2 and 3, whose norms come after both): the QKV and gate/up GEMMs read
  the residual stream as it is (:func:`codagen.ops.qkv_norm_rope`, :func:`codagen.ops.gate_up_swiglu`);
- QK-norm over the whole Q and K projections (OLMo 2 and 3): the QKV GEMM, then one row kernel that normalizes and
  rotates them (a projection's norm needs its whole row);
- a norm of a GEMM's output before its residual add: that GEMM, then one row kernel
  (:func:`codagen.ops.linear_post_norm_residual_rms`), the norm needing the whole row;
- GELU-tanh: the gate/up epilogue's GeGLU in place of SwiGLU;
- an attention soft-cap: attention as transformers' eager attention computes it (SDPA has no soft-cap); a final
  logit soft-cap: in the LM head's cross-entropy epilogue.

Adding a family whose features are among these is one :class:`Family` in :data:`FAMILIES` and one tiny config in
the shared model tests (``tests/models/test_families.py``). :data:`NOT_SUPPORTED_YET` names the families asked for
whose blocks need a primitive the fused decoder lacks; ``patch`` refuses them naming it.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

__all__ = ["Family", "FAMILIES", "NOT_SUPPORTED_YET", "family_of", "Scales", "scales", "qkv_projections",
           "gate_up_projections", "lora_slots", "uses_rope", "residual_dropout", "ROPE_FROM_POSITIONS",
           "rope_from_positions", "norm_eps", "norm_weight", "norms", "activation_of", "inv_freq",
           "attention_scaling", "rope_types", "half_split_dim", "softcap"]


@dataclasses.dataclass(frozen=True)
class Family:
    """One ``transformers`` decoder family, as the fused decoder reads it (the module docstring)."""
    name: str
    model_classes: tuple[str, ...]  # its ...ForCausalLM classes (subclasses are accepted too)
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # one name: HF's fused [q; k; v] projection
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # one name: HF's fused [gate; up] projection
    act_fn: str = "act_fn"  # the MLP's activation module
    attn_norm: str | None = "input_layernorm"  # the norm before attention (None: none, OLMo 2)
    mlp_norm: str | None = "post_attention_layernorm"  # the norm before the MLP (None: none, OLMo 2)
    post_attn_norm: str | None = None  # a norm of the attention block's output before its residual add
    post_mlp_norm: str | None = None  # a norm of the MLP's output before its residual add
    norm_offset: float = 0.0  # the norms multiply by (norm_offset + weight)
    rope_per_layer_type: bool = False  # the rotary module holds <layer_type>_inv_freq per self_attn.layer_type
    rope_interleaved: bool = False  # RoPE rotates channel pairs (2i, 2i + 1) (GLM), not half-split (i, i + d/2)
    unset_config: tuple[str, ...] = ()  # config fields the fused decoder does not compute: None or False only
    attention_softcap: str | None = None  # config field of a tanh soft-cap on the attention logits (Gemma 2)
    logits_softcap: str | None = None  # config field of a tanh soft-cap on the final logits (Gemma 2)
    embedding_multiplier: str | None = None  # attribute of model.model multiplying the embeddings
    residual_multiplier: str | None = None  # attribute of each decoder layer multiplying both residual branches
    logits_divisor: str | None = None  # config field dividing the logits
    rope_flag: str | None = None  # attribute of self_attn: false on a layer without RoPE
    residual_dropout: tuple[str, ...] = ()  # nn.Dropout modules of each decoder layer on its residual branches
    qk_norm_over_projection: bool = False  # q_norm/k_norm normalize the whole Q and K projections (OLMo 2), not heads
    layer_type_attr: str = "layer_type"  # self_attn's attribute naming its layer type (rope_per_layer_type)

    @property
    def llama_layout(self) -> bool:
        """Llama's module tree and arithmetic (what the sharded paths, which read the modules directly, take)."""
        plain = Family("llama", ())
        return all(getattr(self, field.name) == getattr(plain, field.name) for field in dataclasses.fields(self)
                   if field.name not in ("name", "model_classes"))


FAMILIES = {family.name: family for family in (
    Family("llama", ("LlamaForCausalLM",)),
    Family("mistral", ("MistralForCausalLM",)),
    Family("qwen2", ("Qwen2ForCausalLM",)),
    Family("qwen3", ("Qwen3ForCausalLM",)),
    Family("phi3", ("Phi3ForCausalLM",), qkv=("qkv_proj",), gate_up=("gate_up_proj",), act_fn="activation_fn",
           residual_dropout=("resid_attn_dropout", "resid_mlp_dropout")),
    Family("granite", ("GraniteForCausalLM",), embedding_multiplier="embedding_multiplier",
           residual_multiplier="residual_multiplier", logits_divisor="logits_scaling"),
    Family("smollm3", ("SmolLM3ForCausalLM",), rope_flag="use_rope"),
    Family("glm", ("GlmForCausalLM",), gate_up=("gate_up_proj",), act_fn="activation_fn", rope_interleaved=True),
    Family("glm4", ("Glm4ForCausalLM",), gate_up=("gate_up_proj",), act_fn="activation_fn", rope_interleaved=True,
           post_attn_norm="post_self_attn_layernorm", post_mlp_norm="post_mlp_layernorm"),
    Family("gemma2", ("Gemma2ForCausalLM",), mlp_norm="pre_feedforward_layernorm",
           post_attn_norm="post_attention_layernorm", post_mlp_norm="post_feedforward_layernorm", norm_offset=1.0,
           attention_softcap="attn_logit_softcapping", logits_softcap="final_logit_softcapping",
           unset_config=("use_bidirectional_attention",)),
    Family("gemma3", ("Gemma3ForCausalLM",), mlp_norm="pre_feedforward_layernorm",
           post_attn_norm="post_attention_layernorm", post_mlp_norm="post_feedforward_layernorm", norm_offset=1.0,
           rope_per_layer_type=True,
           unset_config=("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention")),
    Family("olmo2", ("Olmo2ForCausalLM",), attn_norm=None, mlp_norm=None, post_attn_norm="post_attention_layernorm",
           post_mlp_norm="post_feedforward_layernorm", qk_norm_over_projection=True),
    Family("olmo3", ("Olmo3ForCausalLM",), attn_norm=None, mlp_norm=None, post_attn_norm="post_attention_layernorm",
           post_mlp_norm="post_feedforward_layernorm", qk_norm_over_projection=True, rope_per_layer_type=True,
           layer_type_attr="attention_type"),
)}

#: families asked for whose blocks need what the fused decoder does not compute yet (refused naming it)
NOT_SUPPORTED_YET = {name: "mixture-of-experts MLPs (grouped GEMMs)" for name in (
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")}


def family_of(model: nn.Module) -> Family:
    """The :class:`Family` of a ``...ForCausalLM`` (or of a subclass); ``TypeError`` naming the supported ones."""
    model_class = type(model)
    family = _FAMILY_OF_CLASS.get(model_class)
    if family is None:
        family = _FAMILY_OF_CLASS[model_class] = _find_family(model_class)
    return family


#: the families found so far, by model class (a plain dict: torch.compile traces a lookup in it without a warning)
_FAMILY_OF_CLASS: dict[type, Family] = {}


def _find_family(model_class: type) -> Family:
    for cls in model_class.__mro__:
        for family in FAMILIES.values():
            if cls.__name__ in family.model_classes:
                return family
    supported = tuple(name for family in FAMILIES.values() for name in family.model_classes)
    name = model_class.__name__
    missing = next((why for cls in model_class.__mro__ if (why := NOT_SUPPORTED_YET.get(cls.__name__))), None)
    detail = f"; {name} needs {missing}, which the fused decoder does not compute yet" if missing else ""
    raise TypeError(f"codagen.patch: model must be one of {supported} (or a subclass), got {name}{detail}")


@dataclasses.dataclass(frozen=True)
class Scales:
    """A model's multipliers (1.0: none): the embeddings', each layer's residual branches', the logits'."""
    embedding: float = 1.0
    residual: tuple[float, ...] = ()  # per decoder layer
    logits: float = 1.0  # the logits are multiplied by this (1 / Granite's logits_scaling)


def _number(owner: object, field: str, where: str) -> float:
    value = getattr(owner, field, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
        raise ValueError(f"codagen.patch: {where}.{field} must be a finite nonzero number, got {value!r}")
    return float(value)


def scales(family: Family, model: nn.Module) -> Scales:
    """``model``'s :class:`Scales`, read from where ``family`` declares them (``ValueError`` naming a bad field)."""
    layers = model.model.layers
    embedding = (1.0 if family.embedding_multiplier is None
                 else _number(model.model, family.embedding_multiplier, "model.model"))
    residual = tuple(1.0 if family.residual_multiplier is None
                     else _number(layer, family.residual_multiplier, f"model.model.layers[{i}]")
                     for i, layer in enumerate(layers))
    logits = 1.0 if family.logits_divisor is None else 1.0 / _number(model.config, family.logits_divisor, "config")
    return Scales(embedding, residual, logits)


def qkv_projections(family: Family, attn: nn.Module, q_rows: int, kv_rows: int) -> tuple:
    """``(q, k, v)`` weights and ``(q, k, v)`` biases (``None`` each where absent) of one attention module, in HF's
    layout; the row slices of a fused ``qkv_proj`` are views of its weight (gradients land on it)."""
    if len(family.qkv) == 3:
        modules = [getattr(attn, name) for name in family.qkv]
        return tuple(m.weight for m in modules), tuple(m.bias for m in modules)
    fused = getattr(attn, family.qkv[0])
    sizes = (q_rows, kv_rows, kv_rows)
    return (tuple(fused.weight.split(sizes, dim=0)),
            (None, None, None) if fused.bias is None else tuple(fused.bias.split(sizes, dim=0)))


def gate_up_projections(family: Family, mlp: nn.Module) -> tuple:
    """``(gate, up)`` weights and ``(gate, up)`` biases of one MLP, in HF's layout (a fused ``gate_up_proj``'s two
    halves as views)."""
    if len(family.gate_up) == 2:
        modules = [getattr(mlp, name) for name in family.gate_up]
        return tuple(m.weight for m in modules), tuple(m.bias for m in modules)
    fused = getattr(mlp, family.gate_up[0])
    return tuple(fused.weight.chunk(2, dim=0)), (None, None) if fused.bias is None else tuple(fused.bias.chunk(2))


def lora_slots(family: Family) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The projections a LoRA adapter may wrap: (submodule of the decoder layer, projection names)."""
    return (("self_attn", (*family.qkv, "o_proj")), ("mlp", (*family.gate_up, "down_proj")))


#: RoPE types whose rotary module picks inv_freq per forward from the largest position (its own update, a host
#: decision): their decode steps run eagerly, not from captured graphs
ROPE_FROM_POSITIONS = ("dynamic", "longrope")


def rope_from_positions(model: nn.Module) -> bool:
    """Whether ``model``'s RoPE frequencies depend on the positions of the call (:data:`ROPE_FROM_POSITIONS`)."""
    return any(rope_type in ROPE_FROM_POSITIONS for rope_type in rope_types(model))


def uses_rope(family: Family, layer: nn.Module) -> bool:
    """Whether ``layer`` rotates its queries and keys (false on SmolLM3's NoPE layers)."""
    return True if family.rope_flag is None else bool(getattr(layer.self_attn, family.rope_flag))


def residual_dropout(family: Family, layer: nn.Module) -> list[str]:
    """The names of the layer's modules on its residual branches that are not the identity in its present mode
    (a dropout that drops, or another module)."""
    return [name for name in family.residual_dropout
            if not isinstance(m := getattr(layer, name), nn.Dropout) or (m.p > 0 and m.training)]



def norm_eps(norm: nn.Module) -> float | None:
    """An RMSNorm module's eps (``variance_epsilon`` in most families, ``eps`` in Gemma's)."""
    eps = norm.__dict__.get("variance_epsilon", norm.__dict__.get("eps"))
    return None if eps is None else float(eps)


def norm_weight(family: Family, norm: nn.Module) -> torch.Tensor:
    """What the norm multiplies by: its weight, or ``norm_offset + weight`` (differentiable)."""
    return norm.weight if family.norm_offset == 0.0 else norm.weight + family.norm_offset


def norms(family: Family, layer: nn.Module) -> dict[str, nn.Module | None]:
    """The decoder layer's norm modules by role: ``attn``, ``mlp`` (before each), ``post_attn``, ``post_mlp``."""
    roles = {"attn": family.attn_norm, "mlp": family.mlp_norm, "post_attn": family.post_attn_norm,
             "post_mlp": family.post_mlp_norm}
    return {role: None if name is None else getattr(layer, name) for role, name in roles.items()}


#: the MLP activation modules the gate/up epilogue computes, by class name (transformers.activations and torch.nn)
_ACTIVATIONS = {("torch.nn.modules.activation", "SiLU"): "silu",
                ("transformers.activations", "SiLUActivation"): "silu",
                ("transformers.activations", "GELUTanh"): "gelu_tanh",
                ("transformers.activations", "PytorchGELUTanh"): "gelu_tanh",
                ("transformers.activations", "NewGELUActivation"): "gelu_tanh"}


def activation_of(act_fn: nn.Module) -> str | None:
    """``"silu"`` or ``"gelu_tanh"`` for the activation modules the gate/up epilogue computes, else None."""
    kind = type(act_fn)
    if kind is nn.GELU:
        return "gelu_tanh" if act_fn.approximate == "tanh" else None
    return _ACTIVATIONS.get((kind.__module__, kind.__name__))


def inv_freq(family: Family, model: nn.Module, layer: nn.Module | None = None) -> torch.Tensor:
    """The RoPE inverse frequencies ``layer`` rotates by (its layer type's, for Gemma 3); the first layer's when
    ``layer`` is None."""
    rotary = model.model.rotary_emb
    if not family.rope_per_layer_type:
        return rotary.inv_freq
    layer = model.model.layers[0] if layer is None else layer
    return getattr(rotary, f"{getattr(layer.self_attn, family.layer_type_attr)}_inv_freq")


def attention_scaling(family: Family, model: nn.Module, layer: nn.Module | None = None) -> float:
    """What the rotary module multiplies cos and sin by (YaRN's and LongRoPE's attention factor; 1 otherwise)."""
    rotary = model.model.rotary_emb
    if not family.rope_per_layer_type:
        return getattr(rotary, "attention_scaling", 1.0)
    layer = model.model.layers[0] if layer is None else layer
    return getattr(rotary, f"{getattr(layer.self_attn, family.layer_type_attr)}_attention_scaling", 1.0)


def rope_types(model: nn.Module) -> tuple[str, ...]:
    """The rotary module's RoPE types (one per layer type for Gemma 3)."""
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    return tuple(sorted(set(rope_type.values()))) if isinstance(rope_type, dict) else (rope_type,)


def half_split_dim(family: Family, rotary_dim: int, head_dim: int) -> int | None:
    """The leading channels of each Q/K head in half-split RoPE order (:class:`codagen.models.llama.AttentionSpec`),
    for a rotary embedding of ``rotary_dim`` channels (twice its ``inv_freq``'s length): None where it rotates them
    all, ``rotary_dim`` for a partial one, 0 for interleaved RoPE."""
    if family.rope_interleaved:
        return 0
    return None if rotary_dim == head_dim else rotary_dim


def softcap(config, field: str | None) -> float | None:
    """A tanh soft-cap from ``config.<field>`` (None where the family has none or the config leaves it unset)."""
    cap = None if field is None else getattr(config, field, None)
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"codagen.patch: config.{field} must be a positive number or None, got {cap!r}")
    return float(cap)
