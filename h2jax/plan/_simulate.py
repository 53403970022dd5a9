"""Discrete-event replay of a plan's pipeline schedule -- any schedule with a task grid
(gpipe, 1f1b, zb-h1, interleaved, zb-v).

Each stage walks its op list (``get_schedule(...).stage_ops(stage_idx)`` -- the very list
the runtime's driver walks) one op at a time; an op starts when the stage is free and its
input has arrived. An op of chunk c on stage s sits at model position
``virtual_stage(s, c)`` (one chunk per stage: position s):

- F(v, m) needs F(v-1, m) finished and its activation moved to v's stage;
- B(v, m) needs F(v, m) and B(v+1, m) finished and the gradient moved back;
- W(v, m) (split schedules) needs B(v, m) on the same stage; unsplit schedules run B and
  W as one backward task;
- a link between two stages moves one tensor at a time per direction (the runtime has one
  transfer thread per boundary and direction), so transfers queue behind each other;
  between two chunks of one stage nothing moves (their devices are the same).

After its last backward a stage spends its tail (gradient all-reduce + optimizer update);
the iteration ends when the last stage finishes.

Shared hosts (``hosts``: one name per stage, None for a stage with a host of its own):
stages on one host share its ``host_cores``. A program that alone runs for d seconds
keeping c cores busy (``fwd_cores`` / ``bwd_cores`` / ``tail_cores``) needs d x c
core-seconds; while the programs running on a host want more cores in total than it
has, each progresses at rate C / (sum of their cores) -- processor sharing, as the OS
gives every busy thread an equal share -- and otherwise at full speed. Time then
advances event by event (a program ends, an input arrives) with piecewise-constant
rates. Without a host shared by two stages this reduces to the plain replay.

Several pipelines (:func:`simulate_pipelines`; :func:`simulate_plan` of a plan with
``pipelines``) are replayed in one replay: each pipeline is its own chain of events (its own
stages, op lists, links), the job's stage g being pipeline p's stage g - offset_p
(``Plan.stage_offsets``), and stages of any pipelines on one shared host share its cores as
stages of one pipeline do. The step then ends as the runtime ends it
(:mod:`h2jax.runtime._pipelines`, ``Trainer.train_step``): the pipelines' threads are joined
after the last backward of every pipeline; the gradients are summed across the pipelines; every
stage -- the mirrors too -- runs its tail (gradient norm, optimizer update) from that moment on;
then every copy takes its owner's value. So the tails wait for the last backward of
the job, not of their own stage. The runtime dispatches the updates from one thread in stage
order: stages on a shared host (emulated chips: a CPU client runs a single-device update on the
thread that dispatches it, so the call returns when it is done) take their tails one after
another in stage order, stages with hosts of their own (asynchronous dispatch) all at once. The
exchange's seconds
(:func:`h2jax.plan._pipelines.exchange_parts`) come as the sum's and the copy back's; where the
stages have processes of their own, the sum comes as (owner, mirror) pairs
(:class:`h2jax.plan._pipelines.Exchange`): the mirror posts its gradient once it is done with its
own ops, the owner takes its pairs one after the other, each once both are done: the sum overlaps
the backward of stages still draining, and the tails wait for the last pair. A plan of one
pipeline has no exchange and keeps each stage's tail right after its own last op.

Durations come from the cost model
(:func:`simulate_plan`) or from a real run's trace (per stage, per microbatch), so the
simulator both checks the analytic formula and replays a measured run.

The events are the runtime's (:mod:`h2jax._trace`: a split backward's tasks are ``bwd``
events with ``part`` "B" or "W", a chunk's carry ``chunk``), written as the same Chrome trace
(:meth:`SimResult.save_trace`) and drawn as the same Gantt chart (:meth:`SimResult.plot`),
without importing JAX.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h2jax._trace import TraceEvent, chrome_trace, idle_share, plot_gantt, sort_events, write_trace
from h2jax.plan._cost import CostOptions, PlanCost, estimate
from h2jax.plan._pipelines import Exchange, PipelinesCost, estimate_pipelines
from h2jax.plan._plan import Plan, PlanError
from h2jax.plan._profiles import ChipProfile, Cluster, ModelShape, ProfileTable
from h2jax.plan.schedules import BACKWARD, FORWARD, Schedule, ScheduleError, Task, get_schedule


@dataclass(frozen=True)
class SimEvent:
    """One interval; times in seconds from the start of the step."""

    kind: str  # fwd | bwd | send | recv | update | other (the exchange across pipelines)
    stage: int
    microbatch: int | None
    start: float
    end: float
    extra: dict = field(default_factory=dict)


def _task_kind(e: SimEvent) -> str:
    """ "F", "B" or "W" of a compute event (a split backward's part, as the runtime records it)."""
    return FORWARD if e.kind == "fwd" else str(e.extra.get("part", BACKWARD))


@dataclass
class SimResult:
    events: list[SimEvent]
    iteration_s: float
    num_stages: int
    chips: tuple[str, ...] = ()
    pipelines: tuple[int, ...] = ()  # the pipeline of each stage; () for a plan of one pipeline

    def stage_order(self, stage: int) -> list[tuple[str, int]]:
        """(kind "F"/"B"/"W", microbatch) of one stage's compute, in start order."""
        return [(t.kind, t.microbatch) for t in self.stage_tasks(stage)]

    def stage_tasks(self, stage: int) -> list[Task]:
        """One stage's compute as schedule tasks (kind, microbatch, chunk), in start order:
        what ``get_schedule(...).stage_ops(stage)`` lists, when the replay kept its order."""
        evs = sorted(
            (e for e in self.events if e.stage == stage and e.kind in ("fwd", "bwd")), key=lambda e: (e.start, e.end)
        )
        return [Task(_task_kind(e), e.microbatch, int(e.extra.get("chunk", 0))) for e in evs]

    @property
    def pipeline_s(self) -> float:
        """First compute start to last compute end."""
        comp = [e for e in self.events if e.kind in ("fwd", "bwd")]
        return max(e.end for e in comp) - min(e.start for e in comp)

    def utilisation(self) -> list[float]:
        """Per stage: compute time / pipeline span."""
        span = self.pipeline_s
        busy = [0.0] * self.num_stages
        for e in self.events:
            if e.kind in ("fwd", "bwd"):
                busy[e.stage] += e.end - e.start
        return [b / span if span > 0 else 0.0 for b in busy]

    @property
    def bubble_fraction(self) -> float:
        busy = sum(e.end - e.start for e in self.events if e.kind in ("fwd", "bwd"))
        return idle_share(busy, self.num_stages, self.pipeline_s) if busy else 0.0

    def stage_labels(self) -> list[str]:
        """``stage <s>``, with the chip type when known (and ``pipeline <p> · `` first with several
        pipelines, as the runtime labels them): the rows of the trace and the chart."""
        return [
            (f"pipeline {self.pipelines[s]} · " if self.pipelines else "")
            + f"stage {s}"
            + (f" · {self.chips[s]}" if self.chips else "")
            for s in range(self.num_stages)
        ]

    def trace_events(self, *, step: int = 0) -> list[TraceEvent]:
        """The events as the runtime records them (µs from the start of the step)."""
        return [
            TraceEvent(
                kind=e.kind,
                stage=e.stage,
                step=step,
                microbatch=e.microbatch,
                start_us=e.start * 1e6,
                dur_us=(e.end - e.start) * 1e6,
                chip=self.chips[e.stage] if self.chips else "",
                extra=dict(e.extra),
            )
            for e in self.events
        ]

    def to_chrome_trace(self, *, step: int = 0, stage_labels: Sequence[str] | None = None) -> dict[str, Any]:
        """The events as the runtime's Chrome/Perfetto trace JSON (µs)."""
        return chrome_trace(sort_events(self.trace_events(step=step)), list(stage_labels or self.stage_labels()))

    def save_trace(self, path: str | Path, **kw: Any) -> Path:
        return write_trace(path, self.to_chrome_trace(**kw))

    def plot(self, path: str | Path, *, title: str = "") -> Path:
        """Gantt chart PNG, drawn as the runtime draws a recorded step."""
        return plot_gantt(self.trace_events(), path, stage_labels=self.stage_labels(), title=title, what="simulated")


def _per_mb(value: float | Sequence[float], m: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * m
    if len(value) != m:
        raise ValueError(f"got {len(value)} durations, expected one per microbatch ({m})")
    return [float(v) for v in value]


class _Walk:
    """What both replays share: the stages' op lists, the durations of each task, the
    dependencies between (virtual stage, kind, microbatch) tasks, and the boundary links.

    A task of chunk c on stage s sits at model position ``virtual_stage(s, c)``. F needs the
    F of the position before it; B its own F and the B of the position after it; W its own
    B. A result crosses to another position's stage over a link (one tensor at a time per
    link and direction); between two chunks of one stage it costs nothing. A chunk task
    takes its stage's duration / num_chunks (even chunks).

    Stages are numbered from 0 here; the events it records name stage s as ``offset + s``
    (the job's stage index of a pipeline starting at `offset`) and go to `events` (a list the
    walks of several pipelines share)."""

    def __init__(
        self,
        sched: Any,
        f: list[list[float]],
        b: list[list[float]],
        w: list[list[float]],
        xf: list[float],
        xb: list[float],
        wrap: tuple[float, float],
        *,
        offset: int = 0,
        events: list[SimEvent] | None = None,
    ) -> None:
        n = sched.num_stages
        self.n, self.v = n, sched.num_chunks
        self.nv = n * self.v
        self.ops = [sched.stage_ops(s) for s in range(n)]
        self.split = sched.split_backward
        self.pos = sched.virtual_stage
        self.where = {sched.virtual_stage(s, c): (s, c) for s in range(n) for c in range(self.v)}
        self.f, self.b, self.w = f, b, w
        self.xf, self.xb, self.wrap = xf, xb, wrap
        self.done: dict[tuple[int, str, int], float] = {}  # (position, kind, mb) -> compute end
        self.arrived: dict[tuple[int, str, int], float] = {}  # input of (position, kind, mb) at its stage
        self.link_free: dict[tuple[Any, str], float] = {}
        self.offset = offset
        self.events: list[SimEvent] = [] if events is None else events

    def duration(self, s: int, task: Task) -> float:
        mb = task.microbatch
        if task.kind == FORWARD:
            d = self.f[s][mb]
        elif task.kind == BACKWARD:
            d = self.b[s][mb] + (0.0 if self.split else self.w[s][mb])
        else:
            d = self.w[s][mb]
        return d / self.v

    def ready(self, s: int, task: Task) -> float | None:
        """When the inputs of `task` on stage s are there (None: not yet known)."""
        pos, mb = self.pos(s, task.chunk), task.microbatch
        if task.kind == FORWARD:
            return 0.0 if pos == 0 else self.arrived.get((pos, FORWARD, mb))
        if task.kind == BACKWARD:
            own = self.done.get((pos, FORWARD, mb))
            nxt = 0.0 if pos == self.nv - 1 else self.arrived.get((pos, BACKWARD, mb))
            return None if own is None or nxt is None else max(own, nxt)
        return self.done.get((pos, BACKWARD, mb))

    def finish(self, s: int, task: Task, start: float, end: float) -> None:
        pos, mb = self.pos(s, task.chunk), task.microbatch
        self.done[(pos, task.kind, mb)] = end
        extra: dict[str, Any] = {}
        if self.split and task.kind != FORWARD:
            extra["part"] = task.kind
        if self.v > 1:
            extra["chunk"] = task.chunk
        self.events.append(SimEvent("fwd" if task.kind == FORWARD else "bwd", self.offset + s, mb, start, end, extra))
        if task.kind == FORWARD and pos < self.nv - 1:
            self._ship(pos, pos + 1, FORWARD, mb, end)
        if task.kind == BACKWARD and pos > 0:
            self._ship(pos, pos - 1, BACKWARD, mb, end)

    def _ship(self, src_pos: int, dst_pos: int, kind: str, mb: int, t_ready: float) -> None:
        (src, c_src), (dst, c_dst) = self.where[src_pos], self.where[dst_pos]
        if src == dst:  # two chunks of one stage: the tensor stays on its devices
            self.arrived[(dst_pos, kind, mb)] = t_ready
            return
        if abs(src - dst) == 1:
            boundary: Any = min(src, dst)
            up = dst > src
            dur = self.xf[boundary] if up else self.xb[boundary]
        else:  # the interleaved wrap: last stage <-> stage 0
            boundary, up = "wrap", src > dst
            dur = self.wrap[0] if up else self.wrap[1]
        key = (boundary, "up" if up else "down")
        start = max(t_ready, self.link_free.get(key, 0.0))
        end = start + dur
        self.link_free[key] = end
        self.arrived[(dst_pos, kind, mb)] = end
        extra: dict[str, Any] = {"phase": kind}
        if self.v > 1:
            extra["chunk"] = c_src
        at = self.offset
        self.events.append(SimEvent("send", at + src, mb, start, end, {"peer": at + dst, **extra}))
        if self.v > 1:
            extra["chunk"] = c_dst
        self.events.append(SimEvent("recv", at + dst, mb, start, end, {"peer": at + src, **extra}))


class _Job:
    """Several pipelines' walks as one (the interface of :class:`_Walk` the replays use): the
    job's stage g is stage g - offset of the walk that holds it; each walk keeps its own
    dependencies and links, and all of them record into one event list."""

    def __init__(self, walks: Sequence[_Walk]) -> None:
        self.walks = list(walks)
        self.of = [(w, s) for w in self.walks for s in range(w.n)]
        self.n = len(self.of)
        self.ops = [w.ops[s] for w, s in self.of]
        self.events = self.walks[0].events

    def duration(self, g: int, task: Task) -> float:
        w, s = self.of[g]
        return w.duration(s, task)

    def ready(self, g: int, task: Task) -> float | None:
        w, s = self.of[g]
        return w.ready(s, task)

    def finish(self, g: int, task: Task, start: float, end: float) -> None:
        w, s = self.of[g]
        w.finish(s, task, start, end)


@dataclass
class _Lane:
    """One pipeline, read and checked: its walk, and per stage its tail, chip, host and cores."""

    walk: _Walk
    tails: list[float]
    chips: list[str]
    hosts: list[str | None]
    cores: tuple[list[float], list[float], list[float]]


_LANE_KEYS = (
    "schedule",
    "num_microbatches",
    "fwd",
    "bwd",
    "wgt",
    "transfer_fwd",
    "transfer_bwd",
    "transfer_wrap",
    "tail",
    "chips",
    "hosts",
    "fwd_cores",
    "bwd_cores",
    "tail_cores",
    "num_chunks",
)


def _lane(
    *,
    schedule: Schedule | str,
    num_microbatches: int,
    fwd: Sequence[float | Sequence[float]],
    bwd: Sequence[float | Sequence[float]],
    wgt: Sequence[float | Sequence[float]] | None = None,
    transfer_fwd: Sequence[float] | None = None,
    transfer_bwd: Sequence[float] | None = None,
    transfer_wrap: tuple[float, float] | None = None,
    tail: Sequence[float] | None = None,
    chips: Sequence[str] = (),
    hosts: Sequence[str | None] | None = None,
    fwd_cores: Sequence[float] | None = None,
    bwd_cores: Sequence[float] | None = None,
    tail_cores: Sequence[float] | None = None,
    num_chunks: int | None = None,
    offset: int = 0,
    events: list[SimEvent] | None = None,
) -> _Lane:
    """One pipeline's arguments of :func:`simulate`, checked, as a :class:`_Lane` whose walk
    names its stages from `offset` and records into `events`."""
    n, m = len(fwd), num_microbatches
    if len(bwd) != n:
        raise ValueError(f"fwd has {n} stages, bwd {len(bwd)}")
    try:
        sched = get_schedule(schedule, n, m, num_chunks=num_chunks)
    except ScheduleError as e:
        raise PlanError("plan.schedule", str(e)) from None
    schedule = sched.schedule.label
    if wgt is None and sched.split_backward:
        raise ValueError(
            f"schedule={schedule!r} splits the backward into B and W: give wgt (the weight-gradient "
            "seconds per stage); without it W would cost nothing and B the whole backward"
        )
    if wgt is not None and len(wgt) != n:
        raise ValueError(f"fwd has {n} stages, wgt {len(wgt)}")
    f = [_per_mb(x, m) for x in fwd]
    b = [_per_mb(x, m) for x in bwd]
    w = [_per_mb(x, m) for x in wgt] if wgt is not None else [[0.0] * m for _ in range(n)]
    xf = list(transfer_fwd or [0.0] * (n - 1))
    xb = list(transfer_bwd or [0.0] * (n - 1))
    if len(xf) != n - 1 or len(xb) != n - 1:
        raise ValueError(f"transfer_fwd / transfer_bwd: expected {n - 1} boundaries, got {len(xf)} / {len(xb)}")
    # a chunk hand-over from the last stage to stage 0 (interleaved's) crosses a link that is no
    # plan boundary (with 2 stages that pair is boundary 0 itself)
    crosses_wrap = sched.schedule.wraps(n)
    if transfer_wrap is None and crosses_wrap and (transfer_fwd or transfer_bwd):
        raise ValueError(f"schedule={schedule!r} moves tensors between the last stage and stage 0: give transfer_wrap")
    walk = _Walk(sched, f, b, w, xf, xb, tuple(transfer_wrap or (0.0, 0.0)), offset=offset, events=events)
    host_list = list(hosts) if hosts is not None else [None] * n
    if len(host_list) != n:
        raise ValueError(f"hosts has {len(host_list)} entries, expected one per stage ({n})")
    ones = [1.0] * n
    return _Lane(
        walk=walk,
        tails=list(tail or [0.0] * n),
        chips=list(chips),
        hosts=host_list,
        cores=(list(fwd_cores or ones), list(bwd_cores or ones), list(tail_cores or ones)),
    )


def simulate(
    *,
    schedule: Schedule | str,
    num_microbatches: int,
    fwd: Sequence[float | Sequence[float]],
    bwd: Sequence[float | Sequence[float]],
    wgt: Sequence[float | Sequence[float]] | None = None,
    transfer_fwd: Sequence[float] | None = None,
    transfer_bwd: Sequence[float] | None = None,
    transfer_wrap: tuple[float, float] | None = None,
    tail: Sequence[float] | None = None,
    chips: Sequence[str] = (),
    hosts: Sequence[str | None] | None = None,
    host_cores: Mapping[str, float] | None = None,
    fwd_cores: Sequence[float] | None = None,
    bwd_cores: Sequence[float] | None = None,
    tail_cores: Sequence[float] | None = None,
    num_chunks: int | None = None,
) -> SimResult:
    """Replay one step of any schedule (a :class:`~h2jax.plan.schedules.Schedule`, or what
    :func:`~h2jax.plan.schedules.as_schedule` reads; `num_chunks`: where the family's chunk
    count is a choice, its count). `fwd[s]` / `bwd[s]` / `wgt[s]`: seconds
    per microbatch of stage s running alone (a number, or one per microbatch) of its forward,
    input-gradient backward (B) and weight-gradient backward (W); an unsplit schedule runs
    B + W as its one backward task, so ``wgt=None`` (W = 0, B = the whole backward) suits
    those, and a split schedule needs `wgt`. A stage of an interleaved / V schedule runs its
    chunks at durations / num_chunks each. `transfer_*[b]`: seconds to cross boundary b
    (stage b -> b + 1 forward, b + 1 -> b backward; a V's second arm uses the backward side
    for its activations); `transfer_wrap`: (last stage -> stage 0, stage 0 -> last stage),
    which only interleaved crosses (0 when no transfers are given). `hosts[s]`,
    `host_cores[host]`, `*_cores[s]`: shared hosts (module docstring; W uses `bwd_cores`)."""
    lane = _lane(
        schedule=schedule,
        num_microbatches=num_microbatches,
        fwd=fwd,
        bwd=bwd,
        wgt=wgt,
        transfer_fwd=transfer_fwd,
        transfer_bwd=transfer_bwd,
        transfer_wrap=transfer_wrap,
        tail=tail,
        chips=chips,
        hosts=hosts,
        fwd_cores=fwd_cores,
        bwd_cores=bwd_cores,
        tail_cores=tail_cores,
        num_chunks=num_chunks,
    )
    return _replay(lane.walk, [lane], host_cores)


def simulate_pipelines(
    pipelines: Sequence[Mapping[str, Any]],
    *,
    exchange_s: float = 0.0,
    exchange_summed_s: float | None = None,
    exchange_pairs: Sequence[tuple[int, int, float]] = (),
    host_cores: Mapping[str, float] | None = None,
) -> SimResult:
    """Replay one step of a job of several pipelines in one replay (module docstring).

    `pipelines[p]`: pipeline p's keyword arguments of :func:`simulate` (all but `host_cores`);
    the job's stages are pipeline 0's, then pipeline 1's, ... (``Plan.stage_offsets``), and
    a host named by stages of any pipelines is shared by all of them (`host_cores`: the cores
    of each shared host, given once for the job). `exchange_s`: seconds of the exchange across
    the pipelines (:func:`h2jax.plan._pipelines.exchange_s`), of them `exchange_summed_s` the
    gradient sum's (None: half, as its bytes are: one gradient to the owner, the value back);
    the step ends as the runtime
    ends it: the last backward of every pipeline, the gradient sum, every stage's tail at
    once, the copy back. `exchange_pairs`: (owner stage, mirror stage, seconds) of a gradient sum
    between stages with processes of their own, in the runtime's order (module docstring); each
    starts once both stages are done and keeps the owner busy, before the `exchange_summed_s`
    that follows the last of them. One pipeline: exactly :func:`simulate` (no exchange)."""
    if not pipelines:
        raise ValueError("pipelines: expected one or more pipelines' arguments, got none")
    if not (exchange_s >= 0 and math.isfinite(exchange_s)):
        raise ValueError(f"exchange_s={exchange_s!r}; expected seconds >= 0")
    summed = exchange_s / 2 if exchange_summed_s is None else exchange_summed_s
    if not 0 <= summed <= exchange_s:
        raise ValueError(f"exchange_summed_s={exchange_summed_s!r}; expected seconds within exchange_s={exchange_s!r}")
    for p, kw in enumerate(pipelines):
        unknown = sorted(set(kw) - set(_LANE_KEYS))
        if unknown:
            why = (
                "give it once, to simulate_pipelines"
                if unknown == ["host_cores"]
                else "expected " + ", ".join(_LANE_KEYS)
            )
            raise ValueError(f"pipelines[{p}]: unknown key(s) {', '.join(unknown)}; {why}")
    for o, m, x in exchange_pairs:
        if not (x >= 0 and math.isfinite(x)) or o == m:
            raise ValueError(f"exchange_pairs: ({o}, {m}, {x!r}); expected two stages and seconds >= 0")
    if len(pipelines) == 1:
        if exchange_s or exchange_pairs:
            what = f"exchange_s={exchange_s!r}" if exchange_s else f"exchange_pairs={list(exchange_pairs)!r}"
            raise ValueError(f"{what} with one pipeline: one pipeline exchanges nothing")
        return simulate(**pipelines[0], host_cores=host_cores)
    events: list[SimEvent] = []
    lanes, offset = [], 0
    for p, kw in enumerate(pipelines):
        try:
            lane = _lane(**kw, offset=offset, events=events)
        except PlanError as e:
            raise PlanError(f"plan.pipelines[{p}].{e.key.removeprefix('plan.')}", e.message) from None
        except ValueError as e:
            raise ValueError(f"pipelines[{p}]: {e}") from None
        lanes.append(lane)
        offset += lane.walk.n
    return _replay(
        _Job([lane.walk for lane in lanes]),
        lanes,
        host_cores,
        barrier=(summed, exchange_s - summed),
        pairs=Exchange(tuple(exchange_pairs)),
        pipelines=tuple(p for p, lane in enumerate(lanes) for _ in range(lane.walk.n)),
    )


def _replay(
    walk: _Walk | _Job,
    lanes: Sequence[_Lane],
    host_cores: Mapping[str, float] | None,
    *,
    barrier: tuple[float, float] | None = None,
    pairs: Exchange = Exchange(),
    pipelines: tuple[int, ...] = (),
) -> SimResult:
    """The replay of `walk` (one pipeline's, or a job's): with processor sharing where a host is
    named by two or more stages, else the plain one. `barrier`: None, each stage's tail right
    after its own last op; (a, b), every tail a seconds after the last op of every stage,
    and b more seconds after the last tail (the exchange across pipelines, module docstring), after
    the `pairs` of stages with processes of their own (on shared hosts: after the last op)."""
    n = walk.n
    tails = [t for lane in lanes for t in lane.tails]
    hosts = [h for lane in lanes for h in lane.hosts]
    chips = [c for lane in lanes for c in lane.chips] if all(lane.chips for lane in lanes) else []
    shared = {h for h in hosts if h is not None and hosts.count(h) > 1}
    if shared:
        missing = sorted(h for h in shared if h not in (host_cores or {}))
        if missing:
            raise ValueError(f"host_cores has no entry for shared host(s) {missing}")
        if pairs.pairs and barrier is not None:  # one process drives them: in turn, after the last op
            barrier = (barrier[0] + pairs.summed_s, barrier[1])
        return _replay_shared(
            walk,
            tails,
            chips=chips,
            hosts=[h if h in shared else None for h in hosts],
            host_cores=dict(host_cores or {}),
            cores=tuple([c for lane in lanes for c in lane.cores[k]] for k in range(3)),  # type: ignore[arg-type]
            barrier=barrier,
            pipelines=pipelines,
        )
    ops = walk.ops
    cursor = [0] * n
    free = [0.0] * n
    remaining = sum(len(o) for o in ops)
    while remaining:
        # start the op that can start earliest (ties: lower stage); deterministic event order
        pick = None
        for s in range(n):
            if cursor[s] == len(ops[s]):
                continue
            task = ops[s][cursor[s]]
            ready = walk.ready(s, task)
            if ready is None:
                continue
            start = max(ready, free[s])
            if pick is None or start < pick[0]:
                pick = (start, s, task)
        if pick is None:
            raise RuntimeError(f"simulation deadlocks; cursors {cursor}")
        start, s, task = pick
        end = start + walk.duration(s, task)
        free[s] = end
        walk.finish(s, task, start, end)
        cursor[s] += 1
        remaining -= 1
    events = walk.events
    if barrier is not None:  # every tail after the last op of the job and the gradient sum
        for o, m, t0, t1 in pairs.timed(free):
            if t1 > t0:
                events.append(
                    SimEvent("other", o, None, t0, t1, {"name": "across pipelines: gradients summed", "with": m})
                )
        last = pairs.sums_end(free)
        gate = last + barrier[0]
        _exchange(events, n, last, gate, "gradients summed")
        free = [gate] * n
    finish = 0.0
    for s in range(n):
        if tails[s] > 0:
            events.append(SimEvent("update", s, None, free[s], free[s] + tails[s]))
        finish = max(finish, free[s] + tails[s])
    if barrier is not None:
        _exchange(events, n, finish, finish + barrier[1], "parameters copied")
        finish += barrier[1]
    return SimResult(events=events, iteration_s=finish, num_stages=n, chips=tuple(chips), pipelines=pipelines)


def _exchange(events: list[SimEvent], n: int, start: float, end: float, what: str) -> None:
    """The exchange across pipelines from `start` to `end`, on every stage, as the runtime
    records it (an ``other`` event named "across pipelines: <what>")."""
    if end > start:
        events.extend(SimEvent("other", s, None, start, end, {"name": f"across pipelines: {what}"}) for s in range(n))


def _replay_shared(
    walk: _Walk | _Job,
    tails: list[float],
    *,
    chips: Sequence[str],
    hosts: list[str | None],
    host_cores: dict[str, float],
    cores: tuple[list[float], list[float], list[float]],
    barrier: tuple[float, float] | None = None,
    pipelines: tuple[int, ...] = (),
) -> SimResult:
    """The replay with processor sharing on shared hosts (module docstring), event by event;
    `barrier` as in :func:`_replay`."""
    cf, cb, ct = cores
    n, ops = walk.n, walk.ops
    cursor = [0] * n
    events = walk.events
    # stage -> [task (None: the tail), start, remaining alone-seconds, cores, duration]
    running: dict[int, list[Any]] = {}
    finished = [False] * n
    finish = 0.0
    now = 0.0
    gate: float | None = None  # with a barrier: when the tails start (known once every op has run)
    # with a barrier, the tails on shared hosts run one after another in stage order (module docstring)
    turn = [s for s in range(n) if hosts[s] is not None and tails[s] > 0] if barrier is not None else []

    def ready_at(s: int) -> float | None:
        return walk.ready(s, ops[s][cursor[s]])

    while True:
        if barrier is not None and gate is None and not running and all(c == len(o) for c, o in zip(cursor, ops)):
            gate = now + barrier[0]
            _exchange(events, n, now, gate, "gradients summed")
        # start whatever can start now (stage order: deterministic)
        for s in range(n):
            if s in running or finished[s]:
                continue
            if cursor[s] == len(ops[s]):
                if barrier is not None and (gate is None or now < gate):
                    continue  # the tails wait for the job's last op and the gradient sum
                if s in turn and turn[0] != s:
                    continue  # the tail of an earlier stage of a shared host runs
                if tails[s] > 0:
                    running[s] = [None, now, tails[s], ct[s], tails[s]]
                    cursor[s] += 1
                else:
                    finished[s] = True
                    finish = max(finish, now)
                continue
            if cursor[s] > len(ops[s]):
                continue
            r = ready_at(s)
            if r is not None and r <= now:
                task = ops[s][cursor[s]]
                d = walk.duration(s, task)
                running[s] = [task, now, d, (cf if task.kind == FORWARD else cb)[s], d]
        if all(finished):
            break
        pending = [
            r
            for s in range(n)
            if s not in running and not finished[s] and cursor[s] < len(ops[s])
            for r in (ready_at(s),)
            if r is not None and r > now
        ]
        if gate is not None and gate > now:
            pending.append(gate)
        if not running:
            if not pending:
                raise RuntimeError(f"simulation deadlocks; cursors {cursor}")
            now = min(pending)
            continue
        demand: dict[str, float] = {}
        for s, job in running.items():
            if hosts[s] is not None:
                demand[hosts[s]] = demand.get(hosts[s], 0.0) + job[3]
        rate = {
            s: 1.0 if hosts[s] is None or demand[hosts[s]] <= 0 else min(1.0, host_cores[hosts[s]] / demand[hosts[s]])
            for s in running
        }
        t_next = min(now + job[2] / rate[s] for s, job in running.items())
        if pending:
            t_next = min(t_next, min(pending))
        dt = t_next - now
        now = t_next
        for s in sorted(running):
            job = running[s]
            job[2] -= rate[s] * dt
            if job[2] > 1e-12 + 1e-9 * job[4]:
                continue
            task, start = job[0], job[1]
            del running[s]
            if task is None:
                events.append(SimEvent("update", s, None, start, now))
                if turn and turn[0] == s:
                    turn.pop(0)
                finished[s] = True
                finish = max(finish, now)
                continue
            walk.finish(s, task, start, now)
            cursor[s] += 1
    if barrier is not None:
        _exchange(events, n, finish, finish + barrier[1], "parameters copied")
        finish += barrier[1]
    return SimResult(events=events, iteration_s=finish, num_stages=n, chips=tuple(chips), pipelines=pipelines)


def _stage_args(plan: Plan, cost: PlanCost) -> dict[str, Any]:
    """:func:`simulate`'s arguments (but `host_cores`) of a one-pipeline plan priced by `cost`."""
    st = cost.stages
    return dict(
        schedule=plan.schedule,
        num_microbatches=plan.num_microbatches,
        fwd=[s.fwd_s for s in st],
        bwd=[s.b_s for s in st],
        wgt=[s.w_s for s in st],
        transfer_fwd=cost.transfers_fwd,
        transfer_bwd=cost.transfers_bwd,
        transfer_wrap=cost.transfer_wrap,
        tail=[s.tail_s for s in st],
        chips=[s.chip for s in plan.stages],
        hosts=[s.host for s in st],
        fwd_cores=[s.fwd_cores for s in st],
        bwd_cores=[s.bwd_cores for s in st],
        tail_cores=[s.tail_cores for s in st],
    )


def simulate_plan(
    plan: Plan,
    model: ModelShape,
    cluster: Cluster | Mapping[str, ChipProfile],
    *,
    table: ProfileTable | None = None,
    opts: CostOptions = CostOptions(),
) -> tuple[SimResult, PlanCost | PipelinesCost]:
    """Simulate `plan` with the cost model's per-stage durations; returns (simulation, estimate).

    Stages on a shared host (emulated chips) share its cores as the cost model says; the
    runtime driver's measured seconds per step outside the pipeline are added at the end.
    A plan of several pipelines is replayed as one job (:func:`simulate_pipelines`; the
    exchange priced by :func:`h2jax.plan._pipelines.exchange_parts`) and its estimate is
    :func:`h2jax.plan._pipelines.estimate_pipelines`'s (a chip mapping is read as a cluster
    of each profile's ``nodes``)."""
    if plan.pipelines:
        if not isinstance(cluster, Cluster):
            cluster = Cluster(tuple((p, p.nodes) for p in cluster.values()))
        job = estimate_pipelines(plan, model, cluster, table=table, opts=opts)
        cores: dict[str, float] = {}
        for c in job.pipelines:
            for h, k in c.host_cores.items():
                cores[h] = min(cores.get(h, k), k)
        args = [_stage_args(pipe, c) for pipe, c in zip(plan.pipeline_plans(), job.pipelines)]
        ex = job.exchange or Exchange()
        sim = simulate_pipelines(
            args,
            exchange_s=ex.after_s + ex.copied_s,
            exchange_summed_s=ex.after_s,
            exchange_pairs=ex.pairs,
            host_cores=cores,
        )
        step_s = max(c.driver_step_s for c in job.pipelines)  # one driver loop per step, its threads at once
        if step_s > 0:
            sim.iteration_s += step_s
        return sim, job
    cost = estimate(plan, model, cluster, table=table, opts=opts)
    sim = simulate(**_stage_args(plan, cost), host_cores=cost.host_cores)
    if cost.driver_step_s > 0:  # the driver's per-step time outside the pipeline (measured)
        sim.iteration_s += cost.driver_step_s
    return sim, cost
