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

import functools
from collections.abc import Callable, Iterable, Sequence
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


def _one_chunk(stage_idx: int, chunk: int) -> int:
    return stage_idx


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"num_stages={num_stages}, num_microbatches={num_microbatches}; expected both >= 1")


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
    virtual_stage: VirtualStage = _one_chunk,
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


def _place(ops: Sequence[Sequence[Task]], *, num_chunks: int = 1, virtual_stage: VirtualStage = _one_chunk) -> Grid:
    """The grid of `place` under unit durations: slot t holds the task running in [t, t + 1)."""
    events = place(ops, dict.fromkeys(KINDS, 1.0), num_chunks=num_chunks, virtual_stage=virtual_stage)
    makespan = int(max((e[4] for e in events), default=0))
    rows: list[list[Task | None]] = [[None] * makespan for _ in ops]
    for s, kind, m, start, _, *chunk in events:
        rows[s][int(start)] = Task(kind, m, *chunk)
    return tuple(tuple(r) for r in rows)


@dataclass(frozen=True)
class GPipe:
    """All forwards, then all backwards: simple, but every microbatch's activations
    stay alive on every stage until its backward (num_microbatches in flight).
    Bubble (F, B durations): (p - 1) / (m + p - 1) of the makespan."""

    num_stages: int
    num_microbatches: int
    split_backward: ClassVar[bool] = False
    num_chunks: ClassVar[int] = 1
    virtual_stage = staticmethod(_one_chunk)

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

    def backward_counts(self) -> tuple[tuple[int, int], ...]:
        """:func:`backward_peaks` of every stage, in closed form."""
        return tuple((n, 0) for n in self.max_in_flight())

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
    num_chunks: ClassVar[int] = 1
    virtual_stage = staticmethod(_one_chunk)

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

    def backward_counts(self) -> tuple[tuple[int, int], ...]:
        """:func:`backward_peaks` of every stage, in closed form."""
        return tuple((n, 0) for n in self.max_in_flight())

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
    num_chunks: ClassVar[int] = 1
    virtual_stage = staticmethod(_one_chunk)

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

    def backward_counts(self) -> tuple[tuple[int, int], ...]:
        """:func:`backward_peaks` of every stage, in closed form: 1F1B's min(p - s, m) awaiting
        B, and min(s + 1, m) awaiting W (the lag of s, and the B that just ran)."""
        p, m = self.num_stages, self.num_microbatches
        return tuple((min(p - s, m), min(s + 1, m)) for s in range(p))

    def tasks(self) -> Grid:
        return _place([self.stage_ops(s) for s in range(self.num_stages)])


@dataclass(frozen=True)
class Interleaved:
    """Interleaved 1F1B (Megatron-LM, arXiv 2104.04473): each stage holds `num_chunks` (v)
    layer chunks, chunk c of stage s at model position c * p + s, so a microbatch passes
    every stage v times. Forwards go in groups of p microbatches, chunk by chunk; stage s
    warms up with 2(p - s - 1) + (v - 1)p chunk forwards, then alternates one forward,
    one backward (backwards visit the chunks in reverse).

    Needs num_microbatches divisible by num_stages (the grouping). In flight: stage s holds
    at most 2(p - s - 1) + (v - 1)p + 1 (chunk, microbatch) activations, each 1/v of a
    stage's. Bubble with unit F and B per chunk: p - 1 idle (F + B) per stage against v·m
    of work, i.e. (p - 1) / (v·m + p - 1) of the makespan (Megatron's (p - 1) / (v·m)
    counts idle per compute): 1F1B's bubble divided by about v, for v times the transfers."""

    num_stages: int
    num_microbatches: int
    num_chunks: int = 2
    split_backward: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_sizes(self.num_stages, self.num_microbatches)
        if self.num_chunks < 1:
            raise ValueError(f"num_chunks={self.num_chunks}; expected >= 1")
        if self.num_microbatches % self.num_stages:
            raise ValueError(
                f"interleaved: num_microbatches={self.num_microbatches} is not a multiple of "
                f"num_stages={self.num_stages} (forwards go in groups of num_stages microbatches)"
            )

    def virtual_stage(self, stage_idx: int, chunk: int) -> int:
        return chunk * self.num_stages + stage_idx

    def _order(self, backward: bool) -> list[tuple[int, int]]:
        """(chunk, microbatch) in the order a stage runs them: groups of p microbatches,
        chunk by chunk (reversed for backwards)."""
        p, v, m = self.num_stages, self.num_chunks, self.num_microbatches
        return [(v - 1 - c if backward else c, i) for g in range(0, m, p) for c in range(v) for i in range(g, g + p)]

    def _warmup(self, stage_idx: int) -> int:
        p, v = self.num_stages, self.num_chunks
        return min(2 * (p - stage_idx - 1) + (v - 1) * p, v * self.num_microbatches)

    def stage_ops(self, stage_idx: int) -> list[Task]:
        fw = [Task(FORWARD, i, c) for c, i in self._order(False)]
        bw = [Task(BACKWARD, i, c) for c, i in self._order(True)]
        warmup, total = self._warmup(stage_idx), len(fw)
        # warmup
        ops = fw[:warmup]
        # steady state: one forward, one backward
        for i in range(total - warmup):
            ops += [fw[warmup + i], bw[i]]
        # cooldown
        ops += bw[total - warmup :]
        return ops

    def max_in_flight(self) -> tuple[int, ...]:
        """(chunk, microbatch) activations per stage (each 1/v of a stage's)."""
        total = self.num_chunks * self.num_microbatches
        return tuple(min(self._warmup(s) + 1, total) for s in range(self.num_stages))

    def backward_counts(self) -> tuple[tuple[int, int], ...]:
        """:func:`backward_peaks` of every stage, in closed form (chunks: its max_in_flight)."""
        return tuple((n, 0) for n in self.max_in_flight())

    def tasks(self) -> Grid:
        ops = [self.stage_ops(s) for s in range(self.num_stages)]
        return _place(ops, num_chunks=self.num_chunks, virtual_stage=self.virtual_stage)


@dataclass(frozen=True)
class ZeroBubbleV:
    """ZB-V (arXiv 2401.10241): two chunks per stage in a V -- chunk 0 of stage s at model
    position s, chunk 1 at 2p - 1 - s, so stage 0 holds the first and the last layers --
    with the B/W split. Stage s warms up with 2(p - s) - 1 chunk-0 forwards, then s pairs
    (chunk-1 F, chunk-0 F), then p - s rounds of chunk-1 F, B, W; the steady state runs
    chunk-0 F, B, W and chunk-1 F, B, W; the cool-down runs the remaining B's with W's
    deferred into the gaps (PyTorch's ScheduleZBVZeroBubble builds the same lists).

    Needs num_microbatches >= 2p - 1 (the warm-up's forwards). In flight: at most 2p
    (chunk, microbatch) activations on every stage, each half a stage's: 1F1B's peak of p
    microbatches. Bubble with unit F = B = W per chunk: p - 1 idle chunk slots per stage,
    only the fill of the first forward (no order of these ops can start the last stage
    earlier), i.e. (p - 1) / (6m + p - 1) of the makespan; the paper's bubble term
    (p - 1)(T_F + T_B - 2T_W) of a stage's times is zero there."""

    num_stages: int
    num_microbatches: int
    split_backward: ClassVar[bool] = True
    num_chunks: ClassVar[int] = 2

    def __post_init__(self) -> None:
        _check_sizes(self.num_stages, self.num_microbatches)
        if self.num_microbatches < 2 * self.num_stages - 1:
            raise ValueError(
                f"zb-v: num_microbatches={self.num_microbatches} < 2 * num_stages - 1 = "
                f"{2 * self.num_stages - 1} (the V's warm-up needs that many)"
            )

    def virtual_stage(self, stage_idx: int, chunk: int) -> int:
        return stage_idx if chunk == 0 else 2 * self.num_stages - 1 - stage_idx

    def stage_ops(self, stage_idx: int) -> list[Task]:
        p, m, s = self.num_stages, self.num_microbatches, stage_idx
        ops: list[Task] = []
        nf, nb, nw = [0, 0], [0, 0], [0, 0]  # per chunk: forwards, B's, W's issued

        def add(kind: str, chunk: int) -> None:
            count = {FORWARD: nf, BACKWARD: nb, WEIGHT: nw}[kind]
            ops.append(Task(kind, count[chunk], chunk))
            count[chunk] += 1

        # warmup: down the V's first arm, then both arms, then the turn at the last stage
        for _ in range(2 * (p - s) - 1):
            add(FORWARD, 0)
        for _ in range(s):
            add(FORWARD, 1)
            add(FORWARD, 0)
        for _ in range(p - s):
            add(FORWARD, 1)
            add(BACKWARD, 1)
            add(WEIGHT, 1)
        # steady state: F, B, W on each chunk in turn
        while nf[1] < nf[0] or nf[0] < m:
            if nf[0] < m:
                add(FORWARD, 0)
            add(BACKWARD, 0)
            add(WEIGHT, 0)
            add(FORWARD, 1)
            add(BACKWARD, 1)
            add(WEIGHT, 1)
        # cooldown: the remaining B's, W's deferred into the gaps and to the end
        for _ in range(s):
            add(BACKWARD, 0)
            add(BACKWARD, 1)
        for _ in range(p - s):
            add(BACKWARD, 0)
            add(WEIGHT, 0)
        while nw[1] < nb[1]:
            add(WEIGHT, 1)
        while nw[0] < nb[0]:
            add(WEIGHT, 0)
        return ops

    def max_in_flight(self) -> tuple[int, ...]:
        """(chunk, microbatch) activations per stage (each half a stage's)."""
        return (2 * self.num_stages,) * self.num_stages

    def backward_counts(self) -> tuple[tuple[int, int], ...]:
        """:func:`backward_peaks` of every stage, in closed form: 2p chunks awaiting B, and
        2s + 1 awaiting W (the cool-down defers the W's of stage s's s B-pairs and one more)."""
        return tuple((2 * self.num_stages, 2 * s + 1) for s in range(self.num_stages))

    def tasks(self) -> Grid:
        ops = [self.stage_ops(s) for s in range(self.num_stages)]
        return _place(ops, num_chunks=2, virtual_stage=self.virtual_stage)


Schedule = GPipe | OneFOneB | ZeroBubbleH1 | Interleaved | ZeroBubbleV
_SCHEDULES: dict[str, type[Schedule]] = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "zb-h1": ZeroBubbleH1,
    "interleaved": Interleaved,
    "zb-v": ZeroBubbleV,
}
ALL_SCHEDULES: tuple[str, ...] = tuple(_SCHEDULES)
"""Every schedule with a task grid here (the runtime runs them all: `h2jax.plan.RUN_SCHEDULES`)."""


def get_schedule(name: str, num_stages: int, num_microbatches: int, *, num_chunks: int | None = None) -> Schedule:
    """The schedule called `name` (gpipe, 1f1b, zb-h1, interleaved with `num_chunks` chunks --
    default 2 --, zb-v) for this pipeline shape. `num_chunks` other than the schedule's own
    (1; zb-v: 2) is a ValueError. The runtime runs every one (`h2jax.plan.RUN_SCHEDULES`)."""
    if name not in _SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(_SCHEDULES)}")
    cls = _SCHEDULES[name]
    if cls is Interleaved:
        return cls(num_stages, num_microbatches, **({} if num_chunks is None else {"num_chunks": num_chunks}))
    if num_chunks is not None and num_chunks != cls.num_chunks:
        raise ValueError(f"{name}: num_chunks={num_chunks}; its stages hold {cls.num_chunks} layer chunk(s) each")
    return cls(num_stages, num_microbatches)


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


@functools.lru_cache(maxsize=8192)
def memory_counts(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int | None = None
) -> tuple[tuple[int, int], ...]:
    """Per stage of the schedule `name`: :func:`backward_peaks` of its op list -- the
    activations the cost model charges a stage for, in (chunk, microbatch) units for the
    chunked schedules (`num_chunks`: interleaved's v; cached: the planner asks per stage)."""
    sched = get_schedule(name, num_stages, num_microbatches, num_chunks=num_chunks)
    closed = getattr(sched, "backward_counts", None)  # every schedule's: equal to the walk (tests)
    if closed is not None:
        return closed()
    return tuple(backward_peaks(sched.stage_ops(s)) for s in range(num_stages))


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
    return place(
        ops,
        {FORWARD: f, BACKWARD: b, WEIGHT: w},
        num_chunks=schedule.num_chunks,
        virtual_stage=schedule.virtual_stage,
    )


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
    num_chunks: int = 1,
    virtual_stage: VirtualStage = _one_chunk,
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
