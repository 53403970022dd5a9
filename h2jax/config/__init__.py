"""Typed experiment config: dataclass tree, YAML files, dotted overrides, validation.

``load_config(path, ["plan.num_microbatches=16"])`` returns a validated
:class:`ExperimentConfig` or raises :class:`ConfigError` naming the key, the value and
what was expected -- before any device is touched.
"""

from h2jax.config._errors import ConfigError
from h2jax.config._load import config_to_dict, load_config, load_raw, save_config, validate
from h2jax.config._schema import (
    CheckpointConfig,
    ChipSpec,
    ClusterConfig,
    DataConfig,
    ExperimentConfig,
    OptimizerConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "ChipSpec",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "ExperimentConfig",
    "OptimizerConfig",
    "TrainConfig",
    "config_to_dict",
    "load_config",
    "load_raw",
    "save_config",
    "validate",
]
