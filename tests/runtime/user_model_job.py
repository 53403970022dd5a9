"""The README's own-model example as a job script: ``python user_model_job.py OUT [key=value ...]``,
alone or under ``mpirun -np 2``. Every process writes what ``h2jax.train`` gave it back:
``OUT/rank<r>.npz`` (the returned model's parameters by path) and ``OUT/rank<r>.json`` (losses)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import h2jax
from h2jax.runtime import flatten

WIDTH = 48


class Embed(nnx.Module):
    def __init__(self, rngs):
        self.table = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (256, WIDTH)))

    def __call__(self, tokens):
        return self.table[...][tokens]


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)

    def __call__(self, h):
        return h + jnp.tanh(self.lin(h))


class Head(nnx.Module):
    def __init__(self, rngs):
        self.out = nnx.Linear(WIDTH, 256, use_bias=False, rngs=rngs)

    def __call__(self, h, targets):
        logits = self.out(h).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


class MyModel(nnx.Module):
    def __init__(self, rngs):
        self.embed, self.head = Embed(rngs), Head(rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(4)])


def main() -> None:
    out = Path(sys.argv[1])
    cfg = h2jax.load_config(
        None,
        [
            "model.n_layers=4",
            "model.seq_len=32",
            "train.steps=4",
            "train.progress=false",
            "train.tensorboard=false",
            "plan.stages.0.layers=[0,3]",
            "plan.stages.1.layers=[3,4]",
            *sys.argv[2:],
        ],
    )
    h2jax.setup_backends(cfg)
    result = h2jax.train(cfg, model=MyModel(nnx.Rngs(0)), run_dir=out / "run")
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    params = {k: np.asarray(v) for k, v in flatten(nnx.state(result.model, nnx.Param)).items()}
    np.savez(out / f"rank{rank}.npz", **params)
    (out / f"rank{rank}.json").write_text(json.dumps({"losses": [h.loss for h in result.history]}))


if __name__ == "__main__":
    main()
