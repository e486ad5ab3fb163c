"""torchtitan config registry of the converted Llama 3: ``--module codagen.integrations.torchtitan --config NAME``
runs torchtitan's ``llama3`` config ``NAME`` with codagen's blocks (the command-line flags apply on top)."""
from __future__ import annotations

import dataclasses

from torchtitan.models.llama3 import config_registry as llama3_config_registry
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.trainer import Trainer

from .model import convert_config

__all__ = ["codagen_trainer_config", "llama3_8b", "llama3_70b", "llama3_debugmodel", "llama3_debugmodel_ce_loss"]


def codagen_trainer_config(config: Trainer.Config) -> Trainer.Config:
    """``config`` (a torchtitan Llama 3 ``Trainer.Config``) with the model converted and the
    ``partial_dtensor`` SPMD backend the converted model runs under."""
    spec = config.model_spec
    if spec is None or not isinstance(spec.model, Llama3Model.Config):
        raise TypeError("codagen_trainer_config: config.model_spec must hold a torchtitan Llama3Model.Config")
    config.model_spec = dataclasses.replace(spec, model=convert_config(spec.model))
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


def llama3_debugmodel() -> Trainer.Config:
    return codagen_trainer_config(llama3_config_registry.llama3_debugmodel())


def llama3_debugmodel_ce_loss() -> Trainer.Config:
    return codagen_trainer_config(llama3_config_registry.llama3_debugmodel_ce_loss())


def llama3_8b() -> Trainer.Config:
    return codagen_trainer_config(llama3_config_registry.llama3_8b())


def llama3_70b() -> Trainer.Config:
    return codagen_trainer_config(llama3_config_registry.llama3_70b())
