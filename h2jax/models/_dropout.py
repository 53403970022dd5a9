"""Dropout whose masks are a pure function of (seed, step, microbatch, layer, site).

A pipelined step must draw the same masks as the sequential model it stands for, its
recompute must redraw the masks its forward drew, the B and W halves of a split backward
must see one mask, and a run resumed after a kill must continue with the masks the
uninterrupted run would have drawn. So no random state lives in the model: each
:class:`Dropout` holds its rate, the model's seed, its layer and its site (which dropout
of the layer) as static attributes, and takes the (step, microbatch) of the program being
traced from :func:`dropout_step`. Its key is::

    fold_in(fold_in(fold_in(fold_in(key(seed), step), microbatch), layer), site)

The runtime's stage programs (``h2jax.runtime.StageProgram``) and the sequential reference
(``h2jax.runtime.reference_loss_and_grads``) trace the model inside ``dropout_step``; the
(step, microbatch) pair is a traced uint32 [2] argument, so one compiled program serves
every step. Outside ``dropout_step`` (evaluation, ``h2jax align``, inference, a plain
``model(tokens, targets)``) a Dropout is the identity: the model is deterministic.

A user's own stageable model gets the same guarantees by using this Dropout (any layer
and site numbering that is unique within the model). NNX's stateful streams
(``nnx.Dropout(rate, rngs=rngs)`` holding an ``nnx.Rngs`` fork) carry their key and a call
counter in the model, which the pipeline cannot keep in step across stages and restarts;
the stage programs and the reference refuse them in one line naming the state.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

EMBED_LAYER = 0xFFFFFFFF
"""The layer number of dropout on the embedding output (blocks count from 0)."""

_STEP: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("h2jax_dropout_step", default=None)


@contextlib.contextmanager
def dropout_step(counter: jax.Array | None) -> Iterator[None]:
    """Within this context, :class:`Dropout` layers draw masks for ``counter`` = uint32
    [step, microbatch] (usually a traced argument); ``None``: deterministic (no dropout).
    Per thread: each stage's runner traces on its own thread."""
    token = _STEP.set(counter)
    try:
        yield
    finally:
        _STEP.reset(token)


def dropout_key(seed: int, layer: int, site: int) -> jax.Array | None:
    """The key of dropout ``site`` of ``layer`` for the (step, microbatch) of the enclosing
    :func:`dropout_step`, or None outside one (module docstring)."""
    counter = _STEP.get()
    if counter is None:
        return None
    counter = jnp.asarray(counter, jnp.uint32)
    key = jax.random.key(seed)
    for data in (counter[0], counter[1], jnp.uint32(layer), jnp.uint32(site)):
        key = jax.random.fold_in(key, data)
    return key


class Dropout(nnx.Dropout):
    """``nnx.Dropout`` with keys from :func:`dropout_key` instead of a stored stream; the
    backward recomputes the mask from the key, so dropout adds no activation memory.

    ``rate``: probability of zeroing an element (kept ones are scaled by 1 / (1 - rate)).
    ``seed``: the model's seed; ``layer``, ``site``: where in the model (unique pairs).
    Identity outside :func:`dropout_step`, at rate 0, or when ``deterministic`` is set
    (``model.eval()``)."""

    def __init__(self, rate: float, *, seed: int, layer: int, site: int):
        super().__init__(rate, rngs=None)
        self.seed, self.layer, self.site = int(seed), int(layer), int(site)

    def __call__(self, inputs: jax.Array, *, deterministic: bool | None = None, rngs=None) -> jax.Array:
        key = rngs if rngs is not None else dropout_key(self.seed, self.layer, self.site)
        if key is None:
            return inputs

        # the backward redraws the mask from the key instead of keeping it: left alone XLA keeps
        # 5 bytes per element (the bool mask and a float32 copy), measured; now it keeps nothing
        @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
        def drop(x: jax.Array, k: jax.Array) -> jax.Array:
            return super(Dropout, self).__call__(x, deterministic=deterministic, rngs=k)

        return drop(inputs, key)
