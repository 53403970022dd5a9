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
