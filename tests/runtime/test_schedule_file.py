"""A schedule from a file trains as a built-in one does: in one process and under mpirun the
pipeline equals the sequential model, and every stage runs its tasks in the file's order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from h2jax.plan import as_schedule
from h2jax.runtime import Trainer
from tests._harness import (
    MP_BASE,
    MP_PLANS,
    MPIRUN,
    REPO,
    TOL,
    S,
    assert_pipeline_equals_sequential,
    final_params,
    mpirun_train,
    plan_cfg,
    sequential_steps,
)

EXAMPLE = str(REPO / "examples" / "schedules" / "eager_1f1b_2x4.csv")


def _file_order(trace: dict, stage: int, step: int) -> list[str]:
    """Stage `stage`'s compute tasks of step `step` in the order they ran, as the file writes them."""
    events = [
        e
        for e in trace["traceEvents"]
        if e["ph"] == "X"
        and e["args"]["kind"] in ("fwd", "bwd")
        and (e["args"]["stage"], e["args"]["step"]) == (stage, step)
    ]
    return [
        ("F" if e["args"]["kind"] == "fwd" else "B") + str(e["args"]["microbatch"])
        for e in sorted(events, key=lambda e: e["ts"])
    ]


def test_a_schedule_file_trains_as_the_sequential_model(tmp_path):
    cfg = plan_cfg(4, EXAMPLE, [S("sim_a", (0, 3), 2, 2), S("sim_b", (3, 4), 4, 1)])
    assert cfg.plan.schedule == as_schedule(EXAMPLE)
    trainer = Trainer(cfg, run_dir=tmp_path)
    assert [str(t) for t in trainer.schedule.stage_ops(0)] == "F0 F1 F2 B0 F3 B1 B2 B3".split()
    assert_pipeline_equals_sequential(cfg, trainer, 3)
    trainer.close()


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")
def test_a_schedule_file_under_mpirun_equals_the_sequential_model(tmp_path):
    args = [*MP_BASE, *MP_PLANS["2st"], f"plan.schedule={EXAMPLE}", "optimizer.eps=1e-3", "optimizer.lr=1e-2"]
    from h2jax.config import load_config

    steps, want_params = sequential_steps(load_config(None, args), 3)
    run = tmp_path / "run"
    proc = mpirun_train(2, [*args, "train.transport=host", "--run-dir", str(run)], tmp_path)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    np.testing.assert_allclose(summary["losses"], [s[0] for s in steps], atol=TOL, rtol=0)
    got = final_params(run)
    assert sorted(got) == sorted(want_params)
    for k, v in want_params.items():
        np.testing.assert_allclose(got[k], v, atol=TOL, rtol=0, err_msg=k)
    trace = json.loads((run / "trace.json").read_text())
    sched = as_schedule(EXAMPLE)
    for stage in (0, 1):
        assert _file_order(trace, stage, 2) == [str(t) for t in sched.stage_ops(2, 4, stage)]
