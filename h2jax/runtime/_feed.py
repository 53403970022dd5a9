"""The job's data on one process: the training stream and its position, the validation
stream, and their arrays on the stages' meshes.

The position of a ``data.sources`` run is the count of sequences consumed
(h2jax.data._sequences): the count at the checkpoint the run continues from, plus the global
batch of every step since. Tokens go to the first stage's mesh, targets to the last's, and
packed data's segment ids to every stage's (each stage's attention reads them), and padded
data's loss shares of the microbatches to the last stage's (h2jax.data.loss_weights).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from h2jax.data import load_data, loss_weights, microbatch_split, split_rows, step_batch, step_segments
from h2jax.runtime._procgroup import global_array


class DataFeed:
    """What an experiment ``cfg`` reads, on this process (module docstring)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.dataset = load_data(cfg)
        self.base = (0, 0)  # (a step, the sequences consumed before it): a restore moves it
        self.wait_s = 0.0  # seconds the last step waited for its batch
        self._val: Any = None  # the validation stream, opened by the first evaluation

    def position(self, step: int) -> int:
        """Sequences consumed before ``step``."""
        base_step, base = self.base
        return base + (step - base_step) * self.cfg.plan.global_batch

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        return step_batch(self.dataset, self.cfg, step, position=self.position(step))

    def segments(self, step: int) -> np.ndarray | None:
        """The document segment ids of ``step``'s inputs (packed data), else None."""
        return step_segments(self.dataset, self.cfg, step, position=self.position(step))

    def validation(self) -> Any:
        """The validation stream (h2jax.data.load_validation), opened on first use."""
        if self._val is None:
            from h2jax.data import load_validation

            self._val = load_validation(self.cfg)
        return self._val

    def validation_batch(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(tokens, targets, segment ids or None: unpacked) of validation batch ``i``, each
        [microbatches, microbatch, seq]."""
        p = self.cfg.plan
        val = self.validation()
        got = val.batch(i * p.global_batch, p.global_batch)
        shape = (*microbatch_split(p), -1)
        tokens, targets = split_rows(got.tokens.reshape(shape))
        return tokens, targets, got.segments[:, :-1].reshape(shape) if val.packing else None

    def metrics(self, step: int) -> dict[str, Any]:
        """A metrics row's data keys: where the step's sequences start, and their epoch."""
        if not self.cfg.data.sources:
            return {}
        pos = self.position(step)
        return {"data_position": pos, "epoch": self.dataset.epoch(pos)}

    def summary(self, step: int) -> dict[str, Any]:
        """summary.json's ``data`` at ``step`` steps trained."""
        if not self.cfg.data.sources:
            return {}
        pos = self.position(step)
        d = self.cfg.data
        return {
            "sources": dict(d.sources),
            "packing": d.packing,
            "sequences_consumed": pos,
            "epochs": self.dataset.epoch(pos),
        }


def place_ends(stages: list[Any], tokens: Any, targets: Any) -> tuple[list[Any] | None, list[Any] | None]:
    """Each microbatch's tokens on the first stage's mesh and targets on the last's (None where
    this process holds neither)."""
    first = next((st for st in stages if st.first), None)
    last = next((st for st in stages if st.last), None)
    return (
        [global_array(t, first.act_sharding) for t in tokens] if first is not None else None,
        [global_array(t, last.act_sharding) for t in targets] if last is not None else None,
    )


def place_weights(stages: list[Any], targets: np.ndarray | None) -> list[Any] | None:
    """The microbatches' loss shares (h2jax.data.loss_weights of ``targets``) on the last
    stage's mesh, where this process holds it and some target is padding; else None."""
    last = next((st for st in stages if st.last), None)
    w = None if last is None or targets is None else loss_weights(targets)
    return None if w is None else [global_array(np.float32(x), last.scalar_sharding) for x in w]


def step_loss(losses: list[Any], weights: list[Any] | None) -> Any:
    """The step's loss from its microbatch losses: their mean, or with loss shares their
    weighted sum (the mean over the step's real targets)."""
    if weights is None:
        return jnp.mean(jnp.stack(losses))
    return jnp.sum(jnp.stack(losses) * jnp.stack(weights))


def place_segments(runners: list[Any], rows: np.ndarray | None) -> dict[int, list[Any]] | None:
    """Segment ids [microbatches, microbatch, seq] on every local stage's mesh, by stage; None for None."""
    if rows is None:
        return None
    return {r.stage_idx: [global_array(x, r.program.act_sharding) for x in rows] for r in runners}
