"""The sequential reference: one device, one ``jax.value_and_grad`` of the same loss.

The pipeline's loss of a step is the mean of its microbatch losses, and its gradient the
gradient of that mean; this computes both without any pipeline, for the equivalence tests
and for ``h2jax``'s own sanity checks. Given the ``step``, microbatch i runs inside
``dropout_step([step, i])``, so a model with dropout draws the masks the pipeline draws at
that step; without it the model runs deterministic (no dropout).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from h2jax.models._dropout import dropout_step
from h2jax.runtime._stage import check_params_only


def reference_loss_and_grads(
    model: nnx.Module, tokens: np.ndarray, targets: np.ndarray, *, device: Any = None, step: int | None = None
) -> tuple[float, Any]:
    """(mean microbatch loss, gradient pytree) on one device; tokens/targets are [M, b, s].
    ``step``: the training step whose dropout masks to draw (None: no dropout)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    check_params_only(rest, "the model")
    device = device or jax.devices("cpu")[0]
    params = jax.device_put(params, device)

    def loss_fn(p):
        m = nnx.merge(graphdef, p)
        losses = []
        for i in range(tokens.shape[0]):
            with dropout_step(None if step is None else jnp.array([step, i], jnp.uint32)):
                losses.append(m(tokens[i], targets[i]))
        return jnp.mean(jnp.stack(losses))

    tok = jax.device_put(jnp.asarray(tokens), device)
    tgt = jax.device_put(jnp.asarray(targets), device)
    tokens, targets = tok, tgt
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    return float(loss), grads
