"""`h2jax train` from two weighted ArrayRecord stores that `h2jax tokenize` wrote: a run stopped
at step 2 and resumed under another plan (another microbatch count and data degree, or under
mpirun with a process per stage) consumes the sequences of an uninterrupted run, step by step,
and its losses follow."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from h2jax.runtime import read_metrics
from tests._harness import QUIET, TINY, mpirun
from tests._harness import cli_env as _env
from tests._harness import train_cli as _run

DATA = "data.sources=" + json.dumps({"a": 3, "b": 1})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two ArrayRecord stores `h2jax tokenize` wrote, and an uninterrupted 4-step run on them."""
    from pydoc_data.topics import topics

    d = tmp_path_factory.mktemp("sources_train")
    keys = sorted(topics)
    (d / "a.txt").write_text("\n\n".join(topics[k] for k in keys[:40]))
    (d / "b.txt").write_text("\n\n".join(topics[k] for k in keys[40:]))
    for name, shards in (("a", 3), ("b", 2)):
        r = subprocess.run(
            [sys.executable, "-m", "h2jax.cli", "tokenize", f"{name}.txt", "--tokenizer", "byte", "--format",
             "arrayrecord", "--shards", str(shards), "--out", name, "--no-progress"],
            cwd=d, env=_env(), capture_output=True, text=True,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
    whole = _run([TINY, *QUIET, DATA, "train.steps=4", "name=whole"], d)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "data: 2 source(s)" in whole.stderr and "a 75%" in whole.stderr
    return d


def _rows(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}


def _same_sequences_and_losses(d, name):
    rows, got = _rows(d / "runs" / "whole"), _rows(d / "runs" / name)
    assert sorted(got) == [0, 1, 2, 3]
    assert [got[s]["data_position"] for s in range(4)] == [rows[s]["data_position"] for s in range(4)] == [0, 8, 16, 24]
    for s in range(4):  # the same sequences, split into other microbatches on another mesh
        assert abs(got[s]["loss"] - rows[s]["loss"]) <= 1e-5, (s, got[s]["loss"], rows[s]["loss"])


@pytest.mark.slow
def test_a_resume_under_another_plan_continues_at_the_sequences_consumed(corpus):
    cut = _run([TINY, *QUIET, DATA, "train.steps=2", "checkpoint.every_steps=2", "name=cut"], corpus)
    assert cut.returncode == 0, cut.stderr[-3000:]
    other_plan = ["plan.num_microbatches=2", "plan.stages.0.data=4"]  # microbatch 4 sequences, data 4
    resumed = _run([TINY, *QUIET, DATA, "train.steps=4", "name=cut", *other_plan], corpus)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_sequences_and_losses(corpus, "cut")


@pytest.mark.multiproc
def test_a_one_process_run_resumed_under_mpirun_continues_at_the_sequences_consumed(corpus):
    cut = _run([TINY, *QUIET, DATA, "train.steps=2", "checkpoint.every_steps=2", "name=cut_mp"], corpus)
    assert cut.returncode == 0, cut.stderr[-3000:]
    argv = [sys.executable, "-m", "h2jax.cli", "train", TINY, *QUIET, DATA, "train.steps=4", "name=cut_mp"]
    resumed = mpirun(2, argv + ["plan.num_microbatches=2"], corpus)  # a process per stage, ffi transport
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_sequences_and_losses(corpus, "cut_mp")
