"""h2jax: train one language model across accelerators of different vendors at once.

``h2jax.train(h2jax.load_config("configs/x.yaml", ["plan.num_microbatches=16"]))`` trains
the experiment; ``h2jax.train(cfg, model=my_nnx_model)`` trains your own Flax NNX model
if it has the stageable form (see :mod:`h2jax.models`).

The names below load lazily, so ``import h2jax.plan`` (pure Python) never pulls in JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ConfigError": "h2jax.config",
    "ExperimentConfig": "h2jax.config",
    "load_config": "h2jax.config",
    "Plan": "h2jax.plan",
    "StageSpec": "h2jax.plan",
    "Trainer": "h2jax.runtime",
    "setup_backends": "h2jax.runtime",
    "train": "h2jax.runtime",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from h2jax.config import ConfigError, ExperimentConfig, load_config
    from h2jax.plan import Plan, StageSpec
    from h2jax.runtime import Trainer, setup_backends, train


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'h2jax' has no attribute {name!r}")
