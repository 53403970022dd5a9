"""Checkpoints through the real CLI: bit-exact resume after SIGKILL, restore onto another plan,
kills during a save, SIGTERM, non-finite steps, a checkpoint directory that cannot be written."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from h2jax.checkpoint import CheckpointStore
from h2jax.runtime import read_metrics
from tests._harness import QUIET, TINY, load_step
from tests._harness import cli_env as _env
from tests._harness import run_losses as _losses
from tests._harness import train_cli as _run

pytestmark = pytest.mark.slow  # end-to-end runs through the CLI: the full suite, not the fast lane

REPO = Path(__file__).resolve().parents[2]


def _load(ckpt_dir: Path, step: int) -> dict[str, np.ndarray]:
    """Every array of a committed step, on the host."""
    return load_step(ckpt_dir, step)


def test_bit_exact_resume_after_sigkill(tmp_path):
    args = [TINY, *QUIET, "train.steps=12", "checkpoint.every_steps=6"]
    straight = _run([*args, "--run-dir", "straight"], tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    # the same run, SIGKILLed right after step 6's checkpoint is committed
    killed = _run([*args, "--run-dir", "resumed"], tmp_path, env=_env(H2JAX_FAULT="kill:committed:6"))
    assert killed.returncode == -signal.SIGKILL
    assert CheckpointStore(tmp_path / "resumed" / "checkpoints").committed_steps() == [6]
    resumed = _run([*args, "--run-dir", "resumed"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step 6" in resumed.stderr
    a, b = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert sorted(b) == list(range(12))  # the metrics file continues without gaps or repeats
    assert [a[s] for s in range(6, 12)] == [b[s] for s in range(6, 12)]  # ==, not approx
    sa, sb = _load(tmp_path / "straight" / "checkpoints", 12), _load(tmp_path / "resumed" / "checkpoints", 12)
    assert sa.keys() == sb.keys() and any(k.startswith("opt_state/0/mu/") for k in sa)
    for k in sa:
        assert np.array_equal(sa[k], sb[k]), k


PLAN_A = """
name: plan_a
model: {n_layers: 8}
cluster: {chips: {sim_a: {nodes: 1}, sim_b: {nodes: 1}, sim_c: {nodes: 1}}}
plan:
  stages:
    - {chip: sim_a, data: 2, tensor: 1, layers: [0, 3]}
    - {chip: sim_b, data: 1, tensor: 2, layers: [3, 8]}
"""

PLAN_B = """
name: plan_b
model: {n_layers: 8}
cluster: {chips: {sim_a: {nodes: 1}, sim_b: {nodes: 1}, sim_c: {nodes: 1}}}
plan:
  stages:
    - {chip: sim_c, data: 1, tensor: 4, layers: [0, 2], recompute: true}
    - {chip: sim_a, data: 2, tensor: 2, layers: [2, 6]}
    - {chip: sim_b, data: 2, tensor: 1, layers: [6, 8]}
"""


def test_restore_onto_a_different_plan(tmp_path):
    """Written under 2 stages (3/5 layers), restored under 3 stages (2/4/2) with other chips and
    data/tensor degrees: the next step's loss matches plan A's within 1e-5."""
    (tmp_path / "a.yaml").write_text(TINY_BASE + PLAN_A)
    (tmp_path / "b.yaml").write_text(TINY_BASE + PLAN_B)
    a = _run(["a.yaml", *QUIET, "train.steps=4", "checkpoint.every_steps=3"], tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    loss_a = _losses(tmp_path / "runs" / "plan_a")[3]
    b = _run(
        [
            "b.yaml",
            *QUIET,
            "train.steps=4",
            f"checkpoint.dir={tmp_path / 'runs' / 'plan_a' / 'checkpoints'}",
            "--restore-step",
            "3",
        ],
        tmp_path,
    )
    assert b.returncode == 0, b.stderr[-3000:]
    assert "step 3" in b.stderr
    loss_b = _losses(tmp_path / "runs" / "plan_b")
    assert list(loss_b) == [3]
    assert abs(loss_b[3] - loss_a) <= 1e-5, (loss_a, loss_b[3])


TINY_BASE = Path(TINY).read_text().split("name: tiny")[0]  # comments only; the plan files say the rest


def test_kill_during_save_at_several_points(tmp_path):
    """Killed at each point of saving step 4 (async write in flight; finalised but not committed;
    committed): the next start always resumes from the latest committed step and cleans up."""
    args = [TINY, *QUIET, "train.steps=6", "checkpoint.every_steps=2", "--run-dir", "run"]
    ckpt = tmp_path / "run" / "checkpoints"
    expected_resume = {"save_started": None, "save_finalized": 2, "committed": 2}
    for point in ("save_started", "save_finalized", "committed"):
        p = _run(args, tmp_path, env=_env(H2JAX_FAULT=f"kill:{point}:4"))
        assert p.returncode == -signal.SIGKILL, (point, p.stderr[-2000:])
        if expected_resume[point] is not None:
            assert f"resumed from {ckpt} step {expected_resume[point]}" in p.stderr.replace("\n", ""), point
        committed = CheckpointStore(ckpt).committed_steps()
        assert committed == ([2, 4] if point == "committed" else [2]), (point, committed)
        assert _load(ckpt, committed[-1])  # the latest committed step restores
    last = _run(args, tmp_path)
    assert last.returncode == 0, last.stderr[-3000:]
    assert "step 4" in last.stderr
    assert CheckpointStore(ckpt).committed_steps() == [2, 4, 6]
    assert not [p for p in (ckpt / "parts" / "main").iterdir() if "tmp" in p.name]


def test_sigterm_saves_and_exits_0(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "h2jax.cli",
            "train",
            TINY,
            *QUIET,
            "train.steps=500",
            "checkpoint.every_steps=0",
            "--run-dir",
            "run",
        ],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and len(read_metrics(metrics)) >= 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped by SIGTERM" in err
    step = max(r["step"] for r in read_metrics(metrics)) + 1
    assert f"saved step {step}" in err.replace("\n", " ")
    assert CheckpointStore(tmp_path / "run" / "checkpoints").latest_committed() == step < 500


def test_nonfinite_abort_names_step_and_stage(tmp_path):
    p = _run([TINY, *QUIET, "train.steps=3", "train.inject_nonfinite_steps=[2]", "checkpoint.enabled=false"], tmp_path)
    assert p.returncode == 1
    err = " ".join(p.stderr.split())
    assert "step 2: non-finite loss=nan" in err and "stage 1" in err, err[-2000:]


def test_nonfinite_skip_changes_nothing(tmp_path):
    p = _run(
        [
            TINY,
            *QUIET,
            "train.steps=4",
            "train.nonfinite=skip",
            "train.inject_nonfinite_steps=[2]",
            "checkpoint.every_steps=1",
            "checkpoint.keep_last=10",
            "--run-dir",
            "run",
        ],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert [rows[s]["skipped"] for s in range(4)] == [0, 0, 1, 0]
    assert [rows[s]["skipped_steps"] for s in range(4)] == [0, 0, 1, 1]
    assert np.isnan(rows[2]["loss"]) and np.isfinite(rows[3]["loss"])
    ckpt = tmp_path / "run" / "checkpoints"
    before, after = _load(ckpt, 2), _load(ckpt, 3)  # the state before and after the skipped step
    for k in before:
        assert np.array_equal(before[k], after[k]), k
    assert not np.array_equal(after["params/head/lm_head"], _load(ckpt, 4)["params/head/lm_head"])


def test_a_failing_save_stops_the_job_and_keeps_earlier_checkpoints(tmp_path):
    args = [TINY, *QUIET, "checkpoint.every_steps=2"]
    first = _run([*args, "train.steps=4", "--run-dir", "run"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoints"
    good = _load(ckpt, 4)

    p = _run([*args, "train.steps=8", "--run-dir", "run"], tmp_path, max_file_kib=16)
    assert p.returncode == 1, p.stderr[-3000:]
    err = "".join(p.stderr.split())
    assert "checkpointsavefailed" in err and f"{ckpt}/parts/main/6".replace(" ", "") in err and "step6" in err
    store = CheckpointStore(ckpt)
    assert store.latest_committed() == 4
    again = _load(ckpt, 4)
    assert all(np.array_equal(good[k], again[k]) for k in good)
