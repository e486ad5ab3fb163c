"""Layer 4: models on the fused ops.

- :class:`Llama` — a LLaMA decoder regrouped the CODA way, parameters in the fused layout;
  Hugging Face state dicts in and out (:meth:`Llama.from_hf_state_dict`, :meth:`Llama.to_hf_state_dict`).
- :class:`ReferenceLlama` — the same model in plain eager PyTorch (HF layout): oracle and baseline.
- :func:`patch` / :func:`unpatch` — run a ``transformers`` Llama / Mistral / Qwen2 / Qwen3 causal LM on codagen
  kernels in place, and undo it (``transformers`` is imported only by a patched forward).
- :func:`keep_attention` — a ``torch.utils.checkpoint`` ``context_fn`` that keeps attention's outputs and
  recomputes the fused GEMMs of a checkpointed block.
"""
from .checkpoint import keep_attention
from .config import LlamaConfig
from .hf import is_patched, patch, unpatch
from .llama import Llama
from .reference import ReferenceLlama

__all__ = ["LlamaConfig", "Llama", "ReferenceLlama", "patch", "unpatch", "is_patched", "keep_attention"]
