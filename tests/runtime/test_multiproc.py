"""mpirun runs: multi-process == single-process, and fail-fast when a rank dies."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from h2jax.config import load_config
from h2jax.runtime import Trainer, read_metrics
from tests._harness import MP_BASE as BASE
from tests._harness import MP_PLANS as PLANS
from tests._harness import MPIRUN, final_params
from tests._harness import mpirun_train as _mpirun

pytestmark = pytest.mark.multiproc

NPROC = {"2st": 2, "3st": 3, "2st-per-device": 4}
OVERRIDES = BASE + PLANS["2st"]


def _rank_lines(err: str, head: str) -> list[str]:
    """The lines of one rank's that begin with ``head``, from ``head`` on. The launcher forwards
    each rank's stderr after its own notices and may leave a byte of its own in front of a rank's
    line (seen once in CI: one unprintable byte after Open MPI's MPI_ABORT notice)."""
    return [ln[ln.index(head) :] for ln in err.splitlines() if head in ln]


_SINGLE: dict[str, tuple] = {}


def single_process_run(plan: str, tmp_path: Path):
    if plan not in _SINGLE:
        cfg = load_config(None, BASE + PLANS[plan])
        trainer = Trainer(cfg, run_dir=tmp_path / "single")
        history = trainer.run()
        trainer.close()
        _SINGLE[plan] = (
            [h.loss for h in history],
            {k: np.asarray(v) for k, v in trainer.params_by_layer().items()},
            sorted(json.loads((tmp_path / "single" / "summary.json").read_text())),
            [sorted(r) for r in read_metrics(tmp_path / "single")],
        )
    return _SINGLE[plan]


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")
@pytest.mark.parametrize(
    "plan,transport",
    [
        ("2st", "host"),
        ("2st", "ffi"),
        ("2st", "ffi-call"),
        ("3st", "ffi"),
        ("2st-per-device", "ffi"),
        pytest.param("2st-per-device", "host", marks=pytest.mark.long),  # per-device: ffi above
    ],
)
def test_multiprocess_equals_single_process(plan, transport, tmp_path):
    """The same config in one process and under mpirun: the same losses (<= 1e-6), final
    parameters, metrics keys, summary keys and Gantt chart."""
    want_losses, want_params, summary_keys, metric_keys = single_process_run(plan, tmp_path)
    nproc = NPROC[plan]
    # emulated chip types hold host memory: nothing to stage, so requiring device-direct links trains
    direct = "comm.require_device_direct=true"
    proc = _mpirun(
        nproc,
        [*BASE, *PLANS[plan], f"train.transport={transport}", direct, "--run-dir", str(tmp_path / "run")],
        tmp_path,
    )
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["processes"] == nproc and summary["transport"] == transport
    # each link named and timed between the ranks of its stages' first devices, in the header too
    links = summary["links"]
    first = [0, 2] if plan == "2st-per-device" else list(range(nproc))
    assert [(lk["src"], lk["dst"], lk["path"], lk["ranks"]) for lk in links] == [
        (s, s + 1, "host", [first[s], first[s + 1]]) for s in range(len(first) - 1)
    ]
    assert all(lk["small_us"] > 0 and lk["large_gbps"] > 0 for lk in links), links
    engine = "mpi4py" if transport == "host" else "mpi"
    assert f"link stage 0 (sim_a) -> stage 1 (sim_b): host via {transport} (engine {engine}, Open MPI" in err
    np.testing.assert_allclose(summary["losses"], want_losses, atol=1e-6, rtol=0)
    assert sorted(summary) == summary_keys
    rows = read_metrics(run)
    assert [sorted(r) for r in rows] == metric_keys
    assert {"tgs/sim_a", "tgs/sim_b", "bubble_fraction"} <= set(rows[0])
    assert (run / "gantt.png").is_file() and summary["gantt_step"] == 2
    got = final_params(run)
    ranks = json.loads((run / "ranks.json").read_text())
    assert [r["stages"] for r in ranks] == (
        [[0], [0], [1], [1]] if plan == "2st-per-device" else [[s] for s in range(nproc)]
    )
    assert [len(r["links"]) for r in ranks] == [sum(r["rank"] in lk["ranks"] for lk in links) for r in ranks]
    if plan == "2st-per-device":  # each stage one jax.distributed cluster on the default cpu backend
        assert [r["group_rank"] for r in ranks] == [0, 1, 0, 1]
        assert [len(r["links"]) for r in ranks] == [1, 0, 1, 0]
        assert {b for r in ranks for b in r["backend"]} == {"cpu"}
    assert sorted(got) == sorted(want_params)
    for k, v in want_params.items():
        np.testing.assert_allclose(got[k], v, atol=1e-6, rtol=0, err_msg=k)
    trace = json.loads((run / "trace.json").read_text())
    kinds = {e["args"]["kind"] for e in trace["traceEvents"] if e["ph"] == "X"}
    # ffi: the transfers run inside the stage programs; host and ffi-call: as events of their own
    assert kinds == ({"fwd", "bwd", "update"} if transport == "ffi" else {"fwd", "bwd", "send", "recv", "update"})


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")
def test_killed_rank_ends_the_job_promptly(tmp_path):
    run = tmp_path / "run"
    proc = _mpirun(2, [*OVERRIDES, "train.steps=1000", "train.transport=host", "--run-dir", str(run)], tmp_path)
    # wait until a few steps completed, then SIGKILL the last stage's process mid-run
    deadline = time.time() + 300
    while time.time() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        if proc.poll() is not None:
            pytest.fail(f"job ended early: {proc.stderr.read()[-3000:]}")
        time.sleep(0.2)
    ranks = json.loads((run / "ranks.json").read_text())
    victim = next(r for r in ranks if r["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    t_kill = time.time()
    out, err = proc.communicate(timeout=90)
    elapsed = time.time() - t_kill
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    lines = _rank_lines(err, "h2jax: stage 0 (rank 0/2")
    assert lines, (out[-3000:], err[-3000:])
    assert "last completed step" in lines[-1]
    step = int(lines[-1].rsplit("last completed step", 1)[1].strip())
    assert step >= 1
    # the survivor names the peer that died, and promises no save it cannot make
    assert any(f"rank 1 (stage 1, pid {victim['pid']})" in ln and "ended" in ln for ln in lines), lines
    assert "exiting 0" not in err


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")
def test_a_stopped_rank_ends_the_job_after_the_transfer_timeout(tmp_path):
    """A rank frozen by SIGSTOP (a hang, as the survivor sees it): the survivor ends the job
    within the transfer timeout (a receive) or the progress watchdog (a collective), naming
    itself and its last completed step; nothing hangs."""
    run = tmp_path / "run"
    args = [
        *OVERRIDES,
        "train.steps=1000",
        "train.transport=host",
        "train.transfer_timeout_s=30",
        "--run-dir",
        str(run),
    ]
    proc = _mpirun(2, args, tmp_path)
    deadline = time.time() + 300
    while time.time() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        if proc.poll() is not None:
            pytest.fail(f"job ended early: {proc.stderr.read()[-3000:]}")
        time.sleep(0.2)
    victim = next(r for r in json.loads((run / "ranks.json").read_text()) if r["rank"] == 1)
    os.kill(victim["pid"], signal.SIGSTOP)
    t_stop = time.time()
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        try:
            os.kill(victim["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode != 0
    assert time.time() - t_stop < 100
    lines = _rank_lines(err, "h2jax: stage 0 (rank 0/2")
    assert lines, err[-3000:]
    assert ("timed out after 30 s" in lines[0] and "peer 1" in lines[0]) or "made no progress" in lines[0], lines
    assert "last completed step" in lines[0]


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")
def test_process_counts_the_plan_cannot_use_fail_with_the_key(tmp_path):
    per_device = [o for o in PLANS["2st-per-device"] if not o.startswith("checkpoint.")]
    # 3 processes for 2 stages of 2 devices each: neither one per stage nor one per device
    proc = _mpirun(3, [*BASE, *per_device, "checkpoint.enabled=false", "--run-dir", str(tmp_path / "a")], tmp_path)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "the job has 3 processes" in err and "(-np 2)" in err and "(-np 4)" in err, err[-3000:]
    # before the plan placed the ranks there is no stage to name, and no step was completed
    assert "stage 2" not in err and "last completed step -1" not in err and "no step completed" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize(
    "bad,says",
    [
        (["train.steps=-1"], "train.steps"),
        (["train.transport=local"], "'local' moves tensors inside one process; under mpirun"),
    ],
    ids=["bad-value", "local-under-mpirun"],
)
def test_a_config_error_under_mpirun_is_one_line_before_the_config(tmp_path, bad, says):
    """Every rank reads the same config and fails alike: rank 0 says it once, before the
    config dump (a transport inside one process is refused there too), and the job exits 2."""
    proc = _mpirun(2, [*OVERRIDES, *bad, "--run-dir", str(tmp_path / "run")], tmp_path)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    lines = _rank_lines(err, "h2jax: config error:")
    assert len(lines) == 1 and says in lines[0], err[-3000:]
    assert "h2jax train:" not in err and "Traceback" not in err, err[-3000:]
    assert "MPI_ABORT" not in err and "\x00" not in err, err[-3000:]  # no launcher banner, no NUL byte
    assert not (tmp_path / "run").exists()
