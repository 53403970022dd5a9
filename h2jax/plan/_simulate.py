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

Durations come from the cost model
(:func:`simulate_plan`) or from a real run's trace (per stage, per microbatch), so the
simulator both checks the analytic formula and replays a measured run.

The events are the runtime's (:mod:`h2jax._trace`: a split backward's tasks are ``bwd``
events with ``part`` "B" or "W", a chunk's carry ``chunk``), written as the same Chrome trace
(:meth:`SimResult.save_trace`) and drawn as the same Gantt chart (:meth:`SimResult.plot`),
without importing JAX.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h2jax._trace import TraceEvent, chrome_trace, idle_share, plot_gantt, sort_events, write_trace
from h2jax.plan._cost import CostOptions, PlanCost, estimate
from h2jax.plan._plan import Plan, PlanError
from h2jax.plan._profiles import ChipProfile, Cluster, ModelShape, ProfileTable
from h2jax.plan.schedules import BACKWARD, FORWARD, Schedule, ScheduleError, Task, get_schedule


@dataclass(frozen=True)
class SimEvent:
    """One interval; times in seconds from the start of the step."""

    kind: str  # fwd | bwd | send | recv | update
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
        """``stage <s>``, with the chip type when known: the rows of the trace and the chart."""
        return [f"stage {s}" + (f" · {self.chips[s]}" if self.chips else "") for s in range(self.num_stages)]

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
    takes its stage's duration / num_chunks (even chunks)."""

    def __init__(
        self,
        sched: Any,
        f: list[list[float]],
        b: list[list[float]],
        w: list[list[float]],
        xf: list[float],
        xb: list[float],
        wrap: tuple[float, float],
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
        self.events: list[SimEvent] = []

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
        self.events.append(SimEvent("fwd" if task.kind == FORWARD else "bwd", s, mb, start, end, extra))
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
        self.events.append(SimEvent("send", src, mb, start, end, {"peer": dst, **extra}))
        if self.v > 1:
            extra["chunk"] = c_dst
        self.events.append(SimEvent("recv", dst, mb, start, end, {"peer": src, **extra}))


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
    walk = _Walk(sched, f, b, w, xf, xb, tuple(transfer_wrap or (0.0, 0.0)))
    tails = list(tail or [0.0] * n)
    hosts = list(hosts) if hosts is not None else [None] * n
    if len(hosts) != n:
        raise ValueError(f"hosts has {len(hosts)} entries, expected one per stage ({n})")
    shared = {h for h in hosts if h is not None and hosts.count(h) > 1}
    if shared:
        missing = sorted(h for h in shared if h not in (host_cores or {}))
        if missing:
            raise ValueError(f"host_cores has no entry for shared host(s) {missing}")
        ones = [1.0] * n
        return _replay_shared(
            walk,
            tails,
            chips=chips,
            hosts=[h if h in shared else None for h in hosts],
            host_cores=dict(host_cores or {}),
            cores=(list(fwd_cores or ones), list(bwd_cores or ones), list(tail_cores or ones)),
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
    finish = 0.0
    for s in range(n):
        if tails[s] > 0:
            events.append(SimEvent("update", s, None, free[s], free[s] + tails[s]))
        finish = max(finish, free[s] + tails[s])
    return SimResult(events=events, iteration_s=finish, num_stages=n, chips=tuple(chips))


def _replay_shared(
    walk: _Walk,
    tails: list[float],
    *,
    chips: Sequence[str],
    hosts: list[str | None],
    host_cores: dict[str, float],
    cores: tuple[list[float], list[float], list[float]],
) -> SimResult:
    """The replay with processor sharing on shared hosts (module docstring), event by event."""
    cf, cb, ct = cores
    n, ops = walk.n, walk.ops
    cursor = [0] * n
    events = walk.events
    # stage -> [task (None: the tail), start, remaining alone-seconds, cores, duration]
    running: dict[int, list[Any]] = {}
    finished = [False] * n
    finish = 0.0
    now = 0.0

    def ready_at(s: int) -> float | None:
        return walk.ready(s, ops[s][cursor[s]])

    while True:
        # start whatever can start now (stage order: deterministic)
        for s in range(n):
            if s in running or finished[s]:
                continue
            if cursor[s] == len(ops[s]):
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
                finished[s] = True
                finish = max(finish, now)
                continue
            walk.finish(s, task, start, now)
            cursor[s] += 1
    return SimResult(events=events, iteration_s=finish, num_stages=n, chips=tuple(chips))


def simulate_plan(
    plan: Plan,
    model: ModelShape,
    cluster: Cluster | Mapping[str, ChipProfile],
    *,
    table: ProfileTable | None = None,
    opts: CostOptions = CostOptions(),
) -> tuple[SimResult, PlanCost]:
    """Simulate `plan` with the cost model's per-stage durations; returns (simulation, estimate).

    Stages on a shared host (emulated chips) share its cores as the cost model says; the
    runtime driver's measured seconds per step outside the pipeline are added at the end."""
    cost = estimate(plan, model, cluster, table=table, opts=opts)
    st = cost.stages
    sim = simulate(
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
        host_cores=cost.host_cores,
        fwd_cores=[s.fwd_cores for s in st],
        bwd_cores=[s.bwd_cores for s in st],
        tail_cores=[s.tail_cores for s in st],
    )
    if cost.driver_step_s > 0:  # the driver's per-step time outside the pipeline (measured)
        sim.iteration_s += cost.driver_step_s
    return sim, cost
