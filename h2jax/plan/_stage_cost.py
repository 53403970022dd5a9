"""The cost of one stage: its seconds per microbatch, its memory per device, and the
boundary transfers between stages (:mod:`h2jax.plan._cost` prices a plan from them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from h2jax.plan._plan import (
    StageSpec,
)
from h2jax.plan._profiles import (
    GB,
    GIB,
    PROGRAM,
    TRANSFER,
    ChipProfile,
    Efficiency,
    LayerCost,
    ModelShape,
    ProfileTable,
    local_cores,
)

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
