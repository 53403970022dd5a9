"""The space the search covers: microbatch sizes, per-chip choices with their memory caps, chip orders; a plan from a choice."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np

from h2jax.plan import _planner
from h2jax.plan._cost import (
    expand_chunks,
    layer_fill_s,
    memory_limit,
    part_costs,
    searched_schedules,
    stage_memory,
)
from h2jax.plan._plan import (
    Plan,
    PlanError,
    StageSpec,
    chunked_variant,
)
from h2jax.plan._profiles import ChipProfile, Cluster, ModelShape, ProfileTable
from h2jax.plan._search._options import ChipChoice, SearchOptions, StageCaps
from h2jax.plan.schedules import Schedule

# -- the space -------------------------------------------------------------------------------


def microbatch_sizes(global_batch: int, opts: SearchOptions) -> list[int]:
    if opts.microbatch_sizes is not None:
        return [b for b in opts.microbatch_sizes if global_batch % b == 0]
    top = opts.max_microbatch or global_batch
    return [b for b in range(1, min(top, global_batch) + 1) if global_batch % b == 0]


@functools.cache
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of n, largest first."""
    return tuple(d for d in range(n, 0, -1) if n % d == 0)


def data_degrees(
    chip: ChipProfile,
    nodes: int,
    *,
    max_stages: int,
    tensor: int,
    microbatch: int,
    stage_in_node: bool,
    per_device: frozenset[int] | None = None,
) -> list[int]:
    """The data degree of k stages of `tensor`-wide meshes on this chip type, for k = 1 ..
    `max_stages` (0: none fits): the largest divisor of the microbatch that k stages' devices
    allow (with `stage_in_node`, within one node and packing into the nodes).

    `per_device`: the sequences per device allowed (those measured at this tensor degree,
    with ``SearchOptions.measured_only``); None: any."""
    devices = nodes * chip.devices_per_node
    divisors = [d for d in _divisors(microbatch) if per_device is None or microbatch // d in per_device]
    out = []
    first = 0  # divisors[first:] are <= the device count's bound, which only falls with k
    for k in range(1, max_stages + 1):
        top = devices // (k * tensor)
        if stage_in_node:
            top = min(top, chip.devices_per_node // tensor)
        while first < len(divisors) and divisors[first] > top:
            first += 1
        d = 0
        for cand in divisors[first:]:
            if not (stage_in_node and k > nodes * (chip.devices_per_node // (cand * tensor))):
                d = cand
                break
        out.append(d)
    return out


def _memory_model(
    model: ModelShape,
    chip: ChipProfile,
    table: ProfileTable | None,
    opts: SearchOptions,
    *,
    data: int,
    tensor: int,
    microbatch: int,
    chunks: int = 1,
) -> np.ndarray:
    """Per recompute flag (no, yes), a middle stage's memory as ``base . (1, j, q) + l slope .
    (1, j, q)`` and the chip's limit, as float64 [flag, (base (3), slope (3), limit)]: params,
    grads and moments grow with its block count l, activations with l x j (j microbatches
    awaiting B; with recompute their inputs, j alone) and l x q (q awaiting W in a split
    schedule) -- so two pricings (l = 0, 1) with their per-count slopes give every (l, j, q).
    `chunks`: the stage's blocks in that many chunks (interleaved, zb-v): j and q count (chunk,
    microbatch)."""
    out = np.empty((2, 7))
    for i, rc in enumerate((False, True)):
        # one pricing per block count: the counts' slopes are the stage's own (in_flight_bytes,
        # pending_w_bytes); split=True prices what W keeps and with nothing awaiting W adds nothing
        per = []
        for l in (0, 1):
            mem, per_j, per_q = stage_memory(
                model,
                chip,
                layers=l,
                first=False,
                last=False,
                data=data,
                tensor=tensor,
                microbatch=microbatch,
                recompute=rc,
                in_flight=1,
                table=table,
                split=True,
                pending_w=0,
                chunks=chunks,
            )
            per.append(np.array([mem.total - per_j, per_j, per_q]))  # mem(l, j, q) = m1(l) + (j - 1) pj(l) + q pq(l)
        out[i, :3] = per[0]
        out[i, 3:6] = per[1] - per[0]
        out[i, 6] = memory_limit(chip, opts.cost)
    return out


def _caps_at(
    mm: np.ndarray,
    points: Sequence[tuple[np.ndarray, np.ndarray]],
    L: int,
    allow_recompute: bool,
    ranks: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Most blocks a middle stage holds without / with recompute if its (awaiting B, awaiting W)
    counts may be any of `points` (float64 arrays over the stage ranks, all of one shape): the
    max over them (:func:`h2jax.plan._planner.caps_at`). `mm`: :func:`_memory_model`'s.
    `ranks` (int64, one per row of 2-d points): the ranks each row's choices use (0 after them)."""
    shape = np.shape(points[0][0])
    ln, lr = _planner.caps_at(mm, [j for j, _ in points], [q for _, q in points], L, allow_recompute, ranks)
    return ln.reshape(shape), lr.reshape(shape)


class _CapsByJ:
    """:func:`_caps_at` of one memory model with nothing awaiting W, tabulated over the count
    awaiting B (j = 0, 1, 2, ...): the floors of the unsplit schedules differ between
    microbatch counts only in which j each rank takes, so every microbatch size indexes one
    table (the same numbers as :func:`_caps_at`: the same formula at the same j)."""

    def __init__(self, mm: np.ndarray, L: int, allow_recompute: bool):
        self.mm, self.L, self.allow_recompute = mm, L, allow_recompute
        self.caps_n = self.caps_r = np.zeros(0)

    def __call__(self, idx: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
        """The caps at counts `idx` (intp), the largest of them `top`."""
        if top >= len(self.caps_n):
            js = np.arange(max(2 * top, 2 * self.L) + 1, dtype=np.float64)
            self.caps_n, self.caps_r = _caps_at(self.mm, [(js, np.zeros_like(js))], self.L, self.allow_recompute)
        return self.caps_n[idx], self.caps_r[idx]


def searched_labels(opts: SearchOptions) -> tuple[Schedule, ...]:
    """The schedules a search prices (:func:`h2jax.plan._cost.searched_schedules`), a family
    whose chunk count is a choice once per count of `opts.interleaved_chunks`."""
    return expand_chunks(searched_schedules(opts.schedule, opts.schedules), opts.interleaved_chunks)


def chip_choices(
    cluster: Cluster,
    model: ModelShape,
    microbatch: int,
    opts: SearchOptions,
    table: ProfileTable | None,
    caps_cache: dict | None = None,
    *,
    num_microbatches: int,
    keep: dict | None = None,
) -> dict[str, list[ChipChoice]]:
    """Every (k, data, tensor) of every chip type for this microbatch size, with the memory
    caps of its stages under each searched schedule (its ``count_floors``) at
    `num_microbatches`.

    `caps_cache`: the memory model by (chip, tensor, sequences per device), which is all it
    depends on, and the caps by counts, shared between microbatch sizes. `keep`: each chip
    type's choices by (microbatch, counts, the options that shape them), for searches whose
    chip types differ (``SearchCache.choices``; keyed there by `caps_cache`'s options and chip
    type count).
    """
    caps_cache = {} if caps_cache is None else caps_cache
    schedules = searched_labels(opts)
    variants = list(dict.fromkeys(s.chunks for s in schedules))  # chunk counts: one memory model each
    flat = [s for s in schedules if not s.floors_need_k]  # caps that do not depend on k
    by_k = [s for s in schedules if s.floors_need_k]
    if len(by_k) > 1:
        raise PlanError(
            "schedules",
            f"{', '.join(s.label for s in by_k)}: the search bounds the memory of one schedule whose floors "
            "depend on a chip type's stage count; expected at most one of them",
        )
    kdep = by_k[0] if by_k else None
    # the loosest caps of the k-independent schedules bound the k-dependent one's too where one
    # of them has floors never above its (its caps_within): one loose object for every k
    with_loose = kdep is None or any(s.name in kdep.caps_within for s in flat)
    out: dict[str, list[ChipChoice]] = {}
    L = model.n_layers
    m = num_microbatches
    n_types = len(cluster.names)
    for chip, nodes in cluster.chips:
        # the choices of a chip type depend on no other chip type (but through n_types, which
        # keys `keep`): a search over other chip types beside it reuses them, and their _Held
        mkey = (
            "choices",
            chip.name,
            nodes,
            microbatch,
            m,
            opts.measured_only,
            opts.max_stages_per_chip,
            opts.group_size,
            opts.stage_in_node,
        )
        hit = keep.get(mkey) if keep is not None else None
        if hit is not None:
            out[chip.name] = hit
            continue
        devices = nodes * chip.devices_per_node
        choices = []
        rows = measured_rows(table, chip.name, model) if opts.measured_only else frozenset()
        for t in model.tensor_degrees(chip.devices_per_node):
            if t > devices:
                continue
            per_device = frozenset(b for tt, b in rows if tt == t) if rows else None
            if per_device == frozenset():
                continue  # this tensor degree was not measured on this chip type
            kmax = min(L, devices // t, opts.max_stages_per_chip or L)
            if opts.group_size:
                kmax = min(kmax, max(1, math.ceil(devices / opts.group_size)))
            by_data: dict[int, list[int]] = {}
            degrees = data_degrees(
                chip,
                nodes,
                max_stages=kmax,
                tensor=t,
                microbatch=microbatch,
                stage_in_node=opts.stage_in_node,
                per_device=per_device,
            )
            for k, d in enumerate(degrees, start=1):
                if d:
                    by_data.setdefault(d, []).append(k)
            for d, ks in by_data.items():
                blk = part_costs(model, chip, table, tensor=t, microbatch_per_device=microbatch // d)["block"]
                rc_s = blk.fwd_s * 2 + blk.bwd_s
                key = (chip.name, t, microbatch // d)
                for v in variants:
                    if (key, v) not in caps_cache:
                        caps_cache[key, v] = _memory_model(
                            model, chip, table, opts, data=d, tensor=t, microbatch=microbatch, chunks=v
                        )
                fills = caps_cache.get((key, "fills", schedules))
                if fills is None:
                    fills = {s: layer_fill_s(model, blk, tensor=t, schedules=(s,)) for s in schedules}
                    caps_cache[key, "fills", schedules] = fills
                # caps depend on k only through the k-dependent schedule's floor key (ZB-H1's floor
                # total): one object per distinct key, shared by every choice with it (one row of
                # _Held), all keys priced at once; the other schedules' do not depend on k: one each
                shared: dict[Schedule | None, StageCaps] = {
                    s: _schedule_caps(caps_cache, key, s, m, n_types, L, fills[s], opts.allow_recompute) for s in flat
                }
                loose = None
                if with_loose:
                    # e.g. 1F1B's caps lie above ZB-H1's (its floors lie below them); the chunked
                    # schedules' (a chunk's activations, their own counts) may lie above either, and
                    # like 1F1B's they do not depend on k: one loose object
                    lkey = (key, m, "loose", schedules)
                    loose = caps_cache.get(lkey)
                    if loose is None:
                        loose = caps_cache[lkey] = StageCaps(
                            functools.reduce(np.maximum, [c.max_layers for c in shared.values()]),
                            functools.reduce(np.maximum, [c.max_layers_rc for c in shared.values()]),
                            min(fills.values()),
                        )
                    if loose.max_layers_rc[0] < 1:
                        continue  # not even one block fits a stage of this shape
                if kdep is not None:
                    tot = kdep.floor_key(np.array(ks), m=m, n_types=n_types).tolist()
                    # a total's caps are priced over the ranks of its most stages here (0 beyond):
                    # keyed by that count too, since another microbatch size with this shape
                    # (fewer data-parallel replicas fit, so fewer stages) reaches fewer ranks
                    most = dict(zip(tot, ks))  # ks ascend: the last k of each total is its most
                    want = [v for v in dict.fromkeys(tot) if (key, kdep, m, v, most[v]) not in caps_cache]
                    if want:
                        fkey = (kdep, "floors", m, n_types, L, tuple(want))  # no chip shape in it
                        floors = caps_cache.get(fkey)
                        if floors is None:
                            kk = np.array(want)[:, None] - n_types + 1  # a k with that key
                            floors = caps_cache[fkey] = kdep.count_floors(k=kk, m=m, n_types=n_types, L=L)
                        ranks = None
                        if np.ndim(floors[0][0]) == 2:  # a total's choices use only their stages' ranks
                            ranks = np.array([most[v] for v in want], dtype=np.int64)
                        ln, lr = _caps_at(caps_cache[key, 1], floors, L, opts.allow_recompute, ranks)
                        if ln.ndim == 1:  # floors that do not depend on the total
                            ln, lr = np.broadcast_to(ln, (len(want), L)), np.broadcast_to(lr, (len(want), L))
                        fill = fills[kdep]
                        for v, a, b in zip(want, ln, lr):
                            caps_cache[key, kdep, m, v, most[v]] = StageCaps(a, b, fill)
                    zb = {v: caps_cache[key, kdep, m, v, most[v]] for v in dict.fromkeys(tot)}  # by floor key
                else:
                    tot = [0.0] * len(ks)
                    zb = {0.0: None}
                # one caps dict per floor total (with the loosest caps under None), shared by its choices
                full: dict[float, dict[Schedule | None, StageCaps] | None] = {}
                if loose is not None:
                    for v, z in zb.items():
                        full[v] = {**shared, kdep: z, None: loose} if z is not None else {**shared, None: loose}
                else:
                    for v, z in zb.items():
                        caps = {**shared, kdep: z} if z is not None else shared
                        loose = StageCaps(
                            np.max([c.max_layers for c in caps.values()], axis=0),
                            np.max([c.max_layers_rc for c in caps.values()], axis=0),
                            min(fills.values()),
                        )
                        lkey = (key, m, loose.max_layers.tobytes(), loose.max_layers_rc.tobytes(), loose.fill_s)
                        loose = caps_cache.setdefault(lkey, loose)  # one object per value: one row of _Held
                        # not even one block fits a stage of this shape: no choice
                        full[v] = {**caps, None: loose} if loose.max_layers_rc[0] >= 1 else None
                layer_s = blk.fwd_s + blk.bwd_s
                name = chip.name
                choices.extend(
                    ChipChoice(name, k, d, t, layer_s, rc_s, full[v]) for k, v in zip(ks, tot) if full[v] is not None
                )
        choices.sort(key=lambda c: (-(c.stages / c.layer_s), c.stages, c.tensor))  # capability first
        out[chip.name] = choices  # never changed: shared by every search given `keep`
        if keep is not None:
            keep[mkey] = choices
    if opts.max_options_per_chip:
        out = beam(out, L, opts.max_options_per_chip)
    return out


def _schedule_caps(
    caps_cache: dict,
    key: tuple,
    schedule: Schedule,
    m: int,
    n_types: int,
    L: int,
    fill_s: float,
    allow_recompute: bool,
) -> StageCaps:
    """The caps of a chip shape (`key`: chip, tensor, sequences per device) under a schedule
    whose floors do not depend on its stage count k (all but ZB-H1), at m microbatches. The
    unsplit schedules' caps come from one table over the count awaiting B (:class:`_CapsByJ`);
    ZB-V's floors do not depend on m either: one pricing per shape."""
    hit = caps_cache.get((key, schedule, m))
    if hit is not None:
        return hit
    fkey = (schedule, "floors", m, n_types, L)  # the floors depend on no chip shape: once per search
    hit = caps_cache.get(fkey)
    if hit is None:
        floors = schedule.count_floors(k=1, m=m, n_types=n_types, L=L)
        # nothing awaits W: caps by j alone, the floors as indices into the table over j
        by_j = len(floors) == 1 and not floors[0][1].any()
        j_idx = floors[0][0].astype(np.intp) if by_j else None
        j_top = int(j_idx.max()) if by_j else 0
        floor_bytes = b"".join(np.ascontiguousarray(a).tobytes() for p in floors for a in p)
        hit = caps_cache[fkey] = (floors, j_idx, j_top, floor_bytes, schedule.chunks)
    floors, j_idx, j_top, floor_bytes, chunks = hit
    if j_idx is not None:
        by_j = caps_cache.get((key, chunks, "by j"))
        if by_j is None:
            by_j = caps_cache[key, chunks, "by j"] = _CapsByJ(caps_cache[key, chunks], L, allow_recompute)
        ln, lr = by_j(j_idx, j_top)
    else:
        fkey = (key, schedule, "floors", floor_bytes)
        if fkey not in caps_cache:
            caps_cache[fkey] = _caps_at(caps_cache[key, chunks], floors, L, allow_recompute)
        ln, lr = caps_cache[fkey]
    hit = caps_cache[key, schedule, m] = StageCaps(ln, lr, fill_s)
    return hit


def measured_rows(table: ProfileTable | None, chip: str, model: ModelShape) -> frozenset[tuple[int, int]]:
    """(tensor, sequences per device) of `chip` measured for `model` (empty: none, or no table)."""
    return table.measured_rows(chip, model) if table is not None and table.entries else frozenset()


class _Held:
    """Every choice of one chip type at once: how many blocks each holds within slot time b
    (the vectorised :meth:`ChipChoice.layers_within`) under one schedule (None: the loosest
    over the searched ones). Choices with one caps object (one (data, tensor), and under
    ZB-H1 one count floor) share their per-rank caps and differ only in how many stages
    they take, so a row per caps object and a running sum over its ranks give every choice
    (compiled: :class:`h2jax.plan._planner.Held`)."""

    def __init__(self, choices: Sequence[ChipChoice], schedule: Schedule | None = None):
        caps_of = [c.caps[schedule] for c in choices]
        # a row per caps object (their order is immaterial), drawn from its choice with the most stages
        keys, row = np.unique(np.array([id(c) for c in caps_of], dtype=np.int64), return_inverse=True)
        row = row.astype(np.int64)
        stages = np.array([c.stages for c in choices], dtype=np.int64)
        most = np.zeros(len(keys), dtype=np.int64)
        np.maximum.at(most, row, stages)
        picks = np.empty(len(keys), dtype=np.int64)  # per row, the index of its choice with the most stages
        picks[row[stages == most[row]]] = np.flatnonzero(stages == most[row])
        k = int(most.max())
        reps = [choices[i] for i in picks.tolist()]
        rep_caps = [caps_of[i] for i in picks.tolist()]
        beyond = np.arange(k)[None, :] >= most[:, None]  # ranks past the row's stage count hold nothing
        ln = np.stack([c.max_layers[:k] for c in rep_caps])
        lr = np.stack([c.max_layers_rc[:k] for c in rep_caps])
        ln[beyond] = 0.0
        lr[beyond] = 0.0
        self.a = np.array([c.layer_s for c in reps])
        self.fill = np.array([c.fill_s for c in rep_caps])  # bounds sum_s fill_s
        self.arc = np.array([c.layer_rc_s for c in reps])
        col = stages - 1
        self.amin = float(self.fill.min())
        self.kernel = _planner.Held(ln, lr, self.a, self.arc, row, col, self.fill[row])

    def each(self, b: float) -> np.ndarray:
        return self.kernel.each(b)

    def most(self, b: float) -> float:
        return self.kernel.most(b)

    def each_on(self, grid: np.ndarray) -> np.ndarray:
        """[choice, grid point]: :meth:`each` at every point of `grid`."""
        return self.kernel.each_on(np.ascontiguousarray(grid, dtype=np.float64))


def kept(keep: dict, choices: list[ChipChoice]) -> dict:
    """What searches keep of one list of :func:`chip_choices` in `keep` (a search's own, or
    shared between them with the lists: ``SearchCache.choices``): a dict beside the list, for
    what depends on it alone (:func:`held_of`, the embedding's and head's fills)."""
    key = ("kept", id(choices))
    hit = keep.get(key)
    if hit is None or hit[0] is not choices:  # the list is kept with it: its id is not reused
        hit = keep[key] = (choices, {})
    return hit[1]


def held_of(keep: dict, choices: list[ChipChoice], schedule: Schedule | None) -> _Held:
    """``_Held(choices, schedule)``, built once per list and schedule (:func:`kept`)."""
    out = kept(keep, choices)
    held = out.get(("held", schedule))
    if held is None:
        held = out["held", schedule] = _Held(choices, schedule)
    return held


def slot_time_bound(helds: Sequence[_Held], L: int) -> float:
    """The smallest slot time b at which the chip types together can hold all L blocks
    (each type with its best choice): no plan's slowest stage is faster. Bisection on a
    non-decreasing step function; the lower end is returned, so it never overshoots."""
    top = max(h.amin for h in helds) * L * 4 + 1e-12
    return _planner.slot_time_bound([h.kernel for h in helds], top, L)


def beam(
    choices: dict[str, list[ChipChoice]], L: int, width: int, helds: Sequence[_Held] | None = None
) -> dict[str, list[ChipChoice]]:
    """Per chip type the `width` choices that hold the most blocks at the slot time the
    whole cluster's bound needs (memory-capped capability, not raw speed). `helds`: the
    choices' :class:`_Held` (loosest caps), in the order of `choices`, where the caller has them."""
    if any(not cs for cs in choices.values()):
        return choices
    helds = dict(zip(choices, helds)) if helds is not None else {name: _Held(cs) for name, cs in choices.items()}
    b_star = slot_time_bound(list(helds.values()), L)
    out = {}
    for name, cs in choices.items():
        held = helds[name].each(b_star) if math.isfinite(b_star) else np.zeros(len(cs))
        rank = sorted(range(len(cs)), key=lambda i: (-float(held[i]), cs[i].stages, cs[i].tensor))
        out[name] = [cs[i] for i in rank[:width]]
    return out


def chip_orders(cluster: Cluster, opts: SearchOptions) -> list[tuple[str, ...]]:
    """Stage orders of the chip types to try; the memory-descending one first."""
    by_mem = tuple(p.name for p in sorted(cluster.profiles.values(), key=lambda p: (-p.memory_gib, p.name)))
    if opts.orders == "memory":
        return [by_mem]
    if math.factorial(len(by_mem)) <= opts.max_orders:
        rest = [o for o in itertools.permutations(by_mem) if o != by_mem]
        return [by_mem, *rest]
    return order_neighbourhood(cluster)


def is_memory_descending(plan: Plan, cluster: Cluster) -> bool:
    mems = [cluster.profile(s.chip).memory_gib for s in plan.stages]
    return all(a >= b for a, b in zip(mems, mems[1:]))


def order_neighbourhood(cluster: Cluster) -> list[tuple[str, ...]]:
    """Memory-descending (the paper's rule), its adjacent swaps, reversed, and by speed either way."""
    by_mem = tuple(p.name for p in sorted(cluster.profiles.values(), key=lambda p: (-p.memory_gib, p.name)))
    swaps = []
    for i in range(len(by_mem) - 1):
        o = list(by_mem)
        o[i], o[i + 1] = o[i + 1], o[i]
        swaps.append(tuple(o))
    by_speed = tuple(p.name for p in sorted(cluster.profiles.values(), key=lambda p: (p.peak_tflops, p.name)))
    out = [by_mem, *swaps, tuple(reversed(by_mem)), by_speed, tuple(reversed(by_speed))]
    return list(dict.fromkeys(out))


def build_plan(
    seq: Sequence[ChipChoice],
    layers: Sequence[int],
    recompute: Sequence[bool],
    *,
    global_batch: int,
    num_microbatches: int,
    schedule: Schedule,
) -> Plan:
    stages, start = [], 0
    for c, n, rc in zip(seq, layers, recompute):
        stages.append(
            StageSpec(chip=c.chip, layers=(start, start + n), data=c.data, tensor=c.tensor, recompute=bool(rc))
        )
        start += n
    if schedule.chunks > 1:  # each stage's blocks as even chunks where the schedule puts them
        one = Plan(stages=tuple(stages), global_batch=global_batch, num_microbatches=num_microbatches)
        return chunked_variant(one, schedule)
    return Plan(stages=tuple(stages), global_batch=global_batch, num_microbatches=num_microbatches, schedule=schedule)
