"""Shared hosts: stages whose chips compute on one machine's cores (emulated chips) slow each
other down. The cost model lengthens the pipeline's steady-state period to the time the host's
cores take to run one microbatch of every stage at once (fluid processor sharing), and bounds
the step by the host's core-seconds over its cores; the simulator shares the cores among the
programs running at once. Hand-computed numbers."""

from __future__ import annotations

import math
import random

import pytest

from h2jax.plan import (
    ChipProfile,
    CostOptions,
    DriverCost,
    LayerCost,
    ModelShape,
    Plan,
    ProfileTable,
    StageSpec,
    estimate,
    get_schedule,
    load_chip,
    simulate,
    simulate_plan,
    stage_cost,
)
from h2jax.plan._cost import fluid_makespan, transfer_s
from h2jax.plan._profiles import PROGRAM, TRANSFER, chip_from_dict

MODEL = ModelShape(n_layers=4, d_model=64, n_heads=4, d_ff=128, vocab_size=256, seq_len=16, act_bytes=4)
SPEC = dict(memory_gib=1.0, peak_tflops=0.1, mem_bw_gbps=40, intra_node_gbps=10, inter_node_gbps=5, devices_per_node=4)


def _chips(**kw) -> dict[str, ChipProfile]:
    return {n: ChipProfile(n, **SPEC, **kw) for n in ("a", "b")}


def _cost(fwd, bwd, cores, update=0.0):
    return LayerCost(
        fwd_s=fwd,
        bwd_s=bwd,
        param_bytes=1e3,
        act_bytes=1e3,
        input_bytes=1e3,
        temp_bytes=1e3,
        estimated=False,
        fwd_cores=cores,
        bwd_cores=cores,
        update_s=update,
    )


def _table(*, host_cores=None) -> ProfileTable:
    """Measured-looking rows for chips a and b at (tensor 1, microbatch 1 and 2 per device)."""
    t = ProfileTable()
    parts = {
        "embed": _cost(0.0, 0.0, 1.0, 0.01),
        "block": _cost(1.0, 2.0, 1.5, 0.1),
        "head": _cost(0.0, 0.0, 1.0, 0.01),
        PROGRAM: _cost(0.1, 0.1, 1.0, 0.08),
    }
    for chip in ("a", "b"):
        for mb in (1, 2):
            t.add(chip, MODEL.key(), 1, mb, parts, host_cores=host_cores)
    return t


def _plan(m=4, data=1):
    return Plan(
        stages=(StageSpec("a", (0, 2), data, 1), StageSpec("b", (2, 4), data, 1)),
        global_batch=2 * m * data,
        num_microbatches=m,
        schedule="1f1b",
    )


def test_chip_profiles_name_their_host():
    assert load_chip("sim_a")[0].host == "local"  # emulated: a CPU client of the machine running the job
    assert load_chip("h100_sxm")[0].host is None  # a real chip has hosts of its own
    prof, _ = chip_from_dict("x", {**SPEC, "host": "box1", "host_cores": 8})
    assert (prof.host, prof.host_cores) == ("box1", 8)
    with pytest.raises(ValueError, match="host_cores"):
        chip_from_dict("x", {**SPEC, "host_cores": 0})


def test_fluid_makespan_hand_computed():
    assert math.isclose(fluid_makespan([(2.0, 1.0), (2.0, 1.0)], 2), 2.0)  # each has its core
    assert math.isclose(fluid_makespan([(3.0, 4.0)], 2), 1.5)  # alone: at most the host's cores
    # both want 2 cores: 1 each until the small one ends at 1, then 2 for the rest: all work / cores
    assert math.isclose(fluid_makespan([(3.0, 2.0), (1.0, 2.0)], 2), 2.0)
    # a job capped at 1 core leaves the other 1 core, and stays the longest: work / cap
    assert math.isclose(fluid_makespan([(4.0, 1.0), (1.0, 2.0)], 2), 4.0)
    # water-filling: capped at 0.5, the first leaves 1.5 to the second (cap 3) on 2 cores; it
    # ends at 1 s, the second has 1.5 left and takes both cores: 1 + 1.5 / 2
    assert math.isclose(fluid_makespan([(0.5, 0.5), (3.0, 3.0)], 2), 1.75)
    assert fluid_makespan([(0.0, 1.0)], 2) == 0.0
    rng = random.Random(5)
    for _ in range(50):  # never below the work over the cores, nor any job's work over its rate
        jobs = [(rng.uniform(0.1, 5), rng.uniform(0.5, 3)) for _ in range(rng.randint(1, 5))]
        c = rng.choice([1, 2, 4])
        t = fluid_makespan(jobs, c)
        assert t >= sum(w for w, _ in jobs) / c * (1 - 1e-12)
        assert all(t >= w / min(cap, c) * (1 - 1e-12) for w, cap in jobs)


def test_stages_sharing_a_host_lengthen_the_steady_state_period():
    chips = _chips(host="h", host_cores=2)
    c = estimate(_plan(), MODEL, chips, table=_table())
    # per stage, one program call each way (0.1 s) + 2 blocks: fwd 2.1 s, bwd 4.1 s
    for s in c.stages:
        assert math.isclose(s.fwd_s, 2.1) and math.isclose(s.bwd_s, 4.1)
        # core-seconds per microbatch: blocks 2 x (1.0 + 2.0) x 1.5 cores + calls 2 x 0.1 x 1 core
        assert math.isclose(s.work_s, 9.2)
    # tails: updates 2 x 0.1 + embed or head 0.01 + call 0.08 = 0.29 s on 1 core
    assert [round(s.tail_s, 9) for s in c.stages] == [0.29, 0.29]
    x = transfer_s(MODEL, chips["a"], (1, 1), chips["b"], (1, 1), microbatch=2)
    # steady state: both stages run a microbatch at once; each wants 9.2 / 6.2 = 1.48 cores,
    # the host has 2, so each gets 1 and takes 9.2 s: the period is 9.2 s, not 6.2 s
    assert math.isclose(c.period_s, 9.2)
    assert math.isclose(c.pipeline_bound_s, 3 * 9.2 + 2 * 6.2 + 2 * x + 0.29)
    # host h: 2 stages x (4 microbatches x 9.2 + 0.29) core-seconds on 2 cores bound it from below
    w = 4 * 9.2 + 0.29
    assert math.isclose(c.host_work_s["h"], 2 * w) and math.isclose(c.host_bound_s["h"], 2 * w / 2)
    assert math.isclose(c.iteration_s, c.pipeline_bound_s) and c.pipeline_bound_s > w
    assert c.bound_by == "pipeline"
    # the same chips with hosts of their own, or the term switched off: the plain pipeline formula
    t_pipe = 3 * 6.2 + 2 * 6.2 + 2 * x + 0.29
    alone = estimate(_plan(), MODEL, _chips(), table=_table())
    off = estimate(_plan(), MODEL, chips, table=_table(), opts=CostOptions(host_contention=False))
    for other in (alone, off):
        assert other.host_bound_s == {} and math.isclose(other.iteration_s, t_pipe)
        assert math.isclose(other.period_s, 6.2)
    # 4 cores: both stages have the 1.48 cores they want: no contention
    assert math.isclose(estimate(_plan(), MODEL, _chips(host="h", host_cores=4), table=_table()).iteration_s, t_pipe)
    # one stage alone on the host wants 1.48 of its 2 cores: the plain formula, exactly
    one = Plan(stages=(StageSpec("a", (0, 4), 1, 1),), global_batch=8, num_microbatches=4, schedule="1f1b")
    c1 = estimate(one, MODEL, chips, table=_table())
    assert math.isclose(c1.period_s, c1.stages[0].t)


def test_a_light_stage_beside_a_heavy_one_slows_it_by_the_cores_it_takes():
    chips = _chips(host="h", host_cores=2)
    plan = Plan(
        stages=(StageSpec("a", (0, 3), 1, 1), StageSpec("b", (3, 4), 1, 1)),
        global_batch=8,
        num_microbatches=4,
        schedule="1f1b",
    )
    c = estimate(plan, MODEL, chips, table=_table())
    heavy, light = c.stages
    # heavy: 3 blocks, t = 0.1 + 3 + 0.1 + 6 = 9.2 s, 3 x 4.5 + 0.2 = 13.7 core-seconds;
    # light: 1 block, t = 3.2 s, 4.7 core-seconds. Together on 2 cores each runs at 1 core
    # until the light one is done (4.7 s), then the heavy one at its own 13.7 / 9.2 cores
    assert math.isclose(heavy.t, 9.2) and math.isclose(heavy.work_s, 13.7)
    assert math.isclose(light.t, 3.2) and math.isclose(light.work_s, 4.7)
    want = 4.7 + (13.7 - 4.7) / (13.7 / 9.2)
    assert math.isclose(c.period_s, want) and want > 9.2  # the pipeline formula's period: 9.2
    # the simulator, which shares the cores op by op, agrees that the light stage costs the heavy one time
    sim, _ = simulate_plan(plan, MODEL, chips, table=_table())
    free, _ = simulate_plan(plan, MODEL, _chips(), table=_table())
    assert sim.iteration_s > free.iteration_s


def test_host_cores_come_from_the_profile_when_the_chip_does_not_say():
    c = estimate(_plan(), MODEL, _chips(host="h"), table=_table(host_cores=1))
    assert c.host_cores == {"h": 1}
    # one core: a period runs both stages' 9.2 core-seconds back to back, and the step all of
    # its core-seconds (the simulator's exact answer on one core without transfers)
    assert math.isclose(c.period_s, 2 * 9.2)
    assert math.isclose(c.iteration_s, 2 * (4 * 9.2 + 0.29)) and c.bound_by == "host h"


def test_data_parallel_devices_share_the_host_too():
    # data=2: two devices each run the 1-device program (1.5 cores) at once on a 2-core host:
    # alone the stage is stretched by 2 x 1.5 / 2 = 1.5 and keeps both cores busy
    chips = _chips(host="h", host_cores=2)
    s = stage_cost(
        MODEL,
        chips["a"],
        layers=2,
        first=False,
        last=False,
        data=2,
        tensor=1,
        microbatch=2,
        recompute=False,
        in_flight=1,
        table=_table(),
    )
    # per device, forward: 2 blocks of 1.0 s at 1.5 cores + one 0.1 s call at 1 core =
    # 3.1 core-seconds in 2.1 s alone -> 1.476 cores
    fwd_c = 3.1 / 2.1
    assert math.isclose(s.fwd_s, 2.1 * 2 * fwd_c / 2)
    assert math.isclose(s.fwd_cores, 2.0) and math.isclose(s.fwd_s * s.fwd_cores, 2 * 3.1)
    one = stage_cost(
        MODEL,
        chips["a"],
        layers=2,
        first=False,
        last=False,
        data=2,
        tensor=1,
        microbatch=2,
        recompute=False,
        in_flight=1,
        table=_table(),
        opts=CostOptions(host_contention=False),
    )
    assert math.isclose(one.fwd_s, 2.1)


def test_a_fused_stage_program_pays_the_call_once():
    chips = _chips()
    s = stage_cost(
        MODEL,
        chips["a"],
        layers=4,
        first=True,
        last=True,
        data=1,
        tensor=1,
        microbatch=2,
        recompute=False,
        in_flight=1,
        table=_table(),
    )
    assert math.isclose(s.fwd_s, 0.1 + 4 * 1.0) and math.isclose(s.bwd_s, 0.1 + 4 * 2.0)
    r = stage_cost(
        MODEL,
        chips["a"],
        layers=4,
        first=True,
        last=True,
        data=1,
        tensor=1,
        microbatch=2,
        recompute=True,
        in_flight=1,
        table=_table(),
    )
    assert math.isclose(r.bwd_s, 0.1 + 4 * 2.0 + 4 * 1.0)  # the recomputed forward runs inside the backward call


def test_profile_table_round_trips_the_new_fields(tmp_path):
    t = _table(host_cores=2)
    t.driver["h"] = DriverCost(step_s=0.5, step_cpu_s=1.0, op_cpu_s=0.2, transfer_cpu_s=0.1)
    t.save(tmp_path / "p.json")
    back = ProfileTable.load(tmp_path / "p.json")
    assert back.host_cores == {"a": 2, "b": 2}
    assert back.entries == t.entries and back.driver == t.driver


def test_the_driver_costs_host_cpu_per_op_per_tensor_sent_and_per_step():
    table = _table()
    table.driver["h"] = DriverCost(step_s=0.5, step_cpu_s=1.0, op_cpu_s=0.2, transfer_cpu_s=0.1)
    chips = _chips(host="h", host_cores=2)
    c = estimate(_plan(), MODEL, chips, table=table)
    # op times are unchanged; their core-seconds grow: stage 0 sends activations (forward),
    # stage 1 gradients (backward), so each stage: 0.2 + 0.2 per microbatch + 0.1 sent
    for s in c.stages:
        assert math.isclose(s.fwd_s, 2.1) and math.isclose(s.work_s, 9.2 + 0.5)
    x = transfer_s(MODEL, chips["a"], (1, 1), chips["b"], (1, 1), microbatch=2)
    # the period: both stages (9.7 core-seconds, 1.56 cores wanted) and the driver's step CPU
    # spread over the 4 periods (0.25 core-seconds, one thread) share 2 cores; all three want
    # more than an equal share, so the cores never idle: (2 x 9.7 + 0.25) / 2
    assert math.isclose(c.period_s, (2 * 9.7 + 0.25) / 2)
    assert math.isclose(c.pipeline_bound_s, 3 * c.period_s + 2 * 6.2 + 2 * x + 0.29 + 0.5)  # + the step's 0.5 s
    w = 4 * 9.7 + 0.29
    assert math.isclose(c.host_work_s["h"], 2 * w + 1.0)  # + the step's 1.0 CPU-s
    assert math.isclose(c.host_bound_s["h"], (2 * w + 1.0) / 2)
    assert math.isclose(c.iteration_s, c.pipeline_bound_s)
    sim, _ = simulate_plan(_plan(), MODEL, chips, table=table)
    assert sim.iteration_s >= c.host_work_s["h"] / 2 - 1e-9
    # another host's driver, or none: nothing changes
    table.driver = {"elsewhere": table.driver["h"]}
    assert math.isclose(estimate(_plan(), MODEL, chips, table=table).iteration_s, 3 * 9.2 + 2 * 6.2 + 2 * x + 0.29)


def test_simulated_sharing_hand_computed():
    # 2 stages on a 2-core host, every op 1 s alone at 1.5 cores, 1F1B, m = 2.
    # s0 F0 [0, 1] alone; s0 F1 and s1 F0 together from 1: 3 cores wanted, 2 there -> rate 2/3,
    # both end at 2.5; s1 B0 alone [2.5, 3.5]; s0 B0 and s1 F1 together [3.5, 5]; s1 B1 [5, 6];
    # s0 B1 [6, 7].
    kw = dict(schedule="1f1b", num_microbatches=2, fwd=[1.0, 1.0], bwd=[1.0, 1.0])
    sim = simulate(**kw, hosts=["h", "h"], host_cores={"h": 2}, fwd_cores=[1.5, 1.5], bwd_cores=[1.5, 1.5])
    got = sorted(
        (e.stage, e.kind, e.microbatch, round(e.start, 9), round(e.end, 9))
        for e in sim.events
        if e.kind in ("fwd", "bwd")
    )
    assert got == [
        (0, "bwd", 0, 3.5, 5.0),
        (0, "bwd", 1, 6.0, 7.0),
        (0, "fwd", 0, 0.0, 1.0),
        (0, "fwd", 1, 1.0, 2.5),
        (1, "bwd", 0, 2.5, 3.5),
        (1, "bwd", 1, 5.0, 6.0),
        (1, "fwd", 0, 1.0, 2.5),
        (1, "fwd", 1, 3.5, 5.0),
    ]
    assert math.isclose(sim.iteration_s, 7.0)
    # sharing is per busy thread (as the OS schedules): a 2-core and a 1-core program together
    # on 2 cores both run at 2/3 speed -- not 1/2 and 1 (max-min fairness) -- so the same times
    uneven = simulate(**kw, hosts=["h", "h"], host_cores={"h": 2}, fwd_cores=[2.0, 1.0], bwd_cores=[2.0, 1.0])
    assert (
        sorted(
            (e.stage, e.kind, e.microbatch, round(e.start, 9), round(e.end, 9))
            for e in uneven.events
            if e.kind in ("fwd", "bwd")
        )
        == got
    )
    assert math.isclose(simulate(**kw).iteration_s, 6.0)  # independent hosts
    # separate hosts named: no sharing either
    assert math.isclose(
        simulate(
            **kw, hosts=["h", "g"], host_cores={"h": 2, "g": 2}, fwd_cores=[1.5, 1.5], bwd_cores=[1.5, 1.5]
        ).iteration_s,
        6.0,
    )


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_one_core_host_runs_the_work_back_to_back(schedule):
    # with no transfers some op is always ready, so a 1-core host is never idle: the step takes
    # exactly the sum of every op's core-seconds, whatever the overlap
    rng = random.Random(7)
    for _ in range(20):
        n, m = rng.randint(2, 4), rng.randint(1, 6)
        fwd = [[rng.uniform(0.1, 1.0) for _ in range(m)] for _ in range(n)]
        bwd = [[rng.uniform(0.1, 2.0) for _ in range(m)] for _ in range(n)]
        tail = [rng.uniform(0.0, 0.5) for _ in range(n)]
        sim = simulate(
            schedule=schedule, num_microbatches=m, fwd=fwd, bwd=bwd, tail=tail, hosts=["h"] * n, host_cores={"h": 1}
        )
        assert math.isclose(sim.iteration_s, sum(map(sum, fwd)) + sum(map(sum, bwd)) + sum(tail), rel_tol=1e-9)


def test_ample_cores_replay_like_independent_chips():
    rng = random.Random(3)
    for _ in range(30):
        n, m = rng.randint(2, 5), rng.randint(1, 8)
        sched = rng.choice(["1f1b", "gpipe"])
        kw = dict(
            schedule=sched,
            num_microbatches=m,
            fwd=[[rng.uniform(0.1, 2) for _ in range(m)] for _ in range(n)],
            bwd=[[rng.uniform(0.1, 3) for _ in range(m)] for _ in range(n)],
            transfer_fwd=[rng.uniform(0, 1) for _ in range(n - 1)],
            transfer_bwd=[rng.uniform(0, 1) for _ in range(n - 1)],
            tail=[rng.uniform(0, 1) for _ in range(n)],
        )
        plain = simulate(**kw)
        shared = simulate(**kw, hosts=["h"] * n, host_cores={"h": 100}, fwd_cores=[2.0] * n, bwd_cores=[2.0] * n)
        key = lambda e: (e.kind, e.stage, -1 if e.microbatch is None else e.microbatch)  # noqa: E731
        a = sorted((key(e), round(e.start, 9), round(e.end, 9)) for e in plain.events)
        b = sorted((key(e), round(e.start, 9), round(e.end, 9)) for e in shared.events)
        assert a == b and math.isclose(plain.iteration_s, shared.iteration_s)


def test_simulated_plan_respects_the_host_bound():
    chips = _chips(host="h", host_cores=2)
    sim, cost = simulate_plan(_plan(m=8), MODEL, chips, table=_table())
    # processor sharing can idle a core (fill, drain) but never deliver more than 2 cores
    assert sim.iteration_s >= cost.host_work_s["h"] / 2 * (1 - 1e-9)
    assert cost.iteration_s > cost.host_work_s["h"] / 2  # the estimate counts the idling too
    free, _ = simulate_plan(_plan(m=8), MODEL, _chips(), table=_table())
    assert sim.iteration_s > free.iteration_s
    # every op and the schedule order are unchanged by the sharing
    for s in range(2):
        assert sim.stage_order(s) == [(t.kind, t.microbatch) for t in get_schedule("1f1b", 2, 8).stage_ops(s)]


def test_missing_host_cores_is_an_error():
    with pytest.raises(ValueError, match="host_cores"):
        simulate(schedule="1f1b", num_microbatches=2, fwd=[1.0, 1.0], bwd=[1.0, 1.0], hosts=["h", "h"])


def test_boundaries_between_chips_of_one_host_use_the_measured_transfer():
    table = _table()
    moved = LayerCost(fwd_s=0.3, bwd_s=0.4, param_bytes=0, act_bytes=0, input_bytes=0, temp_bytes=0, estimated=False)
    for chip in ("a", "b"):
        for mb in (1, 2):
            table.entries[(chip, MODEL.key(), 1, mb)][TRANSFER] = moved
    shared = estimate(_plan(), MODEL, _chips(host="h", host_cores=2), table=table)
    assert shared.transfers_fwd == [0.3] and shared.transfers_bwd == [0.4]
    # chips with hosts of their own: the link model, whatever the table holds
    own = estimate(_plan(), MODEL, _chips(), table=table)
    link = transfer_s(MODEL, _chips()["a"], (1, 1), _chips()["b"], (1, 1), microbatch=2)
    assert own.transfers_fwd == [link] and own.transfers_bwd == [link]


def test_boundary_copies_through_the_host_take_its_cores_too():
    # a measured transfer of 0.3 s each way that keeps 1 core busy (a memcpy by the runtime's
    # transfer thread): per period the two stages' 9.2 core-seconds and the two copies' 0.3
    # share the 2 cores; every job wants more than its equal share, so none idles: (2 x 9.2 +
    # 2 x 0.3) / 2; and the step's core-seconds grow by 4 microbatches x 0.6
    table = _table()
    moved = LayerCost(
        fwd_s=0.3,
        bwd_s=0.3,
        param_bytes=0,
        act_bytes=0,
        input_bytes=0,
        temp_bytes=0,
        estimated=False,
        fwd_cores=1.0,
        bwd_cores=1.0,
    )
    for chip in ("a", "b"):
        for mb in (1, 2):
            table.entries[(chip, MODEL.key(), 1, mb)][TRANSFER] = moved
    c = estimate(_plan(), MODEL, _chips(host="h", host_cores=2), table=table)
    assert math.isclose(c.period_s, (2 * 9.2 + 2 * 0.3) / 2)
    assert math.isclose(c.pipeline_bound_s, 3 * c.period_s + 2 * 6.2 + 2 * 0.3 + 0.29)
    assert math.isclose(c.host_work_s["h"], 2 * (4 * 9.2 + 0.29) + 4 * 0.6)
    # the same copies with no measured cores (tables from before they were measured): not charged
    table.entries = {
        k: {
            **v,
            TRANSFER: LayerCost(
                fwd_s=0.3, bwd_s=0.3, param_bytes=0, act_bytes=0, input_bytes=0, temp_bytes=0, estimated=False
            ),
        }
        for k, v in table.entries.items()
    }
    old = estimate(_plan(), MODEL, _chips(host="h", host_cores=2), table=table)
    assert math.isclose(old.period_s, 9.2) and math.isclose(old.host_work_s["h"], 2 * (4 * 9.2 + 0.29))


def test_search_ranks_plans_by_the_host_bound_too():
    # chips a and b, one device per node, two nodes each, on one 1-core host; 4 layers; every
    # program call costs 0.1 s more. The pipeline alone prefers 4 stages (shorter slots), but
    # a 1-core host runs all the work back to back and more stages mean more program calls:
    # the search must return the 2-stage plan, which the brute force confirms is the fastest.
    from h2jax.plan import Cluster, SearchOptions, exhaustive, search

    one = {**SPEC, "devices_per_node": 1}
    cluster = Cluster(tuple((ChipProfile(n, **one, host="h", host_cores=1), 2) for n in ("a", "b")), name="1core")
    opts = SearchOptions(microbatch_sizes=(1,), max_stages_per_chip=2, allow_recompute=False)
    got = search(cluster, MODEL, global_batch=4, table=_table(), opts=opts)
    want_plan, want, _ = exhaustive(cluster, MODEL, global_batch=4, table=_table(), opts=opts)
    assert len(got.plan.stages) == 2 and math.isclose(got.iteration_s, want, rel_tol=1e-12)
    assert got.cost.bound_by == "host h"
    # the 4-stage plan: shorter by the pipeline formula, longer in fact
    four = Plan(
        stages=tuple(StageSpec(c, (i, i + 1), 1, 1) for i, c in enumerate("aabb")),
        global_batch=4,
        num_microbatches=4,
        schedule="1f1b",
    )
    c4 = estimate(four, MODEL, cluster, table=_table())
    flat = CostOptions(host_contention=False)
    assert (
        estimate(four, MODEL, cluster, table=_table(), opts=flat).iteration_s
        < estimate(got.plan, MODEL, cluster, table=_table(), opts=flat).iteration_s
    )
    assert c4.fits and c4.iteration_s > got.iteration_s
    # without the host term the search goes for the deeper pipeline
    blind = search(
        cluster,
        MODEL,
        global_batch=4,
        table=_table(),
        opts=SearchOptions(
            microbatch_sizes=(1,), max_stages_per_chip=2, allow_recompute=False, cost=CostOptions(host_contention=False)
        ),
    )
    assert len(blind.plan.stages) > 2
