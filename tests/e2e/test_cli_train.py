"""`h2jax train` end to end through the real CLI: exit code, run folder, metrics, trace, Gantt."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from h2jax.plan import check_execution
from h2jax.runtime import load_trace, read_metrics

pytestmark = pytest.mark.slow  # end-to-end runs through the CLI: the full suite, not the fast lane

REPO = Path(__file__).resolve().parents[2]


def _run(args, cwd, *, xla_flags: str | None = None):
    """``h2jax ARGS`` with the suite's compile flags (tests/conftest.py), or `xla_flags`."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["XLA_FLAGS"] = os.environ.get("H2JAX_TEST_XLA_FLAGS", "") if xla_flags is None else xla_flags
    return subprocess.run(
        [sys.executable, "-m", "h2jax.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_train_tiny_through_the_cli(tmp_path):
    proc = _run(["train", str(REPO / "configs" / "tiny.yaml"), "train.steps=4"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "tiny"
    assert proc.stdout.strip().endswith(str(Path("runs") / "tiny"))  # the run folder is printed
    for name in ("config.yaml", "plan.yaml", "metrics.jsonl", "trace.json", "gantt.png", "summary.json"):
        assert (run / name).is_file(), name
    assert any((run / "tb").iterdir())
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        for key in (
            "loss",
            "grad_norm",
            "lr",
            "step_time_s",
            "tokens_per_s",
            "tgs",
            "tgs/sim_a",
            "tgs/sim_b",
            "bubble_fraction",
            "mfu",
            "mfu/sim_a",
            "mfu/sim_b",
        ):
            assert key in r and math.isfinite(r[key]), key
        assert 0.0 <= r["bubble_fraction"] < 1.0
    # the trace of the run: every fwd/bwd with its args, in an order the schedule allows
    trace = json.loads((run / "trace.json").read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["kind"] for e in complete} == {"fwd", "bwd", "send", "recv", "update"}
    assert all({"step", "stage", "microbatch", "kind"} <= set(e["args"]) for e in complete)
    events = load_trace(run / "trace.json")
    for step in range(4):
        compute = [
            (e.stage, "F" if e.kind == "fwd" else "B", e.microbatch, e.start_us, e.end_us)
            for e in events
            if e.step == step and e.kind in ("fwd", "bwd")
        ]
        assert check_execution(compute, num_stages=2, num_microbatches=4, max_in_flight=[2, 1], eps=1e-3) == []
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and math.isfinite(summary["last_loss"])
    # the link table: one process moves the boundary with jax.device_put, timed at start-up
    assert "link stage 0 (sim_a) -> stage 1 (sim_b): host via local (engine jax.device_put" in proc.stderr
    (link,) = summary["links"]
    assert link["path"] == "host" and link["ranks"] is None and link["small_us"] > 0 and link["large_gbps"] > 0


def test_default_job_loss_falls(tmp_path):
    """The default job's model and plan, shortened: the loss falls clearly (5.58 at step 0,
    3.18-3.29 over steps 15-19, 2.88-2.99 over steps 35-39 when measured)."""
    # with XLA's default flags: the default model's steps execute more than they compile (with
    # the suite's -O0, in this process: 39 s against 24 s)
    args = ["train", "train.steps=20", "train.progress=false", "train.tensorboard=false", "train.timeline=false"]
    proc = _run([*args, "--run-dir", str(tmp_path / "run")], tmp_path, xla_flags="")
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [h["step"] for h in history] == list(range(20))
    first, last = history[0]["loss"], min(h["loss"] for h in history[-5:])
    assert first > 5.0 and last < first - 1.5, (first, last)
