"""Pipeline schedules as plain data, and a checker for any execution timeline.

A schedule is a frozen dataclass whose `tasks()` returns a Grid: one row per stage,
one column per unit time slot, `None` for a bubble. Each stage's ordered list of
operations is written out explicitly (warm-up, steady state, cool-down); the grid places
them as early as the dependencies allow under unit durations. No JAX here, so every
schedule is tested exhaustively in milliseconds.

`check_execution` verifies the pipeline invariants on a list of timed events. It is
used both on the idealised grids below and on timelines recorded from real runs, so it
takes float times (seconds, or slots) and a tolerance.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True)
class Task:
    """One unit of pipeline work on a stage: the forward ("F") or backward ("B") of a microbatch."""

    kind: str
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}"


Grid = tuple[tuple[Task | None, ...], ...]
"""Rows = stages, columns = unit time slots, None = bubble."""

Event = tuple[int, str, int, float, float]
"""(stage_idx, kind, microbatch_idx, start, end); times in any one unit (s or slots)."""


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"num_stages={num_stages}, num_microbatches={num_microbatches}; expected both >= 1")


def _place(ops: Sequence[Sequence[Task]]) -> Grid:
    """Place each stage's ordered ops into unit slots as early as dependencies allow.

    F(s, m) waits for F(s-1, m); B(s, m) waits for B(s+1, m) and F(s, m); a stage runs
    one task per slot, in its list order.
    """
    num_stages = len(ops)
    finish: dict[tuple[int, str, int], int] = {}  # (stage, kind, mb) -> end slot
    cursor = [0] * num_stages
    rows: list[list[Task | None]] = [[] for _ in range(num_stages)]
    remaining = sum(len(o) for o in ops)
    t = 0
    while remaining:
        placed = []
        for s in range(num_stages):
            if cursor[s] == len(ops[s]):
                rows[s].append(None)
                continue
            task = ops[s][cursor[s]]
            m = task.microbatch
            if task.kind == FORWARD:
                deps = [(s - 1, FORWARD, m)] if s > 0 else []
            else:
                deps = [(s, FORWARD, m)] + ([(s + 1, BACKWARD, m)] if s < num_stages - 1 else [])
            if all(finish.get(d, t + 1) <= t for d in deps):
                rows[s].append(task)
                placed.append((s, task))
            else:
                rows[s].append(None)
        if not placed:
            raise RuntimeError(f"schedule deadlocks at slot {t}; op lists: {ops}")
        for s, task in placed:
            finish[(s, task.kind, task.microbatch)] = t + 1
            cursor[s] += 1
        remaining -= len(placed)
        t += 1
    return tuple(tuple(r) for r in rows)


@dataclass(frozen=True)
class GPipe:
    """All forwards, then all backwards: simple, but every microbatch's activations
    stay alive on every stage until its backward (num_microbatches in flight)."""

    num_stages: int
    num_microbatches: int

    def __post_init__(self) -> None:
        _check_sizes(self.num_stages, self.num_microbatches)

    def stage_ops(self, stage_idx: int) -> list[Task]:
        m = self.num_microbatches
        ops = [Task(FORWARD, i) for i in range(m)]  # warmup
        # steady state: none
        ops += [Task(BACKWARD, i) for i in range(m)]  # cooldown
        return ops

    def max_in_flight(self) -> tuple[int, ...]:
        """Microbatches whose activations a stage may hold at once."""
        return (self.num_microbatches,) * self.num_stages

    def tasks(self) -> Grid:
        return _place([self.stage_ops(s) for s in range(self.num_stages)])


@dataclass(frozen=True)
class OneFOneB:
    """1F1B: after a short warm-up each stage alternates one forward, one backward, so
    stage s holds at most num_stages - s microbatches; same bubble as GPipe, less memory."""

    num_stages: int
    num_microbatches: int

    def __post_init__(self) -> None:
        _check_sizes(self.num_stages, self.num_microbatches)

    def stage_ops(self, stage_idx: int) -> list[Task]:
        m = self.num_microbatches
        warmup = min(self.num_stages - stage_idx - 1, m)
        # warmup
        ops = [Task(FORWARD, i) for i in range(warmup)]
        # steady state: one forward, one backward
        for i in range(m - warmup):
            ops += [Task(FORWARD, warmup + i), Task(BACKWARD, i)]
        # cooldown
        ops += [Task(BACKWARD, i) for i in range(m - warmup, m)]
        return ops

    def max_in_flight(self) -> tuple[int, ...]:
        return tuple(min(self.num_stages - s, self.num_microbatches) for s in range(self.num_stages))

    def tasks(self) -> Grid:
        return _place([self.stage_ops(s) for s in range(self.num_stages)])


Schedule = GPipe | OneFOneB
_SCHEDULES: dict[str, type[GPipe] | type[OneFOneB]] = {"gpipe": GPipe, "1f1b": OneFOneB}


def get_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The schedule called `name` ("gpipe" or "1f1b") for this pipeline shape."""
    if name not in _SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(_SCHEDULES)}")
    return _SCHEDULES[name](num_stages, num_microbatches)


def stage_tasks(grid: Grid, stage_idx: int) -> list[Task]:
    """The tasks of one stage in execution order (its grid row without bubbles)."""
    return [t for t in grid[stage_idx] if t is not None]


def grid_events(grid: Grid) -> list[Event]:
    """Events of a grid: the task in slot t starts at t and ends at t + 1."""
    return [
        (s, task.kind, task.microbatch, float(t), float(t + 1))
        for s, row in enumerate(grid)
        for t, task in enumerate(row)
        if task is not None
    ]


def bubble_fraction(grid: Grid) -> float:
    """Idle slots / all slots over the grid's makespan (num_stages x longest row)."""
    makespan = max((len(r) for r in grid), default=0)
    total = len(grid) * makespan
    if total == 0:
        return 0.0
    busy = sum(t is not None for r in grid for t in r)
    return (total - busy) / total


def _fmt(x: float) -> str:
    return f"{x:g}"


def check_execution(
    events: Iterable[Event],
    *,
    num_stages: int,
    num_microbatches: int,
    max_in_flight: Sequence[int] | None = None,
    forwards_first: bool = False,
    eps: float = 0.0,
) -> list[str]:
    """Human-readable violations of the pipeline invariants; an empty list means ok.

    `events` are `(stage_idx, kind, microbatch_idx, start, end)` with kind "F" or "B".
    Checked: every (stage, microbatch) has exactly one F and one B; F(s, m) starts after
    F(s-1, m) ends; B(s, m) after B(s+1, m) and after F(s, m) end; events of one stage do
    not overlap; with `max_in_flight`, stage s never holds more than max_in_flight[s]
    microbatches (F started, B not ended); with `forwards_first`, every F of a stage
    starts before any B of it. `eps` is the tolerance on every time comparison, in the
    events' time unit (recorded timestamps jitter).
    """
    errors: list[str] = []
    by_key: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    per_stage: list[list[tuple[float, float, str]]] = [[] for _ in range(num_stages)]
    for ev in events:
        s, kind, m, start, end = ev
        start, end = float(start), float(end)
        if not (0 <= s < num_stages) or kind not in (FORWARD, BACKWARD) or not (0 <= m < num_microbatches):
            errors.append(
                f"event {ev!r}: expected stage in [0, {num_stages}), kind F or B, microbatch in [0, {num_microbatches})"
            )
            continue
        if end < start - eps:
            errors.append(f"stage {s} {kind}{m}: ends at {_fmt(end)} before it starts at {_fmt(start)}")
        by_key.setdefault((s, kind, m), []).append((start, end))
        per_stage[s].append((start, end, f"{kind}{m}"))

    first: dict[tuple[int, str, int], tuple[float, float]] = {}
    for s in range(num_stages):
        for m in range(num_microbatches):
            for kind in (FORWARD, BACKWARD):
                runs = sorted(by_key.get((s, kind, m), []))
                if len(runs) != 1:
                    errors.append(f"stage {s} microbatch {m}: {kind} runs {len(runs)} times, expected 1")
                if runs:
                    first[(s, kind, m)] = runs[0]

    def after(key: tuple[int, str, int], dep: tuple[int, str, int], why: str) -> None:
        if key in first and dep in first and first[key][0] < first[dep][1] - eps:
            errors.append(
                f"stage {key[0]} {key[1]}{key[2]} starts at {_fmt(first[key][0])} before "
                f"stage {dep[0]} {dep[1]}{dep[2]} ends at {_fmt(first[dep][1])} ({why})"
            )

    for s in range(num_stages):
        for m in range(num_microbatches):
            if s > 0:
                after((s, FORWARD, m), (s - 1, FORWARD, m), "forward needs the previous stage's output")
            if s < num_stages - 1:
                after((s, BACKWARD, m), (s + 1, BACKWARD, m), "backward needs the next stage's gradient")
            after((s, BACKWARD, m), (s, FORWARD, m), "backward needs its own forward")

    for s, evs in enumerate(per_stage):
        evs.sort()
        for (a_start, a_end, a), (b_start, _, b) in zip(evs, evs[1:]):
            if b_start < a_end - eps:
                errors.append(
                    f"stage {s}: {b} starts at {_fmt(b_start)} while {a} runs [{_fmt(a_start)}, {_fmt(a_end)})"
                )

    if max_in_flight is not None:
        if len(max_in_flight) != num_stages:
            errors.append(f"max_in_flight has {len(max_in_flight)} entries, expected num_stages={num_stages}")
        else:
            errors += _in_flight_violations(first, num_stages, num_microbatches, max_in_flight, eps)

    if forwards_first:
        for s in range(num_stages):
            f_starts = [first[(s, FORWARD, m)][0] for m in range(num_microbatches) if (s, FORWARD, m) in first]
            b_starts = [first[(s, BACKWARD, m)][0] for m in range(num_microbatches) if (s, BACKWARD, m) in first]
            if f_starts and b_starts and not max(f_starts) < min(b_starts) + eps:
                errors.append(
                    f"stage {s}: a forward starts at {_fmt(max(f_starts))}, not before the first "
                    f"backward at {_fmt(min(b_starts))} (expected all forwards first)"
                )
    return errors


def _in_flight_violations(
    first: dict[tuple[int, str, int], tuple[float, float]],
    num_stages: int,
    num_microbatches: int,
    max_in_flight: Sequence[int],
    eps: float,
) -> list[str]:
    """A microbatch is in flight on a stage from its F's start to its B's end."""
    errors = []
    for s in range(num_stages):
        # (time, order, delta): an end at t - eps is processed before a start at t
        points: list[tuple[float, int, int]] = []
        for m in range(num_microbatches):
            if (s, FORWARD, m) not in first:
                continue
            points.append((first[(s, FORWARD, m)][0], 1, +1))
            b = first.get((s, BACKWARD, m))
            points.append((b[1] - eps if b else float("inf"), 0, -1))
        points.sort()
        count = 0
        for time, _, delta in points:
            count += delta
            if count > max_in_flight[s]:
                errors.append(
                    f"stage {s}: {count} microbatches in flight at {_fmt(time)}, max_in_flight[{s}]={max_in_flight[s]}"
                )
                break
    return errors
