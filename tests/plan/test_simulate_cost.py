"""Simulator and cost model on toy numbers, and the planner CLI (exit 2 on bad input)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from h2jax.plan import (  # noqa: I001
    ChipProfile,
    ModelShape,
    Plan,
    StageSpec,
    check_execution,
    estimate,
    get_schedule,
    simulate,
    simulate_plan,
    stage_tasks,
)
from tests._harness import REPO


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("n,m", [(1, 1), (2, 4), (3, 3), (4, 8), (5, 2)])
def test_unit_durations_replay_the_schedule_grid(schedule, n, m):
    sched = get_schedule(schedule, n, m)
    sim = simulate(schedule=schedule, num_microbatches=m, fwd=[1.0] * n, bwd=[1.0] * n)
    grid = sched.tasks()
    for s in range(n):
        assert sim.stage_order(s) == [(t.kind, t.microbatch) for t in stage_tasks(grid, s)]
    events = [
        (e.stage, "F" if e.kind == "fwd" else "B", e.microbatch, e.start, e.end)
        for e in sim.events
        if e.kind in ("fwd", "bwd")
    ]
    assert check_execution(events, num_stages=n, num_microbatches=m, max_in_flight=sched.max_in_flight()) == []
    # equal stages, no transfers: the analytic (m - 1) * max + sum is exact
    assert math.isclose(sim.iteration_s, (m - 1) * 2.0 + n * 2.0)


def test_transfers_and_tails_delay_the_step():
    base = simulate(schedule="1f1b", num_microbatches=4, fwd=[1.0, 1.0], bwd=[2.0, 2.0])
    slow = simulate(
        schedule="1f1b",
        num_microbatches=4,
        fwd=[1.0, 1.0],
        bwd=[2.0, 2.0],
        transfer_fwd=[0.5],
        transfer_bwd=[0.5],
        tail=[0.0, 3.0],
    )
    assert slow.iteration_s > base.iteration_s
    assert {e.kind for e in slow.events} >= {"send", "recv", "update"}
    trace = slow.to_chrome_trace()
    assert any(ev.get("args", {}).get("kind") == "send" for ev in trace["traceEvents"])


CHIPS = {
    "big": ChipProfile(
        "big",
        memory_gib=0.02,
        peak_tflops=0.05,
        mem_bw_gbps=20,
        intra_node_gbps=10,
        inter_node_gbps=5,
        devices_per_node=4,
    ),
    "fast": ChipProfile(
        "fast",
        memory_gib=0.01,
        peak_tflops=0.2,
        mem_bw_gbps=40,
        intra_node_gbps=10,
        inter_node_gbps=5,
        devices_per_node=4,
    ),
}
MODEL = ModelShape(n_layers=6, d_model=64, n_heads=4, d_ff=128, vocab_size=256, seq_len=64, act_bytes=4)


def _plan(rc0=False, layers=(3, 3), schedule="1f1b"):
    return Plan(
        stages=(StageSpec("big", (0, layers[0]), 1, 1, rc0), StageSpec("fast", (layers[0], 6), 1, 1)),
        global_batch=8,
        num_microbatches=4,
        schedule=schedule,
    )


def test_cost_model_toy_numbers():
    a = estimate(_plan(), MODEL, CHIPS)
    r = estimate(_plan(rc0=True), MODEL, CHIPS)
    # recompute: one more forward in the backward, fewer activations kept
    assert math.isclose(r.stages[0].bwd_s, a.stages[0].bwd_s + a.stages[0].fwd_s)
    assert r.stages[0].memory.activations < a.stages[0].memory.activations
    # GPipe holds every microbatch; 1F1B holds num_stages - stage_idx on stage 0
    g = estimate(_plan(schedule="gpipe"), MODEL, CHIPS)
    assert g.stages[0].in_flight == 4 and a.stages[0].in_flight == 2
    assert math.isclose(g.iteration_s, a.iteration_s)
    # the formula
    ts = [s.t for s in a.stages]
    want = 3 * max(ts) + sum(ts) + sum(a.transfers_fwd) + sum(a.transfers_bwd) + max(s.tail_s for s in a.stages)
    assert math.isclose(a.iteration_s, want)
    # simulation agrees with the formula within the slack of the fill/drain approximation
    sim, _ = simulate_plan(_plan(), MODEL, CHIPS)
    assert abs(sim.iteration_s / a.iteration_s - 1) < 0.1


def test_plan_that_does_not_fit_is_rejected_with_numbers():
    tiny = {
        **CHIPS,
        "fast": ChipProfile(
            "fast",
            memory_gib=0.0005,
            peak_tflops=0.2,
            mem_bw_gbps=40,
            intra_node_gbps=10,
            inter_node_gbps=5,
            devices_per_node=4,
        ),
    }
    c = estimate(_plan(), MODEL, tiny)
    assert not c.fits and "stage 1" in c.reasons[0] and "GiB" in c.reasons[0]


def _cli(*args, cwd=None):
    env = {**os.environ, "COLUMNS": "400"}  # the table's headers unwrapped, whatever the test's terminal
    return subprocess.run(
        [sys.executable, "-m", "h2jax.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


def test_cli_plan_writes_a_trainable_experiment(tmp_path):
    r = _cli("plan", "configs/clusters/sim_mix.yaml", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    same = re.search(r"HeteroSpeedupRatio at the same global batch \(32 hetero, 32 homogeneous\): ([\d.]+) %", out)
    matched = re.search(
        r"HeteroSpeedupRatio at the matched total batch \(32 hetero; homogeneous .* split searched\): ([\d.]+) %", out
    )
    assert same and matched, out
    report = json.loads((tmp_path / "comparison.json").read_text())  # both ratios in the plan's files
    assert report["chips_used"] == {"sim_a": [4, 4], "sim_b": [4, 4]} and report["idle"] == {}
    ratios = report["heterospeedup"]
    assert f"{100 * ratios['same_batch']['ratio']:.1f}" == same.group(1)
    assert f"{100 * ratios['matched_total']['ratio']:.1f}" == matched.group(1)
    assert sum(ratios["matched_total"]["shares"].values()) == 32
    ok = _cli("check-config", str(tmp_path / "experiment.yaml"))
    assert ok.returncode == 0, ok.stderr
    # simulate writes its trace and picture by default (it wrote nothing without --out), and a
    # second run keeps the first one's beside them, with a line
    cluster = str(REPO / "configs" / "clusters" / "sim_mix.yaml")
    for _ in range(2):
        sim = _cli("simulate", str(tmp_path / "plan.yaml"), "--cluster", cluster, cwd=tmp_path)
        assert sim.returncode == 0, sim.stderr
        out = tmp_path / "runs" / "simulate"
        assert (out / "trace.json").is_file() and (out / "gantt.png").is_file()
    (kept,) = [p for p in (tmp_path / "runs").iterdir() if p.name.startswith("simulate.")]
    assert sorted(p.name for p in kept.iterdir()) == ["gantt.png", "trace.json"]
    assert f"the earlier output in runs/simulate is kept in runs/{kept.name}" in " ".join(sim.stderr.split())


def test_cli_plan_explains_every_word_it_prints_and_keeps_an_earlier_plan(tmp_path):
    """Each term of the plan's output has its line under --explain (with this plan's numbers); a
    second --out into the same folder keeps the first plan's files beside the new ones, with a line."""
    first = _cli("plan", "configs/clusters/sim_mix.yaml", "--out", str(tmp_path), "--time-budget", "5")
    assert first.returncode == 0, first.stderr
    assert "--explain says what each word and number above means" in first.stdout
    r = _cli("plan", "configs/clusters/sim_mix.yaml", "--out", str(tmp_path), "--time-budget", "5", "--explain")
    assert r.returncode == 0, r.stderr
    out, _, explained = " ".join(r.stdout.split()).partition("what the output means")
    assert explained, r.stdout
    terms = {  # what the output prints -> the word its explanation starts with
        "data x tensor": "data x tensor:",
        "fwd+bwd / mb": "fwd+bwd / mb:",
        "roofline (": "costs:",
        "memory / device": "memory / device:",
        "estimated iteration": "estimated iteration:",
        "bubble": "bubble:",
        "lower bound": "lower bound:",
        "gap": "gap:",
        "exhaustive": "`exhaustive`",
        "memory-descending": "stage order:",
        "TGS": "TGS:",
        "(exact)": "`exact`",
        "HeteroSpeedupRatio": "HeteroSpeedupRatio:",
        "matched total batch": "matched total batch:",
    }
    for printed, word in terms.items():
        assert printed in out and word in explained, (printed, word)
    gap = re.search(r"\(gap ([\d.]+) %\)", out).group(1)
    assert f"- 1 = {gap} %" in explained  # the numbers are this plan's, not a fixed text
    header = (tmp_path / "plan.yaml").read_text()
    assert "`h2jax train` reads it there: the experiment.yaml" in header and "read by `h2jax train`" not in header
    kept = sorted(p.name for p in tmp_path.iterdir())
    stamp = [p for p in kept if p.startswith("plan.") and p != "plan.yaml"]
    assert len(kept) == 6 and {"plan.yaml", "experiment.yaml", "comparison.json"} <= set(kept) and len(stamp) == 1, kept
    assert f"the earlier {tmp_path / 'plan.yaml'} is kept as {tmp_path / stamp[0]}" in " ".join(r.stderr.split())


def test_cli_plan_bad_input_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("chips: {sim_a: {nodes: 1}}\nmodel: {n_layers: 0}\nglobal_batch: 8\n")
    r = _cli("plan", str(bad))
    assert r.returncode == 2 and "config error" in r.stderr
    assert _cli("plan", "no_such_cluster").returncode == 2
