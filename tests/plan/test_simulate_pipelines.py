"""The simulator replays a job of several pipelines in one replay: each pipeline its own chain of
events, stages of any pipelines on one shared host sharing its cores, and the step ending as the
runtime ends it (the last backward of every pipeline, the gradient sum, every stage's tail at
once, the copy back). A plan of one pipeline replays as it always did. Hand-computed numbers and
the cost model's durations; no JAX."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import pytest
import yaml

from h2jax.plan import Cluster, ModelShape, Plan, PlanError, StageSpec, estimate, simulate, simulate_plan
from h2jax.plan._pipelines import exchange_s
from h2jax.plan._simulate import simulate_pipelines

ROOT = Path(__file__).resolve().parents[2]


def _key(events):
    return [(e.kind, e.stage, e.microbatch, e.start, e.end, e.extra) for e in events]


def _compute_end(sim) -> float:
    return max(e.end for e in sim.events if e.kind in ("fwd", "bwd"))


def _sim_mix(*, host: str | None, cores: int = 2) -> tuple[Cluster, ModelShape]:
    """configs/clusters/sim_mix.yaml, its chips emulated on one host of `cores` cores (or, `host` None, real
    chips with hosts of their own)."""
    path = ROOT / "configs" / "clusters" / "sim_mix.yaml"
    cluster = Cluster.load(path)
    chips = tuple(
        (dataclasses.replace(p, host=host, host_cores=cores, emulated=host is not None), n) for p, n in cluster.chips
    )
    return Cluster(chips, name="sim_mix"), ModelShape.from_config(yaml.safe_load(path.read_text())["model"])


MIXED = Plan(
    (StageSpec("sim_a", (0, 3), 1, 1), StageSpec("sim_b", (3, 6), 1, 1)),
    global_batch=16,
    num_microbatches=4,
    schedule="1f1b",
)
ALONE_A = Plan((StageSpec("sim_a", (0, 6), 1, 1),), global_batch=8, num_microbatches=2, schedule="1f1b")
ALONE_B = Plan((StageSpec("sim_b", (0, 6), 1, 1),), global_batch=8, num_microbatches=2, schedule="1f1b")


# -- (a) one pipeline: as before ------------------------------------------------------------------------
def test_one_pipeline_replays_as_simulate_does():
    rng = random.Random(5)
    for _ in range(30):
        n, m = rng.randint(1, 4), rng.randint(1, 6)
        kw = dict(
            schedule=rng.choice(["1f1b", "gpipe"]),
            num_microbatches=m,
            fwd=[rng.uniform(0.1, 1) for _ in range(n)],
            bwd=[rng.uniform(0.1, 2) for _ in range(n)],
            tail=[rng.uniform(0, 1) for _ in range(n)],
            hosts=["h"] * n,
            fwd_cores=[rng.uniform(0.5, 2) for _ in range(n)],
            bwd_cores=[rng.uniform(0.5, 2) for _ in range(n)],
        )
        a, b = simulate(**kw, host_cores={"h": 2}), simulate_pipelines([kw], host_cores={"h": 2})
        assert _key(a.events) == _key(b.events) and a.iteration_s == b.iteration_s and b.pipelines == ()


def test_one_pipeline_keeps_each_tail_after_its_own_last_op():
    # 2 stages, 1 microbatch, every op 1 s: stage 1's backward ends at 3, stage 0's at 4; stage
    # 1's tail of 5 s starts at 3 (a job of several pipelines would start it at 4)
    sim = simulate(schedule="1f1b", num_microbatches=1, fwd=[1.0, 1.0], bwd=[1.0, 1.0], tail=[0.0, 5.0])
    assert math.isclose(sim.iteration_s, 8.0)
    assert not [e for e in sim.events if e.kind == "other"]


def test_a_plan_of_one_pipeline_simulates_as_before():
    cluster, model = _sim_mix(host="local")
    sim, cost = simulate_plan(MIXED, model, cluster)
    st = cost.stages
    again = simulate(
        schedule=MIXED.schedule,
        num_microbatches=MIXED.num_microbatches,
        fwd=[s.fwd_s for s in st],
        bwd=[s.b_s for s in st],
        wgt=[s.w_s for s in st],
        transfer_fwd=cost.transfers_fwd,
        transfer_bwd=cost.transfers_bwd,
        tail=[s.tail_s for s in st],
        chips=["sim_a", "sim_b"],
        hosts=[s.host for s in st],
        host_cores=cost.host_cores,
        fwd_cores=[s.fwd_cores for s in st],
        bwd_cores=[s.bwd_cores for s in st],
        tail_cores=[s.tail_cores for s in st],
    )
    assert _key(sim.events) == _key(again.events) and sim.iteration_s == again.iteration_s
    assert cost.iteration_s == estimate(MIXED, model, cluster).iteration_s
    one, _ = simulate_plan(Plan(pipelines=(MIXED,)), model, cluster)  # a plan of one pipeline is that pipeline
    assert one.iteration_s == sim.iteration_s


# -- (b) pipelines on hosts of their own: the slowest plus the exchange ---------------------------------
TWO = [
    dict(schedule="1f1b", num_microbatches=4, fwd=[1.0, 0.5], bwd=[2.0, 1.0], transfer_fwd=[0.1], transfer_bwd=[0.1]),
    dict(schedule="gpipe", num_microbatches=2, fwd=[3.0], bwd=[4.0]),
]


def test_pipelines_on_their_own_hosts_take_the_slowest_plus_the_exchange():
    alone = [simulate(**kw).iteration_s for kw in TWO]
    both = simulate_pipelines(TWO, exchange_s=0.8)
    assert math.isclose(both.iteration_s, max(alone) + 0.8)
    # each pipeline's events are its own replay's, under the job's stage index (pipeline 1: stage 2)
    for p, (kw, off) in enumerate(zip(TWO, (0, 2))):
        mine = [e for e in both.events if e.kind != "other" and both.pipelines[e.stage] == p]
        shifted = [
            dataclasses.replace(
                e,
                stage=e.stage + off,
                extra={**e.extra, **({"peer": e.extra["peer"] + off} if "peer" in e.extra else {})},
            )
            for e in simulate(**kw).events
        ]
        assert sorted(_key(mine), key=repr) == sorted(_key(shifted), key=repr)
    assert both.pipelines == (0, 0, 1) and both.num_stages == 3
    # the exchange on every stage: half (the gradients) after the last backward, half (the values)
    # after the tails
    other = sorted({(e.start, e.end, e.extra["name"]) for e in both.events if e.kind == "other"})
    end = max(alone)
    assert other == [
        (end, pytest.approx(end + 0.4), "across pipelines: gradients summed"),
        (pytest.approx(end + 0.4), pytest.approx(end + 0.8), "across pipelines: parameters copied"),
    ]
    assert len([e for e in both.events if e.kind == "other"]) == 2 * 3
    # the sum's seconds given (the cost model prices the two parts apart): the same step, split there
    split = simulate_pipelines(TWO, exchange_s=0.8, exchange_summed_s=0.5)
    assert math.isclose(split.iteration_s, both.iteration_s)
    other = sorted({(e.start, e.end, e.extra["name"]) for e in split.events if e.kind == "other"})
    assert other[0][1] == pytest.approx(end + 0.5) and other[1][:2] == (
        pytest.approx(end + 0.5),
        pytest.approx(end + 0.8),
    )
    with pytest.raises(ValueError, match="exchange_summed_s=0.9"):
        simulate_pipelines(TWO, exchange_s=0.8, exchange_summed_s=0.9)


def test_every_tail_waits_for_the_last_backward_of_the_job():
    # pipeline 1 (gpipe, 2 x (3 + 4) s) ends its compute at 14, after pipeline 0; every stage's
    # tail (3 s on pipeline 0's, 1 s on pipeline 1's) runs from 14 + the gradient sum on, all at
    # once: 3 s, then the copy back
    tails = [dict(TWO[0], tail=[3.0, 3.0]), dict(TWO[1], tail=[1.0])]
    ends = [_compute_end(simulate(**kw)) for kw in TWO]
    assert ends[1] == 14.0 and ends[0] < 14.0
    both = simulate_pipelines(tails, exchange_s=0.8)
    assert math.isclose(both.iteration_s, 14.0 + 0.4 + 3.0 + 0.4)
    updates = sorted((e.stage, e.start, e.end) for e in both.events if e.kind == "update")
    assert updates == [(0, 14.4, 17.4), (1, 14.4, 17.4), (2, 14.4, 15.4)]
    # alone, pipeline 0's tails follow its stages' own last ops: the sum of the alone steps is less
    alone = max(simulate(**kw).iteration_s for kw in tails)
    assert math.isclose(alone, ends[0] + 3.0) and alone + 0.8 < both.iteration_s


def test_a_pair_of_stages_with_processes_of_their_own_sums_once_both_are_done():
    # two pipelines of 2 stages, 1 microbatch, every op 1 s: each pipeline's stage 1 is done at 3,
    # its stage 0 at 4. The last stages' pair (owner 1, mirror 3: 2 s) runs 3 -> 5, beside the
    # first stages' last backward; the first stages' (owner 0, mirror 2: 0.5 s) 4 -> 4.5; every
    # tail (1 s) from 5, the copy back (0.3 s) after it: 6.3 (after the last op: 4 + 2 + 1 + 0.3)
    kw = dict(schedule="1f1b", num_microbatches=1, fwd=[1.0, 1.0], bwd=[1.0, 1.0], tail=[1.0, 1.0])
    both = simulate_pipelines(
        [kw, kw], exchange_s=0.3, exchange_summed_s=0.0, exchange_pairs=[(0, 2, 0.5), (1, 3, 2.0)]
    )
    assert math.isclose(both.iteration_s, 6.3)
    summed = sorted((e.stage, e.start, e.end, e.extra["with"]) for e in both.events if "with" in e.extra)
    assert summed == [(0, 4.0, 4.5, 2), (1, 3.0, 5.0, 3)]  # on the owner, who adds
    after = simulate_pipelines([kw, kw], exchange_s=2.3, exchange_summed_s=2.0)
    assert math.isclose(after.iteration_s, 7.3)
    # a mirror posts to each of its owners and goes on: mirror 2 (done at 4) to owner 1 (done at
    # 3) 4 -> 5 and to owner 0 (done at 4) 4 -> 4.5 at once; tails 5 -> 6
    posted = simulate_pipelines([kw, kw], exchange_pairs=[(1, 2, 1.0), (0, 2, 0.5)])
    assert math.isclose(posted.iteration_s, 6.0)
    # an owner takes its mirrors one after the other: owner 0 (done at 4) adds mirror 2's
    # (done at 4) 4 -> 4.5, then mirror 3's (done at 3) 4.5 -> 5.5; tails 5.5 -> 6.5
    chained = simulate_pipelines([kw, kw], exchange_pairs=[(0, 2, 0.5), (0, 3, 1.0)])
    assert math.isclose(chained.iteration_s, 6.5)
    # on a shared host one process drives every stage: the pairs run after the last op, in turn,
    # then the four tails one after another (the shared host's rule)
    shared = [dict(kw, hosts=["h", "h"]), dict(kw, hosts=["h", "h"])]
    on_host = simulate_pipelines(shared, exchange_pairs=[(1, 3, 2.0)], host_cores={"h": 8})
    last = max(e.end for e in on_host.events if e.kind in ("fwd", "bwd"))
    assert math.isclose(on_host.iteration_s, last + 2.0 + 4 * 1.0)


def test_a_plan_of_two_pipelines_on_hosts_of_their_own():
    cluster, model = _sim_mix(host=None)
    plan = Plan(pipelines=(ALONE_A, ALONE_B))
    sim, job = simulate_plan(plan, model, cluster)
    assert job.exchange_s == exchange_s(plan, model, cluster.profiles) > 0
    ends = [_compute_end(simulate_plan(p, model, cluster)[0]) for p in (ALONE_A, ALONE_B)]
    tails = max(s.tail_s for c in job.pipelines for s in c.stages)
    assert math.isclose(sim.iteration_s, max(ends) + job.exchange_s + tails, rel_tol=1e-12)
    assert sim.stage_labels() == ["pipeline 0 · stage 0 · sim_a", "pipeline 1 · stage 1 · sim_b"]
    trace = sim.to_chrome_trace()
    names = {ev.get("name") for ev in trace["traceEvents"]}
    assert "across pipelines: gradients summed" in names and "across pipelines: parameters copied" in names


# -- (c) pipelines sharing a host ----------------------------------------------------------------------
ONE_STAGE = dict(schedule="1f1b", num_microbatches=2, fwd=[1.0], bwd=[2.0], hosts=["h"])


def test_pipelines_on_one_host_share_its_cores():
    # each pipeline alone: 2 x (1 + 2) = 6 s. Wanting 2 cores each on a 2-core host, together each
    # runs at half speed: 12 s (the joint 24 core-seconds over 2 cores), then the exchange
    busy = dict(ONE_STAGE, fwd_cores=[2.0], bwd_cores=[2.0])
    alone = simulate(**busy, host_cores={"h": 2}).iteration_s
    assert math.isclose(alone, 6.0)
    both = simulate_pipelines([busy, busy], exchange_s=0.4, host_cores={"h": 2})
    assert math.isclose(both.iteration_s, 12.0 + 0.4)
    # wanting 1 core each, they fit side by side: as fast as alone
    light = dict(ONE_STAGE, fwd_cores=[1.0], bwd_cores=[1.0])
    assert math.isclose(simulate_pipelines([light, light], exchange_s=0.4, host_cores={"h": 2}).iteration_s, 6.4)
    # on hosts of their own: as fast as alone whatever they want
    apart = [dict(busy, hosts=["h"]), dict(busy, hosts=["g"])]
    assert math.isclose(simulate_pipelines(apart, exchange_s=0.4, host_cores={"h": 2, "g": 2}).iteration_s, 6.4)


def test_tails_on_a_shared_host_run_one_after_another_in_stage_order():
    # the runtime dispatches the updates from one thread; a CPU client runs each on that thread.
    # 4 cores, 1 each wanted: no sharing; pipeline 0's compute ends at 6, pipeline 1's at 3; the
    # gradient sum 0.5 s; then stage 0's tail (1 s), stage 1's (2 s), the copy back 0.5 s
    pipes = [
        dict(ONE_STAGE, tail=[1.0]),
        dict(ONE_STAGE, fwd=[0.5], bwd=[1.0], tail=[2.0]),
    ]
    sim = simulate_pipelines(pipes, exchange_s=1.0, host_cores={"h": 4})
    updates = sorted((e.stage, e.start, e.end) for e in sim.events if e.kind == "update")
    assert updates == [(0, 6.5, 7.5), (1, 7.5, 9.5)] and math.isclose(sim.iteration_s, 10.0)
    # hosts of their own: at once
    apart = [dict(pipes[0], hosts=None), dict(pipes[1], hosts=None)]
    assert math.isclose(simulate_pipelines(apart, exchange_s=1.0).iteration_s, 6.5 + 2.0 + 0.5)


def test_shared_host_is_never_faster_than_its_cores_nor_than_either_pipeline_alone():
    rng = random.Random(11)
    for _ in range(25):
        pipes, work = [], 0.0
        for _ in range(rng.randint(2, 3)):
            n, m = rng.randint(1, 3), rng.randint(1, 5)
            kw = dict(
                schedule=rng.choice(["1f1b", "gpipe"]),
                num_microbatches=m,
                fwd=[rng.uniform(0.1, 1) for _ in range(n)],
                bwd=[rng.uniform(0.1, 2) for _ in range(n)],
                tail=[rng.uniform(0, 0.5) for _ in range(n)],
                hosts=["h"] * n,
                fwd_cores=[rng.uniform(1, 2) for _ in range(n)],
                bwd_cores=[rng.uniform(1, 2) for _ in range(n)],
                tail_cores=[rng.uniform(1, 2) for _ in range(n)],
            )
            pipes.append(kw)
            work += sum(
                m * (f * cf + b * cb) + t * ct
                for f, b, t, cf, cb, ct in zip(
                    kw["fwd"], kw["bwd"], kw["tail"], kw["fwd_cores"], kw["bwd_cores"], kw["tail_cores"]
                )
            )
        cores = rng.choice([1, 2])
        both = simulate_pipelines(pipes, exchange_s=0.3, host_cores={"h": cores})
        alone = max(simulate(**kw, host_cores={"h": cores}).iteration_s for kw in pipes)
        assert both.iteration_s >= work / cores + 0.3 - 1e-9
        assert both.iteration_s > alone + 0.3


def test_a_plan_of_two_pipelines_on_one_emulated_host():
    cluster, model = _sim_mix(host="local", cores=1)
    plan = Plan(pipelines=(ALONE_A, ALONE_B))
    sim, job = simulate_plan(plan, model, cluster)
    alone = [simulate_plan(p, model, cluster)[0].iteration_s for p in (ALONE_A, ALONE_B)]
    work = sum(c.host_work_s["local"] for c in job.pipelines)
    assert sim.iteration_s >= work / 1 + job.exchange_s - 1e-9
    assert sim.iteration_s > max(alone) + job.exchange_s
    assert job.iteration_s >= job.host_bound_s  # the estimate's own bound: the same joint work


# -- bad input -----------------------------------------------------------------------------------------
def test_bad_input_names_the_pipeline_and_the_key():
    with pytest.raises(ValueError, match=r"^pipelines\[1\]: fwd has 1 stages, bwd 2$"):
        simulate_pipelines([TWO[0], dict(TWO[1], bwd=[1.0, 2.0])])
    with pytest.raises(ValueError, match=r"pipelines\[0\]: unknown key\(s\) host_cores; give it once"):
        simulate_pipelines([dict(TWO[0], host_cores={"h": 2}), TWO[1]])
    with pytest.raises(ValueError, match=r"pipelines\[1\]: unknown key\(s\) fwds"):
        simulate_pipelines([TWO[0], {**TWO[1], "fwds": [1.0]}])
    with pytest.raises(PlanError, match=r"plan\.pipelines\[1\]\.schedule"):
        simulate_pipelines([TWO[0], dict(TWO[1], schedule="nope")])
    with pytest.raises(ValueError, match=r"exchange_s=-1"):
        simulate_pipelines(TWO, exchange_s=-1)
    with pytest.raises(ValueError, match="one pipeline exchanges nothing"):
        simulate_pipelines(TWO[:1], exchange_s=1.0)
    with pytest.raises(ValueError, match="one pipeline exchanges nothing"):
        simulate_pipelines(TWO[:1], exchange_pairs=[(0, 1, 1.0)])
    with pytest.raises(ValueError, match=r"exchange_pairs: \(0, 2, -1.0\)"):
        simulate_pipelines(TWO, exchange_pairs=[(0, 2, -1.0)])
    with pytest.raises(ValueError, match=r"host_cores has no entry for shared host\(s\) \['h'\]"):
        simulate_pipelines([ONE_STAGE, ONE_STAGE])
