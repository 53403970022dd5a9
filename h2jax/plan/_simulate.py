"""Discrete-event replay of a plan's pipeline schedule.

Each stage walks its op list (``get_schedule(...).stage_ops(stage_idx)`` -- the very list
the runtime's driver walks) one op at a time; an op starts when the stage is free and its
input has arrived:

- F(s, m) needs F(s-1, m) finished and its activation moved over boundary s-1;
- B(s, m) needs F(s, m) and B(s+1, m) finished and the gradient moved back;
- a boundary moves one tensor at a time per direction (the runtime has one transfer
  thread per boundary and direction), so transfers queue behind each other.

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

The events are written in the runtime's Chrome trace format (``h2jax.runtime`` timeline:
``pid`` = stage, ``tid`` 0 compute / 1 comm, args step/stage/microbatch/kind/chip) and can
be drawn as a Gantt PNG -- without importing JAX.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from h2jax.plan._cost import CostOptions, PlanCost, estimate
from h2jax.plan._plan import Plan, PlanError
from h2jax.plan._profiles import ChipProfile, Cluster, ModelShape, ProfileTable
from h2jax.plan._schedule import BACKWARD, FORWARD, get_schedule


@dataclass(frozen=True)
class SimEvent:
    """One interval; times in seconds from the start of the step."""

    kind: str  # fwd | bwd | send | recv | update
    stage: int
    microbatch: int | None
    start: float
    end: float
    extra: dict = field(default_factory=dict)


@dataclass
class SimResult:
    events: list[SimEvent]
    iteration_s: float
    num_stages: int
    chips: tuple[str, ...] = ()

    def stage_order(self, stage: int) -> list[tuple[str, int]]:
        """(kind "F"/"B", microbatch) of one stage's compute, in start order."""
        evs = sorted(
            (e for e in self.events if e.stage == stage and e.kind in ("fwd", "bwd")), key=lambda e: (e.start, e.end)
        )
        return [("F" if e.kind == "fwd" else "B", e.microbatch) for e in evs]

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
        u = self.utilisation()
        return 1.0 - sum(u) / len(u) if u else 0.0

    def to_chrome_trace(self, *, step: int = 0, stage_labels: Sequence[str] | None = None) -> dict[str, Any]:
        """The events as the runtime's Chrome/Perfetto trace JSON (µs)."""
        labels = list(
            stage_labels
            or [f"stage {s}" + (f" · {self.chips[s]}" if self.chips else "") for s in range(self.num_stages)]
        )
        out: list[dict[str, Any]] = []
        for s in range(self.num_stages):
            out.append({"ph": "M", "name": "process_name", "pid": s, "tid": 0, "args": {"name": labels[s]}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": s, "tid": 0, "args": {"sort_index": s}})
        for e in sorted(self.events, key=lambda e: (e.start, e.stage)):
            name = {"fwd": f"F{e.microbatch}", "bwd": f"B{e.microbatch}"}.get(
                e.kind, f"{e.kind} {e.extra.get('phase', '')}{'' if e.microbatch is None else e.microbatch}"
            )
            args = {
                "step": step,
                "stage": e.stage,
                "microbatch": e.microbatch,
                "kind": e.kind,
                "chip": self.chips[e.stage] if self.chips else "",
                **e.extra,
            }
            out.append(
                {
                    "name": name.strip(),
                    "cat": e.kind,
                    "ph": "X",
                    "ts": e.start * 1e6,
                    "dur": (e.end - e.start) * 1e6,
                    "pid": e.stage,
                    "tid": 1 if e.kind in ("send", "recv") else 0,
                    "args": args,
                }
            )
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def save_trace(self, path: str | Path, **kw: Any) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_chrome_trace(**kw)))
        return path

    def plot(self, path: str | Path, *, title: str = "") -> Path:
        """Gantt chart PNG: one row per stage, forwards blue, backwards orange, tail green."""
        from matplotlib.figure import Figure

        colours = {"fwd": "#4C72B0", "bwd": "#DD8452", "update": "#55A868", "send": "#8172B3", "recv": "#C44E52"}
        fig = Figure(figsize=(13.0, 1.6 + 0.7 * self.num_stages), dpi=110, layout="constrained")
        ax = fig.add_subplot()
        scale = 1e3 if self.iteration_s < 10 else 1.0
        unit = "ms" if scale == 1e3 else "s"
        for e in self.events:
            lane = (e.stage + 0.22, 0.15) if e.kind in ("send", "recv") else (e.stage - 0.38, 0.58)
            ax.broken_barh(
                [(e.start * scale, (e.end - e.start) * scale)],
                lane,
                facecolors=colours.get(e.kind, "#999999"),
                edgecolor="white",
                linewidth=0.3,
            )
        labels = [f"stage {s}" + (f" · {self.chips[s]}" if self.chips else "") for s in range(self.num_stages)]
        ax.set_yticks(range(self.num_stages), labels)
        ax.set_ylim(self.num_stages - 0.5, -0.5)
        ax.set_xlabel(f"time ({unit})")
        ax.set_title(
            f"{title}\nsimulated: {self.iteration_s * scale:.4g} {unit} per step, "
            f"bubble {100 * self.bubble_fraction:.1f} %",
            loc="left",
            fontsize=10,
        )
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
        return path


def _per_mb(value: float | Sequence[float], m: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * m
    if len(value) != m:
        raise ValueError(f"got {len(value)} durations, expected one per microbatch ({m})")
    return [float(v) for v in value]


REPLAYED = ("gpipe", "1f1b")  # schedules the event model replays (F and B tasks, no W)


def simulate(
    *,
    schedule: str,
    num_microbatches: int,
    fwd: Sequence[float | Sequence[float]],
    bwd: Sequence[float | Sequence[float]],
    transfer_fwd: Sequence[float] | None = None,
    transfer_bwd: Sequence[float] | None = None,
    tail: Sequence[float] | None = None,
    chips: Sequence[str] = (),
    hosts: Sequence[str | None] | None = None,
    host_cores: Mapping[str, float] | None = None,
    fwd_cores: Sequence[float] | None = None,
    bwd_cores: Sequence[float] | None = None,
    tail_cores: Sequence[float] | None = None,
) -> SimResult:
    """Replay one step. `fwd[s]` / `bwd[s]`: seconds per microbatch of stage s running alone
    (a number, or one per microbatch); `transfer_*[b]`: seconds to cross boundary b (stage
    b <-> b + 1); `hosts[s]`, `host_cores[host]`, `*_cores[s]`: shared hosts (module docstring)."""
    n, m = len(fwd), num_microbatches
    if schedule not in REPLAYED:  # the event model below knows F and B tasks only
        raise PlanError(
            "plan.schedule",
            f"schedule={schedule!r}: the simulator replays {', '.join(REPLAYED)} only (a split backward "
            "would be priced wrong); h2jax.plan.timed_events replays any schedule with given F, B, W durations",
        )
    if len(bwd) != n:
        raise ValueError(f"fwd has {n} stages, bwd {len(bwd)}")
    f = [_per_mb(x, m) for x in fwd]
    b = [_per_mb(x, m) for x in bwd]
    xf = list(transfer_fwd or [0.0] * (n - 1))
    xb = list(transfer_bwd or [0.0] * (n - 1))
    tails = list(tail or [0.0] * n)
    sched = get_schedule(schedule, n, m)
    ops = [sched.stage_ops(s) for s in range(n)]
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
            ops,
            f,
            b,
            xf,
            xb,
            tails,
            n=n,
            chips=chips,
            hosts=[h if h in shared else None for h in hosts],
            host_cores=dict(host_cores or {}),
            cores=(list(fwd_cores or ones), list(bwd_cores or ones), list(tail_cores or ones)),
        )
    cursor = [0] * n
    free = [0.0] * n
    done: dict[tuple[int, str, int], float] = {}  # compute end
    arrived: dict[tuple[int, str, int], float] = {}  # input available at stage (s, kind, mb)
    link_free: dict[tuple[int, str], float] = {}
    events: list[SimEvent] = []

    def ship(src: int, dst: int, kind: str, mb: int, t_ready: float) -> None:
        boundary = min(src, dst)
        key = (boundary, kind)
        start = max(t_ready, link_free.get(key, 0.0))
        dur = xf[boundary] if kind == FORWARD else xb[boundary]
        end = start + dur
        link_free[key] = end
        arrived[(dst, kind, mb)] = end
        extra = {"peer": dst, "phase": kind}
        events.append(SimEvent("send", src, mb, start, end, dict(extra)))
        events.append(SimEvent("recv", dst, mb, start, end, {"peer": src, "phase": kind}))

    remaining = sum(len(o) for o in ops)
    while remaining:
        # start the op that can start earliest (ties: lower stage); deterministic event order
        pick = None
        for s in range(n):
            if cursor[s] == len(ops[s]):
                continue
            task = ops[s][cursor[s]]
            mb = task.microbatch
            if task.kind == FORWARD:
                ready = 0.0 if s == 0 else arrived.get((s, FORWARD, mb))
            else:
                own = done.get((s, FORWARD, mb))
                nxt = 0.0 if s == n - 1 else arrived.get((s, BACKWARD, mb))
                ready = None if own is None or nxt is None else max(own, nxt)
            if ready is None:
                continue
            start = max(ready, free[s])
            if pick is None or start < pick[0]:
                pick = (start, s, task)
        if pick is None:
            raise RuntimeError(f"simulation deadlocks; cursors {cursor}")
        start, s, task = pick
        mb = task.microbatch
        dur = f[s][mb] if task.kind == FORWARD else b[s][mb]
        end = start + dur
        free[s] = end
        done[(s, task.kind, mb)] = end
        events.append(SimEvent("fwd" if task.kind == FORWARD else "bwd", s, mb, start, end))
        if task.kind == FORWARD and s < n - 1:
            ship(s, s + 1, FORWARD, mb, end)
        if task.kind == BACKWARD and s > 0:
            ship(s, s - 1, BACKWARD, mb, end)
        cursor[s] += 1
        remaining -= 1
    finish = 0.0
    for s in range(n):
        if tails[s] > 0:
            events.append(SimEvent("update", s, None, free[s], free[s] + tails[s]))
        finish = max(finish, free[s] + tails[s])
    return SimResult(events=events, iteration_s=finish, num_stages=n, chips=tuple(chips))


def _replay_shared(
    ops: list[list[Any]],
    f: list[list[float]],
    b: list[list[float]],
    xf: list[float],
    xb: list[float],
    tails: list[float],
    *,
    n: int,
    chips: Sequence[str],
    hosts: list[str | None],
    host_cores: dict[str, float],
    cores: tuple[list[float], list[float], list[float]],
) -> SimResult:
    """The replay with processor sharing on shared hosts (module docstring), event by event."""
    cf, cb, ct = cores
    cursor = [0] * n
    done: dict[tuple[int, str, int], float] = {}
    arrived: dict[tuple[int, str, int], float] = {}
    link_free: dict[tuple[int, str], float] = {}
    events: list[SimEvent] = []
    # stage -> [kind ("F" | "B" | "tail"), microbatch, start, remaining alone-seconds, cores, duration]
    running: dict[int, list[Any]] = {}
    finished = [False] * n
    finish = 0.0
    now = 0.0

    def ship(src: int, dst: int, kind: str, mb: int, t_ready: float) -> None:
        key = (min(src, dst), kind)
        start = max(t_ready, link_free.get(key, 0.0))
        end = start + (xf[key[0]] if kind == FORWARD else xb[key[0]])
        link_free[key] = end
        arrived[(dst, kind, mb)] = end
        events.append(SimEvent("send", src, mb, start, end, {"peer": dst, "phase": kind}))
        events.append(SimEvent("recv", dst, mb, start, end, {"peer": src, "phase": kind}))

    def ready_at(s: int) -> float | None:
        task = ops[s][cursor[s]]
        mb = task.microbatch
        if task.kind == FORWARD:
            return 0.0 if s == 0 else arrived.get((s, FORWARD, mb))
        own = done.get((s, FORWARD, mb))
        nxt = 0.0 if s == n - 1 else arrived.get((s, BACKWARD, mb))
        return None if own is None or nxt is None else max(own, nxt)

    while True:
        # start whatever can start now (stage order: deterministic)
        for s in range(n):
            if s in running or finished[s]:
                continue
            if cursor[s] == len(ops[s]):
                if tails[s] > 0:
                    running[s] = ["tail", None, now, tails[s], ct[s], tails[s]]
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
                d = (f if task.kind == FORWARD else b)[s][task.microbatch]
                running[s] = [task.kind, task.microbatch, now, d, (cf if task.kind == FORWARD else cb)[s], d]
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
                demand[hosts[s]] = demand.get(hosts[s], 0.0) + job[4]
        rate = {
            s: 1.0 if hosts[s] is None or demand[hosts[s]] <= 0 else min(1.0, host_cores[hosts[s]] / demand[hosts[s]])
            for s in running
        }
        t_next = min(now + job[3] / rate[s] for s, job in running.items())
        if pending:
            t_next = min(t_next, min(pending))
        dt = t_next - now
        now = t_next
        for s in sorted(running):
            job = running[s]
            job[3] -= rate[s] * dt
            if job[3] > 1e-12 + 1e-9 * job[5]:
                continue
            kind, mb, start = job[0], job[1], job[2]
            del running[s]
            if kind == "tail":
                events.append(SimEvent("update", s, None, start, now))
                finished[s] = True
                finish = max(finish, now)
                continue
            done[(s, kind, mb)] = now
            events.append(SimEvent("fwd" if kind == FORWARD else "bwd", s, mb, start, now))
            if kind == FORWARD and s < n - 1:
                ship(s, s + 1, FORWARD, mb, now)
            if kind == BACKWARD and s > 0:
                ship(s, s - 1, BACKWARD, mb, now)
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
        bwd=[s.bwd_s for s in st],
        transfer_fwd=cost.transfers_fwd,
        transfer_bwd=cost.transfers_bwd,
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
