"""Layer 4: models on the fused ops.

- :class:`Llama` — a LLaMA decoder regrouped the CODA way, parameters in the fused layout;
  Hugging Face state dicts in and out (:meth:`Llama.from_hf_state_dict`, :meth:`Llama.to_hf_state_dict`).
- :class:`ReferenceLlama` — the same model in plain eager PyTorch (HF layout): oracle and baseline.
- :func:`patch` / :func:`unpatch` — run a ``transformers`` causal LM of a family in :mod:`.families` (Llama,
  Mistral, Qwen2, Qwen3, Phi-3, Granite, SmolLM3) on codagen kernels in place, and undo it (``transformers`` is
  imported only by a patched forward). Loaded on first use: :mod:`.hf` imports FSDP, DTensor and Dynamo, which
  ``import codagen`` leaves out.
- :func:`refresh_weights` — make a patched model's next forward read its parameters afresh, after in-place
  writes through ``param.data`` (which no version counter sees).
- :func:`keep_attention` — a ``torch.utils.checkpoint`` ``context_fn`` that keeps attention's outputs and
  recomputes the fused GEMMs of a checkpointed block.
"""
from .checkpoint import keep_attention
from .config import LlamaConfig
from .llama import Llama
from .reference import ReferenceLlama

__all__ = ["LlamaConfig", "Llama", "ReferenceLlama", "patch", "unpatch", "is_patched", "refresh_weights",
           "keep_attention"]

_HF_NAMES = ("patch", "unpatch", "is_patched", "refresh_weights")


def __getattr__(name: str):
    if name in _HF_NAMES:
        from . import hf
        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
