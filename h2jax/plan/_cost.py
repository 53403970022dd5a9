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

from h2jax.plan._plan import (
    Plan,
    PlanError,
    StageSpec,
    assign_devices,
    chunked_variant,
)
from h2jax.plan._profiles import (
    GB,
    GIB,
    PROGRAM,
    TRANSFER,
    ChipProfile,
    Cluster,
    Efficiency,
    LayerCost,
    ModelShape,
    ProfileTable,
    local_cores,
)
from h2jax.plan.schedules import Schedule, ScheduleError, as_schedule, schedule_names

ADAMW_UPDATE_BYTES_PER_PARAM = 28  # reads p, g, m, v (16 B); writes p, m, v (12 B), all fp32


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the cost model that are not properties of a chip.

    grad_sync: "step" -- gradients are reduced over the data axis once per step after the
        last backward (the planner's assumption for real clusters); "microbatch" -- every
        backward reduces (what the single-controller runtime does today: its gradient
        accumulator is replicated over the data axis).
    mem_reserve_gib: memory per device kept free for the framework and fragmentation.
    host_contention: charge the work of stages that share a host (emulated chips) against
        its cores, with the runtime driver's CPU where measured (module docstring); False
        prices every stage as if it had the host alone (measured transfers still apply).
    """

    grad_sync: str = "step"
    mem_reserve_gib: float = 0.0
    host_contention: bool = True

    def __post_init__(self) -> None:
        if self.grad_sync not in ("step", "microbatch"):
            raise ValueError(f"grad_sync={self.grad_sync!r}; expected 'step' or 'microbatch'")


@dataclass(frozen=True)
class StageMemoryEstimate:
    """Bytes per device of one stage."""

    params: float
    grads: float
    opt_state: float
    activations: float
    workspace: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.opt_state + self.activations + self.workspace

    def describe(self) -> str:
        return (
            f"{self.total / GIB:.2f} GiB (params {self.params / GIB:.2f}, grads {self.grads / GIB:.2f}, "
            f"optimizer {self.opt_state / GIB:.2f}, activations {self.activations / GIB:.2f}, "
            f"workspace {self.workspace / GIB:.2f})"
        )


@dataclass(frozen=True)
class StageCost:
    """Seconds and bytes of one stage; `fits` False with `reason` when memory is exceeded."""

    fwd_s: float
    bwd_s: float  # includes the recompute forward, and the gradient reduction with grad_sync="microbatch"
    grad_sync_s: float  # once per step (0 with grad_sync="microbatch")
    update_s: float
    memory: StageMemoryEstimate
    memory_limit: float
    in_flight: int
    estimated: bool
    host: str | None = None  # the shared host the stage computes on (None: a host of its own)
    fwd_cores: float = 1.0  # host cores busy while the forward runs alone (average)
    bwd_cores: float = 1.0
    tail_cores: float = 1.0
    w_s: float = 0.0  # the weight-gradient (W) part of bwd_s in a split schedule (0: unsplit)
    w_hidden_s: float = 0.0  # the W work that fills the schedule's waits for B (module docstring)
    pending_w: int = 0  # microbatches whose W has not run after their B (at most at once)
    chunks: int = 1  # layer chunks the stage holds (interleaved, zb-v); in_flight, pending_w count chunks
    in_flight_bytes: float = 0.0  # activation bytes one more (chunk, microbatch) awaiting B adds
    pending_w_bytes: float = 0.0  # bytes one more (chunk, microbatch) awaiting W adds (split schedules)

    @property
    def t(self) -> float:
        """fwd + bwd seconds of one microbatch."""
        return self.fwd_s + self.bwd_s

    @property
    def b_s(self) -> float:
        """The input-gradient (B) task's seconds: the whole backward in an unsplit schedule."""
        return self.bwd_s - self.w_s

    @property
    def tail_s(self) -> float:
        return self.grad_sync_s + self.update_s

    @property
    def work_s(self) -> float:
        """Host core-seconds of one microbatch's forward and backward."""
        return self.fwd_s * self.fwd_cores + self.bwd_s * self.bwd_cores

    @property
    def tail_work_s(self) -> float:
        return self.tail_s * self.tail_cores

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory_limit


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
        busy = sum(m * s.t for s in self.stages)
        return max(0.0, 1.0 - busy / (len(self.stages) * pipe)) if pipe > 0 else 0.0

    @property
    def pipeline_s(self) -> float:
        """T_pipe of the plan's schedule without the tails and the shared-host period."""
        transfers = sum(self.transfers_fwd) + sum(self.transfers_bwd)
        return pipeline_time(
            self.stages, self.plan.schedule, self.plan.num_microbatches, transfers=transfers, tails=False
        )


def part_costs(
    model: ModelShape, chip: ChipProfile, table: ProfileTable | None, *, tensor: int, microbatch_per_device: int
) -> dict[str, LayerCost]:
    table = table if table is not None else _DEFAULT_TABLE
    return table.costs(model, chip, tensor=tensor, microbatch=microbatch_per_device)


_DEFAULT_TABLE = ProfileTable()


def host_cores(chip: ChipProfile, table: ProfileTable | None = None) -> int:
    """Cores of the host `chip` computes on: the profile's `host_cores`, else what the
    profiler recorded for the chip, else this machine's (where emulated chips run)."""
    if chip.host_cores is not None:
        return chip.host_cores
    if table is not None and chip.name in table.host_cores:
        return table.host_cores[chip.name]
    return local_cores()


def _cores(c: float) -> float:
    return c if c > 0 else 1.0


def allreduce_s(nbytes: float, n: int, bw_gbps: float, eff: Efficiency) -> float:
    """Ring all-reduce of `nbytes` over `n` devices at `bw_gbps` per device."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (bw_gbps * GB * eff.link) + eff.collective_latency_s


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


def weight_grad_share(model: ModelShape, *, tensor: int) -> dict[str, float]:
    """The weight-gradient (W) share of each part's backward, from its FLOPs (the roofline's
    counts: ``h2jax.plan._profiles.roofline_costs``). A block's backward is 2x its forward
    matmuls plus the attention's (its scores recomputed): W is the weight-gradient matmul of
    each of its weights, 2 x tokens x weights, the rest (the input-gradient matmuls and all of
    the attention's) is B. The embedding has no input gradient (its input is token ids): all
    W. The head's backward is its logits matmul twice: half each. Tokens cancel, so the share
    does not depend on the microbatch; XLA's compiled FLOPs of a 4-block stage gave W = 0.494
    of the backward, B = 0.505 (docs/LOG.md), against 0.496 / 0.504 here."""
    d, f, s = model.d_model, model.d_ff, model.seq_len
    hd, kv = d / model.n_heads, model.kv_heads
    t_kv = tensor if kv % tensor == 0 else 1
    weights = (2 * d * d + 3 * d * f) / tensor + 2 * d * kv * hd / t_kv  # per token: 2 x weights FLOPs each way
    attn = 4 * s * d / tensor  # per token: q.k^T and p.v, forward
    fwd = 2 * weights + attn
    bwd = 2 * fwd + attn / 2
    return {"block": 2 * weights / bwd, "embed": 1.0, "head": 0.5}


def weight_grad_keep_bytes(model: ModelShape, *, tensor: int, microbatch_per_device: int) -> dict[str, float]:
    """Bytes per device one microbatch's pending W keeps per part, from B's end to W's end.

    The runtime's W (``h2jax.runtime._split``) transposes every *mixing* equation (an
    activation meets a parameter) against its output cotangent, with the activation inputs
    held: so it keeps, per token, those inputs -- the normed input of wq/wk/wv and of
    w_gate/w_up, the attention output into wo, the SwiGLU product into w_down (compute
    dtype), the two RMSNorms' normalised inputs (fp32) -- and the cotangents of their outputs
    (q, k, v, wo's, w_gate's, w_up's, w_down's, the norms'; compute dtype). The embedding
    keeps the token ids and its output's cotangent; the head the normed input and the fp32
    logits' cotangent (the largest: vocab / tensor per token).
    """
    t, d, f, a = tensor, model.d_model, model.d_ff, model.act_bytes
    hd, kv = model.head_dim, model.kv_heads
    t_kv = t if kv % t == 0 else 1
    tokens = microbatch_per_device * model.seq_len
    inputs = a * (2 * d + d / t + f / t) + 4 * 2 * d
    cotangents = a * (d / t + 2 * kv * hd / t_kv + d + 2 * f / t + d + 2 * d)
    return {
        "block": tokens * (inputs + cotangents),
        "embed": tokens * (4 + a * d / t),
        "head": tokens * ((a + 4) * d + 4 * model.vocab_size / t + a * d),
    }


def memory_limit(chip: ChipProfile, opts: CostOptions = CostOptions()) -> float:
    """Bytes per device a stage of `chip` may use: its memory less the reserve."""
    return chip.memory_bytes - opts.mem_reserve_gib * GIB


def _used_parts(parts: Mapping[str, LayerCost], *, layers: int, first: bool, last: bool) -> list[tuple[LayerCost, int]]:
    """(part, count) a stage runs: its blocks, the embedding if first, the head if last."""
    return [(parts["block"], layers)] + [(parts[name], 1) for name, on in (("embed", first), ("head", last)) if on]


def stage_memory(
    model: ModelShape,
    chip: ChipProfile,
    *,
    layers: int,
    first: bool,
    last: bool,
    data: int,
    tensor: int,
    microbatch: int,
    recompute: bool,
    in_flight: int,
    table: ProfileTable | None = None,
    split: bool = False,
    pending_w: int = 0,
    chunks: int = 1,
) -> tuple[StageMemoryEstimate, float, float]:
    """The memory side of :func:`stage_cost` (its ``memory``, ``in_flight_bytes`` and
    ``pending_w_bytes``): bytes per device, and what one more (chunk, microbatch) awaiting B
    (per_j) and awaiting W (per_q) adds. The search's memory caps price memory alone with it."""
    table = table if table is not None else _DEFAULT_TABLE
    parts = part_costs(model, chip, table, tensor=tensor, microbatch_per_device=max(1, microbatch // data))
    used = _used_parts(parts, layers=layers, first=first, last=last)
    pbytes = sum(n * p.param_bytes for p, n in used)
    act = sum(n * p.act_bytes for p, n in used)
    temp = max(p.temp_bytes for p, _ in used)
    inp = parts["embed"].input_bytes if first else parts["block"].input_bytes
    if recompute:  # the backward keeps only each block's input and runs the forward again
        per_j = inp
        activations = in_flight * inp + act / chunks
    else:
        per_j = act / chunks
        activations = in_flight * per_j
    per_q = 0.0
    if split:
        keep = weight_grad_keep_bytes(model, tensor=tensor, microbatch_per_device=max(1, microbatch // data))
        names = ("block", "embed", "head")
        per_q = sum(n * keep[k] for k, n in zip(names, (layers, int(first), int(last)))) / chunks
        activations += pending_w * per_q
    mem = StageMemoryEstimate(
        params=pbytes, grads=pbytes, opt_state=2 * pbytes, activations=activations, workspace=temp
    )
    return mem, per_j, per_q


def stage_cost(
    model: ModelShape,
    chip: ChipProfile,
    *,
    layers: int,
    first: bool,
    last: bool,
    data: int,
    tensor: int,
    microbatch: int,
    recompute: bool,
    in_flight: int,
    table: ProfileTable | None = None,
    opts: CostOptions = CostOptions(),
    split: bool = False,
    pending_w: int = 0,
    chunks: int = 1,
) -> StageCost:
    """Cost of one stage holding `layers` blocks (plus embedding if `first`, head if `last`).

    `microbatch` is the stage's microbatch in sequences (split over `data` devices);
    `in_flight` microbatches await their backward at most at once. `split`: the schedule
    runs the backward as B and W (:func:`weight_grad_share`; W is a program call of its own),
    and `pending_w` microbatches keep what W needs (:func:`weight_grad_keep_bytes`) at once.
    `chunks`: the stage holds its blocks as that many even layer chunks (interleaved, zb-v):
    every chunk is a program of its own (one call each per forward, B and W), and `in_flight`
    and `pending_w` count (chunk, microbatch) pairs, each 1 / chunks of the stage's activations.
    """
    table = table if table is not None else _DEFAULT_TABLE
    eff = table.eff
    parts = part_costs(model, chip, table, tensor=tensor, microbatch_per_device=max(1, microbatch // data))
    used = _used_parts(parts, layers=layers, first=first, last=last)
    fwd = sum(n * p.fwd_s for p, n in used)
    bwd = sum(n * p.bwd_s for p, n in used)
    # host core-seconds (per device) of the parts; 1 core where the profile did not measure it
    fwd_w = sum(n * p.fwd_s * _cores(p.fwd_cores) for p, n in used)
    bwd_w = sum(n * p.bwd_s * _cores(p.bwd_cores) for p, n in used)
    estimated = any(p.estimated for p, _ in used)
    mem, per_j, per_q = stage_memory(
        model,
        chip,
        layers=layers,
        first=first,
        last=last,
        data=data,
        tensor=tensor,
        microbatch=microbatch,
        recompute=recompute,
        in_flight=in_flight,
        table=table,
        split=split,
        pending_w=pending_w,
        chunks=chunks,
    )
    pbytes = mem.params
    if recompute:  # the backward program runs the forward again (inside the same program)
        bwd += fwd
        bwd_w += fwd_w
    wgt = hidden = 0.0
    if split:
        share = weight_grad_share(model, tensor=tensor)
        names = ("block", "embed", "head")
        counted = [(parts[k], n, share[k]) for k, n in zip(names, (layers, int(first), int(last))) if n]
        wgt = sum(n * sh * p.bwd_s for p, n, sh in counted)
        # W fills a wait for B at most as long as the forward it stands in for, part by part
        hidden = sum(n * min(sh * p.bwd_s, p.fwd_s) for p, n, sh in counted)
    prog = parts.get(PROGRAM)
    if prog is not None:  # one call per program, whatever it fuses; a program per chunk
        fwd += chunks * prog.fwd_s
        bwd += chunks * prog.bwd_s
        fwd_w += chunks * prog.fwd_s * _cores(prog.fwd_cores)
        bwd_w += chunks * prog.bwd_s * _cores(prog.bwd_cores)
        if split:  # W is a second backward program
            bwd += chunks * prog.bwd_s
            wgt += chunks * prog.bwd_s
            bwd_w += chunks * prog.bwd_s * _cores(prog.bwd_cores)
    z = data * tensor
    bw = chip.intra_node_gbps if z <= chip.devices_per_node else chip.inter_node_gbps
    sync = allreduce_s(pbytes, data, bw, eff)
    if opts.grad_sync == "microbatch":
        bwd += sync
        bwd_w += sync
        wgt += sync if split else 0.0  # the weight gradients are W's
        sync = 0.0
    measured_update = all(p.update_s > 0 for p, _ in used)
    if measured_update:
        update = sum(n * p.update_s for p, n in used) + (prog.update_s if prog is not None else 0.0)
    else:
        update = pbytes / 4 * ADAMW_UPDATE_BYTES_PER_PARAM / (chip.mem_bw_gbps * GB * eff.mem_bw)
    tail_w = update + sync
    fwd_c = fwd_w / fwd if fwd > 0 else 1.0
    bwd_c = bwd_w / bwd if bwd > 0 else 1.0
    tail_c = 1.0
    host = chip.host if opts.host_contention else None
    if host is not None and data > 1:
        # `data` devices of the stage each run the measured per-device program at once on the
        # shared host: `data` times the work; alone, slower once they want more than its cores
        cap = host_cores(chip, table)
        fwd *= max(1.0, data * fwd_c / cap)
        bwd *= max(1.0, data * bwd_c / cap)
        wgt *= max(1.0, data * bwd_c / cap)
        hidden *= max(1.0, data * bwd_c / cap)
        update *= max(1.0, data * tail_c / cap)
        fwd_c = data * fwd_w / fwd if fwd > 0 else 1.0
        bwd_c = data * bwd_w / bwd if bwd > 0 else 1.0
        tail_c = data * tail_w / (update + sync) if update + sync > 0 else 1.0
    return StageCost(
        fwd_s=fwd,
        bwd_s=bwd,
        grad_sync_s=sync,
        update_s=update,
        memory=mem,
        memory_limit=memory_limit(chip, opts),
        in_flight=in_flight,
        estimated=estimated,
        host=host,
        fwd_cores=fwd_c,
        bwd_cores=bwd_c,
        tail_cores=tail_c,
        w_s=wgt,
        w_hidden_s=hidden,
        pending_w=pending_w,
        chunks=chunks,
        in_flight_bytes=per_j,
        pending_w_bytes=per_q,
    )


def transfer_s(
    model: ModelShape,
    src_chip: ChipProfile,
    src: tuple[int, int],
    dst_chip: ChipProfile,
    dst: tuple[int, int],
    *,
    microbatch: int,
    eff: Efficiency = Efficiency(),
) -> float:
    """Seconds to move one boundary tensor (mb x seq x d_model) from a (data, tensor) mesh to another.

    Each destination (data slice, tensor slot) receives a distinct 1/tensor piece of its
    data slice from a distinct source device, so min(n_src, n_dst) links run in parallel;
    the destination then all-gathers over its tensor axis on its intra-node link. Links
    between chip types (or between nodes) run at the slower side's inter-node bandwidth.
    """
    nbytes = microbatch * model.seq_len * model.d_model * model.act_bytes
    n_src, n_dst = src[0] * src[1], dst[0] * dst[1]
    links = max(1, min(n_src, n_dst))
    same_node = src_chip.name == dst_chip.name and n_src + n_dst <= src_chip.devices_per_node
    bw = src_chip.intra_node_gbps if same_node else min(src_chip.inter_node_gbps, dst_chip.inter_node_gbps)
    t = nbytes / links / (bw * GB * eff.link) + eff.collective_latency_s
    dp_t, tp_t = dst
    if tp_t > 1:
        t += (tp_t - 1) / tp_t * (nbytes / dp_t) / (dst_chip.intra_node_gbps * GB * eff.link)
    return t


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


def fluid_makespan(jobs: Sequence[tuple[float, float]], cores: float) -> float:
    """When the last of `jobs` -- (core-seconds, most cores it can use) -- finishes if all start
    together on `cores` cores shared fluidly: at every moment each unfinished job runs at
    the smaller of its cap and an equal share of what the capped jobs leave (water-filling,
    processor sharing). Alone, a job takes work / min(cap, cores); together never less than
    sum(work) / cores."""
    left = {i: w for i, (w, cap) in enumerate(jobs) if w > 0 and cap > 0}
    t = 0.0
    while left:
        rate: dict[int, float] = {}
        free, k = float(cores), len(left)
        for i in sorted(left, key=lambda i: jobs[i][1]):  # smallest caps first
            rate[i] = min(jobs[i][1], free / k)
            free -= rate[i]
            k -= 1
        dt = min(left[i] / rate[i] for i in left)
        t += dt
        for i in list(left):
            left[i] -= rate[i] * dt
            if left[i] <= 1e-12 * jobs[i][0]:
                del left[i]
    return t


def measured_transfer(
    table: ProfileTable | None, model: ModelShape, chip: ChipProfile, src: StageSpec, microbatch: int
) -> LayerCost | None:
    """The profiler's ``"transfer"`` row of the sending stage's chip at its tensor degree and
    per-device microbatch (a boundary tensor moved through a shared host's memory), if any."""
    if table is None:
        return None
    return table.costs(model, chip, tensor=src.tensor, microbatch=max(1, microbatch // src.data)).get(TRANSFER)


def boundary_transfers(
    stages: Sequence[StageSpec],
    model: ModelShape,
    profiles: Mapping[str, ChipProfile],
    *,
    microbatch: int,
    eff: Efficiency = Efficiency(),
    table: ProfileTable | None = None,
) -> tuple[list[float], list[float]]:
    """Per boundary: seconds of the forward activation and of the backward gradient transfer.

    Between two chips on one shared host (emulated chips) the tensor crosses that host's
    memory, not a link: the profiler's measured ``"transfer"`` of the sending stage's chip
    (at its tensor degree and per-device microbatch) is used where the table has one, else
    the link model of :func:`transfer_s`."""
    fwd, bwd = [], []
    for a, b in zip(stages, stages[1:]):
        ca, cb = profiles[a.chip], profiles[b.chip]
        same_host = ca.host is not None and ca.host == cb.host
        for src, dst, cs, cd, out, kind in ((a, b, ca, cb, fwd, "fwd_s"), (b, a, cb, ca, bwd, "bwd_s")):
            hit = measured_transfer(table, model, cs, src, microbatch) if same_host else None
            out.append(
                getattr(hit, kind)
                if hit is not None
                else transfer_s(
                    model, cs, (src.data, src.tensor), cd, (dst.data, dst.tensor), microbatch=microbatch, eff=eff
                )
            )
    return fwd, bwd


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
