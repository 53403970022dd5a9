"""Typed experiment config: dataclass tree, YAML files, dotted overrides, validation.

``load_config(path, ["plan.num_microbatches=16"])`` (``path``: a YAML or a ``.gin`` file) returns a validated
:class:`ExperimentConfig` or raises :class:`ConfigError` naming the key, the value and
what was expected -- before any device is touched. It runs :func:`validate` (the config
against itself) and :func:`check_inputs` (against the files the run reads and writes).
"""

from h2jax.config._chips import resolve_chip
from h2jax.config._errors import ConfigError
from h2jax.config._gin import model_factory, read_gin
from h2jax.config._inputs import check_inputs, format_bytes, format_count
from h2jax.config._load import (
    check_launcher,
    config_to_dict,
    config_warnings,
    load_config,
    load_raw,
    save_config,
    validate,
)
from h2jax.config._schema import (
    CheckpointConfig,
    ChipSpec,
    ClusterConfig,
    CommConfig,
    DataConfig,
    ExperimentConfig,
    OptimizerConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "CommConfig",
    "ChipSpec",
    "ClusterConfig",
    "ConfigError",
    "check_inputs",
    "DataConfig",
    "ExperimentConfig",
    "OptimizerConfig",
    "TrainConfig",
    "config_to_dict",
    "format_bytes",
    "format_count",
    "load_config",
    "load_raw",
    "model_factory",
    "read_gin",
    "resolve_chip",
    "save_config",
    "validate",
    "check_launcher",
    "config_warnings",
]
