"""h2jax: train one language model across accelerators of different vendors at once.

``h2jax.train(h2jax.load_config("configs/x.yaml", ["plan.num_microbatches=16"]))`` trains
the experiment; ``h2jax.train(cfg, model=my_nnx_model)`` trains your own Flax NNX model
if it has the stageable form (see :mod:`h2jax.models`).
"""

from h2jax.config import ConfigError, ExperimentConfig, load_config
from h2jax.plan import Plan, StageSpec
from h2jax.runtime import Trainer, train

__all__ = ["ConfigError", "ExperimentConfig", "Plan", "StageSpec", "Trainer", "load_config", "train"]
__version__ = "0.1.0"
