"""Tied embeddings under mpirun: stages in different processes (one per stage, or one per
device) exchange the table's gradient shares and new values through the host, each process
the slices it holds and a process of the other stage needs; the boundaries travel by the ffi or host transport.

Against the sequential model, in this process: each step's loss and every gradient within
1e-5 of ``jax.value_and_grad`` of the whole model (test_tied.py's reasons), the parameters
after 3 steps within 1e-5 of a sequential optax loop, both copies of the table identical
(``==``) across the processes; and the run's checkpoint restores, in one
process, under a plan whose single stage holds the embedding and the head.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from h2jax.runtime import Trainer
from tests._harness import (
    MPIRUN,
    TABLE,
    TIED,
    S,
    assert_recorded_equals_sequential,
    mpirun,
    named_cfg,
    plan_cfg,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")]

JOB = Path(__file__).with_name("tied_job.py")


@pytest.mark.parametrize(
    "plan,transport,nproc",
    [
        ("2st-1f1b", "ffi", 2),
        pytest.param("3st-gpipe", "host", 3, marks=[pytest.mark.slow, pytest.mark.long]),
        pytest.param("2st-per-device", "ffi", 4, marks=[pytest.mark.slow, pytest.mark.long]),
        pytest.param("2st-one-to-two", "ffi", 3, marks=[pytest.mark.slow, pytest.mark.long]),
    ],
)
def test_tied_under_mpirun_equals_sequential(plan, transport, nproc, tmp_path):
    # the gradients and parameters of all processes together hold the model once (the table once)
    cfg, ranks, got = run_and_compare(plan, transport, nproc, tmp_path)

    # both copies of the table equal bit for bit across the processes
    copies = {k: v for rk in ranks for k, v in rk.items() if k.startswith("copy/")}
    last = str(cfg.plan.num_stages - 1)
    assert sorted(copies) == ["copy/0", f"copy/{last}"]
    assert np.array_equal(copies["copy/0"], copies[f"copy/{last}"])
    assert np.array_equal(copies["copy/0"], got[TABLE])
    # the bytes each process posts to others over the 3 steps (fp32 gradients, the table's values)
    table = got[TABLE]
    sent = [int(rk["exchange_bytes"]) for rk in ranks]
    if plan == "2st-per-device":
        # stage 0 over two processes (tensor 2: the tied table split on vocab), stage 1 over two
        # (data 2: each holds it whole, takes it cut over its data axis, all-gathers it). Each
        # step each mirror process sends one owner process its half of the fp32 gradient, and
        # each owner process its half of the new values to one mirror process: every process
        # moves half the table, none the whole
        assert sent == [3 * (table.nbytes // 2)] * 2 + [3 * (table.size // 2) * 4] * 2
    if plan == "2st-one-to-two":
        # the owner alone (one process) sends the mirror processes a half each of the new values;
        # the two mirror processes hold the whole gradient alike and send the owner a half each
        assert sent == [3 * table.nbytes] + [3 * (table.size // 2) * 4] * 2

    # the multi-process checkpoint, restored in one process onto one stage holding both uses
    restored_on_one_stage(cfg, got, tmp_path)


def run_and_compare(plan: str, transport: str, nproc: int, tmp_path):
    """tied_job.py's run of ``plan`` on ``nproc`` processes against the sequential model: (the
    experiment, each rank's record, every parameter after the run by model path)."""
    proc = mpirun(nproc, [sys.executable, str(JOB), str(tmp_path), plan, f"train.transport={transport}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(nproc)]
    cfg = named_cfg(plan)
    grads = [
        {k.split("/", 2)[2]: v for rk in ranks for k, v in rk.items() if k.startswith(f"grads/{step}/")}
        for step in range(3)
    ]
    got = {k[len("params/") :]: v for rk in ranks for k, v in rk.items() if k.startswith("params/")}
    assert_recorded_equals_sequential(cfg, grads, got, [(rk["losses"], rk["norms"]) for rk in ranks])
    return cfg, ranks, got


def restored_on_one_stage(cfg, got: dict, tmp_path) -> None:
    """The run's checkpoint (tmp_path/run), restored in one process onto one stage holding every
    layer (and both uses of a tied table): the parameters ``got``, bit for bit."""
    tied = TIED if cfg.model.tie_embeddings else {}
    one = plan_cfg(cfg.model.n_layers, "1f1b", [S("sim_a", (0, cfg.model.n_layers), 2, 2)], **tied)
    trainer = Trainer(one, run_dir=tmp_path / "one")
    assert not trainer.tied  # one stage: nothing is held twice
    assert trainer.restore(tmp_path / "run" / "checkpoints") == 3
    restored = {k: np.asarray(v) for k, v in trainer.params_by_layer().items()}
    trainer.close()
    assert sorted(restored) == sorted(got)
    for k, v in got.items():
        assert np.array_equal(restored[k], v), k


@pytest.mark.parametrize("transport", ["ffi"])
def test_pipelines_under_mpirun_equal_sequential(transport, tmp_path):
    """Two pipelines on disjoint processes (one per stage: 2 + 1): each layer's gradient summed
    across them through the host, every copy updated alike; the checkpoint, one part per process
    (the second pipeline's holds no array: its copies are the first's), restores onto one stage."""
    cfg, _, got = run_and_compare("2p-mpirun", transport, 3, tmp_path)
    restored_on_one_stage(cfg, got, tmp_path)
