"""pipeline == sequential: the test everything else rests on.

For each plan the loss and every parameter gradient of each of 3 steps equal a single-device
``jax.value_and_grad`` of the same model and batch within 1e-5 (fp32), and the parameters
after the 3 optimizer steps equal those of a single-device optax loop within 1e-5
(tests/_harness.py holds the check, and explains the optimizer's eps=1e-3).
"""

from __future__ import annotations

import jax
import pytest

from h2jax.plan import check_execution
from h2jax.runtime import Trainer
from tests._harness import S, assert_pipeline_equals_sequential, plan_cfg

PLANS = {
    # 2 stages, uneven split, different mesh shapes on either side (the default job's shape)
    "2st-1f1b-2x2-to-4x1": (4, "1f1b", [S("sim_a", (0, 3), 2, 2), S("sim_b", (3, 4), 4, 1)]),
    # pure tensor parallel into pure data parallel, recompute on the first stage, GPipe
    "2st-gpipe-tp4-recompute": (4, "gpipe", [S("sim_a", (0, 1), 1, 4, True), S("sim_b", (1, 4), 2, 1)]),
    # 3 stages, recompute in the middle, vocab-parallel head (tensor=2 on the last stage)
    "3st-1f1b-mixed": (5, "1f1b", [S("sim_a", (0, 1), 2, 1), S("sim_b", (1, 3), 1, 2, True), S("sim_c", (3, 5), 2, 2)]),
    # 4 stages on 4 chip types, every shape different, recompute on/off
    "4st-1f1b-4chips": (
        6,
        "1f1b",
        [S("sim_a", (0, 2), 1, 2), S("sim_b", (2, 3), 4, 1, True), S("sim_c", (3, 4), 2, 1), S("sim_d", (4, 6), 1, 4)],
    ),
    # 4 stages, two chip types each holding two stages on separate nodes, GPipe
    "4st-gpipe-2chips": (
        4,
        "gpipe",
        [S("sim_a", (0, 1), 2, 2), S("sim_b", (1, 2), 2, 1), S("sim_a", (2, 3), 1, 1, True), S("sim_b", (3, 4), 1, 4)],
    ),
    # 3 stages, GPipe, all recompute, uneven 1/1/3
    "3st-gpipe-recompute": (
        5,
        "gpipe",
        [S("sim_c", (0, 1), 4, 1, True), S("sim_a", (1, 2), 1, 1, True), S("sim_d", (2, 5), 2, 2, True)],
    ),
}


def make_cfg(name: str, **extra: str):
    n_layers, schedule, stages = PLANS[name]
    return plan_cfg(n_layers, schedule, stages, **extra)


# the fast lane keeps one plan (2 chip types, different meshes, 1F1B); the full suite runs all
FAST_PLAN = "2st-1f1b-2x2-to-4x1"


@pytest.mark.parametrize(
    "name", [n if n == FAST_PLAN else pytest.param(n, marks=pytest.mark.slow) for n in sorted(PLANS)]
)
def test_pipeline_equals_sequential(name, tmp_path):
    cfg = make_cfg(name)
    trainer = Trainer(cfg, run_dir=tmp_path)

    def sharded_as_the_parameters(step, _):  # the gradient really is sharded as the stage's parameters are
        for st in trainer.stages:
            for g, p in zip(jax.tree.leaves(st.grads()), jax.tree.leaves(st.params)):
                assert g.sharding.is_equivalent_to(p.sharding, g.ndim)

    assert_pipeline_equals_sequential(cfg, trainer, 3, on_grads=sharded_as_the_parameters)
    trainer.close()


@pytest.mark.slow
def test_recorded_timeline_obeys_the_schedule(tmp_path):
    """The order in which a real run executed equals what the schedule allows."""
    for name in ("4st-1f1b-4chips", "4st-gpipe-2chips"):
        cfg = make_cfg(name, **{"plan.num_microbatches": 8, "plan.global_batch": 32})
        trainer = Trainer(cfg, run_dir=tmp_path / name)
        trainer.run(steps=2)
        p, m = cfg.plan.num_stages, cfg.plan.num_microbatches
        for step in range(2):
            ev = trainer.timeline.events(step)
            compute = [
                (e.stage, "F" if e.kind == "fwd" else "B", e.microbatch, e.start_us, e.end_us)
                for e in ev
                if e.kind in ("fwd", "bwd")
            ]
            assert len(compute) == 2 * p * m
            kw = (
                {"max_in_flight": trainer.schedule.max_in_flight()}
                if cfg.plan.schedule.name == "1f1b"
                else {"forwards_first": True}
            )
            # eps: 1 ns, the rounding of (start - t0) * 1e6 vs start_us + dur_us
            assert check_execution(compute, num_stages=p, num_microbatches=m, eps=1e-3, **kw) == []
            sends = [e for e in ev if e.kind == "send"]
            recvs = [e for e in ev if e.kind == "recv"]
            assert len(sends) == len(recvs) == 2 * (p - 1) * m  # every boundary, both directions
            # a transfer starts after the program that produced it ended
            fwd_end = {(e[0], e[2]): e[4] for e in compute if e[1] == "F"}
            for e in sends:
                if e.extra["phase"] == "F":
                    assert e.start_us >= fwd_end[(e.stage, e.microbatch)]
