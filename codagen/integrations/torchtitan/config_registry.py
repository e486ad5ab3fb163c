"""torchtitan config registry of the converted models: ``--module codagen.integrations.torchtitan --config NAME``
runs torchtitan's ``llama3`` or ``qwen3`` config ``NAME`` with codagen's blocks (the command-line flags apply on
top)."""
from __future__ import annotations

import dataclasses

from torchtitan.models.llama3 import config_registry as llama3_config_registry
from torchtitan.models.qwen3 import config_registry as qwen3_config_registry
from torchtitan.trainer import Trainer

from .model import convert_config

__all__ = ["codagen_trainer_config", "llama3_8b", "llama3_8b_fp8", "llama3_70b", "llama3_debugmodel",
           "llama3_debugmodel_fp8", "llama3_debugmodel_ce_loss",
           "qwen3_0_6b", "qwen3_1_7b", "qwen3_14b", "qwen3_32b", "qwen3_debugmodel"]


def codagen_trainer_config(config: Trainer.Config, fp8: str | None = None) -> Trainer.Config:
    """``config`` (a torchtitan Llama 3 or dense Qwen3 ``Trainer.Config``) with the model converted
    (:func:`convert_config`, with ``fp8``) and the ``partial_dtensor`` SPMD backend the converted model runs under."""
    spec = config.model_spec
    if spec is None:
        raise TypeError("codagen_trainer_config: config.model_spec is None; expected a Llama 3 or Qwen3 model spec")
    config.model_spec = dataclasses.replace(spec, model=convert_config(spec.model, fp8))
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


def llama3_debugmodel() -> Trainer.Config:
    return codagen_trainer_config(llama3_config_registry.llama3_debugmodel())


def llama3_debugmodel_ce_loss() -> Trainer.Config:
    return codagen_trainer_config(llama3_config_registry.llama3_debugmodel_ce_loss())


def llama3_8b() -> Trainer.Config:
    return codagen_trainer_config(llama3_config_registry.llama3_8b())


def llama3_8b_fp8() -> Trainer.Config:
    """``llama3_8b`` with every block's GEMMs in FP8 (``fp8="blockwise"``)."""
    return codagen_trainer_config(llama3_config_registry.llama3_8b(), fp8="blockwise")


def llama3_debugmodel_fp8() -> Trainer.Config:
    return codagen_trainer_config(llama3_config_registry.llama3_debugmodel(), fp8="blockwise")


def llama3_70b() -> Trainer.Config:
    return codagen_trainer_config(llama3_config_registry.llama3_70b())


def qwen3_debugmodel() -> Trainer.Config:
    return codagen_trainer_config(qwen3_config_registry.qwen3_debugmodel())


def qwen3_0_6b() -> Trainer.Config:
    return codagen_trainer_config(qwen3_config_registry.qwen3_0_6b())


def qwen3_1_7b() -> Trainer.Config:
    return codagen_trainer_config(qwen3_config_registry.qwen3_1_7b())


def qwen3_14b() -> Trainer.Config:
    return codagen_trainer_config(qwen3_config_registry.qwen3_14b())


def qwen3_32b() -> Trainer.Config:
    return codagen_trainer_config(qwen3_config_registry.qwen3_32b())
