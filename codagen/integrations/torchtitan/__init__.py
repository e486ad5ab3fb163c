"""torchtitan (0.3) integration: its Llama 3 and dense Qwen3 with codagen's fused blocks (:mod:`.model`), and a
torchtitan config registry of the converted models (:mod:`.config_registry`,
``--module codagen.integrations.torchtitan``)."""
from .model import CodagenBlock, CodagenConverter, CodagenLlama3Model, CodagenQwen3Model, LayerNorms, convert_config

__all__ = ["CodagenBlock", "CodagenConverter", "CodagenLlama3Model", "CodagenQwen3Model", "LayerNorms",
           "convert_config"]
