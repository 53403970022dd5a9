"""A user's own Flax NNX model in the stageable form (embed, blocks, head), for the gin tests:
a gin file selects it with ``experiment.model = @gin_user_model.MyModel``."""

from __future__ import annotations

import jax.numpy as jnp
import optax
from flax import nnx


class Embed(nnx.Module):
    def __init__(self, rngs, width):
        self.table = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (256, width)))

    def __call__(self, tokens):
        return self.table[...][tokens]


class Block(nnx.Module):
    def __init__(self, rngs, width):
        self.lin = nnx.Linear(width, width, use_bias=False, rngs=rngs)

    def __call__(self, h):
        return h + jnp.tanh(self.lin(h))


class Head(nnx.Module):
    def __init__(self, rngs, width):
        self.out = nnx.Linear(width, 256, use_bias=False, rngs=rngs)

    def __call__(self, h, targets):
        logits = self.out(h).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


class MyModel(nnx.Module):
    def __init__(self, rngs, width=48, n_blocks=4):
        self.width = width
        self.embed, self.head = Embed(rngs, width), Head(rngs, width)
        self.blocks = nnx.List([Block(rngs, width) for _ in range(n_blocks)])
