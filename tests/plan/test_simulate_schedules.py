"""The simulator replays every schedule with a task grid (gpipe, 1f1b, zb-h1, interleaved,
zb-v) from per-stage F, B, W durations, without devices."""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from pathlib import Path

import pytest

import h2jax
from h2jax.plan import check_execution, get_schedule, schedule_names, simulate, timed_events

PUBLISHED = [(p, m) for p in range(2, 9) for m in range(p, 4 * p + 1)]


def _sched(name, p, m):
    try:
        return get_schedule(name, p, m)
    except ValueError:  # interleaved: m a multiple of p; zb-v: m >= 2p - 1
        return None


def _unit(name, p, m):
    """F = B = W = 1 per (chunk) task: a stage's durations are num_chunks times that."""
    v = get_schedule(name, p, m).num_chunks
    return simulate(schedule=name, num_microbatches=m, fwd=[v] * p, bwd=[v] * p, wgt=[v] * p)


def _idle_per_compute(sim):
    """Idle stage-time / compute stage-time over the pipeline span (the papers' bubble rate)."""
    busy = sum(e.end - e.start for e in sim.events if e.kind in ("fwd", "bwd"))
    return (sim.num_stages * sim.pipeline_s - busy) / busy


@pytest.mark.parametrize("p,m", PUBLISHED)
def test_unit_bubble_equals_the_published_formulas(p, m):
    # 1F1B and GPipe (the backward is one B + W task): (p - 1) / m idle per compute,
    # (p - 1) / (m + p - 1) of the span
    for name in ("1f1b", "gpipe"):
        sim = _unit(name, p, m)
        assert _idle_per_compute(sim) == pytest.approx((p - 1) / m, abs=1e-12)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    # ZB-H1 (arXiv 2401.10241, F = B = W): bubble (p - 1)(T_F + T_B - T_W) = p - 1 per stage
    # against 3m of compute
    zb = _unit("zb-h1", p, m)
    assert zb.iteration_s == 3 * m + p - 1
    assert _idle_per_compute(zb) == pytest.approx((p - 1) / (3 * m), abs=1e-12)
    # interleaved 1F1B (Megatron-LM, arXiv 2104.04473, v = 2 and 3 chunks): (p - 1) / (v m)
    if m % p == 0:
        for v in (2, 3):
            il = simulate(
                schedule="interleaved", num_microbatches=m, fwd=[v] * p, bwd=[v] * p, wgt=[v] * p, num_chunks=v
            )
            assert _idle_per_compute(il) == pytest.approx((p - 1) / (v * m), abs=1e-12)
    # ZB-V (m >= 2p - 1): only the fill of the first forward, p - 1 chunk slots against 6m
    if m >= 2 * p - 1:
        zbv = _unit("zb-v", p, m)
        assert _idle_per_compute(zbv) == pytest.approx((p - 1) / (6 * m), abs=1e-12)


@pytest.mark.parametrize("name", schedule_names())
@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (2, 4), (3, 6), (4, 8), (5, 10)])
def test_replay_keeps_the_schedule_order_and_its_invariants(name, p, m):
    sched = _sched(name, p, m)
    if sched is None:
        pytest.skip(f"{name} does not take p={p}, m={m}")
    rng = random.Random(hash((name, p, m)) & 0xFFFF)
    kw = dict(
        fwd=[rng.uniform(0.5, 2) for _ in range(p)],
        bwd=[rng.uniform(0.5, 2) for _ in range(p)],
        wgt=[rng.uniform(0.3, 2) for _ in range(p)],
    )
    sim = simulate(schedule=name, num_microbatches=m, **kw)
    for s in range(p):
        assert sim.stage_tasks(s) == sched.stage_ops(s)
    events = [
        (e.stage, str(e.extra.get("part", "F" if e.kind == "fwd" else "B")), e.microbatch, e.start, e.end)
        + ((e.extra["chunk"],) if sched.num_chunks > 1 else ())
        for e in sim.events
        if e.kind in ("fwd", "bwd")
    ]
    assert (
        check_execution(
            events,
            num_stages=p,
            num_microbatches=m,
            max_in_flight=sched.max_in_flight(),
            split_backward=sched.split_backward,
            num_chunks=sched.num_chunks,
            virtual_stage=sched.virtual_stage,
            eps=1e-9,
        )
        == []
    )
    # without transfers the replay is the schedule's own placement (h2jax.plan.timed_events,
    # whose durations are per chunk task)
    v = sched.num_chunks
    placed = timed_events(
        sched, **{k: [x / v for x in kw[a]] for k, a in (("forward", "fwd"), ("backward", "bwd"), ("weight", "wgt"))}
    )
    got = sorted((*ev[:3], *ev[5:], round(ev[3], 9), round(ev[4], 9)) for ev in events)
    want = sorted((*ev[:3], *ev[5:], round(ev[3], 9), round(ev[4], 9)) for ev in placed)
    assert got == want
    assert math.isclose(sim.iteration_s, max(e[4] for e in placed))


def test_unsplit_backward_is_b_plus_w_and_split_schedules_need_w():
    kw = dict(num_microbatches=4, fwd=[1.0, 1.0], bwd=[0.6, 0.6])
    whole = simulate(schedule="1f1b", **kw, wgt=[0.4, 0.4])
    assert math.isclose(
        whole.iteration_s, simulate(schedule="1f1b", num_microbatches=4, fwd=[1.0] * 2, bwd=[1.0] * 2).iteration_s
    )
    assert all("part" not in e.extra for e in whole.events)
    with pytest.raises(ValueError, match="wgt"):
        simulate(schedule="zb-h1", **kw)
    split = simulate(schedule="zb-h1", **kw, wgt=[0.4, 0.4])
    parts = [e.extra.get("part") for e in split.events if e.kind == "bwd"]
    assert parts.count("B") == parts.count("W") == 8
    assert split.iteration_s < whole.iteration_s


def test_transfers_between_chunks_of_one_stage_cost_nothing():
    p, m = 3, 6
    kw = dict(num_microbatches=m, fwd=[2.0] * p, bwd=[2.0] * p, wgt=[2.0] * p)
    # zb-v: chunk 0 of the last stage hands over to its chunk 1 on the same devices
    sim = simulate(schedule="zb-v", **kw, transfer_fwd=[0.5] * (p - 1), transfer_bwd=[0.5] * (p - 1))
    sends = [e for e in sim.events if e.kind == "send"]
    assert all(e.stage != e.extra["peer"] for e in sends)
    # every position hop of the V crosses a link except the turn at the last stage:
    # (2p - 2) hops x m microbatches x 2 directions
    assert len(sends) == 2 * (2 * p - 2) * m
    assert sim.iteration_s > simulate(schedule="zb-v", **kw).iteration_s
    # interleaved hands chunk c of the last stage to chunk c + 1 of stage 0: a link of its own
    with pytest.raises(ValueError, match="transfer_wrap"):
        simulate(schedule="interleaved", **kw, transfer_fwd=[0.5] * (p - 1), transfer_bwd=[0.5] * (p - 1))
    il = simulate(
        schedule="interleaved",
        **kw,
        transfer_fwd=[0.5] * (p - 1),
        transfer_bwd=[0.5] * (p - 1),
        transfer_wrap=(0.5, 0.5),
    )
    wraps = [e for e in il.events if e.kind == "send" and abs(e.stage - e.extra["peer"]) == p - 1]
    assert len(wraps) == 2 * m  # (v - 1) wraps per microbatch and direction


@pytest.mark.parametrize("name", schedule_names())
def test_ample_shared_cores_replay_like_independent_chips(name):
    rng = random.Random(11)
    for _ in range(10):
        p = rng.randint(2, 4)
        m = 2 * p
        kw = dict(
            schedule=name,
            num_microbatches=m,
            fwd=[[rng.uniform(0.1, 2) for _ in range(m)] for _ in range(p)],
            bwd=[[rng.uniform(0.1, 2) for _ in range(m)] for _ in range(p)],
            wgt=[[rng.uniform(0.1, 2) for _ in range(m)] for _ in range(p)],
            transfer_fwd=[rng.uniform(0, 1) for _ in range(p - 1)],
            transfer_bwd=[rng.uniform(0, 1) for _ in range(p - 1)],
            transfer_wrap=(rng.uniform(0, 1), rng.uniform(0, 1)),
            tail=[rng.uniform(0, 1) for _ in range(p)],
        )
        plain = simulate(**kw)
        shared = simulate(**kw, hosts=["h"] * p, host_cores={"h": 100}, fwd_cores=[2.0] * p, bwd_cores=[2.0] * p)
        key = lambda e: (e.kind, e.stage, -1 if e.microbatch is None else e.microbatch, str(e.extra))  # noqa: E731
        a = sorted((key(e), round(e.start, 9), round(e.end, 9)) for e in plain.events)
        b = sorted((key(e), round(e.start, 9), round(e.end, 9)) for e in shared.events)
        assert a == b and math.isclose(plain.iteration_s, shared.iteration_s)


def test_one_core_host_runs_every_split_task_back_to_back():
    rng = random.Random(5)
    for _ in range(10):
        p, m = rng.randint(2, 4), rng.randint(2, 6)
        f = [[rng.uniform(0.1, 1) for _ in range(m)] for _ in range(p)]
        b = [[rng.uniform(0.1, 1) for _ in range(m)] for _ in range(p)]
        w = [[rng.uniform(0.1, 1) for _ in range(m)] for _ in range(p)]
        sim = simulate(schedule="zb-h1", num_microbatches=m, fwd=f, bwd=b, wgt=w, hosts=["h"] * p, host_cores={"h": 1})
        assert math.isclose(sim.iteration_s, sum(map(sum, f)) + sum(map(sum, b)) + sum(map(sum, w)), rel_tol=1e-9)


def _timeline_module():
    """h2jax/runtime/_timeline.py imports no JAX; loaded by path, so this test needs none either."""
    path = Path(h2jax.__file__).parent / "runtime" / "_timeline.py"
    spec = importlib.util.spec_from_file_location("_h2jax_timeline_alone", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_simulated_timelines_load_and_draw_with_the_runtime_timeline(tmp_path):
    tl = _timeline_module()
    for name in ("zb-h1", "zb-v"):
        sim = simulate(schedule=name, num_microbatches=6, fwd=[1.0] * 3, bwd=[1.0] * 3, wgt=[0.8] * 3, tail=[0.5] * 3)
        events = tl.load_trace(sim.save_trace(tmp_path / f"{name}.json"))
        names = {e.name for e in events}
        chunk = ("c0", "c1") if name == "zb-v" else ("", "")  # a stage of two chunks names which one ran
        assert {f"F0{chunk[0]}", f"B0{chunk[1]}", f"W0{chunk[0]}", "update"} <= names
        assert tl.bubble_fraction(events, 3) == pytest.approx(sim.bubble_fraction, abs=1e-9)
        tl.plot_gantt(events, tmp_path / f"{name}.png", stage_labels=[f"stage {s}" for s in range(3)], title=name)
        assert (tmp_path / f"{name}.png").stat().st_size > 0
        sim.plot(tmp_path / f"{name}-sim.png", title=name)
