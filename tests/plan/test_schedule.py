"""Schedules as data: exhaustive invariants on small shapes, and the checker's teeth."""

from __future__ import annotations

import itertools

import pytest

from h2jax.plan import (
    GPipe,
    Interleaved,
    OneFOneB,
    Task,
    ZeroBubbleH1,
    ZeroBubbleV,
    bubble_fraction,
    check_execution,
    get_schedule,
    grid_events,
    idle_fraction,
    stage_tasks,
    timed_events,
)

SHAPES = list(itertools.product(range(1, 7), range(1, 13)))  # (num_stages, num_microbatches)


def _check(events, p, m, **kw):
    return check_execution(events, num_stages=p, num_microbatches=m, **kw)


@pytest.mark.parametrize("p,m", SHAPES)
def test_1f1b_grid_is_valid_with_in_flight_bound(p, m):
    grid = OneFOneB().bind(p, m).tasks()
    assert len(grid) == p
    assert _check(grid_events(grid), p, m, max_in_flight=[p - s for s in range(p)]) == []
    assert OneFOneB().bind(p, m).max_in_flight() == tuple(min(p - s, m) for s in range(p))


@pytest.mark.parametrize("p,m", SHAPES)
def test_gpipe_grid_is_valid_forwards_first(p, m):
    grid = GPipe().bind(p, m).tasks()
    assert _check(grid_events(grid), p, m, forwards_first=True, max_in_flight=[m] * p) == []


@pytest.mark.parametrize("p,m", SHAPES)
def test_op_order_and_makespan(p, m):
    for sched in (GPipe().bind(p, m), OneFOneB().bind(p, m)):
        grid = sched.tasks()
        assert all(len(row) == len(grid[0]) for row in grid)
        for s in range(p):
            assert stage_tasks(grid, s) == sched.stage_ops(s)
        # unit F and B: both schedules finish in 2 * (m + p - 1) slots
        assert len(grid[0]) == 2 * (m + p - 1)
        assert bubble_fraction(grid) == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_stage_ops_shape():
    ops = OneFOneB().bind(4, 6).stage_ops(0)
    assert [str(t) for t in ops] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split()
    assert [str(t) for t in OneFOneB().bind(4, 6).stage_ops(3)] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5".split()
    # fewer microbatches than warm-up slots: warm-up is capped at num_microbatches
    assert [str(t) for t in OneFOneB().bind(5, 2).stage_ops(0)] == "F0 F1 B0 B1".split()


def test_1f1b_holds_less_than_gpipe():
    assert OneFOneB().bind(4, 8).max_in_flight() == (4, 3, 2, 1)
    assert GPipe().bind(4, 8).max_in_flight() == (8, 8, 8, 8)
    gpipe_events = grid_events(GPipe().bind(4, 8).tasks())
    assert _check(gpipe_events, 4, 8, max_in_flight=[4, 3, 2, 1])


def test_get_schedule():
    assert get_schedule("gpipe", 2, 3) == GPipe().bind(2, 3)
    assert get_schedule("1f1b", 2, 3) == OneFOneB().bind(2, 3)
    assert get_schedule("zb-h1", 2, 3) == ZeroBubbleH1().bind(2, 3)
    assert get_schedule("interleaved", 2, 4) == Interleaved(2).bind(2, 4)
    assert get_schedule("zb-v", 2, 3) == ZeroBubbleV().bind(2, 3)
    with pytest.raises(ValueError, match="gpipe, 1f1b, zb-h1, interleaved, zb-v"):
        get_schedule("dualpipe", 2, 3)
    with pytest.raises(ValueError, match="num_microbatches=3 is not a multiple of num_stages=2"):
        get_schedule("interleaved", 2, 3)
    with pytest.raises(ValueError, match="num_microbatches=4 < 2 \\* num_stages - 1 = 5"):
        get_schedule("zb-v", 3, 4)
    with pytest.raises(ValueError, match="num_stages=0"):
        get_schedule("1f1b", 0, 3)


def test_bubble_fraction_examples():
    assert bubble_fraction(OneFOneB().bind(1, 5).tasks()) == 0.0
    assert bubble_fraction(()) == 0.0
    f, b = Task("F", 0), Task("B", 0)
    assert bubble_fraction(((f, None), (None, b))) == 0.5


# -- the checker catches every injected violation -------------------------------------


def _base(p=3, m=4):
    return grid_events(OneFOneB().bind(p, m).tasks()), p, m


def _replace(events, stage, kind, mb, start, end):
    out = [e for e in events if e[:3] != (stage, kind, mb)]
    return out + [(stage, kind, mb, start, end)]


def test_duplicate_forward_is_caught():
    events, p, m = _base()
    errs = _check(events + [(1, "F", 2, 100.0, 101.0)], p, m)
    assert any("stage 1 microbatch 2: F runs 2 times" in e for e in errs), errs


def test_missing_backward_is_caught():
    events, p, m = _base()
    events = [e for e in events if e[:3] != (0, "B", 3)]
    errs = _check(events, p, m)
    assert any("stage 0 microbatch 3: B runs 0 times" in e for e in errs), errs


def test_backward_before_forward_is_caught():
    events, p, m = _base(p=1, m=2)
    # swap F0 and B0 on the single stage
    events = _replace(_replace(events, 0, "F", 0, 1.0, 2.0), 0, "B", 0, 0.0, 1.0)
    errs = _check(events, 1, 2)
    assert any("B0 starts at 0 before stage 0 F0 ends at 2" in e for e in errs), errs


def test_forward_dependency_violation_is_caught():
    events, p, m = _base()
    f = [e for e in events if e[:3] == (1, "F", 0)][0]
    events = _replace(events, 1, "F", 0, f[3] - 0.5, f[4] - 0.5)
    errs = _check(events, p, m)
    assert any("stage 1 F0 starts at 0.5 before stage 0 F0 ends at 1" in e for e in errs), errs


def test_backward_dependency_violation_is_caught():
    events, p, m = _base()
    b = [e for e in events if e[:3] == (1, "B", 1)][0]
    events = _replace(events, 1, "B", 1, b[3] - 0.25, b[4] - 0.25)
    errs = _check(events, p, m)
    assert any("stage 1 B1" in e and "stage 2 B1" in e for e in errs), errs


def test_overlap_on_one_stage_is_caught():
    errs = _check([(0, "F", 0, 0.0, 2.0), (0, "B", 0, 2.0, 3.0), (0, "F", 1, 1.0, 1.5), (0, "B", 1, 3.0, 4.0)], 1, 2)
    assert any("stage 0: F1 starts at 1 while F0 runs [0, 2)" in e for e in errs), errs


def test_in_flight_violation_is_caught():
    events = grid_events(GPipe().bind(3, 4).tasks())
    errs = _check(events, 3, 4, max_in_flight=[3, 2, 1])
    assert any("stage 0: 4 microbatches in flight" in e and "max_in_flight[0]=3" in e for e in errs), errs


def test_forwards_first_violation_is_caught():
    events = grid_events(OneFOneB().bind(2, 3).tasks())
    errs = _check(events, 2, 3, forwards_first=True)
    assert any("expected all forwards first" in e for e in errs), errs


def test_bad_event_fields_are_reported():
    errs = _check([(5, "X", 0, 0.0, 1.0)], 1, 1)
    assert any("expected stage in [0, 1)" in e for e in errs), errs


def test_float_times_and_tolerance():
    # a recorded timeline: B of stage 1 ends 1 µs after the backward of stage 0 starts
    events = [
        (0, "F", 0, 0.0, 0.010),
        (1, "F", 0, 0.011, 0.020),
        (1, "B", 0, 0.020, 0.0400010),
        (0, "B", 0, 0.040, 0.060),
    ]
    assert _check(events, 2, 1) != []
    assert _check(events, 2, 1, eps=1e-5) == []
    assert _check(events, 2, 1, max_in_flight=[1, 1], forwards_first=True, eps=1e-5) == []


def test_in_flight_boundary_end_then_start_is_not_overlap():
    # B0 ends at exactly the time F1 starts: one microbatch in flight, not two
    events = [(0, "F", 0, 0.0, 1.0), (0, "B", 0, 1.0, 2.0), (0, "F", 1, 2.0, 3.0), (0, "B", 1, 3.0, 4.0)]
    assert _check(events, 1, 2, max_in_flight=[1]) == []


# -- split backward: ZB-H1 --------------------------------------------------------------

PUBLISHED = [(p, m) for p in range(2, 9) for m in range(p, 4 * p + 1)]


@pytest.mark.parametrize("p,m", SHAPES)
def test_zb_h1_one_f_b_w_per_microbatch_and_dependencies(p, m):
    sched = ZeroBubbleH1().bind(p, m)
    grid = sched.tasks()
    for s in range(p):
        ops = sched.stage_ops(s)
        assert stage_tasks(grid, s) == ops
        for kind in "FBW":
            assert sorted(t.microbatch for t in ops if t.kind == kind) == list(range(m))
    # the grid and a replay with uneven durations both satisfy every dependency and the bound
    bound = sched.max_in_flight()
    assert bound == (min(p, m),) * p
    assert _check(grid_events(grid), p, m, max_in_flight=bound) == []
    uneven = timed_events(sched, forward=1.0, backward=1.7, weight=0.6)
    assert _check(uneven, p, m, max_in_flight=bound) == []


@pytest.mark.parametrize("p,m", PUBLISHED)
def test_bubble_equals_published_formula_with_unit_f_b_w(p, m):
    # 1F1B with F = B = W = 1 (its backward lasts B + W = 2): (p - 1) / (m + p - 1)
    one_f_one_b = timed_events(OneFOneB().bind(p, m), forward=1, backward=1, weight=1)
    assert idle_fraction(one_f_one_b, p) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert idle_fraction(timed_events(GPipe().bind(p, m)), p) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    # ZB-H1 (arXiv 2401.10241): (p - 1)(F + B - W) idle per stage = p - 1 slots of a 3m + p - 1 makespan
    zb = timed_events(ZeroBubbleH1().bind(p, m), forward=1, backward=1, weight=1)
    assert max(e[4] for e in zb) == 3 * m + p - 1
    assert idle_fraction(zb, p) == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    # the unit grid of the schedule is the same placement
    assert bubble_fraction(ZeroBubbleH1().bind(p, m).tasks()) == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)


def test_zb_h1_stage_ops_shape():
    sched = ZeroBubbleH1().bind(4, 6)
    assert " ".join(map(str, sched.stage_ops(0))) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5"
    # the last stage holds its W's back by p - 1 and runs them at the end
    assert " ".join(map(str, sched.stage_ops(3))) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5"


def test_unsplit_schedules_have_no_w():
    for sched in (GPipe().bind(3, 5), OneFOneB().bind(3, 5)):
        assert not sched.split_backward
        assert all(t.kind != "W" for s in range(3) for t in sched.stage_ops(s))
    assert ZeroBubbleH1().bind(3, 5).split_backward


def test_weight_before_its_input_gradient_is_caught():
    events = grid_events(ZeroBubbleH1().bind(2, 3).tasks())
    b = [e for e in events if e[:3] == (1, "B", 0)][0]
    events = _replace(events, 1, "W", 0, b[3] - 1.0, b[3] - 0.5)
    errs = _check(events, 2, 3)
    assert any("stage 1 W0" in e and "stage 1 B0" in e and "cotangents" in e for e in errs), errs


def test_missing_or_duplicate_weight_is_caught():
    events = grid_events(ZeroBubbleH1().bind(2, 3).tasks())
    missing = [e for e in events if e[:3] != (0, "W", 2)]
    assert any("stage 0 microbatch 2: W runs 0 times" in e for e in _check(missing, 2, 3, split_backward=True))
    dup = events + [(1, "W", 1, 100.0, 101.0)]
    assert any("stage 1 microbatch 1: W runs 2 times" in e for e in _check(dup, 2, 3))
    # W events in an unsplit check are refused, not ignored
    assert any("kind F or B" in e for e in _check(events, 2, 3, split_backward=False))


def test_in_flight_of_split_schedule_lasts_until_w():
    # F0 B0 F1 W0 B1 W1 on one stage: two microbatches are alive between F1 and W0
    events = [(0, "F", 0, 0, 1), (0, "B", 0, 1, 2), (0, "F", 1, 2, 3), (0, "W", 0, 3, 4), (0, "B", 1, 4, 5)]
    events.append((0, "W", 1, 5, 6))
    assert _check(events, 1, 2, max_in_flight=[2]) == []
    errs = _check(events, 1, 2, max_in_flight=[1])
    assert any("2 microbatches in flight" in e for e in errs), errs


def test_idle_fraction_examples():
    assert idle_fraction([], 2) == 0.0
    assert idle_fraction([(0, "F", 0, 0.0, 1.0), (1, "F", 0, 1.0, 2.0)], 2) == 0.5


# -- chunks: interleaved 1F1B and ZB-V -----------------------------------------------------------


def _chunk_check(sched, events, **kw):
    return check_execution(
        events,
        num_stages=sched.num_stages,
        num_microbatches=sched.num_microbatches,
        num_chunks=sched.num_chunks,
        virtual_stage=sched.virtual_stage,
        **kw,
    )


def _prefix_in_flight(ops, freed_by):
    """The most (chunk, microbatch) activations alive at once in this op order, whatever the timing."""
    alive = peak = 0
    for t in ops:
        alive += (t.kind == "F") - (t.kind == freed_by)
        peak = max(peak, alive)
    return peak


CHUNKED = [("interleaved", p, m, v) for p in range(1, 7) for m in range(p, 4 * p + 1, p) for v in (1, 2, 3)] + [
    ("zb-v", p, m, 2) for p in range(1, 7) for m in range(2 * p - 1, 4 * p + 1)
]


@pytest.mark.parametrize("name,p,m,v", CHUNKED)
def test_chunked_schedules_are_valid(name, p, m, v):
    sched = Interleaved(v).bind(p, m) if name == "interleaved" else ZeroBubbleV().bind(p, m)
    kinds = "FBW" if sched.split_backward else "FB"
    grid = sched.tasks()
    positions = sorted(sched.virtual_stage(s, c) for s in range(p) for c in range(v))
    assert positions == list(range(p * v))
    for s in range(p):
        ops = sched.stage_ops(s)
        assert stage_tasks(grid, s) == ops
        for c in range(v):
            for kind in kinds:
                assert sorted(t.microbatch for t in ops if t.kind == kind and t.chunk == c) == list(range(m))
        freed_by = "W" if sched.split_backward else "B"
        assert _prefix_in_flight(ops, freed_by) <= sched.max_in_flight()[s]
    bound = sched.max_in_flight()
    assert _chunk_check(sched, grid_events(grid), max_in_flight=bound) == []
    uneven = timed_events(sched, forward=[1.0, 1.3] * p, backward=1.6, weight=0.7)
    assert _chunk_check(sched, uneven, max_in_flight=bound) == []


@pytest.mark.parametrize("p,m", [(p, m) for p, m in PUBLISHED if m % p == 0])
def test_interleaved_bubble_equals_megatron_formula(p, m):
    for v in (2, 3):
        events = timed_events(Interleaved(v).bind(p, m), forward=1, backward=1, weight=1)
        assert idle_fraction(events, p) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m", PUBLISHED)
def test_zb_v_bubble_is_only_the_fill(p, m):
    if m < 2 * p - 1:
        with pytest.raises(ValueError, match="2 \\* num_stages - 1"):
            ZeroBubbleV().bind(p, m)
        return
    events = timed_events(ZeroBubbleV().bind(p, m), forward=1, backward=1, weight=1)
    # each stage does 6m unit chunk tasks; the last starts after p - 1 chunk forwards
    assert max(e[4] for e in events) == 6 * m + p - 1
    assert idle_fraction(events, p) == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
    # half-stage chunks: per stage-sized unit that is half ZB-H1's idle
    assert ZeroBubbleV().bind(p, m).max_in_flight() == (2 * p,) * p


def test_interleaved_stage_ops_shape():
    sched = Interleaved(2).bind(2, 4)
    assert " ".join(map(str, sched.stage_ops(0))) == ("F0 F1 F0c1 F1c1 F2 B0c1 F3 B1c1 F2c1 B0 F3c1 B1 B2c1 B3c1 B2 B3")
    assert sched.max_in_flight() == (5, 3)


def test_chunk_dependency_violation_is_caught():
    sched = Interleaved(2).bind(2, 2)
    events = grid_events(sched.tasks())
    # chunk 1 of stage 0 is model position 2: its F needs stage 1 chunk 0 (position 1)
    f = [e for e in events if e[:3] == (0, "F", 0) and e[5] == 1][0]
    events = [e for e in events if e != f] + [(0, "F", 0, 0.5, 0.9, 1)]
    errs = _chunk_check(sched, events)
    assert any("stage 0 F0 chunk 1 starts at 0.5 before stage 1 F0 chunk 0" in e for e in errs), errs
    bad = _chunk_check(sched, events + [(0, "F", 1, 50.0, 51.0, 2)])
    assert any("chunk in [0, 2)" in e for e in bad), bad
