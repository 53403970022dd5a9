"""Flax NNX models in the stageable form, and how the runtime cuts them into stages.

The stageable protocol
----------------------
h2jax can train any `flax.nnx.Module` that has

- ``model.embed(tokens) -> h``: int32 tokens [batch, seq] to hidden states;
- ``model.blocks``: a sequence (e.g. ``nnx.List``) of blocks, each ``block(h) -> h`` with
  the same shape in and out; a block is the unit a stage's layer range counts;
- ``model.head(h, targets) -> loss``: a float32 scalar (mean over tokens).

The loss of the whole model is ``head(blocks[-1](...blocks[0](embed(tokens))), targets)``.
`check_stageable(model)` raises TypeError when a model lacks this form. The runtime
builds one `StageModule(model, layers=(start, stop), first=..., last=...)` per pipeline
stage; stages share the model's submodules, so their parameters partition the model's.

Tensor parallelism is declared on the parameters themselves with Flax NNX sharding
metadata (``nnx.Param(..., out_sharding=(None, "tensor"))``) over the stage mesh axis
"tensor"; `partition_specs(module)` returns the PartitionSpec of every Param, matching
``nnx.split(module, nnx.Param)[1]``. `tensor_divisible_dims(cfg)` lists the sizes a stage's
tensor degree must divide.

`GPT` is the built-in model: pre-norm RMSNorm, causal attention with rotary positions,
SwiGLU MLP, untied lm_head, no biases; `build_model(cfg, seed=...)` makes one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from h2jax.models._config import GPTConfig, tensor_divisible_dims  # pure Python: no JAX

# the rest needs Flax/JAX; loaded on first use so that configs validate without JAX
_LAZY = {
    "GPT": "h2jax.models._gpt",
    "TENSOR": "h2jax.models._gpt",
    "Block": "h2jax.models._gpt",
    "Embed": "h2jax.models._gpt",
    "Head": "h2jax.models._gpt",
    "build_model": "h2jax.models._gpt",
    "StageModule": "h2jax.models._stage",
    "check_stageable": "h2jax.models._stage",
    "partition_specs": "h2jax.models._stage",
}

__all__ = sorted([*_LAZY, "GPTConfig", "tensor_divisible_dims"])

if TYPE_CHECKING:
    from h2jax.models._gpt import GPT, TENSOR, Block, Embed, Head, build_model
    from h2jax.models._stage import StageModule, check_stageable, partition_specs


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'h2jax.models' has no attribute {name!r}")
