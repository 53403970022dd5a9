"""The sequential reference: one device, one ``jax.value_and_grad`` of the same loss.

The pipeline's loss of a step is the mean of its microbatch losses, and its gradient the
gradient of that mean; this computes both without any pipeline, for the equivalence tests
and for ``h2jax``'s own sanity checks. Given the ``step``, microbatch i runs inside
``dropout_step([step, i])``, so a model with dropout draws the masks the pipeline draws at
that step; without it the model runs deterministic (no dropout). Packed data's segment ids
keep each microbatch's attention inside its documents, as the stage programs do.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from h2jax.models import document_segments, dropout_step
from h2jax.runtime._stage import check_params_only


@functools.lru_cache(maxsize=16)
def _value_and_grad(graphdef: Any, dropout: bool, segmented: bool, weighted: bool) -> Any:
    """The jitted (loss, grads) of the mean microbatch loss of models of ``graphdef`` (``weighted``:
    the sum of each microbatch's loss times its share, h2jax.data.loss_weights).

    Tokens, targets and the (step, microbatch) counters are arguments, not constants of the
    program, so one compiled program serves every step of a model (and XLA's persistent
    cache, where one is set, every run of it). The microbatches run in a loop (``lax.map``),
    so the program holds one copy of the model whatever their number: unrolled, 8
    microbatches of a 4-layer test model took 10 s to compile, against 5 s."""

    def loss_fn(params, tokens, targets, counters, segments, weights):
        m = nnx.merge(graphdef, params)

        def one(xs):
            tok, tgt, counter, seg = xs
            with dropout_step(counter if dropout else None), document_segments(seg if segmented else None):
                return m(tok, tgt)

        losses = jax.lax.map(one, (tokens, targets, counters, segments))
        return jnp.sum(losses * weights) if weighted else jnp.mean(losses)

    return jax.jit(jax.value_and_grad(loss_fn))


def reference_loss_and_grads(
    model: nnx.Module,
    tokens: np.ndarray,
    targets: np.ndarray,
    *,
    device: Any = None,
    step: int | None = None,
    segments: np.ndarray | None = None,
) -> tuple[float, Any]:
    """(the step's loss, gradient pytree) on one device; tokens/targets are [M, b, s]. The loss
    is the mean microbatch loss, or where some target is padding (negative) the mean over the
    real targets (h2jax.data.loss_weights). ``step``: the training step whose dropout masks to
    draw (None: no dropout); ``segments``: the inputs' document segment ids [M, b, s] of packed
    data (None: causal attention)."""
    from h2jax.data import loss_weights

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    check_params_only(rest, "the model")
    device = device or jax.devices("cpu")[0]
    num = np.shape(tokens)[0]
    counters = np.stack([np.full(num, 0 if step is None else step), np.arange(num)], axis=1).astype(np.uint32)
    segs = np.zeros(np.shape(tokens), np.int32) if segments is None else np.asarray(segments, np.int32)
    w = loss_weights(np.asarray(targets))
    weights = np.zeros(num, np.float32) if w is None else w
    args = jax.device_put((params, jnp.asarray(tokens), jnp.asarray(targets), counters, segs, weights), device)
    loss, grads = _value_and_grad(graphdef, step is not None, segments is not None, w is not None)(*args)
    return float(loss), grads
