"""``h2jax train --elastic``: a 3-stage job over sim_a (2 nodes) and sim_b (2 nodes) loses a
sim_b node mid-run -- in one process and under mpirun -- and finishes on the plan the planner
chose for the survivors, without a person: every step once in metrics.jsonl, the events file
names the lost node, and the steps after the rewind equal a manual restore of the same
checkpoint under that plan. A second loss that leaves too little memory ends the job with one
line. Five kill -9s of random ranks at random steps end with every step trained once and the
parameters of an uninterrupted run."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from h2jax.elastic import parse_fault
from h2jax.runtime import load_trace, read_metrics
from tests._harness import MPIRUN, QUIET, final_params, run_losses, train_cli

EL = """
name: el
model: {vocab_size: 256, seq_len: 32, d_model: 32, n_heads: 4, n_layers: 3, d_ff: 128}
cluster:
  chips:
    sim_a: {nodes: 2}
    sim_b: {nodes: 2}
plan:
  global_batch: 8
  num_microbatches: 4
  schedule: 1f1b
  stages:
    - {chip: sim_a, layers: [0, 1]}
    - {chip: sim_b, layers: [1, 2]}
    - {chip: sim_b, layers: [2, 3], tensor: 2}
optimizer: {warmup_steps: 1}
train: {steps: 8}
checkpoint: {every_steps: 2, keep_last: 10}  # every step a resume may start from stays
"""
FAST = ["--backoff-s", "0"]
LAUNCHER = f"{MPIRUN} --allow-run-as-root --oversubscribe -np {{stages}}"


def _events(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_fault_specs_and_their_bad_input():
    assert parse_fault("node:sim_b:1@5", 0) == {"id": 0, "kind": "node", "chip": "sim_b", "node": 1, "step": 5}
    assert parse_fault("kill:2@3", 1) == {"id": 1, "kind": "kill", "rank": 2, "step": 3}
    assert parse_fault("stop:0@7", 2)["kind"] == "stop"
    from h2jax._strict import ConfigError

    with pytest.raises(ConfigError, match="expected node:CHIP:NODE@STEP"):
        parse_fault("node:sim_b@5", 0)


def _lost_node_is_replanned(tmp_path, launcher: list[str]):
    (tmp_path / "el.yaml").write_text(EL)
    trace = "train.timeline=true"
    r = train_cli(
        ["el.yaml", *QUIET, trace, "--elastic", *FAST, "--inject-fault", "node:sim_b:1@5", *launcher], tmp_path
    )
    assert r.returncode == 0, r.stderr[-4000:]
    run = tmp_path / "runs" / "el"
    ev = _events(run)
    kinds = [e["event"] for e in ev]
    assert kinds == ["launch", "failure", "replan", "launch", "first_step", "finished"], kinds
    failure, replan = ev[1], ev[2]
    assert failure["lost_nodes"] == [{"chip": "sim_b", "node": 1}]
    assert failure["lost_processes"][0]["stages"] and failure["lost_processes"][0]["fired_step"] == 5
    assert 0 <= failure["detect_s"] < 10 and replan["replan_s"] < 2 and replan["nodes"] == {"sim_a": 2, "sim_b": 1}
    resume = failure["resume_step"]
    assert resume in (2, 4) and failure["steps_redone"] == 5 - resume  # the save of step 4 may not have committed
    assert "h2jax elastic: launch 0 ended" in r.stderr and "; lost sim_b node 1; resuming from step" in r.stderr
    rows = read_metrics(run / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(8))  # every step once
    aside = read_metrics(run / "metrics.replaced.jsonl")
    assert sorted(row["step"] for row in aside) == list(range(resume, 5))  # the rows of the steps redone
    summary = json.loads((run / "summary.json").read_text())["elastic"]
    assert summary["restarts"] == 1 and summary["lost_nodes"] == [{"chip": "sim_b", "node": 1}]
    assert 0 < summary["goodput"] < 1
    # the trace marks the boundary: on each stage of the new plan, from the relaunch to its first step
    marks = [e for e in load_trace(run / "trace.json") if e.extra.get("recovery")]
    assert sorted(e.stage for e in marks) == list(range(len(replan["plan"]["stages"]))), marks
    assert {(e.step, e.extra["from_step"], e.extra["attempt"]) for e in marks} == {(resume, resume, 1)}
    assert marks[0].name.startswith("resumed after launch 0 ended (") and marks[0].name.endswith("lost sim_b node 1")
    resumed = json.loads((run / "summary.json").read_text())["resumed"]
    assert resumed == {"step": resume, "after": marks[0].name.removeprefix("resumed after ")}
    # a person's restore of the same checkpoint under the plan the planner chose trains the same steps
    manual = tmp_path / "manual"
    shutil.copytree(run / "checkpoints", manual / "checkpoints")
    plan = {k: v for k, v in replan["plan"].items() if k != "model"}
    cluster = json.dumps({"sim_a": {"nodes": 2}, "sim_b": {"nodes": 1}})
    m = train_cli(
        ["el.yaml", *QUIET, trace, f"plan={json.dumps(plan)}", f"cluster.chips={cluster}", "--run-dir", str(manual),
         "--restore-step", str(resume)],
        tmp_path,
    )  # fmt: skip
    assert m.returncode == 0, m.stderr[-3000:]
    assert "resumed" not in json.loads((manual / "summary.json").read_text())  # not an elastic relaunch
    got, want = run_losses(run), run_losses(manual)
    assert sorted(want) == list(range(resume, 8))
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-6, (s, got[s], want[s])
    return r


@pytest.mark.slow
def test_a_lost_node_is_replanned_and_the_job_finishes_in_one_process(tmp_path):
    r = _lost_node_is_replanned(tmp_path, [])
    assert "re-planned onto sim_a 2 nodes, sim_b 1 node" in r.stderr


@pytest.mark.multiproc
def test_a_lost_node_is_replanned_and_the_job_finishes_under_mpirun(tmp_path):
    _lost_node_is_replanned(tmp_path, ["--launcher", LAUNCHER])


@pytest.mark.slow
def test_a_second_loss_that_leaves_too_little_memory_ends_the_job_in_one_line(tmp_path):
    (tmp_path / "el.yaml").write_text(EL)
    small_a = [  # one sim_a device of 1.4 MiB: stage 0 fits, the whole model does not
        "cluster.chips.sim_a.nodes=1",
        "cluster.chips.sim_a.devices_per_node=1",
        "cluster.chips.sim_a.memory_gib=0.0014",
        "plan.stages.0.recompute=true",
    ]
    faults = ["--inject-fault", "node:sim_b:1@3", "--inject-fault", "node:sim_b:0@5"]
    r = train_cli(["el.yaml", *QUIET, *small_a, "--elastic", *FAST, *faults], tmp_path)
    assert r.returncode == 1, r.stderr[-3000:]
    line = [x for x in r.stderr.splitlines() if x.startswith("h2jax: elastic:")]
    assert len(line) == 1, r.stderr[-3000:]
    assert "the surviving chips (sim_a 1 node, sim_b 0 nodes) cannot hold the model" in line[0]
    assert "fits every stage's memory" in line[0] and "committed steps on disk" in line[0]
    ev = _events(tmp_path / "runs" / "el")
    assert [e["event"] for e in ev][-2:] == ["replan", "gave_up"] and ev[-2]["plan"] is None


@pytest.mark.multiproc
def test_kill_9_of_random_ranks_at_random_steps_keeps_every_step_once(tmp_path):
    (tmp_path / "el.yaml").write_text(EL)
    rng = np.random.default_rng(34)
    steps = sorted(rng.choice(np.arange(1, 12), size=5, replace=False).tolist())
    faults = [x for s in steps for x in ("--inject-fault", f"kill:{int(rng.integers(0, 3))}@{s}")]
    common = ["el.yaml", *QUIET, "train.steps=12"]
    r = train_cli([*common, "--elastic", *FAST, "--max-restarts", "5", "--launcher", LAUNCHER, *faults], tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    run = tmp_path / "runs" / "el"
    ev = _events(run)
    failures = [e for e in ev if e["event"] == "failure"]
    assert len(failures) == 5 and not any(e["event"] == "replan" for e in ev)  # a process died, no node: same plan
    assert [f["lost_processes"][0]["fired_step"] for f in failures] == steps
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == list(range(12))
    whole = train_cli([*common, "name=whole"], tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    got, want = final_params(run), final_params(tmp_path / "runs" / "whole")
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0, err_msg=k)


@pytest.mark.slow
def test_a_straggler_is_named_per_chip_type_and_replanned_for_its_measured_speed(tmp_path):
    (tmp_path / "el.yaml").write_text(EL)
    args = ["el.yaml", *QUIET, "train.timeline=true", "train.steps=12", "--elastic", *FAST, "--replan-stragglers"]
    r = train_cli([*args, "--inject-fault", "slow:2:0.05@4"], tmp_path)  # stage 2 (sim_b): +50 ms a fwd / bwd
    assert r.returncode == 0, r.stderr[-4000:]
    assert "h2jax: straggler: stage 2 (sim_b) has taken" in r.stderr
    run = tmp_path / "runs" / "el"
    ev = _events(run)
    straggler = next(e for e in ev if e["event"] == "straggler")
    assert (straggler["stage"], straggler["chip"], straggler["replan"]) == (2, "sim_b", True)
    assert straggler["slowdown"] >= 2 and straggler["step"] >= 4 + 2  # three slow steps seen
    replan = next(e for e in ev if e["event"] == "replan")
    assert replan["slowdown"]["sim_b"] == straggler["slowdown"] and replan["nodes"] == {"sim_a": 2, "sim_b": 2}
    stages = replan["plan"]["stages"]
    on_b = sum(b - a for st in stages if st["chip"] == "sim_b" for a, b in st.get("chunks") or [st["layers"]])
    assert on_b < 2  # the slow chip type now holds fewer of the 3 layers than its 2
    assert not any(e["event"] == "failure" for e in ev)  # a save and a relaunch, nothing lost
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == list(range(12))


@pytest.mark.slow
def test_a_node_that_comes_back_is_admitted_at_a_step_boundary(tmp_path):
    (tmp_path / "el.yaml").write_text(EL)
    faults = ["--inject-fault", "node:sim_b:1@3", "--inject-fault", "back:sim_b@6"]
    r = train_cli(["el.yaml", *QUIET, "train.steps=10", "--elastic", *FAST, *faults], tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    run = tmp_path / "runs" / "el"
    ev = _events(run)
    assert [e["event"] for e in ev if e["event"] in ("failure", "admit", "replan")] == [
        "failure",
        "replan",
        "admit",
        "replan",
    ]
    replans = [e for e in ev if e["event"] == "replan"]
    assert replans[0]["nodes"] == {"sim_a": 2, "sim_b": 1} and replans[1]["nodes"] == {"sim_a": 2, "sim_b": 2}
    assert sum(e["event"] == "failure" for e in ev) == 1  # taking a node in is a save and a relaunch
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == list(range(10))
    from tests._harness import run_cli

    refused = run_cli(["admit", str(run), "sim_b"], tmp_path)  # the supervisor is gone: one line
    assert refused.returncode == 2 and "its supervisor is not running" in refused.stderr
