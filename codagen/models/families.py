"""Decoder families as specs: how a ``transformers`` family's modules map onto the fused decoder.

Every family :func:`codagen.patch` takes is a pre-norm decoder whose blocks the fused programs compute
(``codagen.models.llama``). What separates one family from another is declared in its :class:`Family`:

- where the projections live: ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``, or one fused
  ``qkv_proj`` (rows ``[q; k; v]``) and ``gate_up_proj`` (rows ``[gate; up]``), as Phi-3 stores them;
- the MLP's activation attribute (``act_fn``, Phi-3's ``activation_fn``);
- multipliers (Granite): the embeddings times ``model.model.<embedding_multiplier>``, both residual branches
  times ``layer.<residual_multiplier>``, the logits divided by ``config.<logits_divisor>``; the attention's own
  ``scaling`` is SDPA's scale in every family;
- layers without RoPE (SmolLM3): ``self_attn.<rope_flag>`` false;
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
- a layer without RoPE rotates its Q/K pairs by the angle 0 (``cos 0 = 1``, ``sin 0 = 0``: the identity).

Adding a family whose features are among these is one :class:`Family` in :data:`FAMILIES` and one tiny config in
the shared model tests (``tests/models/test_families.py``). :data:`NOT_SUPPORTED_YET` names the families asked for
whose blocks need a primitive the fused decoder lacks; ``patch`` refuses them naming it.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from torch import nn

__all__ = ["Family", "FAMILIES", "NOT_SUPPORTED_YET", "family_of", "Scales", "scales", "qkv_projections",
           "gate_up_projections", "lora_slots", "uses_rope", "residual_dropout", "ROPE_FROM_POSITIONS",
           "rope_from_positions"]


@dataclasses.dataclass(frozen=True)
class Family:
    """One ``transformers`` decoder family, as the fused decoder reads it (the module docstring)."""
    name: str
    model_classes: tuple[str, ...]  # its ...ForCausalLM classes (subclasses are accepted too)
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # one name: HF's fused [q; k; v] projection
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # one name: HF's fused [gate; up] projection
    act_fn: str = "act_fn"  # the MLP's activation module
    embedding_multiplier: str | None = None  # attribute of model.model multiplying the embeddings
    residual_multiplier: str | None = None  # attribute of each decoder layer multiplying both residual branches
    logits_divisor: str | None = None  # config field dividing the logits
    rope_flag: str | None = None  # attribute of self_attn: false on a layer without RoPE
    residual_dropout: tuple[str, ...] = ()  # nn.Dropout modules of each decoder layer on its residual branches

    @property
    def llama_layout(self) -> bool:
        """Llama's module tree and arithmetic (what the sharded paths, which read the modules directly, take)."""
        return (self.qkv == Family.qkv and self.gate_up == Family.gate_up and self.act_fn == Family.act_fn
                and self.embedding_multiplier is self.residual_multiplier is self.logits_divisor is None
                and self.rope_flag is None and not self.residual_dropout)


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
)}

#: families asked for whose blocks need what the fused decoder does not compute yet (refused naming it)
NOT_SUPPORTED_YET = {
    "Gemma2ForCausalLM": "x (1 + w) RMSNorms, norms after attention and the MLP (sandwich norms), GELU-tanh "
                         "GeGLU, attention and final logit soft-caps",
    "Gemma3ForCausalLM": "x (1 + w) RMSNorms, sandwich norms, GELU-tanh GeGLU, local/global RoPE bases",
    "Olmo2ForCausalLM": "norms after attention and the MLP (post-norms), QK-norm over the whole projection",
    "Olmo3ForCausalLM": "post-norms, QK-norm over the whole projection",
    "Glm4ForCausalLM": "norms after attention and the MLP (sandwich norms), partial rotary embeddings",
    "GlmForCausalLM": "partial rotary embeddings",
}


def family_of(model: nn.Module) -> Family:
    """The :class:`Family` of a ``...ForCausalLM`` (or of a subclass); ``TypeError`` naming the supported ones."""
    return _family_of_class(type(model))


@functools.cache
def _family_of_class(model_class: type) -> Family:
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
    return getattr(model.model.rotary_emb, "rope_type", "default") in ROPE_FROM_POSITIONS


def uses_rope(family: Family, layer: nn.Module) -> bool:
    """Whether ``layer`` rotates its queries and keys (false on SmolLM3's NoPE layers)."""
    return True if family.rope_flag is None else bool(getattr(layer.self_attn, family.rope_flag))


def residual_dropout(family: Family, layer: nn.Module) -> list[str]:
    """The names of the layer's modules on its residual branches that are not the identity in its present mode
    (a dropout that drops, or another module)."""
    return [name for name in family.residual_dropout
            if not isinstance(m := getattr(layer, name), nn.Dropout) or (m.p > 0 and m.training)]

