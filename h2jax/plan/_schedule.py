"""Pipeline schedules as plain data, and a checker for any execution timeline.

A schedule is a frozen dataclass whose `tasks()` returns a Grid: one row per stage,
one column per unit time slot, `None` for a bubble. Each stage's ordered list of
operations is written out explicitly (warm-up, steady state, cool-down); the grid places
them as early as the dependencies allow under unit durations (`timed_events` does the
same with any F / B / W durations). No JAX here, so every schedule is tested
exhaustively in milliseconds.

Task kinds: "F" forward; "B" backward; "W" weight gradient. Schedules with
``split_backward = False`` (gpipe, 1f1b) run the whole backward as one "B" task (input
and weight gradient together); split schedules (zb-h1) run "B" as the input gradient only
and a separate "W" task computes the weight gradient later, filling bubbles.

`check_execution` verifies the pipeline invariants on a list of timed events. It is
used both on the idealised grids below and on timelines recorded from real runs, so it
takes float times (seconds, or slots) and a tolerance.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

FORWARD = "F"
BACKWARD = "B"
WEIGHT = "W"
KINDS = (FORWARD, BACKWARD, WEIGHT)


@dataclass(frozen=True)
class Task:
    """One unit of pipeline work on a stage: the forward ("F"), backward ("B": input gradient,
    and in unsplit schedules the weight gradient too) or weight gradient ("W") of a microbatch."""

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


def _deps(task: Task, stage_idx: int, num_stages: int) -> list[tuple[int, str, int]]:
    """What a task waits for: F(s, m) for F(s-1, m); B(s, m) for F(s, m) and B(s+1, m);
    W(s, m) for B(s, m) (it consumes the cotangents B kept)."""
    s, m = stage_idx, task.microbatch
    if task.kind == FORWARD:
        return [(s - 1, FORWARD, m)] if s > 0 else []
    if task.kind == BACKWARD:
        return [(s, FORWARD, m)] + ([(s + 1, BACKWARD, m)] if s < num_stages - 1 else [])
    return [(s, BACKWARD, m)]


def place(ops: Sequence[Sequence[Task]], durations: dict[str, float | Sequence[float]]) -> list[Event]:
    """Run each stage's ordered ops as early as the dependencies allow, with the duration of
    each kind from `durations` (one number, or one per stage); one task at a time per stage,
    in list order; transfers take no time. Returns events.

    Every start depends only on the stage's previous end and the dependencies' ends, so the
    order in which stages are visited does not change the result."""
    num_stages = len(ops)
    end: dict[tuple[int, str, int], float] = {}
    free = [0.0] * num_stages
    cursor = [0] * num_stages
    events: list[Event] = []
    remaining = sum(len(o) for o in ops)
    while remaining:
        progress = False
        for s in range(num_stages):
            while cursor[s] < len(ops[s]):
                task = ops[s][cursor[s]]
                deps = _deps(task, s, num_stages)
                if not all(d in end for d in deps):
                    break
                start = max([free[s]] + [end[d] for d in deps])
                dur = durations[task.kind]
                free[s] = end[(s, task.kind, task.microbatch)] = start + (
                    dur if isinstance(dur, float | int) else dur[s]
                )
                events.append((s, task.kind, task.microbatch, start, free[s]))
                cursor[s] += 1
                remaining -= 1
                progress = True
        if not progress:
            waiting = {s: ops[s][cursor[s]] for s in range(num_stages) if cursor[s] < len(ops[s])}
            raise RuntimeError(f"schedule deadlocks; next task per stage: {waiting}")
    return events


def _place(ops: Sequence[Sequence[Task]]) -> Grid:
    """The grid of `place` under unit durations: slot t holds the task running in [t, t + 1)."""
    events = place(ops, dict.fromkeys(KINDS, 1.0))
    makespan = int(max((e[4] for e in events), default=0))
    rows: list[list[Task | None]] = [[None] * makespan for _ in ops]
    for s, kind, m, start, _ in events:
        rows[s][int(start)] = Task(kind, m)
    return tuple(tuple(r) for r in rows)


@dataclass(frozen=True)
class GPipe:
    """All forwards, then all backwards: simple, but every microbatch's activations
    stay alive on every stage until its backward (num_microbatches in flight).
    Bubble (F, B durations): (p - 1) / (m + p - 1) of the makespan."""

    num_stages: int
    num_microbatches: int
    split_backward: ClassVar[bool] = False

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
    stage s holds at most num_stages - s microbatches; same bubble as GPipe,
    (p - 1) / (m + p - 1) of the makespan, with less memory."""

    num_stages: int
    num_microbatches: int
    split_backward: ClassVar[bool] = False

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


@dataclass(frozen=True)
class ZeroBubbleH1:
    """ZB-H1 (arXiv 2401.10241, "handcrafted 1"): the backward split into B (input gradient,
    on the critical path) and W (weight gradient, needed only at the step end). Stage s
    runs 1F1B's warm-up of p - s - 1 forwards, then F, B, W cycles in which its W's lag
    its B's by s, and a cool-down of B's, each followed by W's down to that lag, then the
    remaining W's -- the deferred W's fill the tail where 1F1B idles.

    In flight (F started, W not ended): at most min(p, m) microbatches on every stage --
    1F1B's peak (its stage 0), so per-device memory never exceeds 1F1B's worst stage; later
    stages hold more than under 1F1B (the last stage must defer p - 1 W's for its B chain
    to finish in time). Bubble with unit F = B = W: (p - 1) idle slots per stage against
    1F1B's 3(p - 1), i.e. (p - 1) / (3m + p - 1) of the makespan (the paper's bubble rate
    (p - 1) / 3m counts idle per compute)."""

    num_stages: int
    num_microbatches: int
    split_backward: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_sizes(self.num_stages, self.num_microbatches)

    def stage_ops(self, stage_idx: int) -> list[Task]:
        m = self.num_microbatches
        warmup = min(self.num_stages - stage_idx - 1, m)
        lag = stage_idx  # W's this stage holds back behind its B's
        # warmup
        ops = [Task(FORWARD, i) for i in range(warmup)]
        done_b = done_w = 0
        # steady state: F, B, and a W once more than `lag` B's wait for theirs
        for i in range(m - warmup):
            ops += [Task(FORWARD, warmup + i), Task(BACKWARD, i)]
            done_b += 1
            if done_b - done_w > lag:
                ops.append(Task(WEIGHT, done_w))
                done_w += 1
        # cooldown: B's as they arrive, W's down to the lag, then the deferred W's
        for i in range(m - warmup, m):
            ops.append(Task(BACKWARD, i))
            done_b += 1
            while done_b - done_w > lag:
                ops.append(Task(WEIGHT, done_w))
                done_w += 1
        ops += [Task(WEIGHT, i) for i in range(done_w, m)]
        return ops

    def max_in_flight(self) -> tuple[int, ...]:
        return (min(self.num_stages, self.num_microbatches),) * self.num_stages

    def tasks(self) -> Grid:
        return _place([self.stage_ops(s) for s in range(self.num_stages)])


Schedule = GPipe | OneFOneB | ZeroBubbleH1
_SCHEDULES: dict[str, type[GPipe] | type[OneFOneB] | type[ZeroBubbleH1]] = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "zb-h1": ZeroBubbleH1,
}


def get_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The schedule called `name` (gpipe, 1f1b or zb-h1) for this pipeline shape."""
    if name not in _SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(_SCHEDULES)}")
    return _SCHEDULES[name](num_stages, num_microbatches)


def timed_events(
    schedule: Schedule,
    *,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 1.0,
    weight: float | Sequence[float] = 1.0,
) -> list[Event]:
    """The schedule's op lists placed as early as dependencies allow with these durations
    (one number, or one per stage; input-gradient backward and weight gradient separately:
    an unsplit schedule's B takes backward + weight)."""
    ops = [schedule.stage_ops(s) for s in range(schedule.num_stages)]
    n = schedule.num_stages

    def per_stage(x: float | Sequence[float]) -> list[float]:
        return [float(x)] * n if isinstance(x, float | int) else [float(v) for v in x]

    f, b, w = per_stage(forward), per_stage(backward), per_stage(weight)
    if not schedule.split_backward:
        b = [bi + wi for bi, wi in zip(b, w)]
    return place(ops, {FORWARD: f, BACKWARD: b, WEIGHT: w})


def idle_fraction(events: Iterable[Event], num_stages: int) -> float:
    """Idle time / (num_stages x makespan), the makespan from the first start to the last end."""
    events = list(events)
    if not events:
        return 0.0
    t0, t1 = min(e[3] for e in events), max(e[4] for e in events)
    total = num_stages * (t1 - t0)
    if total <= 0:
        return 0.0
    return (total - sum(e[4] - e[3] for e in events)) / total


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
    split_backward: bool | None = None,
    eps: float = 0.0,
) -> list[str]:
    """Human-readable violations of the pipeline invariants; an empty list means ok.

    `events` are `(stage_idx, kind, microbatch_idx, start, end)` with kind "F", "B" or "W".
    Checked: every (stage, microbatch) has exactly one F and one B, and with
    `split_backward` exactly one W (None: split when any W event is present); F(s, m)
    starts after F(s-1, m) ends; B(s, m) after B(s+1, m) and after F(s, m) end; W(s, m)
    after B(s, m) ends; events of one stage do not overlap; with `max_in_flight`, stage s
    never holds more than max_in_flight[s] microbatches (F started, and its last backward
    task -- W when split, else B -- not ended); with `forwards_first`, every F of a stage
    starts before any B of it. `eps` is the tolerance on every time comparison, in the
    events' time unit (recorded timestamps jitter).
    """
    events = list(events)
    if split_backward is None:
        split_backward = any(ev[1] == WEIGHT for ev in events)
    kinds = KINDS if split_backward else (FORWARD, BACKWARD)
    errors: list[str] = []
    by_key: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    per_stage: list[list[tuple[float, float, str]]] = [[] for _ in range(num_stages)]
    for ev in events:
        s, kind, m, start, end = ev
        start, end = float(start), float(end)
        if not (0 <= s < num_stages) or kind not in kinds or not (0 <= m < num_microbatches):
            errors.append(
                f"event {ev!r}: expected stage in [0, {num_stages}), kind {' or '.join(kinds)}, "
                f"microbatch in [0, {num_microbatches})"
            )
            continue
        if end < start - eps:
            errors.append(f"stage {s} {kind}{m}: ends at {_fmt(end)} before it starts at {_fmt(start)}")
        by_key.setdefault((s, kind, m), []).append((start, end))
        per_stage[s].append((start, end, f"{kind}{m}"))

    first: dict[tuple[int, str, int], tuple[float, float]] = {}
    for s in range(num_stages):
        for m in range(num_microbatches):
            for kind in kinds:
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
            if split_backward:
                after((s, WEIGHT, m), (s, BACKWARD, m), "weight gradient needs its input gradient's cotangents")

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
            freed_by = WEIGHT if split_backward else BACKWARD
            errors += _in_flight_violations(first, num_stages, num_microbatches, max_in_flight, eps, freed_by)

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
    freed_by: str,
) -> list[str]:
    """A microbatch is in flight on a stage from its F's start to the end of its `freed_by`
    task (the last one that reads its activations)."""
    errors = []
    for s in range(num_stages):
        # (time, order, delta): an end at t - eps is processed before a start at t
        points: list[tuple[float, int, int]] = []
        for m in range(num_microbatches):
            if (s, FORWARD, m) not in first:
                continue
            points.append((first[(s, FORWARD, m)][0], 1, +1))
            b = first.get((s, freed_by, m))
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
