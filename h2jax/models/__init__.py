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
``nnx.split(module, nnx.Param)[1]``; pass the stage's degree (``tensor=t``) so that
grouped-query key/value weights are replicated where t does not divide their heads.
`tensor_divisible_dims(cfg)` lists the sizes a stage's tensor degree must divide.

`GPT` is the built-in model, of the LLaMA family: pre-norm RMSNorm, causal grouped-query
attention (`n_kv_heads`) with rotary positions (optionally scaled: `RopeScaling`), SwiGLU
MLP, lm_head untied or tied to the embedding, no biases; `build_model(cfg, seed=...)`
makes one. Its defaults (MHA, unscaled, untied, no dropout) are h2jax's small GPT.

Dropout: `Dropout` (an nnx.Dropout without a stored stream) draws its masks from the
(step, microbatch) that the runtime's programs set with `dropout_step` and the seed, layer
and site it holds, so a pipelined, recomputed or resumed step draws the masks of the
sequential model; outside `dropout_step` it is the identity. A stageable model may hold
only Params (no batch statistics, no stored RNG streams).

Packed documents: within `document_segments(segment_ids)` the built-in attention keeps each
token inside its own document (`current_segments()` gives a user's model the same ids).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from h2jax.models._config import GPTConfig, RopeScaling, tensor_divisible_dims  # pure Python: no JAX

# the rest needs Flax/JAX; loaded on first use so that configs validate without JAX
_LAZY = {
    "GPT": "h2jax.models._llama",
    "TENSOR": "h2jax.models._llama",
    "Block": "h2jax.models._llama",
    "Dropout": "h2jax.models._dropout",
    "dropout_step": "h2jax.models._dropout",
    "document_segments": "h2jax.models._segments",
    "current_segments": "h2jax.models._segments",
    "Embed": "h2jax.models._llama",
    "Head": "h2jax.models._llama",
    "build_model": "h2jax.models._llama",
    "SharedParam": "h2jax.models._stage",
    "StageModule": "h2jax.models._stage",
    "boundary_shapes": "h2jax.models._stage",
    "shared_parameters": "h2jax.models._stage",
    "check_stageable": "h2jax.models._stage",
    "check_calls": "h2jax.models._stage",
    "partition_specs": "h2jax.models._stage",
}

__all__ = sorted([*_LAZY, "GPTConfig", "RopeScaling", "tensor_divisible_dims"])

if TYPE_CHECKING:
    from h2jax.models._dropout import Dropout, dropout_step
    from h2jax.models._llama import GPT, TENSOR, Block, Embed, Head, build_model
    from h2jax.models._segments import current_segments, document_segments
    from h2jax.models._stage import (
        SharedParam,
        StageModule,
        boundary_shapes,
        check_calls,
        check_stageable,
        partition_specs,
        shared_parameters,
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'h2jax.models' has no attribute {name!r}")
