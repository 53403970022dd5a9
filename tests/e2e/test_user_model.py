"""A user's own Flax NNX model in the stageable form trains through h2jax.train (the README example)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import optax
from flax import nnx

import h2jax


class Embed(nnx.Module):
    def __init__(self, rngs):
        self.table = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (256, 64)))

    def __call__(self, tokens):
        return self.table[...][tokens]


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(64, 64, use_bias=False, rngs=rngs)

    def __call__(self, h):
        return h + jnp.tanh(self.lin(h))


class Head(nnx.Module):
    def __init__(self, rngs):
        self.out = nnx.Linear(64, 256, use_bias=False, rngs=rngs)

    def __call__(self, h, targets):
        logits = self.out(h).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


class MyModel(nnx.Module):
    def __init__(self, rngs):
        self.embed, self.head = Embed(rngs), Head(rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(4)])


def test_readme_user_model_trains(tmp_path):
    cfg = h2jax.load_config(
        None,
        [
            "model.n_layers=4",
            "model.d_model=64",
            "model.seq_len=32",
            "train.steps=20",
            "train.progress=false",
            "train.tensorboard=false",
            "plan.stages.0.layers=[0,3]",
            "plan.stages.1.layers=[3,4]",
        ],
    )
    h2jax.setup_backends(cfg.cluster)
    history = h2jax.train(cfg, model=MyModel(nnx.Rngs(0)), run_dir=tmp_path)
    assert len(history) == 20
    assert all(math.isfinite(h.loss) for h in history)
    assert history[-1].loss < history[0].loss - 0.5, [h.loss for h in history]
    assert (tmp_path / "trace.json").is_file() and (tmp_path / "gantt.png").is_file()


def test_non_stageable_model_is_refused(tmp_path):
    import pytest

    class NoHead(nnx.Module):
        def __init__(self, rngs):
            self.embed = Embed(rngs)
            self.blocks = nnx.List([Block(rngs)])

    cfg = h2jax.load_config(None, ["train.progress=false"])
    with pytest.raises(TypeError, match="head"):
        h2jax.train(cfg, model=NoHead(nnx.Rngs(0)), run_dir=tmp_path)
