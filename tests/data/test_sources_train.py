"""`h2jax train` from two weighted ArrayRecord stores that `h2jax tokenize` wrote: a run stopped
at step 2 and resumed under another plan (another microbatch count and data degree) consumes
the sequences of an uninterrupted run, step by step, and its losses follow."""

from __future__ import annotations

import json

import pytest

from h2jax.runtime import read_metrics
from tests._harness import QUIET, TINY
from tests._harness import cli_env as _env
from tests._harness import train_cli as _run

pytestmark = pytest.mark.slow


def test_a_resume_under_another_plan_continues_at_the_sequences_consumed(tmp_path):
    import subprocess
    import sys
    from pydoc_data.topics import topics

    keys = sorted(topics)
    (tmp_path / "a.txt").write_text("\n\n".join(topics[k] for k in keys[:40]))
    (tmp_path / "b.txt").write_text("\n\n".join(topics[k] for k in keys[40:]))
    for name, shards in (("a", 3), ("b", 2)):
        r = subprocess.run(
            [sys.executable, "-m", "h2jax.cli", "tokenize", f"{name}.txt", "--tokenizer", "byte", "--format",
             "arrayrecord", "--shards", str(shards), "--out", name, "--no-progress"],
            cwd=tmp_path, env=_env(), capture_output=True, text=True,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
    data = "data.sources=" + json.dumps({"a": 3, "b": 1})
    whole = _run([TINY, *QUIET, data, "train.steps=4", "name=whole"], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "data: 2 source(s)" in whole.stderr and "a 75%" in whole.stderr
    cut = _run([TINY, *QUIET, data, "train.steps=2", "checkpoint.every_steps=2", "name=cut"], tmp_path)
    assert cut.returncode == 0, cut.stderr[-3000:]
    other_plan = ["plan.num_microbatches=2", "plan.stages.0.data=4"]  # microbatch 4 sequences, data 4
    resumed = _run([TINY, *QUIET, data, "train.steps=4", "name=cut", *other_plan], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = {r["step"]: r for r in read_metrics(tmp_path / "runs" / "whole" / "metrics.jsonl")}
    got = {r["step"]: r for r in read_metrics(tmp_path / "runs" / "cut" / "metrics.jsonl")}
    assert sorted(got) == [0, 1, 2, 3]
    assert [got[s]["data_position"] for s in range(4)] == [rows[s]["data_position"] for s in range(4)] == [0, 8, 16, 24]
    for s in range(4):  # the same sequences, split into other microbatches on another mesh
        assert abs(got[s]["loss"] - rows[s]["loss"]) <= 1e-5, (s, got[s]["loss"], rows[s]["loss"])
