"""Checkpoints under mpirun: bit-exact resume after the job is killed, restore across modes
(multi-process <-> single-process, another plan), SIGTERM / SIGUSR1 save-and-exit, a failing
save, non-finite steps skipped on every rank alike, and FailFast's grace period."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from h2jax.checkpoint import CheckpointStore
from h2jax.config import load_config
from h2jax.runtime import Trainer, read_metrics
from tests._harness import MP_BASE as BASE
from tests._harness import MP_PLANS as PLANS
from tests._harness import MPIRUN, final_params, load_step
from tests._harness import cli_env as _env

pytestmark = pytest.mark.multiproc
needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")

QUIET = ["train.timeline=false", "train.memory_check=false"]
# the straight run and the killed-and-resumed run: 8 steps, checkpoints every 2, step 1 non-finite (skipped)
STRAIGHT = [
    *BASE,
    *PLANS["2st"],
    *QUIET,
    "train.steps=8",
    "checkpoint.every_steps=2",
    "train.transport=host",
    "train.nonfinite=skip",
    "train.inject_nonfinite_steps=[1]",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> dict[str, str]:
    """One persistent compilation cache for this module's jobs: the ranks of every job after
    the first load the stage programs instead of compiling them again (the same executables,
    so the numbers are unchanged; it roughly halves a job's time on 2 cores)."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def _start(args: list[str], cwd: Path, env: dict[str, str], np_: int = 2) -> subprocess.Popen:
    """mpirun -np 2 h2jax train ARGS, with extra environment variables for every rank."""
    cmd = [
        MPIRUN,
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        str(np_),
        sys.executable,
        "-m",
        "h2jax.cli",
        "train",
        *args,
    ]
    return subprocess.Popen(
        cmd, cwd=cwd, env={**_env(), **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _job(args: list[str], cwd: Path, env: dict[str, str], np_: int = 2) -> tuple[int, str]:
    """An mpirun job (2 ranks unless told) to its end; returns (returncode, stderr)."""
    proc = _start(args, cwd, env, np_)
    _, err = proc.communicate(timeout=600)
    return proc.returncode, err


def _load(ckpt_dir: Path, step: int) -> dict[str, np.ndarray]:
    return load_step(ckpt_dir, step)


def _rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}


def _params(run_dir: Path) -> dict[str, np.ndarray]:
    return final_params(run_dir)


def _same_end_state(straight: Path, run: Path, step: int) -> tuple[dict, dict]:
    """The final parameters (what the jobs wrote) and every array of checkpoint ``step`` of
    two runs are identical (==); returns (parameters, checkpoint arrays) of ``straight``."""
    pa, pb = _params(straight), _params(run)
    assert pa.keys() == pb.keys() and len(pa) > 10
    for k in pa:
        assert np.array_equal(pa[k], pb[k]), k
    sa, sb = _load(straight / "checkpoints", step), _load(run / "checkpoints", step)
    assert sa.keys() == sb.keys() and any(k.startswith("opt_state/0/mu/blocks/3/") for k in sa)
    for k in sa:
        assert np.array_equal(sa[k], sb[k]), k
    return pa, sa


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache) -> Path:
    """8 steps under mpirun without interruption (checkpoints at 4, 6, 8 kept)."""
    cwd = tmp_path_factory.mktemp("straight")
    rc, err = _job([*STRAIGHT, "--run-dir", "run"], cwd, cache)
    assert rc == 0, err[-4000:]
    return cwd / "run"


@needs_mpirun
def test_bit_exact_resume_after_the_job_is_killed(straight, cache, tmp_path):
    """Killed (every rank SIGKILLs itself) right after step 4 counts on every rank, then resumed
    to step 8: the losses of steps 4-7, the final parameters and the final optimizer state are
    identical (==) to the uninterrupted run's; the skipped step stays skipped and counted."""
    run = tmp_path / "run"
    rc, err = _job([*STRAIGHT, "--run-dir", str(run)], tmp_path, {**cache, "H2JAX_FAULT": "kill:committed_all:4"})
    assert rc != 0, err[-3000:]
    ckpt = run / "checkpoints"
    assert CheckpointStore(ckpt).committed_steps() == [2, 4]
    rc, err = _job([*STRAIGHT, "--run-dir", str(run)], tmp_path, cache)
    assert rc == 0, err[-4000:]
    assert f"resumed from {ckpt} step 4" in " ".join(err.split()), err[-3000:]

    a, b = _rows(straight), _rows(run)
    assert sorted(b) == list(range(8))  # the metrics file continues without gaps or repeats
    assert [a[s]["loss"] for s in range(4, 8)] == [b[s]["loss"] for s in range(4, 8)]  # ==, not approx
    # step 1 was non-finite: skipped on every rank, counted before and after the restart
    assert math.isnan(a[1]["loss"]) and a[1]["skipped"] == 1 and a[2]["skipped"] == 0
    assert [b[s]["skipped_steps"] for s in range(8)] == [0] + [1] * 7
    _, sa = _same_end_state(straight, run, 8)
    # 8 steps, one skipped: AdamW counted 7 updates (stage 0's part holds the stage-wide count)
    assert int(sa["opt_state/0/count"]) == 7
    store = CheckpointStore(ckpt)
    assert store.step_parts(8) == ("stage0", "stage1") and store.committed_steps() == [4, 6, 8]
    assert not [p for part in ("stage0", "stage1") for p in (ckpt / "parts" / part).iterdir() if "tmp" in p.name]


@needs_mpirun
def test_a_multiprocess_checkpoint_restores_in_one_process_under_another_plan(straight, tmp_path):
    """The 2-process run's step-4 checkpoint (parts stage0/stage1: layers 0-2 on 2x2, layer 3 on
    4x1) restored by the single-controller Trainer under the 3-stage plan (layers 0 / 1-2 / 3,
    tensor degrees 2 / 1 / 4, recompute, GPipe): its steps 4-7 give the 2-process run's losses
    within 1e-5 (the bar for a plan change) and its final parameters within 1e-5."""
    cfg = load_config(
        None,
        [
            *BASE,
            *PLANS["3st"],
            *QUIET,
            "train.steps=8",
            "checkpoint.enabled=false",
            "train.nonfinite=skip",
            "train.inject_nonfinite_steps=[1]",
        ],
    )
    trainer = Trainer(cfg, run_dir=tmp_path / "single")
    assert trainer.restore(straight / "checkpoints", 4) == 4
    assert trainer.step == 4 and trainer.skipped_steps == 1
    history = trainer.run()
    trainer.close()
    want = _rows(straight)
    assert [h.step for h in history] == [4, 5, 6, 7]
    for h in history:
        assert abs(h.loss - want[h.step]["loss"]) <= 1e-5, (h.step, h.loss, want[h.step]["loss"])
    got = {k: np.asarray(v) for k, v in trainer.params_by_layer().items()}
    ref = _params(straight)
    assert got.keys() == ref.keys()
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], atol=1e-5, rtol=0, err_msg=k)


def _immutable(path: Path, on: bool) -> bool:
    """chattr +i / -i: a directory nobody, root included, can write into (False: not supported here)."""
    try:
        return subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


@needs_mpirun
def test_a_failing_save_stops_every_rank_and_keeps_earlier_checkpoints(straight, cache, tmp_path):
    """Step 6's commit markers cannot be written (an unwritable directory): the job ends non-zero
    with an error naming the path and the step; steps 2 and 4 stay committed and restore."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "commits" / "6").mkdir(parents=True)
    if not _immutable(ckpt / "commits" / "6", True):
        pytest.skip("chattr +i is not available here")
    try:
        rc, err = _job([*STRAIGHT, f"checkpoint.dir={ckpt}", "--run-dir", str(tmp_path / "run")], tmp_path, cache)
    finally:
        _immutable(ckpt / "commits" / "6", False)
    assert rc != 0
    flat = " ".join(err.split())
    assert "checkpoint save failed: saving step 6 to " in flat, err[-3000:]
    # read from the disk, with the steps a rerun trains again: up to the last one completed
    saved = re.search(
        rf"\(committed steps on disk: 2, 4 in {re.escape(str(ckpt))} \(a rerun resumes from step 4: steps 4-(\d+) of "
        r"this run are trained again\)\); last completed step (\d+)",
        flat,
    )
    assert saved and saved.group(1) == saved.group(2), err[-3000:]
    assert f"{ckpt}/parts/stage" in flat and "Operation not permitted" in flat
    assert CheckpointStore(ckpt).committed_steps() == [2, 4]
    sa, sb = _load(straight / "checkpoints", 4), _load(ckpt, 4)
    assert sa.keys() == sb.keys() and all(np.array_equal(sa[k], sb[k]) for k in sa)


def _wait_rows(run_dir: Path, n: int, proc, after: int = -1, timeout: float = 300) -> None:
    """Until metrics.jsonl holds ``n`` rows of steps > ``after``."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists() and len([r for r in read_metrics(metrics) if r["step"] > after]) >= n:
            return
        if proc.poll() is not None:
            pytest.fail(f"job ended early (rc {proc.returncode}): {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"no {n} steps after {after} within {timeout} s")


@needs_mpirun
def test_single_process_checkpoint_resumes_under_mpirun_and_stop_signals_save(cache, tmp_path):
    """A single-controller checkpoint (part main) resumed by a 2-process job: the next losses
    equal the single-controller run's within 1e-6. SIGTERM to one rank stops every rank at the
    same step boundary with that step committed by both parts, exit 0; the restart resumes from
    it, and SIGUSR1 to mpirun (what it forwards without killing the ranks) saves and stops too."""
    ckpt = tmp_path / "ckpt"
    common = [*BASE, *PLANS["2st"], *QUIET, "train.steps=200", f"checkpoint.dir={ckpt}"]
    # one process, SIGKILLed right after committing step 6 (checkpoints 3 and 6, part "main")
    env = {k: v for k, v in _env().items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "PRTE_"))}
    single = subprocess.run(
        [
            sys.executable,
            "-m",
            "h2jax.cli",
            "train",
            *common,
            "checkpoint.every_steps=3",
            "--run-dir",
            str(tmp_path / "single"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**env, **cache, "H2JAX_FAULT": "kill:committed:6"},
        timeout=600,
    )
    assert single.returncode == -signal.SIGKILL, single.stderr[-3000:]
    assert CheckpointStore(ckpt).committed_steps() == [3, 6]
    want = _rows(tmp_path / "single")

    args = [*common, "train.transport=host", "checkpoint.every_steps=0"]
    run = tmp_path / "run"
    proc = _start([*args, "--run-dir", str(run), "--restore-step", "3"], tmp_path, cache)
    _wait_rows(run, 3, proc)
    victim = next(r for r in json.loads((run / "ranks.json").read_text()) if r["rank"] == 1)
    os.kill(victim["pid"], signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    flat = " ".join(err.split())
    assert f"resumed from {ckpt} step 3" in flat
    rows = _rows(run)
    for step in (3, 4, 5):  # the first steps after the restore, under the other mode
        assert abs(rows[step]["loss"] - want[step]["loss"]) <= 1e-6, (step, rows[step]["loss"], want[step]["loss"])
    stop = max(rows) + 1
    assert "stopped by SIGTERM" in flat and f"saved step {stop}" in flat
    store = CheckpointStore(ckpt)
    assert store.latest_committed() == stop < 200
    assert store.step_parts(stop) == ("stage0", "stage1")

    # the restart continues from there; SIGUSR1 to mpirun stops it the same way
    proc = _start([*args, "--run-dir", str(run)], tmp_path, cache)
    _wait_rows(run, 2, proc, after=stop - 1)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    flat = " ".join(err.split())
    assert f"resumed from {ckpt} step {stop}" in flat and "stopped by SIGUSR1" in flat
    rows = _rows(run)
    assert sorted(rows) == list(range(3, max(rows) + 1))  # continued without gaps or repeats
    stop2 = max(rows) + 1
    assert f"saved step {stop2}" in flat and CheckpointStore(ckpt).latest_committed() == stop2 > stop


# FailFast's stop signals in a process of its own (no MPI): "hang" never reaches a step
# boundary (as when a peer died inside a collective); "boundary" reaches one at once
CHILD = """
import os, sys, time
from h2jax.launch import FailFast, LaunchInfo
ff = FailFast(LaunchInfo("openmpi-5", 1, 2, 1), stage=1)
ff.start()
if sys.argv[1] != "off":
    ff.allow_graceful_stop(float(sys.argv[1]))
    ff.saved = lambda: "committed steps on disk: 5"
ff.last_completed_step = 7
print("ready", os.getpid(), flush=True)
for _ in range(3000):
    if ff.stop_signal and sys.argv[2] == "boundary":
        ff.stopping()
        ff.finish()
        print("saved", flush=True)
        sys.exit(0)
    time.sleep(0.01)
sys.exit(3)
"""
# what Open MPI's daemon is to a rank: its parent, relaying the rank's stderr (here into a
# file) and forwarding the stop signals it gets (then it is the signals' sender)
LAUNCHER = """
import signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[3:]], stderr=open(sys.argv[2], "w"))
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(sig, lambda signum, frame: child.send_signal(signum))
sys.exit(child.wait())
"""


@pytest.mark.parametrize(
    "grace,mode,signals,sender,code,says",
    [
        # checkpoints off: at once
        ("off", "hang", [signal.SIGTERM], "launcher", 1, ["stopped by SIGTERM (another process"]),
        # a SIGTERM from mpirun's daemon is followed by SIGKILL: no save is promised, and the line
        # goes to the launcher's own stderr (it stops relaying the ranks' as it ends the job)
        ("30", "hang", [signal.SIGTERM], "launcher", 1, ["to launcher: stopped by SIGTERM: mpirun follows a SIGTERM"]),
        # from anyone else (kill on the rank's pid): a save at the next step boundary, within the grace period
        (
            "1",
            "hang",
            [signal.SIGTERM],
            "other",
            1,
            ["SIGTERM received: asking every", "stopped by SIGTERM: the job reached no step"],
        ),
        (
            "30",
            "hang",
            [signal.SIGINT, signal.SIGTERM],
            "other",
            1,
            ["SIGINT received", "stopped by SIGTERM (another process"],
        ),
        ("30", "boundary", [signal.SIGUSR1], "launcher", 0, ["SIGUSR1 received: asking every"]),
    ],
)
def test_stop_signals_save_or_end_the_process_within_the_grace_period(
    grace, mode, signals, sender, code, says, tmp_path
):
    relayed = tmp_path / "rank.err"
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, CHILD, str(relayed), grace, mode],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready, pid = proc.stdout.readline().split()
    assert ready == "ready"
    t0 = time.time()
    for sig in signals:
        if sender == "launcher":
            proc.send_signal(sig)
        else:
            subprocess.run(["kill", f"-{sig.name.removeprefix('SIG')}", pid], check=True)
        time.sleep(0.2)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == code, (out, err)
    assert time.time() - t0 < 10
    lines = [f"to launcher: {ln}" for ln in err.splitlines()] + relayed.read_text().splitlines()
    assert len(lines) == len(says), lines
    for line, want in zip(lines, says):
        assert line.removeprefix("to launcher: ").startswith("h2jax: stage 1 (rank 1/2, openmpi-5) "), line
        assert want.removeprefix("to launcher: ") in line and line.startswith("to launcher:") == want.startswith(
            "to launcher:"
        ), line
        # a line that ends the process says what the disk holds (read when it is printed)
        ends = "stopped by" in line and grace != "off"
        tail = "; committed steps on disk: 5; last completed step 7" if ends else "; last completed step 7"
        assert line.endswith(tail), line
    assert ("saved" in out) == (code == 0)


# one process per device: each stage is sharded over two processes (its own jax.distributed
# cluster), so its part of a step is one orbax multi-host save of both processes' shards
PER_DEVICE = [
    *BASE,
    *[o for o in PLANS["2st-per-device"] if not o.startswith("checkpoint.")],
    *QUIET,
    "train.steps=6",
    "checkpoint.every_steps=2",
    "train.transport=ffi",
]


@needs_mpirun
def test_one_process_per_device_resumes_bit_exact_and_restores_anywhere(cache, tmp_path):
    """mpirun -np 4, a stage over two processes: killed right after step 4 counts on every
    rank, resumed to step 6: losses, parameters and optimizer state == the uninterrupted
    run's; its checkpoint restores in one process, and onto the one-process-per-stage layout."""
    straight, run = tmp_path / "straight", tmp_path / "run"
    rc, err = _job([*PER_DEVICE, "--run-dir", str(straight)], tmp_path, cache, 4)
    assert rc == 0, err[-4000:]
    rc, err = _job([*PER_DEVICE, "--run-dir", str(run)], tmp_path, {**cache, "H2JAX_FAULT": "kill:committed_all:4"}, 4)
    assert rc != 0, err[-3000:]
    ckpt = run / "checkpoints"
    assert CheckpointStore(ckpt).committed_steps() == [2, 4]
    rc, err = _job([*PER_DEVICE, "--run-dir", str(run)], tmp_path, cache, 4)
    assert rc == 0, err[-4000:]
    assert f"resumed from {ckpt} step 4" in " ".join(err.split()), err[-3000:]
    a, b = _rows(straight), _rows(run)
    assert sorted(b) == list(range(6))
    assert [a[s]["loss"] for s in (4, 5)] == [b[s]["loss"] for s in (4, 5)]  # ==, not approx
    # the step-6 checkpoint, read in this one process: both parts, every array, == the straight run's
    pa, sa = _same_end_state(straight, run, 6)
    for k, v in pa.items():  # the params the job wrote at its end are the checkpoint's
        assert np.array_equal(sa[f"params/{k}"], v), k
    # the same directory continued by the one-process-per-stage layout (-np 2): another
    # sharding of every stage, read from the shards the four processes wrote
    rc, err = _job([*PER_DEVICE, "train.steps=7", "--run-dir", str(run)], tmp_path, cache, 2)
    assert rc == 0, err[-4000:]
    assert f"resumed from {ckpt} step 6" in " ".join(err.split()), err[-3000:]
    assert sorted(_rows(run)) == list(range(7))
