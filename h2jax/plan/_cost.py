"""The cost model: iteration time and per-device memory of a Plan, from per-layer costs.

Per stage s (chip c, mesh data x tensor, layers l_s, microbatch mb sequences):

- forward / backward seconds per microbatch: the sum of its parts (embedding on stage 0,
  l_s blocks, head and loss on the last stage) at mb / data sequences per device, from a
  :class:`ProfileTable` (measured, or the roofline estimate); recompute adds one forward
  to the backward;
- data-parallel gradient all-reduce of the stage's fp32 gradients (ring over `data`
  devices; intra-node link when the stage fits in a node, else inter-node), once per step
  (``grad_sync="step"``) or inside every backward (``"microbatch"``: what the current
  single-controller runtime does);
- optimizer update: as measured by ``h2jax profile`` (gradient norm + AdamW step), else
  AdamW reads params, grads and both moments, writes three (28 B/param) at the chip's
  memory bandwidth.

Boundaries: one activation (forward) and one gradient (backward) per microbatch and
boundary, mb x seq x d_model x act_bytes each, sent over min(devices of either side)
parallel links (the topology-aware resharding pattern: each destination (data, tensor)
slot receives a distinct piece), plus the all-gather inside the destination's tensor axis.
Between chips on one shared host (emulated) the measured host-memory transfer is used.

Iteration time, 1F1B and GPipe alike (they differ in memory, not in time)::

    T_pipe = (m - 1) * P + sum_s t_s + sum_b (c_fwd_b + c_bwd_b) + max_s g_s
    T      = max(T_pipe, max_h W_h / C_h)

with t_s = fwd_s + bwd_s, c the boundary transfers, g_s = gradient all-reduce + update,
and the steady-state period P = max_s t_s when every stage has its chip to itself. The
first two terms of T_pipe are the classic pipeline estimate (fill/drain plus m - 1
steady-state slots of the slowest stage); the simulator replays the schedule event by
event to check it.

ZB-H1 splits each backward into B (input gradient) and W (weight gradient), by each
part's FLOPs (:func:`weight_grad_share`: W ~ 0.5 of a block's backward; the W program is
one more call). W leaves the critical path and fills the waits for B, so with h_s the W
work of stage s that can fill a slot (per part at most the forward it stands in for)::

    T_pipe = (m - 1) * P + sum_s (t_s - 2 h_s) + transfers + max_s (g_s + 2 h_s)

which on equal stages is the paper's m (F + B + W) + (p - 1)(F + B - W) (arXiv 2401.10241)
and never exceeds 1F1B's T_pipe of the same plan. On 900 random uneven pipelines (stages
up to 4x apart, p = 2..8, m = p..4p, no transfers) it lay between 0.7 % below and 11 %
above the event replay, 1.3-2.7 % above on average (1F1B's formula: up to 20 % above).

Chunked schedules (a stage holds v layer chunks, each its own program: interleaved with v =
2 or more, zb-v with 2 in a V; the simulator and this model take the chunks as even, 1/v of
the stage each). A stage's seconds are its parts' (the embedding with the stage holding model
position 0, the head with the one holding the last: zb-v puts both on stage 0) plus a program
call per chunk; its activations are counted per (chunk, microbatch), each 1/v of the stage's,
with the schedule's own peak counts (:func:`in_flight`, :func:`pending_weight_grads`). Every
boundary is crossed once per chunk each way, which the shared-host terms count. T_pipe keeps
the shape above with the schedule's (fill, end) (:func:`schedule_terms`): interleaved (t / v,
t - t / v + tail), Megatron's m t + (p - 1) t / v on equal stages; zb-v (g, t - g + tail), g =
max(f, b, f + b - 2w, 2(b - w)) of one chunk's F, B, W, which on equal stages is the replay's
m t + (p - 1) g for any F, B, W with B >= F. On 120 random uneven pipelines each (stages ~10x
apart, transfers from negligible to dominant; tests/plan/test_chunked_cost.py) interleaved's
lay -0.9 to +10.2 % from the replay (mean +2.7 %), zb-v's -4.4 to +7.9 % (mean +1.9 %).

Shared hosts (``ChipProfile.host``; emulated chips all compute on the job's own machine):
the stages of host h share its C_h cores. A stage's program keeps `cores` of them busy
on average while it runs alone (measured by ``h2jax profile``: from how much slower
copies of a program run side by side on the host, else CPU seconds / wall seconds; 1
when not measured), so one microbatch's forward and backward need ``work_s = fwd x
cores_fwd + bwd x cores_bwd`` core-seconds of it. In 1F1B's steady state every stage runs
one microbatch's forward and backward per period, all at once; on a shared host they
take turns on its cores, so the period is (``steady_period``) the larger of max_s t_s and
the time the host's cores take to finish one microbatch's work of each of its stages
started together, each stage using at most its own average cores work_s / t_s and an
equal share of what the others leave (fluid processor sharing, ``fluid_makespan``); the
boundary tensors moved between two stages of the host are copies on its CPU (the runtime's
transfer threads), so each transfer's seconds times the cores the profiler saw the copy
keep busy join that period as jobs of their own (``transfer_jobs``). Fill and drain
(sum_s t_s) are priced uncontended: fewer stages run then. A light stage
beside a heavy one thus lengthens the period by the cores it takes while both run (the
uneven split 5 + 1 of the fidelity benchmark: priced 14-19 % short without it), and
stages that together want no more than C_h cores cost nothing extra. The step also
cannot be shorter than W_h / C_h, the host's core-seconds per step (W_h: every stage's
``m x work_s + tail work``, m times the copies', and the driver's per-step CPU) over its
cores. Session 4's
host term spread each stage's work evenly over its fill-to-drain window instead; with a
profile timed alongside the steps it priced plans with 2 microbatches on 2-3 stages 3-8
% long and the uneven split 14-19 % short, ranking the ten plans at tau 0.42-0.69
against 0.73-0.87 for this period (docs/LOG.md, session 5). A stage with `data` devices
on a shared host runs `data` copies of the measured per-device program at once, so its
work is `data` times theirs and, alone, it is stretched by max(1, data x cores / C_h).
The simulator models the sharing event by event instead (processor sharing: when the
programs running on a host want more cores than it has, each runs slower by C_h / sum of
their cores). Stages of one emulated node share one PJRT client, whose programs run one
after another: the period is at least their summed seconds, and they join the fluid
sharing as one job (``shared_clients``, placed as the runtime places them). Chips with
hosts of their own (every real chip profile) are unaffected.
``CostOptions(host_contention=False)`` turns the term off. The search
(``h2jax.plan._search``) prices each configuration's T_pipe-optimal split (P = max t)
with this estimate, contention included, and improves the split by it
(``polish_split``).

The runtime's driver (Python threads that dispatch programs, move boundary tensors and
run the step) costs host CPU too: where the table holds a measured ``DriverCost`` for a
shared host, its CPU per forward/backward and per boundary tensor sent is added to each
op's core-seconds (so to W_h, and to the contention the simulator sees), its per-step CPU
to W_h (spread over the whole step), and its per-step seconds to T_pipe.

Program calls: a measured table's ``"program"`` pseudo-part is the fixed cost of one
program call (dispatch, launch, synchronisation). A stage's forward is one program
whatever it holds (embedding, blocks, head), so it pays that cost once -- summing the
separately timed parts would pay it once per part.

Memory per device of stage s: params + grads (fp32) + AdamW moments (2 x fp32) of its
parts, all divided by the tensor degree where the layout shards them; activations of the
microbatches awaiting their backward (the schedule's count, :func:`in_flight` -- 1F1B and
ZB-H1: min(num_stages - s, m); GPipe: m), or with recompute only their inputs plus one
microbatch being recomputed; in a split schedule, what W keeps from B's end to its own
(:func:`weight_grad_keep_bytes`) for the most microbatches awaiting W at once
(:func:`pending_weight_grads`; ZB-H1: min(s + 1, m)) -- the sum of the two peaks, an
upper bound; workspace = the largest transient buffer. A plan that does not fit is
rejected with the numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from h2jax._trace import idle_share
from h2jax.plan._plan import (
    Plan,
    PlanError,
    StageSpec,
    assign_devices,
    chunked_variant,
)
from h2jax.plan._profiles import (
    GIB,
    ChipProfile,
    Cluster,
    LayerCost,
    ModelShape,
    ProfileTable,
)
from h2jax.plan._stage_cost import (  # noqa: F401 (re-exported: the per-stage half)
    _DEFAULT_TABLE,
    ADAMW_UPDATE_BYTES_PER_PARAM,
    CostOptions,
    StageCost,
    StageMemoryEstimate,
    allreduce_s,
    boundary_transfers,
    fluid_makespan,
    host_cores,
    measured_transfer,
    memory_limit,
    part_costs,
    stage_cost,
    stage_memory,
    transfer_s,
    weight_grad_keep_bytes,
    weight_grad_share,
)
from h2jax.plan.schedules import Schedule, ScheduleError, as_schedule, schedule_names


@dataclass
class PlanCost:
    """The estimate of one plan (see the module docstring for the formula)."""

    plan: Plan
    stages: list[StageCost]
    transfers_fwd: list[float]  # seconds per microbatch, boundary b = stage b -> b + 1
    transfers_bwd: list[float]
    iteration_s: float
    tokens_per_step: int
    devices_by_chip: dict[str, int]
    cluster_devices_by_chip: dict[str, int]
    reasons: list[str] = field(default_factory=list)
    pipeline_bound_s: float = 0.0  # T_pipe of the module docstring
    period_s: float = 0.0  # its steady-state period P (max_s t_s, longer where stages share a host)
    driver_step_s: float = 0.0  # the runtime driver's seconds per step outside the pipeline (in T_pipe)
    host_bound_s: dict[str, float] = field(default_factory=dict)  # host -> W_h / C_h (module docstring)
    host_work_s: dict[str, float] = field(default_factory=dict)  # host -> W_h, core-seconds per step
    host_cores: dict[str, int] = field(default_factory=dict)  # host -> C_h
    transfer_wrap: tuple[float, float] = (0.0, 0.0)  # interleaved: last stage -> stage 0, and back

    @property
    def fits(self) -> bool:
        return not self.reasons

    @property
    def bound_by(self) -> str:
        """ "pipeline", or "host <name>" when a shared host's cores bound the step."""
        if self.host_bound_s:
            h, w = max(self.host_bound_s.items(), key=lambda kv: kv[1])
            if w > self.pipeline_bound_s:
                return f"host {h}"
        return "pipeline"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.iteration_s

    def tgs(self, *, all_cluster_devices: bool = True) -> float:
        """Tokens per chip per second: over every chip of the cluster (idle ones count) by default."""
        n = sum((self.cluster_devices_by_chip if all_cluster_devices else self.devices_by_chip).values())
        return self.tokens_per_s / n

    @property
    def bubble_fraction(self) -> float:
        """1 - compute / (num_stages x pipeline time), the pipeline part of the iteration only."""
        m = self.plan.num_microbatches
        pipe = self.pipeline_s
        return idle_share(sum(m * s.t for s in self.stages), len(self.stages), pipe)

    @property
    def pipeline_s(self) -> float:
        """T_pipe of the plan's schedule without the tails and the shared-host period."""
        transfers = sum(self.transfers_fwd) + sum(self.transfers_bwd)
        return pipeline_time(
            self.stages, self.plan.schedule, self.plan.num_microbatches, transfers=transfers, tails=False
        )


def searched_schedules(schedule: Schedule | str | None, schedules: Sequence[Schedule | str]) -> tuple[Schedule, ...]:
    """The schedules a search prices: `schedule` alone, or (None) each of `schedules` -- less
    each one whose ``dominated_by`` is among them (GPipe beside 1F1B: this model gives it
    1F1B's time and at least 1F1B's memory). Names are read by :func:`as_schedule`; an
    unknown one is a PlanError naming the known ones."""
    given = (schedule,) if schedule is not None else tuple(schedules)
    if not given:
        raise PlanError("schedules", "no schedule to search; expected one or more of " + ", ".join(schedule_names()))
    try:
        found = tuple(dict.fromkeys(as_schedule(s) for s in given))
    except ScheduleError as e:
        raise PlanError("plan.schedule" if schedule is not None else "schedules", str(e)) from None
    if len(found) > 1:
        names = {s.name for s in found}
        found = tuple(s for s in found if s.dominated_by not in names)
    return found


def expand_chunks(schedules: Sequence[Schedule], chunk_counts: Sequence[int]) -> tuple[Schedule, ...]:
    """Each schedule whose chunk count is a family's choice once per count of `chunk_counts`
    (``SearchOptions.interleaved_chunks``), the others as they are."""
    out: list[Schedule] = []
    for s in schedules:
        if s.chunk_choice:
            try:
                out.extend(type(s).search_variants(chunk_counts))
            except ScheduleError as e:
                raise PlanError("interleaved_chunks", str(e)) from None
        else:
            out.append(s)
    return tuple(dict.fromkeys(out))


def part_fill_s(model: ModelShape, name: str, part: LayerCost, *, tensor: int, schedules: Sequence[Schedule]) -> float:
    """The least one part ("embed", "block", "head") adds to sum_s fill_s (:func:`schedule_terms`)
    under any of `schedules` (the search's lower bounds): each schedule's own
    :meth:`~h2jax.plan.schedules.Schedule.least_fill` (fwd + bwd; less twice the W it hides
    under ZB-H1; (fwd + bwd) / v interleaved; under ZB-V half its forward)."""
    full = part.fwd_s + part.bwd_s
    least = full
    w = None
    for sched in schedules:
        if w is None and sched.split_backward:
            w = weight_grad_share(model, tensor=tensor)[name] * part.bwd_s
        least = min(least, sched.least_fill(fwd=part.fwd_s, bwd=part.bwd_s, w=w or 0.0))
    return least


def layer_fill_s(model: ModelShape, block: LayerCost, *, tensor: int, schedules: Sequence[str]) -> float:
    """:func:`part_fill_s` of one block."""
    return part_fill_s(model, "block", block, tensor=tensor, schedules=schedules)


def schedule_terms(stage: StageCost, schedule: Schedule) -> tuple[float, float]:
    """(fill, end) of one stage in T_pipe = (m - 1) P + sum_s fill_s + transfers + max_s end_s
    (module docstring): the schedule's own :meth:`~h2jax.plan.schedules.Schedule.pipeline_terms`.
    (t, tail) unsplit; ZB-H1 (t - 2 h, tail + 2 h) with h its W work that fills the waits for
    B (``w_hidden_s``), which gives the paper's (p - 1)(F + B - W) bubble on equal stages.
    Interleaved with v chunks: (t / v, t - t / v + tail), Megatron's m t + (p - 1) t / v on
    equal stages. ZB-V: (g, t - g + tail) with g = max(f, b, f + b - 2w, 2(b - w)) of one
    chunk's F, B, W (half the stage's): on equal stages m t + (p - 1) g, which the replay gives
    for any F, B, W with B >= F (p - 1 idle forwards when F = B = W)."""
    fill, end = schedule.pipeline_terms(
        t=stage.t, fwd=stage.fwd_s, b=stage.b_s, w=stage.w_s, hidden=stage.w_hidden_s, tail=stage.tail_s
    )
    return float(fill), float(end)


def pipeline_time(
    stages: Sequence[StageCost],
    schedule: Schedule,
    num_microbatches: int,
    *,
    transfers: float,
    period: float | None = None,
    tails: bool = True,
) -> float:
    """T_pipe of `schedule` over these stages (module docstring), the period P = max t unless
    given (shared hosts: :func:`steady_period`); `tails` False leaves the tails out. A schedule
    with no closed form (a schedule file) is priced by replaying its op lists with each
    stage's task seconds, stretched by P / max t, plus the transfers and the largest tail."""
    p = max(s.t for s in stages) if period is None else period
    if not schedule.closed_form:
        return replayed_time(stages, schedule, num_microbatches, transfers=transfers, period=p, tails=tails)
    terms = [schedule_terms(s, schedule) for s in stages]
    end = max(e if tails else e - s.tail_s for (_, e), s in zip(terms, stages))
    return (num_microbatches - 1) * p + sum(f for f, _ in terms) + transfers + end


def replayed_time(
    stages: Sequence[StageCost],
    schedule: Schedule,
    num_microbatches: int,
    *,
    transfers: float,
    period: float,
    tails: bool = True,
) -> float:
    """T_pipe of `schedule` by replay (:meth:`~h2jax.plan.schedules.BoundSchedule.events`): one
    chunk's F, B and W take the stage's seconds over its chunks, scaled so the slowest stage's
    microbatch takes `period`."""
    v = schedule.chunks
    scale = period / max(s.t for s in stages) if max(s.t for s in stages) > 0 else 1.0
    events = schedule.bind(len(stages), num_microbatches).events(
        forward=[scale * s.fwd_s / v for s in stages],
        backward=[scale * s.b_s / v for s in stages],
        weight=[scale * s.w_s / v for s in stages],
    )
    makespan = max((e[4] for e in events), default=0.0)
    return makespan + transfers + (max(s.tail_s for s in stages) if tails else 0.0)


def iteration_time(
    ts: Sequence[float], transfers: float, tails: Sequence[float], num_microbatches: int, *, period: float | None = None
) -> float:
    """(m - 1) * P + sum t + transfers + max tail: the formula every estimate uses, with the
    steady-state period P = max t (or `period`: on shared hosts, :func:`steady_period`)."""
    p = max(ts) if period is None else period
    return (num_microbatches - 1) * p + sum(ts) + transfers + max(tails)


def estimate(
    plan: Plan,
    model: ModelShape,
    cluster: Cluster | Mapping[str, ChipProfile],
    *,
    table: ProfileTable | None = None,
    opts: CostOptions = CostOptions(),
) -> PlanCost:
    """Price `plan`: per-stage times and memory, transfers, iteration time, fit.

    `cluster` gives the chip profiles (a Cluster also gives device counts for TGS).
    Reasons a plan does not fit are listed in `PlanCost.reasons` with the numbers.
    """
    profiles = cluster.profiles if isinstance(cluster, Cluster) else dict(cluster)
    table = table if table is not None else _DEFAULT_TABLE
    n, m = plan.num_stages, plan.num_microbatches
    mb = plan.microbatch_size
    sched = plan.schedule
    split = sched.split_backward
    # a stage holds v chunks; the embedding and the head sit with the stages holding the first
    # and the last model position (zb-v: both on stage 0)
    v = sched.chunks
    chunked = v > 1
    ends = plan.positions()
    first_stage, last_stage = ends[0][0], ends[-1][0]
    counts = sched.memory_counts(n, m)  # per stage: (awaiting B, awaiting W)
    unit = "(chunk, microbatch) activations" if chunked else "microbatches"
    reasons: list[str] = []
    stages: list[StageCost] = []
    for i, s in enumerate(plan.stages):
        chip = profiles[s.chip]
        sc = stage_cost(
            model,
            chip,
            layers=s.num_layers,
            first=i == first_stage,
            last=i == last_stage,
            data=s.data,
            tensor=s.tensor,
            microbatch=mb,
            recompute=s.recompute,
            in_flight=counts[i][0],
            table=table,
            opts=opts,
            split=split,
            pending_w=counts[i][1],
            chunks=v,
        )
        stages.append(sc)
        if not sc.fits:
            reasons.append(
                f"stage {i} ({s.chip} {s.data}x{s.tensor}, {s.num_layers} layers, recompute "
                f"{'on' if s.recompute else 'off'}, {sc.in_flight} {unit} in flight"
                + (f", {sc.pending_w} awaiting W" if sc.pending_w else "")
                + ") needs "
                f"{sc.memory.describe()} per device; {s.chip} has {sc.memory_limit / GIB:.2f} GiB"
            )
    fwd_x, bwd_x = boundary_transfers(plan.stages, model, profiles, microbatch=mb, eff=table.eff, table=table)
    wrap = (0.0, 0.0)
    if sched.wraps(n):  # chunk c of the last stage feeds chunk c + 1 of stage 0 (interleaved)
        (wf,), (wb,) = boundary_transfers(
            [plan.stages[-1], plan.stages[0]], model, profiles, microbatch=mb, eff=table.eff, table=table
        )
        wrap = (wf, wb)
    stages, step_s, step_cpu = with_driver(stages, table)
    cores = shared_host_cores(plan.stages, [s.host for s in stages], profiles, table)
    moves = transfer_jobs(plan.stages, model, profiles, fwd_x, bwd_x, microbatch=mb, table=table)
    if chunked:  # every boundary is crossed once per chunk each way per microbatch
        moves = {h: jobs * v for h, jobs in moves.items()}
    nodes = {p.name: k for p, k in cluster.chips} if isinstance(cluster, Cluster) else None
    clients = shared_clients(plan, profiles, nodes) if opts.host_contention else []
    period = steady_period(stages, cores, m, extra=step_cpu, transfers=moves, clients=clients)
    t_pipe = pipeline_time(stages, sched, m, transfers=sum(fwd_x) + sum(bwd_x), period=period) + step_s
    per_step = {h: step_cpu.get(h, 0.0) + m * sum(w for w, _ in moves.get(h, ())) for h in cores}
    bounds, work = host_bounds(stages, m, cores, extra=per_step)
    t = max([t_pipe, *bounds.values()])
    used: dict[str, int] = {}
    for s in plan.stages:
        used[s.chip] = used.get(s.chip, 0) + s.num_devices
    total = {name: cluster.devices(name) for name in cluster.names} if isinstance(cluster, Cluster) else dict(used)
    return PlanCost(
        plan=plan,
        stages=stages,
        transfers_fwd=fwd_x,
        transfers_bwd=bwd_x,
        iteration_s=t,
        tokens_per_step=plan.global_batch * model.seq_len,
        devices_by_chip=used,
        cluster_devices_by_chip=total,
        reasons=reasons,
        pipeline_bound_s=t_pipe,
        period_s=period,
        host_bound_s=bounds,
        host_work_s=work,
        host_cores=cores,
        driver_step_s=step_s,
        transfer_wrap=wrap,
    )


def schedule_estimates(
    plan: Plan,
    model: ModelShape,
    cluster: Cluster | Mapping[str, ChipProfile],
    *,
    table: ProfileTable | None = None,
    opts: CostOptions = CostOptions(),
    schedules: Sequence[Schedule | str] = (),
) -> dict[Schedule, PlanCost | str]:
    """The same stages and batch priced under each of `schedules` (default: every registered
    family at its default chunks; ``h2jax plan`` prints them beside the one it chose): the time
    each takes, and whether it still fits. A chunked schedule gets each stage's blocks as even
    chunks (:func:`h2jax.plan.chunked_variant`), or, where it cannot run these stages, the
    reason. Keyed by schedule."""
    out: dict[Schedule, PlanCost | str] = {}
    for sched in (as_schedule(s) for s in (schedules or schedule_names())):
        if sched.chunk_choice or sched.chunks > 1:
            try:
                variant = chunked_variant(plan, sched)
            except PlanError as e:
                out[sched] = e.message
                continue
        elif plan.num_chunks > 1:  # one range per stage, the same block counts, in stage order
            starts = np.cumsum([0, *(st.num_layers for st in plan.stages)]).tolist()
            stages = tuple(replace(st, layers=(a, a + st.num_layers), chunks=()) for st, a in zip(plan.stages, starts))
            variant = replace(plan, stages=stages, schedule=sched)
        else:
            variant = replace(plan, schedule=sched)
        why = sched.shape_error(variant.num_stages, variant.num_microbatches)
        out[sched] = why if why is not None else estimate(variant, model, cluster, table=table, opts=opts)
    return out


def with_driver(stages: list[StageCost], table: ProfileTable) -> tuple[list[StageCost], float, dict[str, float]]:
    """The stages with the runtime driver's host CPU folded into their work (per forward and
    backward, and per boundary tensor they send), the driver's per-step seconds, and its
    per-step CPU seconds per shared host -- where the table measured the driver there."""
    out, step_s, step_cpu = [], 0.0, {}
    n = len(stages)
    for i, s in enumerate(stages):
        d = table.driver.get(s.host) if s.host is not None else None
        if d is None:
            out.append(s)
            continue
        # per chunk (a program and a boundary tensor each; one chunk: the ends send one way only)
        sends_f = s.chunks if s.chunks > 1 else int(i < n - 1)
        sends_b = s.chunks if s.chunks > 1 else int(i > 0)
        extra_f = s.chunks * d.op_cpu_s + sends_f * d.transfer_cpu_s
        extra_b = s.chunks * d.op_cpu_s * (2 if s.w_s > 0 else 1) + sends_b * d.transfer_cpu_s  # B and W: two ops
        out.append(
            replace(
                s,
                fwd_cores=(s.fwd_s * s.fwd_cores + extra_f) / s.fwd_s if s.fwd_s > 0 else s.fwd_cores,
                bwd_cores=(s.bwd_s * s.bwd_cores + extra_b) / s.bwd_s if s.bwd_s > 0 else s.bwd_cores,
            )
        )
        step_s = max(step_s, d.step_s)
        step_cpu[s.host] = d.step_cpu_s
    return out, step_s, step_cpu


def shared_host_cores(
    specs: Sequence[StageSpec],
    hosts: Sequence[str | None],
    profiles: Mapping[str, ChipProfile],
    table: ProfileTable | None = None,
) -> dict[str, int]:
    """Cores of every shared host the stages use (the fewest any of its chips reports)."""
    out: dict[str, int] = {}
    for spec, h in zip(specs, hosts):
        if h is not None:
            c = host_cores(profiles[spec.chip], table)
            out[h] = min(out.get(h, c), c)
    return out


def host_bounds(
    stages: Sequence[StageCost],
    num_microbatches: int,
    cores: Mapping[str, float],
    *,
    extra: Mapping[str, float] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """(host -> W_h / C_h, host -> W_h) of every shared host (module docstring): W_h the
    core-seconds one step needs of host h (its stages' ``m x work + tail work``, plus
    ``extra[h]`` per step: the driver's); no schedule delivers them faster."""
    work: dict[str, float] = {}
    for s in stages:
        if s.host is not None:
            work[s.host] = work.get(s.host, 0.0) + num_microbatches * s.work_s + s.tail_work_s
    for h, w in (extra or {}).items():
        if h in work and w > 0:
            work[h] += w
    return {h: w / cores[h] for h, w in work.items()}, work


def steady_period(
    stages: Sequence[StageCost],
    cores: Mapping[str, float],
    num_microbatches: int,
    *,
    extra: Mapping[str, float] | None = None,
    transfers: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    clients: Sequence[Sequence[int]] = (),
) -> float:
    """The steady-state period P of the pipeline (module docstring): max_s t_s, and on every
    shared host h the time its cores take to run one microbatch's forward and backward of
    each of its stages started together (:func:`fluid_makespan`; a stage uses at most its
    own average cores, ``work_s / t``), with the driver's per-step CPU ``extra[h]`` spread
    over the m periods as one more job of at most one core (a Python thread), and the
    boundary tensors moved through the host's memory, ``transfers[h]`` (:func:`transfer_jobs`).
    Stages of one group of `clients` (:func:`shared_clients`) run one after another: the
    group is one job of their summed seconds and work, and P is at least its seconds."""
    grouped = {i for g in clients for i in g}
    period = max([s.t for s in stages] + [sum(stages[i].t for i in g) for g in clients])
    for h, c in cores.items():
        jobs = [
            (s.work_s, s.work_s / s.t)
            for i, s in enumerate(stages)
            if i not in grouped and s.host == h and s.t > 0 and s.work_s > 0
        ]
        for g in clients:
            work, secs = sum(stages[i].work_s for i in g), sum(stages[i].t for i in g)
            if stages[g[0]].host == h and secs > 0 and work > 0:
                jobs.append((work, work / secs))
        jobs += list((transfers or {}).get(h, ()))
        drv = (extra or {}).get(h, 0.0)
        if drv > 0:
            jobs.append((drv / num_microbatches, 1.0))
        if jobs:
            period = max(period, fluid_makespan(jobs, c))
    return period


def shared_clients(
    plan: Plan, profiles: Mapping[str, ChipProfile], nodes: Mapping[str, int] | None = None
) -> list[tuple[int, ...]]:
    """Groups of two or more stages on one node of an emulated chip type: one PJRT client,
    whose programs run one after another (a stage's forward waits for the other stage's
    backward), placed as the runtime places them (:func:`h2jax.plan._plan.assign_devices`).
    `nodes`: nodes per chip type (default: each profile's). Real chips: none (a process each)."""
    emulated = {s.chip for s in plan.stages if profiles[s.chip].emulated}
    if not emulated or len(plan.stages) == len({s.chip for s in plan.stages}):
        return []
    chips = {s.chip for s in plan.stages}
    try:
        where = assign_devices(
            plan,
            nodes={n: (nodes or {}).get(n, profiles[n].nodes) for n in chips},
            devices_per_node={n: profiles[n].devices_per_node for n in chips},
        )
    except PlanError:
        return []  # a plan the runtime cannot place in one process; check_plan says why
    by_node: dict[tuple[str, int], list[int]] = {}
    for i, (s, (node, _)) in enumerate(zip(plan.stages, where)):
        if s.chip in emulated:
            by_node.setdefault((s.chip, node), []).append(i)
    return [tuple(g) for g in by_node.values() if len(g) > 1]


def transfer_jobs(
    stages: Sequence[StageSpec],
    model: ModelShape,
    profiles: Mapping[str, ChipProfile],
    fwd: Sequence[float],
    bwd: Sequence[float],
    *,
    microbatch: int,
    table: ProfileTable | None,
) -> dict[str, list[tuple[float, float]]]:
    """host -> [(core-seconds per microbatch, cores)] of the boundary tensors moved through a
    shared host's memory (both sides on it): each transfer of `fwd` / `bwd` seconds keeps the
    measured ``"transfer"``'s cores busy (the runtime's transfer threads copy on the host's
    CPU). Transfers without measured cores cost the host nothing here (as before they were
    measured)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for i, (a, b) in enumerate(zip(stages, stages[1:])):
        ca, cb = profiles[a.chip], profiles[b.chip]
        if ca.host is None or ca.host != cb.host:
            continue
        for src, cs, secs in ((a, ca, fwd[i]), (b, cb, bwd[i])):
            hit = measured_transfer(table, model, cs, src, microbatch)
            if hit is not None and hit.fwd_cores > 0 and secs > 0:
                out.setdefault(ca.host, []).append((secs * hit.fwd_cores, hit.fwd_cores))
    return out
