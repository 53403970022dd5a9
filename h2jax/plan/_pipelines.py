"""The cost of a job of several pipelines, and the plan of one pipeline per chip type.

A job of several pipelines (``Plan.pipelines``) runs its pipelines at once, each on its own
chips and its share of the step's sequences; the step ends when the slowest pipeline's last
update has run and every layer's copies have been summed and copied back. So its time is

    max over pipelines of its own iteration (h2jax.plan.estimate of that pipeline alone)
    + the exchange across pipelines

where the exchange prices the runtime's transfers (h2jax.runtime._tied): every layer is owned by the
first pipeline's stage that holds it; each other pipeline's stage holding it sends its gradient
there, where it is added, and takes back the new values (the gradient's bytes, fp32; a mirror's
optimizer moments do not travel: h2jax.runtime._tied). Each of these transfers is priced sharded:
the tensor cut into as many pieces as the smaller of the two stages has devices, each piece on its
own link (the pattern of the boundary transfers, h2jax.plan._stage_cost.transfer_s), and the
receiving stage all-gathering the pieces over its data axis on its intra-node link. That is the
runtime's pattern: in one process ``jax.device_put`` between the stage meshes; across processes
each process sends the pieces it holds (h2jax.plan.slice_routes) -- through host memory, a copy off
and onto the devices at each end that a device-direct exchange would not make, so on real chips the
exchange takes longer than priced, and ``h2jax plan`` says so beside a plan of several pipelines
that it chooses (:data:`RUNTIME_PATH`). A link between two chip types, or between nodes of one,
runs at the slower side's inter-node bandwidth. The runtime posts its sends and goes on
(h2jax.runtime._world.World.post), so a stage that sends to several is held by none of them, and a
stage receives its transfers one after the other, in the runtime's order (:class:`Exchange`): an
owner its mirrors' gradients, a mirror its owners' values.
Between chips that share a host (emulated) the bytes cross its memory and the one process's driver
runs every (owner, mirror) pair in turn: each pair costs what the profiler measured of that exchange
between two clients of the host (``"exchange_call"`` per list plus ``"exchange"`` per block's worth
of parameters, h2jax.runtime._profile: the runtime's own calls timed), added up over the pairs;
without such rows, the link model above at the profiler's boundary-transfer rate. The gradient sum
and the copy back are priced apart (:func:`exchange_parts`; the simulator replays them apart).

The gradient sum overlaps the backward where the stages have processes of their own (real chips, one
process per stage under mpirun): each process goes on to the exchange as soon as its own stage's
last op is done: a mirror posts its gradients to its owners, an owner adds its mirrors' in order
(h2jax.runtime._tied.TiedParams.sum_grads), each once its mirror has posted it (:class:`Exchange`).
So a pair of late stages (the last stages of a pipeline finish their backwards first) is summed
while the stages below them still drain. When a stage is done comes from a replay of its pipeline's
schedule (its last op's distance from the pipeline's, the transfers left out: the done time errs
late). Where stages share a host (emulated chips: one process drives them all) every pair runs after
the job's last op, one after the other. The global gradient norm then waits for every sum, every
stage runs its update (the tails), and the copy back follows the updates: neither overlaps anything.

With shared hosts (emulated chips) the pipelines' stages also share the host's cores: the step
is at least every pipeline's host work over the cores, as for one pipeline (h2jax.plan._cost).

Which plans of several pipelines to run is searched by h2jax.plan._pipeline_search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from h2jax.plan._plan import Plan

RUNTIME_PATH = (
    "the exchange is priced as sharded transfers over the stages' links, as a device-direct exchange would run; "
    "across processes h2jax's runtime sends the same pieces through host memory (a copy off and onto the devices at "
    "each end): on real chips slower than priced"
)


@dataclass(frozen=True)
class PipelinesCost:
    """What :func:`estimate_pipelines` gives: each pipeline's cost, the exchange and the step."""

    plan: Plan
    pipelines: tuple[Any, ...]  # each pipeline's PlanCost
    exchange_s: float
    iteration_s: float
    tokens_per_step: int
    devices_by_chip: dict[str, int]
    cluster_devices_by_chip: dict[str, int]
    reasons: list[str] = field(default_factory=list)
    host_bound_s: float = 0.0
    exchange_summed_s: float = 0.0  # of exchange_s, the gradient sum's (the rest: the copy back)
    exchange_overlap_s: float = 0.0  # of the gradient sum, the seconds that ran while a stage still computed
    exchange: Exchange | None = None  # the exchange itself (its pairs: h2jax.plan._simulate replays them)

    @property
    def fits(self) -> bool:
        return not self.reasons

    def exchange_words(self, fmt: Any = "{:.3f} s".format) -> str:
        """The exchange in words: "0.128 s exchange across pipelines (0.041 s of it beside the
        backward)"; `fmt` formats seconds."""
        hidden = fmt(self.exchange_overlap_s)
        beside = f" ({hidden} of it beside the backward)" if hidden != fmt(0.0) else ""
        return f"{fmt(self.exchange_s)} exchange across pipelines{beside}"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.iteration_s if self.iteration_s > 0 else 0.0

    @property
    def device_direct_priced(self) -> bool:
        """The exchange's transfers run between processes (real chips) and are priced as a
        device-direct exchange would run them, faster than the runtime's today (:data:`RUNTIME_PATH`)."""
        return self.exchange is not None and bool(self.exchange.pairs)

    @property
    def exchange_note(self) -> str:
        """:data:`RUNTIME_PATH` where :attr:`device_direct_priced`, else ""."""
        return RUNTIME_PATH if self.device_direct_priced else ""


def _holdings(pipe: Plan, model: Any) -> list[tuple[set[int], bool, bool]]:
    """Per stage of one pipeline: (its blocks, whether it holds the embedding, the head)."""
    out = [(set(), False, False) for _ in pipe.stages]
    positions = pipe.positions()
    for k, (s, c) in enumerate(positions):
        blocks, emb, head = out[s]
        a, b = pipe.stages[s].layer_chunks[c]
        blocks.update(range(a, b))
        out[s] = (blocks, emb or k == 0, head or k == len(positions) - 1)
    return out


def _rate_s_per_byte(src: Any, s_spec: Any, dst: Any, d_spec: Any, model: Any, table: Any) -> float:
    """Seconds per byte of a sharded transfer between two stages (module docstring)."""
    from h2jax.plan._stage_cost import measured_transfer

    eff = table.eff
    if src.host is not None and src.host == dst.host:
        hit = measured_transfer(table, model, src, s_spec, s_spec.data)
        if hit is not None:  # the measured boundary tensor: seq x d_model x act_bytes per sequence
            return hit.fwd_s / (model.seq_len * model.d_model * model.act_bytes)
    links = max(1, min(s_spec.num_devices, d_spec.num_devices))
    bw = min(src.inter_node_gbps, dst.inter_node_gbps) * 1e9 * eff.link
    gather = 0.0
    if d_spec.data > 1:  # the receiver's all-gather over its data axis, of its 1/tensor share
        gather = (d_spec.data - 1) / d_spec.data / d_spec.tensor / (dst.intra_node_gbps * 1e9 * eff.link)
    return 1.0 / (links * bw) + gather


def measured_exchange(table: Any, model: Any, chip: Any, tensor: int) -> tuple[Any, Any] | None:
    """The profiler's exchange rows of `chip` at tensor degree `tensor` for `model`'s shape
    (``"exchange"`` per block, ``"exchange_call"`` per list; any microbatch's: they do not depend
    on it), if measured."""
    from h2jax.plan._profiles import EXCHANGE, EXCHANGE_CALL

    if table is None:
        return None
    key = model.key()
    for (c, mkey, t, _), parts in sorted(table.entries.items()):
        if c == chip.name and mkey == key and t == tensor and EXCHANGE in parts and EXCHANGE_CALL in parts:
            return parts[EXCHANGE], parts[EXCHANGE_CALL]
    return None


@dataclass(frozen=True)
class Exchange:
    """The exchange across a plan's pipelines as the runtime runs it (module docstring)."""

    pairs: tuple[tuple[int, int, float], ...] = ()  # (receiver, sender, seconds): the gradient sum's
    # transfers (owner, mirror) between stages with processes of their own, in the runtime's order
    after_s: float = 0.0  # the gradient sum's seconds after the job's last op (stages sharing a host)
    copied_s: float = 0.0  # the copy back's, after the updates

    def timed(self, ready: Sequence[float]) -> list[tuple[int, int, float, float]]:
        """(receiver, sender, start, end) of each (receiver, sender, seconds) pair, the job's
        stage g done with its own ops at ready[g] (0 where not given): the sender posts its send
        when it is free and goes on; the receiver takes its pairs one after the other, each once
        the sender has posted it."""
        free = dict(enumerate(ready))
        out = []
        for r, src, s in self.pairs:
            t0 = max(free.get(r, 0.0), free.get(src, 0.0))
            free[r] = t0 + s
            out.append((r, src, t0, t0 + s))
        return out

    def sums_end(self, ready: Sequence[float]) -> float:
        """When the gradient sum is done, stage g done with its own ops at ready[g]."""
        return max([*ready, *(e for *_, e in self.timed(ready))], default=0.0) + self.after_s

    @property
    def summed_s(self) -> float:
        """The gradient sum's seconds where every stage is done at once."""
        return self.sums_end(())


def exchange(plan: Plan, model: Any, profiles: dict[str, Any], *, table: Any = None) -> Exchange:
    """The exchange across ``plan``'s pipelines (module docstring); empty for one pipeline."""
    from h2jax.plan._cost import _DEFAULT_TABLE

    pipes = plan.pipeline_plans()
    if len(pipes) < 2:
        return Exchange()
    table = table if table is not None else _DEFAULT_TABLE
    eff = table.eff
    offsets = plan.stage_offsets()
    owners = _holdings(pipes[0], model)
    mirrors = [
        (offsets[p] + m, pipes[p].stages[m], held)
        for p in range(1, len(pipes))
        for m, held in enumerate(_holdings(pipes[p], model))
    ]
    pairs: list[tuple[int, int, float]] = []
    copies: list[tuple[int, int, float]] = []
    hosts = [0.0, 0.0]
    for o, (blocks, emb, head) in enumerate(owners):
        spec_o = pipes[0].stages[o]
        prof_o = profiles[spec_o.chip]
        for g, spec_m, (m_blocks, m_emb, m_head) in mirrors:
            params = len(blocks & m_blocks) * model.block_params
            params += model.embed_params * (emb and m_emb) + model.head_params * (head and m_head)
            if not params:
                continue
            prof_m = profiles[spec_m.chip]
            if prof_o.host is not None and prof_o.host == prof_m.host:
                rows = [
                    measured_exchange(table, model, prof, spec.tensor)
                    for prof, spec in ((prof_o, spec_o), (prof_m, spec_m))
                ]
                got = [r or rows[1 - i] for i, r in enumerate(rows)]  # the receiver's, else the sender's
                if got[0] is not None:  # measured: the host's one driver runs every pair in turn
                    per_block = params / model.block_params
                    hosts[0] += got[0][1].fwd_s + per_block * got[0][0].fwd_s
                    hosts[1] += got[1][1].bwd_s + per_block * got[1][0].bwd_s
                    continue
            grads = 4 * params  # fp32
            pairs.append(
                (
                    o,
                    g,
                    grads * _rate_s_per_byte(prof_m, spec_m, prof_o, spec_o, model, table) + eff.collective_latency_s,
                )
            )
            copies.append(
                (
                    g,
                    o,
                    grads * _rate_s_per_byte(prof_o, spec_o, prof_m, spec_m, model, table) + eff.collective_latency_s,
                )
            )
    pairs.sort(key=lambda x: (x[1], -x[0]))  # the runtime's order: by mirror, then owner from the last down
    copies.sort(key=lambda x: (x[1], x[0]))  # each mirror takes its owners' values owner by owner
    if any(profiles[s.chip].host is not None for s in plan.stages):  # one process drives them all: in turn, after
        return Exchange((), hosts[0] + sum(x for *_, x in pairs), hosts[1] + sum(x for *_, x in copies))
    return Exchange(tuple(pairs), hosts[0], Exchange(tuple(copies)).summed_s + hosts[1])


def exchange_parts(plan: Plan, model: Any, profiles: dict[str, Any], *, table: Any = None) -> tuple[float, float]:
    """(the gradient sum's seconds, the copy back's) of the exchange across ``plan``'s pipelines,
    every stage done at once (:func:`exchange`); (0, 0) for one pipeline."""
    ex = exchange(plan, model, profiles, table=table)
    return ex.summed_s, ex.copied_s


def exchange_s(plan: Plan, model: Any, profiles: dict[str, Any], *, table: Any = None) -> float:
    """Seconds of the exchange across ``plan``'s pipelines (:func:`exchange_parts` added up)."""
    return sum(exchange_parts(plan, model, profiles, table=table))


@lru_cache(maxsize=4096)
def _slacks(
    schedule: Any, m: int, fwd: tuple[float, ...], b: tuple[float, ...], w: tuple[float, ...]
) -> tuple[float, ...]:
    """Per stage of one pipeline: how long before the pipeline's last op its own last op ends,
    in a replay of the schedule with these seconds per chunk (transfers left out)."""
    events = schedule.bind(len(fwd), m).events(forward=list(fwd), backward=list(b), weight=list(w))
    ends = [0.0] * len(fwd)
    for e in events:
        ends[e[0]] = max(ends[e[0]], e[4])
    last = max(ends, default=0.0)
    return tuple(last - e for e in ends)


def stage_ready_s(pipe: Plan, cost: Any) -> tuple[list[float], float]:
    """(when each stage of one pipeline is done with its own ops, the seconds after that to the
    end of its step: the tails, the driver's step) (module docstring)."""
    from h2jax.plan._cost import pipeline_time

    st = cost.stages
    transfers = sum(cost.transfers_fwd) + sum(cost.transfers_bwd)
    tails = pipeline_time(st, pipe.schedule, pipe.num_microbatches, transfers=transfers, period=cost.period_s)
    bare = pipeline_time(
        st, pipe.schedule, pipe.num_microbatches, transfers=transfers, period=cost.period_s, tails=False
    )
    last = cost.iteration_s - (tails - bare) - cost.driver_step_s
    if len(st) == 1:  # nothing below it to drain
        return [last], cost.iteration_s - last
    v = pipe.schedule.chunks
    top = max(s.t for s in st)
    scale = cost.period_s / top if top > 0 and cost.period_s > 0 else 1.0
    slack = _slacks(
        pipe.schedule,
        pipe.num_microbatches,
        tuple(round(scale * s.fwd_s / v, 12) for s in st),
        tuple(round(scale * s.b_s / v, 12) for s in st),
        tuple(round(scale * s.w_s / v, 12) for s in st),
    )
    return [last - x for x in slack], cost.iteration_s - last


def estimate_pipelines(plan: Plan, model: Any, cluster: Any, *, table: Any = None, opts: Any = None) -> PipelinesCost:
    """Price a plan of one or several pipelines (module docstring)."""
    from h2jax.plan._cost import CostOptions, estimate

    opts = opts if opts is not None else CostOptions()
    costs = tuple(estimate(p, model, cluster, table=table, opts=opts) for p in plan.pipeline_plans())
    profiles = cluster.profiles
    ex = exchange(plan, model, profiles, table=table)
    summed, copied = ex.summed_s, ex.copied_s
    step = max(c.iteration_s for c in costs) + summed + copied
    overlap = 0.0
    if ex.pairs:  # the gradient sum overlaps the backward (module docstring)
        ready: list[float] = []
        after = 0.0
        for pipe, c in zip(plan.pipeline_plans(), costs):
            r, a = stage_ready_s(pipe, c)
            ready += r
            after = max(after, a)
        done = ex.sums_end(ready)
        step = max(max(c.iteration_s for c in costs), done + after) + copied
        overlap = max(0.0, max(ready) + summed - done)
    work: dict[str, float] = {}
    cores: dict[str, int] = {}
    for c in costs:
        for h, w in c.host_work_s.items():
            work[h] = work.get(h, 0.0) + w
            cores[h] = c.host_cores[h]
    bound = max((work[h] / cores[h] for h in work), default=0.0)
    used: dict[str, int] = {}
    for s in plan.stages:
        used[s.chip] = used.get(s.chip, 0) + s.num_devices
    reasons = [f"pipeline {p}: {r}" for p, c in enumerate(costs) for r in c.reasons]
    for chip, n in used.items():
        if n > cluster.devices(chip):
            reasons.append(f"the pipelines use {n} {chip} chips, the cluster has {cluster.devices(chip)}")
    return PipelinesCost(
        plan=plan,
        pipelines=costs,
        exchange_s=summed + copied,
        exchange_overlap_s=overlap,
        exchange=ex,
        exchange_summed_s=summed,
        iteration_s=max(step, bound),
        tokens_per_step=plan.global_batch * model.seq_len,
        devices_by_chip=used,
        cluster_devices_by_chip={c: cluster.devices(c) for c in cluster.names},
        reasons=reasons,
        host_bound_s=bound,
    )
