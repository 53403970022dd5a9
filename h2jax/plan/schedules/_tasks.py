"""Pipeline tasks and timelines: the vocabulary every schedule is written in, and a checker for
any execution timeline.

A schedule (:mod:`h2jax.plan.schedules`) lists, per stage, the order of its tasks: "F" forward,
"B" backward (in unsplit schedules the input and weight gradient together; in split ones the
input gradient only) and "W" weight gradient, each of one microbatch and one of the stage's
layer chunks. :func:`place` runs such lists as early as the dependencies allow under given
durations; a Grid is that placement under unit durations (one column per time slot, ``None``
for a bubble). No JAX here, so every schedule is tested exhaustively in milliseconds.

:func:`check_execution` verifies the pipeline invariants on a list of timed events. It is
used both on the idealised grids and on timelines recorded from real runs, so it takes float
times (seconds, or slots) and a tolerance. :func:`idle_fraction` is the one definition of a
pipeline's bubble: the runtime's timeline, the simulator and the cost model all use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from h2jax._trace import idle_share

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
    chunk: int = 0  # which of the stage's layer chunks (virtual stages); 0 for one-chunk schedules

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


Grid = tuple[tuple[Task | None, ...], ...]
"""Rows = stages, columns = unit time slots, None = bubble."""

Event = tuple[int, str, int, float, float] | tuple[int, str, int, float, float, int]
"""(stage_idx, kind, microbatch_idx, start, end[, chunk]); times in any one unit (s or
slots); a missing chunk means chunk 0."""

VirtualStage = Callable[[int, int], int]
"""(stage_idx, chunk) -> position of that layer chunk in the model (0 = embedding side)."""


def one_chunk(stage_idx: int, chunk: int) -> int:
    return stage_idx


def _deps(kind: str, pos: int, m: int, num_virtual: int) -> list[tuple[int, str, int]]:
    """What a task of the layer chunk at model position `pos` waits for, as (position, kind,
    microbatch): F(v, m) for F(v-1, m); B(v, m) for F(v, m) and B(v+1, m); W(v, m) for
    B(v, m) (it consumes the cotangents B kept)."""
    if kind == FORWARD:
        return [(pos - 1, FORWARD, m)] if pos > 0 else []
    if kind == BACKWARD:
        return [(pos, FORWARD, m)] + ([(pos + 1, BACKWARD, m)] if pos < num_virtual - 1 else [])
    return [(pos, BACKWARD, m)]


def place(
    ops: Sequence[Sequence[Task]],
    durations: dict[str, float | Sequence[float]],
    *,
    num_chunks: int = 1,
    virtual_stage: VirtualStage = one_chunk,
) -> list[Event]:
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
                pos = virtual_stage(s, task.chunk)
                deps = _deps(task.kind, pos, task.microbatch, num_stages * num_chunks)
                if not all(d in end for d in deps):
                    break
                start = max([free[s]] + [end[d] for d in deps])
                dur = durations[task.kind]
                free[s] = end[(pos, task.kind, task.microbatch)] = start + (
                    dur if isinstance(dur, float | int) else dur[s]
                )
                chunk = (task.chunk,) if num_chunks > 1 else ()
                events.append((s, task.kind, task.microbatch, start, free[s], *chunk))
                cursor[s] += 1
                remaining -= 1
                progress = True
        if not progress:
            waiting = {s: ops[s][cursor[s]] for s in range(num_stages) if cursor[s] < len(ops[s])}
            raise RuntimeError(f"schedule deadlocks; next task per stage: {waiting}")
    return events


def grid_of(ops: Sequence[Sequence[Task]], *, num_chunks: int = 1, virtual_stage: VirtualStage = one_chunk) -> Grid:
    """The grid of `place` under unit durations: slot t holds the task running in [t, t + 1)."""
    events = place(ops, dict.fromkeys(KINDS, 1.0), num_chunks=num_chunks, virtual_stage=virtual_stage)
    makespan = int(max((e[4] for e in events), default=0))
    rows: list[list[Task | None]] = [[None] * makespan for _ in ops]
    for s, kind, m, start, _, *chunk in events:
        rows[s][int(start)] = Task(kind, m, *chunk)
    return tuple(tuple(r) for r in rows)


def backward_peaks(ops: Sequence[Task]) -> tuple[int, int]:
    """(awaiting backward, awaiting weight gradient): the most (chunk, microbatch) activations
    one stage's op list holds at once between an F's start and its B's end, and the most
    whose B has started and whose W has not ended (what W keeps: its inputs and the output
    cotangents B made). The stage runs its ops one at a time in this order, so the counts
    follow from the order alone, whatever the durations. Unsplit lists (no W) give 0 for
    the second; their first is the schedule's `max_in_flight`."""
    started_f = ended_b = started_b = ended_w = 0
    peak_fb = peak_bw = 0
    for task in ops:
        if task.kind == FORWARD:
            started_f += 1
            peak_fb = max(peak_fb, started_f - ended_b)
        elif task.kind == BACKWARD:
            started_b += 1
            peak_fb = max(peak_fb, started_f - ended_b)
            ended_b += 1
        else:
            peak_bw = max(peak_bw, started_b - ended_w)
            ended_w += 1
    if any(t.kind == WEIGHT for t in ops):
        peak_bw = max(peak_bw, started_b - ended_w)
    return peak_fb, peak_bw


def idle_fraction(events: Iterable[Event], num_stages: int) -> float:
    """Idle time / (num_stages x makespan), the makespan from the first start to the last end."""
    events = list(events)
    if not events:
        return 0.0
    t0, t1 = min(e[3] for e in events), max(e[4] for e in events)
    return idle_share(sum(e[4] - e[3] for e in events), num_stages, t1 - t0)


def stage_tasks(grid: Grid, stage_idx: int) -> list[Task]:
    """The tasks of one stage in execution order (its grid row without bubbles)."""
    return [t for t in grid[stage_idx] if t is not None]


def grid_events(grid: Grid) -> list[Event]:
    """Events of a grid: the task in slot t starts at t and ends at t + 1 (with its chunk
    when a grid holds chunks other than 0)."""
    chunked = any(task is not None and task.chunk for row in grid for task in row)
    return [
        (s, task.kind, task.microbatch, float(t), float(t + 1), *((task.chunk,) if chunked else ()))
        for s, row in enumerate(grid)
        for t, task in enumerate(row)
        if task is not None
    ]


def bubble_fraction(grid: Grid) -> float:
    """Idle slots / all slots over the grid's makespan (num_stages x longest row)."""
    makespan = max((len(r) for r in grid), default=0)
    return idle_share(sum(t is not None for r in grid for t in r), len(grid), makespan)


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
    num_chunks: int = 1,
    virtual_stage: VirtualStage = one_chunk,
    eps: float = 0.0,
) -> list[str]:
    """Human-readable violations of the pipeline invariants; an empty list means ok.

    `events` are `(stage_idx, kind, microbatch_idx, start, end[, chunk])` with kind "F", "B"
    or "W". Stage s holds `num_chunks` layer chunks; `virtual_stage(s, c)` is chunk c's
    position in the model. Checked: every (stage, chunk, microbatch) has exactly one F and
    one B, and with `split_backward` exactly one W (None: split when any W event is
    present); the F of a chunk starts after the F of the chunk before it in the model ends;
    its B after the B of the chunk after it and after its own F; W after its B; events of
    one stage do not overlap; with `max_in_flight`, stage s never holds more than
    max_in_flight[s] (chunk, microbatch) activations (F started, its last backward task --
    W when split, else B -- not ended); with `forwards_first`, every F of a stage starts
    before any B of it. `eps` is the tolerance on every time comparison, in the events'
    time unit (recorded timestamps jitter).
    """
    events = list(events)
    if split_backward is None:
        split_backward = any(ev[1] == WEIGHT for ev in events)
    kinds = KINDS if split_backward else (FORWARD, BACKWARD)
    num_virtual = num_stages * num_chunks
    where = {virtual_stage(s, c): (s, c) for s in range(num_stages) for c in range(num_chunks)}
    if sorted(where) != list(range(num_virtual)):
        return [
            f"virtual_stage maps {num_stages} stages x {num_chunks} chunks onto {sorted(where)}, expected 0..{num_virtual - 1}"
        ]

    def name(s: int, c: int, kind: str, m: int) -> str:
        return f"stage {s} {kind}{m}" + (f" chunk {c}" if num_chunks > 1 else "")

    errors: list[str] = []
    by_key: dict[tuple[int, int, str, int], list[tuple[float, float]]] = {}
    per_stage: list[list[tuple[float, float, str]]] = [[] for _ in range(num_stages)]
    for ev in events:
        s, kind, m, start, end, *rest = ev
        c = int(rest[0]) if rest else 0
        start, end = float(start), float(end)
        if not (0 <= s < num_stages) or kind not in kinds or not (0 <= m < num_microbatches) or not 0 <= c < num_chunks:
            errors.append(
                f"event {ev!r}: expected stage in [0, {num_stages}), kind {' or '.join(kinds)}, "
                f"microbatch in [0, {num_microbatches})" + (f", chunk in [0, {num_chunks})" if num_chunks > 1 else "")
            )
            continue
        if end < start - eps:
            errors.append(f"{name(s, c, kind, m)}: ends at {_fmt(end)} before it starts at {_fmt(start)}")
        by_key.setdefault((s, c, kind, m), []).append((start, end))
        per_stage[s].append((start, end, f"{kind}{m}" + (f"c{c}" if c else "")))

    first: dict[tuple[int, int, str, int], tuple[float, float]] = {}
    for s in range(num_stages):
        for c in range(num_chunks):
            for m in range(num_microbatches):
                for kind in kinds:
                    runs = sorted(by_key.get((s, c, kind, m), []))
                    if len(runs) != 1:
                        at = f"stage {s}" + (f" chunk {c}" if num_chunks > 1 else "")
                        errors.append(f"{at} microbatch {m}: {kind} runs {len(runs)} times, expected 1")
                    if runs:
                        first[(s, c, kind, m)] = runs[0]

    def after(key: tuple[int, int, str, int], dep: tuple[int, int, str, int], why: str) -> None:
        if key in first and dep in first and first[key][0] < first[dep][1] - eps:
            errors.append(
                f"{name(*key)} starts at {_fmt(first[key][0])} before "
                f"{name(*dep)} ends at {_fmt(first[dep][1])} ({why})"
            )

    for pos in range(num_virtual):
        s, c = where[pos]
        for m in range(num_microbatches):
            if pos > 0:
                after((s, c, FORWARD, m), (*where[pos - 1], FORWARD, m), "forward needs the previous stage's output")
            if pos < num_virtual - 1:
                after((s, c, BACKWARD, m), (*where[pos + 1], BACKWARD, m), "backward needs the next stage's gradient")
            after((s, c, BACKWARD, m), (s, c, FORWARD, m), "backward needs its own forward")
            if split_backward:
                after((s, c, WEIGHT, m), (s, c, BACKWARD, m), "weight gradient needs its input gradient's cotangents")

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
            errors += _in_flight_violations(first, num_stages, max_in_flight, eps, freed_by)

    if forwards_first:
        for s in range(num_stages):
            f_starts = [v[0] for k, v in first.items() if k[0] == s and k[2] == FORWARD]
            b_starts = [v[0] for k, v in first.items() if k[0] == s and k[2] == BACKWARD]
            if f_starts and b_starts and not max(f_starts) < min(b_starts) + eps:
                errors.append(
                    f"stage {s}: a forward starts at {_fmt(max(f_starts))}, not before the first "
                    f"backward at {_fmt(min(b_starts))} (expected all forwards first)"
                )
    return errors


def _in_flight_violations(
    first: dict[tuple[int, int, str, int], tuple[float, float]],
    num_stages: int,
    max_in_flight: Sequence[int],
    eps: float,
    freed_by: str,
) -> list[str]:
    """A (chunk, microbatch) is in flight on a stage from its F's start to the end of its
    `freed_by` task (the last one that reads its activations)."""
    errors = []
    for s in range(num_stages):
        # (time, order, delta): an end at t - eps is processed before a start at t
        points: list[tuple[float, int, int]] = []
        for (stage, c, kind, m), (start, _) in first.items():
            if stage != s or kind != FORWARD:
                continue
            points.append((start, 1, +1))
            b = first.get((s, c, freed_by, m))
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
