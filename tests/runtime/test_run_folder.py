"""A run folder belongs to one job at a time, and its name cannot lead out of ``train.out_dir``.

Two ``h2jax train`` runs into one folder used to interleave their metric rows and kill each
other's saves with a wrong cause; ``name=../../escape`` trained outside ``train.out_dir``."""

from __future__ import annotations

import json
import os

import pytest

from h2jax.config import ConfigError, load_config
from h2jax.runtime import LOCK_FILENAME, RunLock
from tests._harness import QUIET, TINY, train_cli


def test_a_second_lock_on_a_run_folder_is_refused_naming_the_holder(tmp_path):
    first, second = RunLock(tmp_path / "run"), RunLock(tmp_path / "run")
    first.acquire()
    with pytest.raises(ConfigError) as e:
        second.acquire()  # flock: another open file, even in this process, is another holder
    assert e.value.key == "name"
    assert f"is in use by another h2jax job: pid {os.getpid()} on {os.uname().nodename}" in str(e.value)
    first.release()
    second.acquire()
    assert json.loads((tmp_path / "run" / LOCK_FILENAME).read_text())["pid"] == os.getpid()
    second.release()


def test_a_lock_file_left_by_a_killed_job_is_not_a_lock(tmp_path):
    (tmp_path / LOCK_FILENAME).write_text(json.dumps({"pid": 999999, "host": "gone", "started": "yesterday"}))
    lock = RunLock(tmp_path)
    lock.acquire()  # nobody holds the flock: the file only names the last holder
    assert json.loads((tmp_path / LOCK_FILENAME).read_text())["pid"] == os.getpid()
    lock.release()


@pytest.mark.slow
def test_train_into_a_folder_another_job_holds_exits_2_and_writes_nothing(tmp_path):
    run = tmp_path / "twice"
    held = RunLock(run)
    held.acquire()
    r = train_cli([TINY, *QUIET, "--run-dir", str(run)], tmp_path)
    held.release()
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("h2jax:")]
    assert len(lines) == 1 and f"run folder {run} is in use by another h2jax job: pid {os.getpid()}" in lines[0]
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILENAME]  # no config, metrics or checkpoint


@pytest.mark.parametrize("name", ["../../escape", "a/b", "..", ""])
def test_a_run_name_is_one_folder_name(name):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"name={name}"], check_files=False)
    assert e.value.key == "name" and "expected one folder name" in e.value.message


def test_a_lock_whose_file_is_gone_says_the_run_folder_is_gone(tmp_path):
    from h2jax.runtime._outputs import RunFolderGone

    lock = RunLock(tmp_path / "run")
    lock.acquire()
    lock.check_present()  # there: nothing to say
    (tmp_path / "run" / LOCK_FILENAME).unlink()
    (tmp_path / "run" / LOCK_FILENAME).write_text("{}")  # another file at the same path is not ours
    with pytest.raises(RunFolderGone, match="was deleted or replaced while this job wrote it"):
        lock.check_present()
    lock.release()


@pytest.mark.slow
def test_a_run_folder_deleted_mid_run_ends_the_job_with_one_line(tmp_path):
    """It used to re-create the folder and exit 0 with metrics.jsonl and tb/ gone, or (during a
    save) say that earlier checkpoints were intact after they had been deleted."""
    import shutil
    import subprocess
    import sys
    import time

    from tests._harness import cli_env

    run = tmp_path / "run"
    # no periodic save: the job meets the deletion between steps (a save it meets fails naming
    # what is on the disk, test_multiproc_checkpoint)
    args = [TINY, *QUIET, "train.steps=100000", "checkpoint.every_steps=0", "--run-dir", str(run)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "h2jax.cli", "train", *args],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        rows = run / "metrics.jsonl"
        while not (rows.is_file() and len(rows.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        shutil.rmtree(run)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("h2jax: run folder gone:")]
    assert len(lines) == 1, err[-3000:]
    flat = " ".join(err.split())
    assert f"run folder {run} was deleted or replaced" in flat and "no checkpoint is left" in flat, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not (run / "metrics.jsonl").exists()  # nothing written into a new folder as if all were well
