"""Schedules as data: exhaustive invariants on small shapes, and the checker's teeth."""

from __future__ import annotations

import itertools

import pytest

from h2jax.plan import (
    GPipe,
    OneFOneB,
    Task,
    bubble_fraction,
    check_execution,
    get_schedule,
    grid_events,
    stage_tasks,
)

SHAPES = list(itertools.product(range(1, 7), range(1, 13)))  # (num_stages, num_microbatches)


def _check(events, p, m, **kw):
    return check_execution(events, num_stages=p, num_microbatches=m, **kw)


@pytest.mark.parametrize("p,m", SHAPES)
def test_1f1b_grid_is_valid_with_in_flight_bound(p, m):
    grid = OneFOneB(p, m).tasks()
    assert len(grid) == p
    assert _check(grid_events(grid), p, m, max_in_flight=[p - s for s in range(p)]) == []
    assert OneFOneB(p, m).max_in_flight() == tuple(min(p - s, m) for s in range(p))


@pytest.mark.parametrize("p,m", SHAPES)
def test_gpipe_grid_is_valid_forwards_first(p, m):
    grid = GPipe(p, m).tasks()
    assert _check(grid_events(grid), p, m, forwards_first=True, max_in_flight=[m] * p) == []


@pytest.mark.parametrize("p,m", SHAPES)
def test_op_order_and_makespan(p, m):
    for sched in (GPipe(p, m), OneFOneB(p, m)):
        grid = sched.tasks()
        assert all(len(row) == len(grid[0]) for row in grid)
        for s in range(p):
            assert stage_tasks(grid, s) == sched.stage_ops(s)
        # unit F and B: both schedules finish in 2 * (m + p - 1) slots
        assert len(grid[0]) == 2 * (m + p - 1)
        assert bubble_fraction(grid) == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_stage_ops_shape():
    ops = OneFOneB(4, 6).stage_ops(0)
    assert [str(t) for t in ops] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split()
    assert [str(t) for t in OneFOneB(4, 6).stage_ops(3)] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5".split()
    # fewer microbatches than warm-up slots: warm-up is capped at num_microbatches
    assert [str(t) for t in OneFOneB(5, 2).stage_ops(0)] == "F0 F1 B0 B1".split()


def test_1f1b_holds_less_than_gpipe():
    assert OneFOneB(4, 8).max_in_flight() == (4, 3, 2, 1)
    assert GPipe(4, 8).max_in_flight() == (8, 8, 8, 8)
    gpipe_events = grid_events(GPipe(4, 8).tasks())
    assert _check(gpipe_events, 4, 8, max_in_flight=[4, 3, 2, 1])


def test_get_schedule():
    assert get_schedule("gpipe", 2, 3) == GPipe(2, 3)
    assert get_schedule("1f1b", 2, 3) == OneFOneB(2, 3)
    with pytest.raises(ValueError, match="gpipe, 1f1b"):
        get_schedule("interleaved", 2, 3)
    with pytest.raises(ValueError, match="num_stages=0"):
        get_schedule("1f1b", 0, 3)


def test_bubble_fraction_examples():
    assert bubble_fraction(OneFOneB(1, 5).tasks()) == 0.0
    assert bubble_fraction(()) == 0.0
    f, b = Task("F", 0), Task("B", 0)
    assert bubble_fraction(((f, None), (None, b))) == 0.5


# -- the checker catches every injected violation -------------------------------------


def _base(p=3, m=4):
    return grid_events(OneFOneB(p, m).tasks()), p, m


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
    events = grid_events(GPipe(3, 4).tasks())
    errs = _check(events, 3, 4, max_in_flight=[3, 2, 1])
    assert any("stage 0: 4 microbatches in flight" in e and "max_in_flight[0]=3" in e for e in errs), errs


def test_forwards_first_violation_is_caught():
    events = grid_events(OneFOneB(2, 3).tasks())
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
