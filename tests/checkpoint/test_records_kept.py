"""Bad input against a run folder that already holds a run: one line, the documented exit code,
and nothing saved is lost -- every committed step still restores, and metrics.jsonl and
summary.json still hold the earlier run's records byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests._harness import QUIET, TINY
from tests._harness import load_step as _load
from tests._harness import train_cli as _run

pytestmark = pytest.mark.slow

ARGS = [TINY, *QUIET, "checkpoint.every_steps=2", "train.tensorboard=true"]

# (name, extra args, exit code, what the one line says, whether the run trains more steps)
CASES = [
    ("nothing to train", ["train.steps=4"], 0, "nothing to train", False),
    ("negative steps", ["train.steps=-1"], 2, "train.steps", False),
    ("missing corpus", ["train.steps=6", "data.corpus=no_such_corpus.txt"], 2, "data.corpus", False),
    (
        "uncommitted restore step",
        ["train.steps=6", "--restore-step", "3"],
        2,
        "step 3 is not among the checkpoints",
        False,
    ),
    (
        "init over checkpoints",
        ["train.steps=6", "--init-from", "run/checkpoints"],
        1,
        "already holds checkpoints",
        False,
    ),
    # refused before any device (exit 2), from the config.yaml beside the steps
    ("another model", ["train.steps=6", "model.d_model=64"], 2, "holds another model", False),
    ("full disk", ["train.steps=8"], 1, "checkpoint save failed", True),
]


@pytest.fixture(scope="module")
def earlier(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("earlier")
    proc = _run([*ARGS, "train.steps=4", "--run-dir", "run"], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd / "run"


@pytest.mark.parametrize("name,extra,code,says,trains", CASES, ids=[c[0] for c in CASES])
def test_bad_input_keeps_every_record(earlier, tmp_path, name, extra, code, says, trains):
    run = tmp_path / "run"
    shutil.copytree(earlier, run)
    metrics, summary = (run / "metrics.jsonl").read_bytes(), (run / "summary.json").read_bytes()
    events = sorted(p.name for p in (run / "tb").iterdir())
    proc = _run([*ARGS, *extra, "--run-dir", "run"], tmp_path, max_file_kib=64 if name == "full disk" else None)
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Event loop is closed" not in proc.stderr, proc.stderr[-3000:]  # orbax's noise of a failed save
    said = [ln for ln in proc.stderr.splitlines() if says in ln]
    assert said, proc.stderr[-3000:]
    if code:
        errors = [
            ln for ln in proc.stderr.splitlines() if ln.startswith("h2jax:") and ("error" in ln or "failed" in ln)
        ]
        assert len(errors) == 1, errors
    # nothing saved is lost
    for step in (2, 4):
        arrays = _load(run / "checkpoints", step)
        assert any(k.startswith("params/") for k in arrays) and any(k.startswith("opt_state/") for k in arrays)
    now = (run / "metrics.jsonl").read_bytes()
    if trains:  # the earlier rows stay, new ones follow
        assert now.startswith(metrics) and len(now) > len(metrics)
    else:
        assert now == metrics
        assert (run / "summary.json").read_bytes() == summary
        assert sorted(p.name for p in (run / "tb").iterdir()) == events  # no empty events file
