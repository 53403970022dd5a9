"""A stop asked while the trainer sets up (the first compiles run there) is kept for the first
step boundary. Python's own KeyboardInterrupt used to be raised inside JAX's gc callback there,
which swallowed it: the job went on to train every step."""

from __future__ import annotations

import os
import signal

from h2jax.config import load_config
from h2jax.models import build_model
from h2jax.runtime import Trainer
from tests._harness import QUIET, TINY


def test_a_ctrl_c_during_the_set_up_stops_at_the_first_boundary_and_saves(tmp_path):
    cfg = load_config(TINY, [*QUIET, "train.steps=5"])
    before = signal.getsignal(signal.SIGINT)

    def builder():  # called inside the set-up, before the stages are built and compiled
        os.kill(os.getpid(), signal.SIGINT)
        return build_model(cfg.model, seed=cfg.seed)

    trainer = Trainer(cfg, model=builder, run_dir=tmp_path / "run")
    try:
        trainer.resume()
        history = trainer.run()
    finally:
        trainer.close()
    assert trainer.preempted == "SIGINT"
    assert [h.step for h in history] == [0]  # one step, not five
    assert trainer.checkpoint_store().committed_steps() == [1]  # saved before stopping
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler is back
