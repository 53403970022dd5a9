"""What keeps a stage's work from being slowed by the host (h2jax/runtime/_runner.py, _trainer.py):

- on CPU devices a stage's programs run one after another, in dispatch order: the runner
  waits for each before it dispatches the next (the CPU client would run independent ones
  side by side on the same cores);
- from the second step on, Python's full collections leave out every object that existed
  after the first step (``gc.freeze``), and the run undoes that when it ends.
"""

from __future__ import annotations

import gc

import jax
import pytest

from h2jax.runtime import Trainer
from tests._harness import split_cfg as make_cfg

PROGRAMS = ("forward", "backward", "input_backward", "weight_backward")


def test_a_cpu_stage_dispatches_a_program_only_after_the_last_one_ran(tmp_path):
    trainer = Trainer(make_cfg("2st-2x2-to-4x1", schedule="zb-h1"), run_dir=tmp_path)  # F, B and W programs
    dispatches: list[tuple[int, str, bool]] = []  # (stage, program, the stage's previous output was ready)
    for runner in trainer.runners:
        assert runner.in_order
        last: list = []  # this stage's last output, over all its programs

        def wrap(fn, name, stage, last=last):
            def call(*args, **kwargs):
                dispatches.append((stage, name, all(x.is_ready() for x in last)))
                out = fn(*args, **kwargs)
                last[:] = jax.tree.leaves(out)
                return out

            return call

        for st in runner.programs:
            for name in PROGRAMS:
                setattr(st, name, wrap(getattr(st, name), name, runner.stage_idx))
    for _ in range(2):
        trainer.train_step()
    m = trainer.cfg.plan.num_microbatches
    assert len(dispatches) == 2 * len(trainer.runners) * 3 * m  # one F, B and W per stage and microbatch
    assert {name for _, name, _ in dispatches} == {"forward", "input_backward", "weight_backward"}
    late = [d for d in dispatches if not d[2]]
    assert not late, f"dispatched before the stage's previous program ended: {late}"


@pytest.mark.slow  # the fast lane keeps the dispatch order (above)
def test_full_collections_leave_out_what_the_first_step_made(tmp_path):
    trainer = Trainer(make_cfg("2st-2x2-to-4x1", schedule="1f1b"), run_dir=tmp_path)
    frozen: list[int] = []
    step = trainer.train_step

    def counted():
        frozen.append(gc.get_freeze_count())
        return step()

    trainer.train_step = counted
    before = gc.get_freeze_count()  # 0 on Python 3.11 and 3.13; CPython 3.12.1 has 375 that unfreeze() keeps
    trainer.run(3)
    assert frozen[0] == before, "the first step (compilation) ran frozen"
    assert all(n > before for n in frozen[1:]), frozen
    assert gc.get_freeze_count() == before, "the run left objects frozen"


@pytest.mark.slow
def test_a_transfer_counts_in_its_own_step_when_the_receiver_starts_late(tmp_path):
    """Each stage's runner starts a step on its own thread; a transfer into a stage whose
    thread has not yet started the step is recorded in the step it belongs to (on a busy host
    the receiver's first forward of step 1 was counted in step 0)."""
    import time

    trainer = Trainer(make_cfg("2st-2x2-to-4x1", schedule="1f1b"), run_dir=tmp_path)
    late = trainer.runners[1]
    run_step = late.run_step

    def slow_start(step, tokens, targets, **kw):
        time.sleep(0.3)  # stage 0 sends its first forwards of the step meanwhile
        return run_step(step, tokens, targets, **kw)

    late.run_step = slow_start
    for _ in range(2):
        trainer.train_step()
    m = trainer.cfg.plan.num_microbatches
    for step in range(2):
        kinds = [e.kind for e in trainer.timeline.events(step)]
        assert kinds.count("send") == kinds.count("recv") == 2 * m, (step, kinds.count("send"), kinds.count("recv"))
    trainer.close()
