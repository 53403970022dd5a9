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
- optimizer update: AdamW reads params, grads and both moments, writes three (28 B/param)
  at the chip's memory bandwidth.

Boundaries: one activation (forward) and one gradient (backward) per microbatch and
boundary, mb x seq x d_model x act_bytes each, sent over min(devices of either side)
parallel links (the topology-aware resharding pattern: each destination (data, tensor)
slot receives a distinct piece), plus the all-gather inside the destination's tensor axis.

Iteration time, 1F1B and GPipe alike (they differ in memory, not in time)::

    T = (m - 1) * max_s t_s + sum_s t_s + sum_b (c_fwd_b + c_bwd_b) + max_s g_s

with t_s = fwd_s + bwd_s, c the boundary transfers, g_s = gradient all-reduce + update.
The first two terms are the classic pipeline estimate (fill/drain plus m - 1 steady-state
slots of the slowest stage); the simulator replays the schedule event by event to check it.

Memory per device of stage s: params + grads (fp32) + AdamW moments (2 x fp32) of its
parts, all divided by the tensor degree where the layout shards them; activations of the
microbatches in flight (1F1B: min(num_stages - s, m); GPipe: m), or with recompute only
their inputs plus one microbatch being recomputed; workspace = the largest transient
buffer. A plan that does not fit is rejected with the numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from h2jax.plan._plan import Plan, StageSpec
from h2jax.plan._profiles import GB, GIB, ChipProfile, Cluster, Efficiency, LayerCost, ModelShape, ProfileTable

ADAMW_UPDATE_BYTES_PER_PARAM = 28  # reads p, g, m, v (16 B); writes p, m, v (12 B), all fp32


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the cost model that are not properties of a chip.

    grad_sync: "step" -- gradients are reduced over the data axis once per step after the
        last backward (the planner's assumption for real clusters); "microbatch" -- every
        backward reduces (what the single-controller runtime does today: its gradient
        accumulator is replicated over the data axis).
    mem_reserve_gib: memory per device kept free for the framework and fragmentation.
    """

    grad_sync: str = "step"
    mem_reserve_gib: float = 0.0

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
        return (f"{self.total / GIB:.2f} GiB (params {self.params / GIB:.2f}, grads {self.grads / GIB:.2f}, "
                f"optimizer {self.opt_state / GIB:.2f}, activations {self.activations / GIB:.2f}, "
                f"workspace {self.workspace / GIB:.2f})")


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

    @property
    def t(self) -> float:
        """fwd + bwd seconds of one microbatch."""
        return self.fwd_s + self.bwd_s

    @property
    def tail_s(self) -> float:
        return self.grad_sync_s + self.update_s

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

    @property
    def fits(self) -> bool:
        return not self.reasons

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
        m = self.plan.num_microbatches
        ts = [s.t for s in self.stages]
        return (m - 1) * max(ts) + sum(ts) + sum(self.transfers_fwd) + sum(self.transfers_bwd)


def part_costs(model: ModelShape, chip: ChipProfile, table: ProfileTable | None, *, tensor: int,
               microbatch_per_device: int) -> dict[str, LayerCost]:
    table = table if table is not None else _DEFAULT_TABLE
    return table.costs(model, chip, tensor=tensor, microbatch=microbatch_per_device)


_DEFAULT_TABLE = ProfileTable()


def allreduce_s(nbytes: float, n: int, bw_gbps: float, eff: Efficiency) -> float:
    """Ring all-reduce of `nbytes` over `n` devices at `bw_gbps` per device."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (bw_gbps * GB * eff.link) + eff.collective_latency_s


def in_flight(schedule: str, num_stages: int, num_microbatches: int, stage_idx: int) -> int:
    """Microbatches whose activations stage `stage_idx` holds at once (the schedules' max_in_flight)."""
    if schedule == "gpipe":
        return num_microbatches
    return min(num_stages - stage_idx, num_microbatches)


def stage_cost(model: ModelShape, chip: ChipProfile, *, layers: int, first: bool, last: bool, data: int,
               tensor: int, microbatch: int, recompute: bool, in_flight: int, table: ProfileTable | None = None,
               opts: CostOptions = CostOptions()) -> StageCost:
    """Cost of one stage holding `layers` blocks (plus embedding if `first`, head if `last`).

    `microbatch` is the stage's microbatch in sequences (split over `data` devices).
    """
    table = table if table is not None else _DEFAULT_TABLE
    eff = table.eff
    parts = part_costs(model, chip, table, tensor=tensor, microbatch_per_device=max(1, microbatch // data))
    blk = parts["block"]
    fwd = layers * blk.fwd_s
    bwd = layers * blk.bwd_s
    pbytes = layers * blk.param_bytes
    act = layers * blk.act_bytes
    temp = blk.temp_bytes
    inp = blk.input_bytes
    estimated = blk.estimated
    for name, on in (("embed", first), ("head", last)):
        if on:
            p = parts[name]
            fwd += p.fwd_s
            bwd += p.bwd_s
            pbytes += p.param_bytes
            act += p.act_bytes
            temp = max(temp, p.temp_bytes)
            estimated = estimated or p.estimated
    if first:
        inp = parts["embed"].input_bytes
    if recompute:
        bwd += fwd
        activations = in_flight * inp + act
    else:
        activations = in_flight * act
    z = data * tensor
    bw = chip.intra_node_gbps if z <= chip.devices_per_node else chip.inter_node_gbps
    sync = allreduce_s(pbytes, data, bw, eff)
    if opts.grad_sync == "microbatch":
        bwd += sync
        sync = 0.0
    update = pbytes / 4 * ADAMW_UPDATE_BYTES_PER_PARAM / (chip.mem_bw_gbps * GB * eff.mem_bw)
    mem = StageMemoryEstimate(params=pbytes, grads=pbytes, opt_state=2 * pbytes, activations=activations,
                              workspace=temp)
    return StageCost(fwd_s=fwd, bwd_s=bwd, grad_sync_s=sync, update_s=update, memory=mem,
                     memory_limit=chip.memory_bytes - opts.mem_reserve_gib * GIB, in_flight=in_flight,
                     estimated=estimated)


def transfer_s(model: ModelShape, src_chip: ChipProfile, src: tuple[int, int], dst_chip: ChipProfile,
               dst: tuple[int, int], *, microbatch: int, eff: Efficiency = Efficiency()) -> float:
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


def iteration_time(ts: Sequence[float], transfers: float, tails: Sequence[float], num_microbatches: int) -> float:
    """(m - 1) * max t + sum t + transfers + max tail: the formula every estimate uses."""
    return (num_microbatches - 1) * max(ts) + sum(ts) + transfers + max(tails)


def estimate(plan: Plan, model: ModelShape, cluster: Cluster | Mapping[str, ChipProfile], *,
             table: ProfileTable | None = None, opts: CostOptions = CostOptions()) -> PlanCost:
    """Price `plan`: per-stage times and memory, transfers, iteration time, fit.

    `cluster` gives the chip profiles (a Cluster also gives device counts for TGS).
    Reasons a plan does not fit are listed in `PlanCost.reasons` with the numbers.
    """
    profiles = cluster.profiles if isinstance(cluster, Cluster) else dict(cluster)
    table = table if table is not None else _DEFAULT_TABLE
    n, m = plan.num_stages, plan.num_microbatches
    mb = plan.microbatch_size
    reasons: list[str] = []
    stages: list[StageCost] = []
    for i, s in enumerate(plan.stages):
        chip = profiles[s.chip]
        sc = stage_cost(model, chip, layers=s.num_layers, first=i == 0, last=i == n - 1, data=s.data,
                        tensor=s.tensor, microbatch=mb, recompute=s.recompute,
                        in_flight=in_flight(plan.schedule, n, m, i), table=table, opts=opts)
        stages.append(sc)
        if not sc.fits:
            reasons.append(f"stage {i} ({s.chip} {s.data}x{s.tensor}, {s.num_layers} layers, recompute "
                           f"{'on' if s.recompute else 'off'}, {sc.in_flight} microbatches in flight) needs "
                           f"{sc.memory.describe()} per device; {s.chip} has {sc.memory_limit / GIB:.2f} GiB")
    fwd_x, bwd_x = boundary_transfers(plan.stages, model, profiles, microbatch=mb, eff=table.eff)
    t = iteration_time([s.t for s in stages], sum(fwd_x) + sum(bwd_x), [s.tail_s for s in stages], m)
    used: dict[str, int] = {}
    for s in plan.stages:
        used[s.chip] = used.get(s.chip, 0) + s.num_devices
    total = ({name: cluster.devices(name) for name in cluster.names} if isinstance(cluster, Cluster)
             else dict(used))
    return PlanCost(plan=plan, stages=stages, transfers_fwd=fwd_x, transfers_bwd=bwd_x, iteration_s=t,
                    tokens_per_step=plan.global_batch * model.seq_len, devices_by_chip=used,
                    cluster_devices_by_chip=total, reasons=reasons)


def boundary_transfers(stages: Sequence[StageSpec], model: ModelShape, profiles: Mapping[str, ChipProfile], *,
                       microbatch: int, eff: Efficiency = Efficiency()) -> tuple[list[float], list[float]]:
    """Per boundary: seconds of the forward activation and of the backward gradient transfer."""
    fwd, bwd = [], []
    for a, b in zip(stages, stages[1:]):
        ca, cb = profiles[a.chip], profiles[b.chip]
        fwd.append(transfer_s(model, ca, (a.data, a.tensor), cb, (b.data, b.tensor), microbatch=microbatch, eff=eff))
        bwd.append(transfer_s(model, cb, (b.data, b.tensor), ca, (a.data, a.tensor), microbatch=microbatch, eff=eff))
    return fwd, bwd
