"""Damaged checkpoints through the real CLI: named in one line, never a traceback, and the run
falls back to the newest intact committed step; a step without its commit marker is kept aside."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests._harness import QUIET, TINY
from tests._harness import train_cli as _run

pytestmark = pytest.mark.slow  # end-to-end runs through the CLI: the full suite, not the fast lane

ARGS = [TINY, *QUIET, "checkpoint.every_steps=2"]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Path:
    """A run of 4 steps with committed checkpoints at steps 2 and 4 (copied by each test)."""
    cwd = tmp_path_factory.mktemp("four")
    proc = _run([*ARGS, "train.steps=4", "--run-dir", "run"], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd / "run"


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _truncate_arrays(ckpt: Path, step: int) -> list[Path]:
    files = [p for p in (ckpt / "parts" / "main" / str(step) / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    assert files
    for p in files:
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2])
    return files


def test_a_truncated_newest_step_falls_back_to_the_previous_one(four_steps, tmp_path):
    run = _copy(four_steps, tmp_path)
    _truncate_arrays(run / "checkpoints", 4)
    before = (run / "metrics.jsonl").read_text()
    proc = _run([*ARGS, "train.steps=6", "--run-dir", "run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"{(run / 'checkpoints').absolute()} step 4 is damaged" in proc.stderr, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step 2 (the newest intact step" in proc.stderr, proc.stderr[-3000:]
    # the rows of steps 2-3 that the resumed run replaces are kept, not lost
    replaced = (run / "metrics.replaced.jsonl").read_text().splitlines()
    assert [line for line in before.splitlines() if line not in replaced][:2] == before.splitlines()[:2]
    assert len(replaced) == 2


def test_restore_step_of_a_damaged_step_exits_1_naming_it(four_steps, tmp_path):
    run = _copy(four_steps, tmp_path)
    _truncate_arrays(run / "checkpoints", 4)
    proc = _run([*ARGS, "train.steps=6", "--restore-step", "4", "--run-dir", "run"], tmp_path)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "step 4 is damaged" in ln]
    assert lines and "checkpoint error" in lines[0], proc.stderr[-3000:]


def test_a_step_without_its_commit_marker_is_kept_aside(four_steps, tmp_path):
    run = _copy(four_steps, tmp_path)
    (run / "checkpoints" / "commits" / "4" / "main.json").unlink()
    proc = _run([*ARGS, "train.steps=4", "--run-dir", "run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    aside = list((run / "checkpoints" / "aside").iterdir())
    assert len(aside) == 1 and aside[0].name.startswith("main-step4-"), aside
    assert (aside[0] / "state").is_dir()  # the files, whole
    assert "kept aside step 4 of part main (no commit marker)" in proc.stderr, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step 2" in proc.stderr
