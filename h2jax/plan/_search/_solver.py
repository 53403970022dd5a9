"""The exact inner problem: layers and recompute for a fixed sequence of stages, and the polish of a plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from h2jax.plan import _planner
from h2jax.plan._cost import (
    CostOptions,
    estimate,
    stage_cost,
    transfer_s,
)
from h2jax.plan._plan import (
    Plan,
)
from h2jax.plan._profiles import Cluster, ModelShape, ProfileTable
from h2jax.plan._search._options import INF, ChipChoice, SearchCache, SearchOptions
from h2jax.plan.schedules import Schedule, as_schedule

# -- the exact inner problem: layers and recompute for a fixed sequence of stages --------------


@dataclass
class _StageArrays:
    """Per layer count l = 0..L (the last axis; a leading axis: several stages at once)."""

    t: np.ndarray  # seconds of fwd+bwd per microbatch with l layers; inf: does not fit
    g: np.ndarray  # end term (``pipeline_terms``): the tail (sync + update), + 2 h under ZB-H1, + t - fill chunked
    recompute: np.ndarray  # bool: the cheapest fitting choice recomputes
    fill: np.ndarray | None = None  # the stage's share of sum_s fill_s; None: t (unsplit schedules)


class _Solver:
    """Caches per-stage pricings and solves the layer split of one stage sequence exactly."""

    def __init__(
        self,
        model: ModelShape,
        cluster: Cluster,
        table: ProfileTable | None,
        opts: SearchOptions,
        cache: SearchCache | None = None,
    ):
        self.model, self.cluster, self.table, self.opts = model, cluster, table, opts
        L = model.n_layers
        self.L = L
        self.layers = np.arange(L + 1, dtype=np.float64)
        # by chip shape, schedule and boundary: shared with other searches through `cache`
        self._tables: dict[tuple, _planner.Pricing]
        self._xfer: dict[tuple, float]
        self._counts: dict[tuple, np.ndarray]
        self._tables, self._xfer, self._counts = cache.pricings(opts) if cache is not None else ({}, {}, {})
        self._by_choice: dict[tuple, _planner.Pricing] = {}  # a search's choices live as long as it does
        self._pairs: dict[tuple[int, int], float] = {}
        self.dp_solves = 0

    def arrays(
        self,
        chip: str,
        data: int,
        tensor: int,
        mb: int,
        first: bool,
        last: bool,
        infl: int,
        pending: int = 0,
        schedule: Schedule | str = "1f1b",
    ) -> _StageArrays:
        """One stage's time, fill, end and fit for every layer count l under `schedule`, with
        `infl` microbatches awaiting B and `pending` awaiting W: what :meth:`solve` prices."""
        schedule = as_schedule(schedule)
        t, g, recompute, fill = _planner.stage_rows(
            [self.pricing(chip, data, tensor, mb, first, last, schedule)],
            [1],
            np.array([[infl, pending]], dtype=np.int64),
            self.opts.allow_recompute,
            schedule.chunks,
            _has_fill(schedule),
        )
        return _StageArrays(t=t[0], g=g[0], recompute=recompute[0], fill=None if fill is None else fill[0])

    def pricing(
        self, chip: str, data: int, tensor: int, mb: int, first: bool, last: bool, schedule: Schedule
    ) -> _planner.Pricing:
        """One stage shape's pricing over the layer count l, as :func:`h2jax.plan._planner.solve`
        takes it (a :class:`h2jax.plan._planner.Pricing` of the table): float64 [recompute flag
        (no, yes), quantity, l] with the quantities time,
        fill, end, mem1, per_j, per_q and the memory limit. The memory is mem(l, j, q) = mem1 +
        (j - 1) per_j + q per_q -- affine in the microbatches awaiting B (j) and W (q), from the
        stage costs at l = 0 and 1 with their per-count slopes (``StageCost.in_flight_bytes``,
        ``.pending_w_bytes``), so every stage position shares one pricing. The fill and end come
        from the seconds over l (:func:`h2jax.plan._cost.pipeline_terms`): affine but for ZB-V's,
        a maximum of affine terms."""
        key = (chip, data, tensor, mb, first, last, schedule)
        hit = self._tables.get(key)
        if hit is not None:
            return hit
        chunks, split = schedule.chunks, schedule.split_backward
        prof = self.cluster.profile(chip)
        kw = dict(
            first=first, last=last, data=data, tensor=tensor, microbatch=mb, table=self.table, opts=self.opts.cost
        )
        out = np.empty((2, 7, self.L + 1))
        for i, rc in enumerate((False, True)):
            c0, c1 = (
                stage_cost(self.model, prof, layers=n, recompute=rc, in_flight=1, split=split, chunks=chunks, **kw)
                for n in (0, 1)
            )
            # every quantity affine over l: v0 + l (v1 - v0), all at once
            v0, v1 = (
                np.array(
                    [
                        c.t,
                        c.fwd_s,
                        c.b_s,
                        c.w_s,
                        c.w_hidden_s,
                        c.tail_s,
                        c.memory.total,
                        c.in_flight_bytes,
                        c.pending_w_bytes,  # 0 unsplit: nothing awaits W
                    ]
                )
                for c in (c0, c1)
            )
            t, fwd, b, w, hidden, tail, out[i, 3], out[i, 4], out[i, 5] = v0[:, None] + self.layers * (v1 - v0)[:, None]
            out[i, 1], out[i, 2] = schedule.pipeline_terms(t=t, fwd=fwd, b=b, w=w, hidden=hidden, tail=tail)
            out[i, 0] = t
            out[i, 6] = c0.memory_limit
        hit = self._tables[key] = _planner.Pricing(out)
        return hit

    def stage_pricing(self, c: ChipChoice, mb: int, first: bool, last: bool, schedule: Schedule) -> _planner.Pricing:
        """:meth:`pricing` of a stage of choice `c` (of microbatch size `mb`), cached by the
        choice's identity (a search asks for the same ones thousands of times)."""
        key = (id(c), first, last, schedule)
        hit = self._by_choice.get(key)
        if hit is None:
            hit = self._by_choice[key] = self.pricing(c.chip, c.data, c.tensor, mb, first, last, schedule)
        return hit

    def counts(self, schedule: Schedule, S: int, m: int) -> np.ndarray:
        """int64 [stage, (awaiting B, awaiting W)] of `schedule` (its ``memory_counts``)."""
        key = (schedule, S, m)
        hit = self._counts.get(key)
        if hit is None:
            hit = self._counts[key] = np.array(schedule.memory_counts(S, m), dtype=np.int64)
        return hit

    def solve(
        self,
        tables: list[np.ndarray],
        runs: list[int],
        counts: np.ndarray,
        schedule: Schedule,
        m: int,
        transfers: float,
        best: float,
    ) -> tuple[float, list[int], list[bool]] | None:
        """The best layer split and recompute flags of a stage sequence under `schedule`, if it
        beats `best` (module docstring, "Why the exact round is exact"; compiled:
        :mod:`h2jax.plan._planner`): the stages as runs of one shape, ``runs[i]`` stages priced by
        ``tables[i]`` (:meth:`pricing`), with `counts` (:meth:`counts`)."""
        value, layers, recompute, n_dp = _planner.solve(
            tables, runs, counts, self.opts.allow_recompute, schedule.chunks, _has_fill(schedule), m, transfers, best
        )
        self.dp_solves += n_dp
        return None if layers is None else (value, layers, recompute)

    def transfers(self, groups: Sequence[ChipChoice], mb: int) -> float:
        """Seconds of every boundary of a stage sequence per microbatch (both ways): each chip
        type's stages, in this order, pass (stages - 1) boundaries among themselves and one to
        the next type's."""
        pairs = self._pairs  # by (id, id): a search's choices live as long as it does, each of one microbatch size
        within = across = 0  # summed in this order, as plans are priced
        prev = None
        for c in groups:
            x = pairs.get((id(c), id(c)))
            within += (c.stages - 1) * (x if x is not None else self._between(c, c, mb))
            if prev is not None:
                x = pairs.get((id(prev), id(c)))
                across += x if x is not None else self._between(prev, c, mb)
            prev = c
        return within + across

    def _between(self, a: ChipChoice, b: ChipChoice, mb: int) -> float:
        key = (id(a), id(b))
        hit = self._pairs.get(key)
        if hit is None:
            hit = self._pairs[key] = self.transfer((a.chip, a.data, a.tensor), (b.chip, b.data, b.tensor), mb)
        return hit

    def transfer(self, a: tuple[str, int, int], b: tuple[str, int, int], mb: int) -> float:
        key = (a, b, mb)
        hit = self._xfer.get(key)
        if hit is None:
            eff = self.table.eff if self.table is not None else ProfileTable().eff
            pa, pb = self.cluster.profile(a[0]), self.cluster.profile(b[0])
            hit = transfer_s(self.model, pa, a[1:], pb, b[1:], microbatch=mb, eff=eff) + transfer_s(
                self.model, pb, b[1:], pa, a[1:], microbatch=mb, eff=eff
            )
            self._xfer[key] = hit
        return hit


def _has_fill(schedule: Schedule) -> bool:
    """Whether a stage's fill term may differ from its time t (split or chunked schedules)."""
    return schedule.split_backward or schedule.chunks > 1


def _full_time(plan: Plan, model: ModelShape, cluster: Cluster, table: ProfileTable | None, opts: CostOptions) -> float:
    cost = estimate(plan, model, cluster, table=table, opts=opts)
    return cost.iteration_s if cost.fits else INF


def polish_split(
    seq: Sequence[ChipChoice],
    layers: list[int],
    recompute: list[bool],
    price,
    *,
    allow_recompute: bool,
    min_layers: int = 1,
) -> tuple[float, list[int], list[bool]]:
    """Hill-climb from a layer split by the full estimate `price(layers, recompute)`: give one
    layer of any stage to any other (the stages between keep their counts, their ranges
    shift) or flip one stage's recompute flag, take the best move while it helps. With
    shared hosts the contention depends on the split too (how much of the host each stage
    wants while they run together), which the T_pipe-optimal split the dynamic program
    finds does not see. Moves between any two stages, not only neighbours: a one-layer
    stage between them would otherwise wall the better split off (a move through it
    empties it). Every stage keeps `min_layers` blocks (a chunked schedule's: one per chunk)."""
    value = price(layers, recompute)
    while True:
        moves: list[tuple[list[int], list[bool]]] = []
        for a in range(len(seq)):
            for b in range(len(seq)):
                if a != b and layers[a] > min_layers:  # a layer from stage a to stage b
                    ls = list(layers)
                    ls[a] -= 1
                    ls[b] += 1
                    moves.append((ls, recompute))
        if allow_recompute:
            for i in range(len(seq)):
                rc = list(recompute)
                rc[i] = not rc[i]
                moves.append((layers, rc))
        best_move = min(((price(ls, rc), ls, rc) for ls, rc in moves), key=lambda t: t[0], default=None)
        if best_move is None or best_move[0] >= value * (1 - 1e-12):
            return value, layers, recompute
        value, layers, recompute = best_move


def has_shared_host(cluster: Cluster) -> bool:
    """Whether stages may share a host's cores (emulated chips: two nodes, or two chip types,
    on one machine), so that the cost model's host bound can decide the step time."""
    on_host: dict[str, int] = {}
    for prof, nodes in cluster.chips:
        if prof.host is not None:
            on_host[prof.host] = on_host.get(prof.host, 0) + nodes * prof.devices_per_node
    return any(n > 1 for n in on_host.values())
