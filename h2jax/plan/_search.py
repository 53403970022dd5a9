"""HeteroAuto: search the plan space of a heterogeneous cluster for the fastest plan that fits.

The space (the exhaustive enumerator in this module walks exactly the same one):

- microbatch size mb: a divisor of the global batch (m = global_batch / mb microbatches);
- stage order across chip types: every permutation (memory-descending is the paper's rule;
  the search confirms or beats it), all stages of one chip type contiguous;
- per chip type c: its number of stages k_c and tensor degree t_c (dividing heads, d_ff and
  vocab; at most a node); the data degree follows from the device count: the largest
  d <= devices_c / (k_c t_c) that divides mb (and, with ``stage_in_node``, lets k_c stages
  of d x t_c devices pack into the chip's nodes). With ``group_size`` g the chips of a type
  are handled g at a time: k_c <= ceil(devices_c / g) (a restriction for experts: the
  defaults search without it);
- per stage: its number of layers (>= 1, summing to the model's) and its recompute flag.

- the schedule, among every one the runtime runs (``SearchOptions.schedules``; GPipe only where
  1F1B is not offered: same time, more memory): ZB-H1's split backward shortens the fill
  and drain but keeps more activations alive, so where memory is tight 1F1B wins; the
  chunked ones (interleaved with each v of ``SearchOptions.interleaved_chunks``, zb-v with 2)
  shorten them further for more activations, program calls and boundary crossings, and
  need a block per chunk on every stage (a stage's blocks become even chunks,
  :func:`h2jax.plan.chunked_variant`) and their microbatch counts (interleaved: a multiple of
  the stage count; zb-v: at least 2p - 1). Internally interleaved with v chunks is the
  schedule object ``Interleaved(v)`` (label ``interleaved:v``).

Objective: the cost model's iteration time (:mod:`h2jax.plan._cost`); constraint: every
stage fits its chip's memory. Per configuration and order each schedule is solved in turn
(split ones first, so the faster sets the bar); every schedule's T_pipe has the same shape
(``(m - 1) max t + sum fill + max end``, fill and end non-decreasing in the layer count: affine,
but for zb-v's maximum of affine terms, priced at every count), so the exact round below
covers them unchanged (a chunked stage's fill is infinite below one block per chunk). Every bound below
is taken per schedule, with that schedule's memory caps (its ``count_floors``) and fills,
and a schedule is solved only where its own bound leaves it a chance: ZB-H1's shorter fill
does not loosen the bound of configurations where its extra memory cannot fit.

Why the exact round is exact. For a fixed (mb, per-chip choice, order) every stage's time,
tail and memory are affine in its layer count, and time and tail grow with it, so the exact
optimum of ``(m - 1) max_s t_s + sum_s t_s + transfers + max_s g_s`` over layer splits and
recompute flags is found by enumerating thresholds B >= max t and G >= max g in increasing
order and solving ``min sum t`` under the per-stage layer caps they imply with a min-plus
dynamic program (compiled: :mod:`h2jax.plan._planner`), stopping as soon as
``(m - 1) B + G + min sum t`` cannot beat the best. Per-chip choices are walked depth first,
every order for each; a configuration is skipped only when a lower bound of every plan it
can give -- ``(m - 1) B_lb + L min_s a_s`` plus the cheapest embedding and head, with B_lb
the slot time below which its stages cannot hold the L whole blocks within their memory
(:meth:`ChipChoice.layers_within`: a stage with l blocks takes at least l a_s, and holds
no more than its memory allows with the fewest microbatches its rank allows in flight: under
1F1B the r-th fewest of a chip type's k stages holds at least min(r, m)) -- cannot beat the
best plan found so far, under every schedule. Nothing else is cut, so when the exact round
ends every plan of the space was priced or bounded out: the result says ``exhaustive``, and
the tests hold it to a brute force over the same space on 60 random instances, and on 20
more with the shared-host term.

Effort (``SearchOptions.auto``, the default). The exact round is taken at once when the
space has at most EXACT_DIRECT (microbatch, configuration, order) triples. Otherwise the
search runs rounds of growing cost, each pruning with the best plan so far, and keeps the
best plan between them (anytime: a budget that runs out mid-round returns it):
seeds (per microbatch size, each chip type's choice that holds the most blocks at the
slot-time bound, and every chip type with the same stage count K for K = 1, 2, 3, 4, 6, 8,
...: the stage count is what that ranking judges worst), in an order neighbourhood
(memory-descending, its adjacent swaps, reversed, by speed); coordinate descent from the
best configuration and the two best other seeds (a chip type's stage count and tensor
degree together, or the microbatch size, while that helps; then the order, by the
neighbourhood and adjacent swaps); beams of the best 2, 3, 4, 8, ... choices per chip type
by the same ranking, each followed by coordinate descent; last the exact round, which the
incumbent lets prune hard. Before the exact round a configuration's chunked schedules are
solved only in the stage order its one-chunk schedules found best (a heuristic, like those
rounds; the exact round tries every order under every schedule).
The search stops at the exact round's end (exhaustive), at the
time budget, or -- in a space of more than EXACT_AFTER_LOCAL triples -- when two beam
rounds in a row found nothing better after 15 % of the budget (converged, not exhaustive). How near that is to the optimum is measured, not
proven: on instances of 64-256 chips whose whole space the exact search covers in seconds
(tests/plan/test_search_effort.py) the defaults' plan is within 2 % of the enumerated
optimum, and ``benchmarks/planner_scale.py`` prints the same study beside the large
clusters.

The lower bound reported with the result (:func:`root_bound`) holds for the whole space:
per microbatch size, the slot-time bound with every chip type at its best choice, plus the
pipeline's fill and drain -- ``sum_s t_s`` at least the cheapest split of the L blocks over
the chip types (each at least one) within their memory-capped capacities at that slot time
-- plus the cheapest embedding and head; per schedule, the least over the schedules. A
microbatch size (or one schedule at it) whose bound cannot beat the best plan so far is
skipped by every round. ZB-H1's caps know a chip type's own stage count k only (every
stage holds at least min(p, m) + 1 microbatches awaiting B or W, with p >= k + the other
chip types), so its bound stays looser than 1F1B's where its memory would not fit. On the mid-size instances the optimum itself
sits some 20-80 % above it (the bound ignores transfers, tails and that the stages of all chip
types share one sequence of in-flight counts), so a gap of that size at scale is the
bound's, not necessarily the search's.

Shared hosts (emulated chips, whose stages all compute on one machine's cores): the cost
model lengthens the steady-state period to the time the host's cores take to run one
microbatch of every stage at once, and bounds the step by W_h / C_h (``h2jax.plan._cost``);
both depend on the configuration (data degrees, stage count, microbatches: program calls)
far more than on the layer split. The search finds each configuration's T_pipe-optimal
split as above, improves it by the full estimate (:func:`polish_split`: give a layer of one
stage to another or flip a recompute flag while that helps) and ranks configurations by
that; pruning stays valid (every bound is below T_pipe, which is below the full estimate).
Exact for T_pipe; with contention the hill climb is not proven optimal, but on 80 random
shared-host instances (1, 2 or 4 cores) it matched the brute force on all 80; 20 of them
are in the tests.
"""

from __future__ import annotations

import functools
import gc
import itertools
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from h2jax.plan import _planner
from h2jax.plan._cost import (
    CostOptions,
    PlanCost,
    estimate,
    expand_chunks,
    layer_fill_s,
    memory_limit,
    part_costs,
    part_fill_s,
    searched_schedules,
    stage_cost,
    stage_memory,
    transfer_s,
)
from h2jax.plan._plan import (
    INTERLEAVED_CHUNKS,
    Plan,
    PlanError,
    StageSpec,
    chunked_variant,
)
from h2jax.plan._profiles import ChipProfile, Cluster, ModelShape, ProfileTable
from h2jax.plan.schedules import Schedule, as_schedule, schedule_names

INF = math.inf
DEFAULT_TIME_BUDGET_S = 3.0  # what `h2jax plan` allows the search without --time-budget
PATIENCE = 0.15  # share of the budget after which two beam rounds without improvement end an auto search
EXACT_DIRECT = 4000
EXACT_AFTER_LOCAL = 200_000  # ... below which auto does not stop before its exact round, budget allowing
SEED_SLACK = 1.25  # seeds within this factor of the best plan so far are priced (and may start a climb)
LOCAL_STARTS = 3  # coordinate descent starts from the best configuration and the best other seeds  # (microbatch, configuration, order) triples below which auto goes straight to exact


@dataclass(frozen=True)
class SearchOptions:
    """The space HeteroAuto searches, and how.

    schedule: one schedule the plans use (any of `schedules`); None: the search
        chooses among `schedules` as one more dimension of the space.
    schedules: the schedules a free search chooses among (names, schedule files or
        :class:`~h2jax.plan.schedules.Schedule` objects); by default every registered family
        (``h2jax.plan.schedule_names()``: gpipe, 1f1b, zb-h1, interleaved with each v of
        `interleaved_chunks`, zb-v), as ``h2jax plan``. The one-chunk ones alone search a
        third faster, with a higher lower bound (the chunked ones' short fills lower it).
        GPipe is skipped beside 1F1B: the cost model gives it 1F1B's time with at least
        1F1B's memory, so it never wins.
    interleaved_chunks: the chunk counts v (each >= 2) the search tries wherever it searches
        interleaved: more chunks shorten the fill and drain (t / v per stage) for more
        activations, program calls and transfers, and need v blocks per stage.
    microbatch_sizes: candidate microbatch sizes (sequences); None: every divisor of the
        global batch up to `max_microbatch`.
    max_stages_per_chip: cap on k_c; None: up to the layer count.
    group_size: handle chips of a type this many at a time (k_c <= ceil(devices / g));
        None: no grouping (k_c up to devices / t_c).
    stage_in_node: a stage lives inside one node (single-process runs, emulated chips);
        False: a stage may span nodes (data axis across nodes, tensor axis inside one).
    orders: "all" permutations of the chip types (capped by `max_orders`, beyond which
        :func:`order_neighbourhood` is tried: the search is then not exhaustive), or
        "memory" (memory-descending only: the paper's rule).
    allow_recompute: let stages recompute activations in the backward.
    max_options_per_chip: keep only the best this-many (k_c, t_c) choices per chip type by
        memory-capped capability (a beam, fixed by hand; None: all, which is exact).
    auto: let the search set its own effort (module docstring, "Effort"): exact in one
        round where the space is small, else rounds of growing beams over an order
        neighbourhood, then the exact space, until the space is covered, the rounds stop
        improving, or the time budget is spent. False: one round over exactly this space.
    measured_only: where the profile table holds measured rows of a chip type for the
        model's shape, that chip type's stages use only its measured (tensor degree,
        sequences per device): the plan is then priced by measurements alone, not by a
        roofline estimate of a row nobody timed (an estimate beside measured neighbours
        ranks by a different yardstick: on emulated chips it reads the spec sheet, not this
        host). Chip types with no measured row are priced by the roofline either way. False:
        every row, the unmeasured ones by the roofline (the result says which stages).
    time_budget_s: wall-clock seconds the search may take. Past it the search returns the
        best plan found so far, marked not exhaustive (and computes the lower bound then, if
        the budget ran out before it: a fraction of a second at 10,000 chips). None: no
        limit, and no convergence stop either: the search runs until the exact round ends
        (hours on 10,000 chips).
    """

    schedule: Schedule | str | None = None
    schedules: tuple[Schedule | str, ...] = schedule_names()
    interleaved_chunks: tuple[int, ...] = INTERLEAVED_CHUNKS
    microbatch_sizes: tuple[int, ...] | None = None
    max_microbatch: int | None = None
    max_stages_per_chip: int | None = None
    group_size: int | None = None
    stage_in_node: bool = False
    orders: str = "all"
    max_orders: int = 120
    allow_recompute: bool = True
    max_options_per_chip: int | None = None
    measured_only: bool = True
    auto: bool = True
    time_budget_s: float | None = DEFAULT_TIME_BUDGET_S
    cost: CostOptions = field(default_factory=CostOptions)


@dataclass(eq=False, slots=True)  # never changed once built: its identity names a _Held row
class StageCaps:
    """Under one schedule (or all of a search's, the loosest): most blocks each stage rank of a
    chip type's choice holds within its memory (ranks fewest-microbatches-held first; a choice
    of k stages uses the first k), and the least a block adds to sum_s fill_s."""

    max_layers: np.ndarray  # per rank, without recompute
    max_layers_rc: np.ndarray  # ... with recompute
    fill_s: float


@dataclass(eq=False, slots=True)  # identity: one object per choice of a search, hashed often; never changed
class ChipChoice:
    """One chip type's part of a configuration: k stages of data x tensor devices."""

    chip: str
    stages: int
    data: int
    tensor: int
    layer_s: float  # forward + backward seconds of one block per microbatch (no recompute)
    layer_rc_s: float = INF  # the same with recompute (one more forward)
    # per searched schedule, and None: the loosest over them (the per-rank max, the least fill)
    caps: dict[str | None, StageCaps] = field(default_factory=dict)

    @property
    def fill_s(self) -> float:
        """What one block adds at least to sum_s fill_s (``h2jax.plan._cost.schedule_terms``)
        under any searched schedule: its fwd + bwd, less the W it hides in a split schedule."""
        return self.caps[None].fill_s

    @property
    def capability(self) -> float:
        """Layers per second this chip type's stages process together (sum of 1 / a_s)."""
        return self.stages / self.layer_s

    def bounds(self, schedule: Schedule | None = None) -> StageCaps:
        """This choice's caps and fill under `schedule` (None: the loosest over the searched ones)."""
        return self.caps[schedule]

    def layers_within(self, b: np.ndarray, schedule: Schedule | None = None) -> np.ndarray:
        """Upper bound on the blocks these stages can hold if no stage may take longer than `b`.

        A stage with l <= max_layers blocks takes >= l * layer_s, so l <= floor(b / layer_s);
        with more it must recompute and takes >= l * layer_rc_s; it never holds more than
        max_layers_rc. Whole blocks only: the floor is what makes the bound see that 96
        layers over 16 stages cannot be split finer than one block (rounded up by a hair so
        floating-point noise can only loosen it).
        """
        caps = self.bounds(schedule)
        if isinstance(b, float):  # one slot time (the search's pruning asks thousands of times)
            return _planner.blocks_within(
                caps.max_layers, caps.max_layers_rc, self.stages, b, self.layer_s, self.layer_rc_s
            )
        b = np.asarray(b, dtype=np.float64)
        ln = np.asarray(caps.max_layers[: self.stages], dtype=np.float64).reshape((-1,) + (1,) * b.ndim)
        lr = np.asarray(caps.max_layers_rc[: self.stages], dtype=np.float64).reshape((-1,) + (1,) * b.ndim)
        xn = np.floor(b / self.layer_s * (1 + 1e-9))
        xr = np.floor(b / self.layer_rc_s * (1 + 1e-9)) if math.isfinite(self.layer_rc_s) else np.zeros_like(b)
        return np.maximum(np.minimum(ln, xn), np.minimum(lr, xr)).sum(axis=0)


@dataclass
class SearchResult:
    plan: Plan | None
    cost: PlanCost | None
    iteration_s: float
    lower_bound_s: float
    search_s: float
    configs_seen: int = 0
    configs_solved: int = 0
    orders_solved: int = 0
    dp_solves: int = 0
    memory_descending: bool | None = None
    note: str = ""
    exhaustive: bool = False  # every plan of the space was priced or excluded by a lower bound
    rounds: tuple[str, ...] = ()  # what each round of the search covered, in order
    found_s: float = INF  # seconds into the search when the returned plan was found (the rest found nothing better)

    @property
    def gap(self) -> float:
        """(estimate - lower bound) / lower bound."""
        return self.iteration_s / self.lower_bound_s - 1.0 if self.plan is not None else INF


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
) -> dict[str, list[ChipChoice]]:
    """Every (k, data, tensor) of every chip type for this microbatch size, with the memory
    caps of its stages under each searched schedule (its ``count_floors``) at
    `num_microbatches`.

    `caps_cache`: the memory model by (chip, tensor, sequences per device), which is all it
    depends on, and the caps by counts, shared between microbatch sizes.
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
                    want = [v for v in dict.fromkeys(tot) if (key, kdep, m, v) not in caps_cache]
                    if want:
                        fkey = (kdep, "floors", m, n_types, L, tuple(want))  # no chip shape in it
                        floors = caps_cache.get(fkey)
                        if floors is None:
                            kk = np.array(want)[:, None] - n_types + 1  # a k with that key
                            floors = caps_cache[fkey] = kdep.count_floors(k=kk, m=m, n_types=n_types, L=L)
                        ranks = None
                        if np.ndim(floors[0][0]) == 2:  # a total's choices use only their stages' ranks
                            most = dict(zip(tot, ks))  # ks ascend: the last k of each total is its most
                            ranks = np.array([most[v] for v in want], dtype=np.int64)
                        ln, lr = _caps_at(caps_cache[key, 1], floors, L, opts.allow_recompute, ranks)
                        if ln.ndim == 1:  # floors that do not depend on the total
                            ln, lr = np.broadcast_to(ln, (len(want), L)), np.broadcast_to(lr, (len(want), L))
                        fill = fills[kdep]
                        for v, a, b in zip(want, ln, lr):
                            caps_cache[key, kdep, m, v] = StageCaps(a, b, fill)
                    zb = {v: caps_cache[key, kdep, m, v] for v in dict.fromkeys(tot)}  # by floor key
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
        out[chip.name] = choices
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

    def __init__(self, model: ModelShape, cluster: Cluster, table: ProfileTable | None, opts: SearchOptions):
        self.model, self.cluster, self.table, self.opts = model, cluster, table, opts
        L = model.n_layers
        self.L = L
        self.layers = np.arange(L + 1, dtype=np.float64)
        self._tables: dict[tuple, _planner.Pricing] = {}
        self._by_choice: dict[tuple, _planner.Pricing] = {}  # a search's choices live as long as it does
        self._counts: dict[tuple, np.ndarray] = {}
        self._xfer: dict[tuple, float] = {}
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


# -- the search ------------------------------------------------------------------------------


class _Bounds:
    """Lower bounds of one microbatch size: total work over total (memory-capped) capability.

    On a geometric grid of slot times B (from the slot-time bound of all these choices up),
    each choice's `layers_within(B)` is tabulated; a set of choices needs B >= the first
    grid point where they hold all L layers, so the grid point before it bounds max_s t_s
    from below. The bound is ``(m - 1) B_lb + L min_s a_s + fixed_s`` (sum_s fill_s >= L times
    the least per-block fill, plus the cheapest embedding and head), with the caps and fills of
    `schedule` (None: the loosest over the searched schedules).
    """

    POINTS = 1000

    def __init__(
        self,
        choices: dict[str, list[ChipChoice]],
        names: Sequence[str],
        m: int,
        mb: int,
        L: int,
        *,
        schedule: Schedule | None = None,
        fixed_s: float = 0.0,
    ):
        self.m, self.mb, self.L, self.fixed_s = m, mb, L, fixed_s
        self.lists = [choices[n] for n in names]
        helds = [_Held(cs, schedule) for cs in self.lists]
        self.floor = slot_time_bound(helds, L)
        amax = max(c.layer_rc_s if math.isfinite(c.layer_rc_s) else c.layer_s for cs in self.lists for c in cs)
        top = max(amax * L * 1.01, self.floor * 1.01) if math.isfinite(self.floor) else amax * L * 1.01
        lo = self.floor if math.isfinite(self.floor) and self.floor > 0 else top * 1e-6
        self.grid = np.geomspace(lo, top, self.POINTS)
        self.grids = [h.each_on(self.grid) for h in helds]
        n = len(self.lists)
        self.suffix = [np.zeros_like(self.grid) for _ in range(n + 1)]
        self.suffix_amin = [INF] * (n + 1)
        for i in range(n - 1, -1, -1):
            self.suffix[i] = self.suffix[i + 1] + np.max(self.grids[i], axis=0)
            self.suffix_amin[i] = min(self.suffix_amin[i + 1], min(c.caps[schedule].fill_s for c in self.lists[i]))
        self.fills = [[c.caps[schedule].fill_s for c in cs] for cs in self.lists]
        self.root = self.bound(self.suffix[0], self.suffix_amin[0])

    def bound(self, held: np.ndarray, amin: float) -> float:
        idx = int(np.searchsorted(held, self.L - 1e-9, side="left"))  # held is non-decreasing in B
        if idx >= len(self.grid) or not math.isfinite(self.floor):
            return INF  # cannot hold the model at any slot time
        b_lb = float(self.grid[idx - 1]) if idx > 0 else self.floor
        return (self.m - 1) * b_lb + self.L * amin + self.fixed_s


class _OutOfTime(Exception):
    """The time budget is spent: the round in progress stops where it is."""


def root_bound(
    choices: dict[str, list[ChipChoice]],
    *,
    m: int,
    L: int,
    fixed_s: float = 0.0,
    schedule: Schedule | None = None,
    helds: Sequence[_Held] | None = None,
) -> float:
    """A lower bound on every plan of one microbatch size (any configuration, any order).

    ``T >= (m - 1) B + sum_s t_s`` with B = max_s t_s. B is at least the slot time at which
    the chip types, each with its best choice, hold all L whole blocks within their memory
    (:func:`slot_time_bound`). For any B, the blocks cost at least F(B): the cheapest way to
    give each chip type x_c >= 1 blocks (every chip type of the space has a stage), sum x_c =
    L, where x blocks on type c cost at least x times the per-block time of the fastest of
    its choices that can hold x blocks within slot time B and memory (a min-plus dynamic
    program over the types: the pipeline's fill and drain priced with the memory limits
    kept). T(B) is minimised over a grid above the slot-time bound, each interval
    [B_i, B_i+1] counted at its cheapest: ``(m - 1) B_i + F(B_i+1)``. `fixed_s`: seconds
    every plan pays beyond the blocks (the cheapest embedding and head). `schedule`: the
    plans of that schedule, with its memory caps and fills (None: of every searched
    schedule, with the loosest). `helds`: the choices' :class:`_Held` under `schedule`, where
    the caller has them.
    """
    if any(not cs for cs in choices.values()):
        return INF
    helds = [_Held(cs, schedule) for cs in choices.values()] if helds is None else helds
    b_lb = slot_time_bound(helds, L)
    if not math.isfinite(b_lb):
        return INF
    amin = min(h.amin for h in helds)
    kernels = [h.kernel for h in helds]

    def fill(b: float) -> float:
        return _planner.least_block_seconds(kernels, b, L)

    if m == 1:
        return max(b_lb, L * amin) + fixed_s
    # above b_top no slot time can pay for itself: (m - 1) b_top + L amin is what the
    # slowest feasible slot already costs
    b_feasible = b_lb * (1 + 1e-7) + 1e-15
    f_feasible = fill(b_feasible)
    if not math.isfinite(f_feasible):  # the first slot time with a split: growing steps, then bisection
        # at b_all every choice holds all its memory allows: no split there, none at all (a chip
        # type that cannot hold a block under this schedule, though the others hold the model)
        b_all = 2 * L * max(float(np.where(np.isfinite(h.arc), h.arc, h.a).max()) for h in helds)
        if not math.isfinite(fill(b_all)):
            return INF
        lo, step = b_feasible, 0.01
        while not math.isfinite(f_feasible):
            lo, b_feasible = b_feasible, min(b_feasible * (1 + step), b_all)
            f_feasible, step = fill(b_feasible), step * 2
        for _ in range(12):
            mid = 0.5 * (lo + b_feasible)
            f_mid = fill(mid)
            if math.isfinite(f_mid):
                b_feasible, f_feasible = mid, f_mid
            else:
                lo = mid
    b_top = b_feasible + max(0.0, f_feasible - L * amin) / (m - 1)
    grid = np.linspace(b_lb, b_top, 17)
    best = (m - 1) * float(grid[-1]) + L * amin
    f_last = fill(float(grid[-1]))
    for i in range(len(grid) - 1):
        if (m - 1) * float(grid[i]) + f_last >= best:
            break  # F only falls with B: no later interval can do better
        best = min(best, (m - 1) * float(grid[i]) + fill(float(grid[i + 1])))
    return max(best, (m - 1) * b_lb + L * amin) + fixed_s


def _fixed_parts_s(
    cluster: Cluster,
    model: ModelShape,
    choices: dict[str, list[ChipChoice]],
    mb: int,
    table: ProfileTable | None,
    schedules: Sequence[Schedule] = (),
) -> float:
    """The cheapest embedding plus the cheapest head (fwd + bwd, less the W a split schedule
    hides) over every choice: stage 0 and the last stage run them besides their blocks,
    whatever the plan."""
    emb, head = INF, INF
    for name, cs in choices.items():
        chip = cluster.profile(name)
        for t, d in {(c.tensor, c.data) for c in cs}:
            parts = part_costs(model, chip, table, tensor=t, microbatch_per_device=max(1, mb // d))
            for part in ("embed", "head"):
                fill = part_fill_s(model, part, parts[part], tensor=t, schedules=schedules)
                emb, head = (min(emb, fill), head) if part == "embed" else (emb, min(head, fill))
    return (emb if math.isfinite(emb) else 0.0) + (head if math.isfinite(head) else 0.0)


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


class _Run:
    """One search: the best plan so far (kept across rounds, so every round prunes with it),
    the caches, and the clock."""

    def __init__(self, cluster, model, global_batch, table, opts: SearchOptions, deadline: float, start: float):
        self.cluster, self.model, self.gb, self.table, self.opts = cluster, model, global_batch, table, opts
        self.deadline, self.start = deadline, start
        self.found_s = INF  # when the best plan so far was found, in seconds from `start`
        self.L = model.n_layers
        self.names = cluster.names
        self.solver = _Solver(model, cluster, table, opts)
        # split schedules first: the fastest of a configuration sets the bar the others must beat
        self.schedules = sorted(searched_labels(opts), key=lambda s: not s.split_backward)
        self.shared = opts.cost.host_contention and has_shared_host(cluster)
        self.best = INF
        self.best_plan: tuple | None = None
        self.best_config: tuple[tuple[ChipChoice, ...], int] | None = None
        self.stats = {"configs": 0, "solved": 0, "orders": 0}
        self.ticks = 0
        self._keyed_cache: dict[int, dict] = {}
        self.mb_bound: dict[int, float] = {}
        self.schedule_bound: dict[tuple[int, str], float] = {}  # (mb, schedule) -> root bound of its plans
        self._fixed: dict[tuple[int, str], float] = {}
        self._shapes: dict[int, dict[str, list[ChipChoice]]] = {}  # per mb, one choice per (tensor, data)
        self.starts: list[tuple[float, tuple[ChipChoice, ...], int, tuple[str, ...], str]] = []
        self.last_schedule: Schedule | None = None  # the schedule of evaluate's result
        self._ranked_cache: dict[int, dict] = {}
        self._helds: dict[tuple[int, str | None], list[_Held]] = {}
        self._memo: dict[tuple, tuple] = {}  # evaluate's results by (config, mb, orders, schedules, screen)
        space_opts = SearchOptions(**{**_fields(opts), "max_options_per_chip": None})
        self.space: dict[int, dict[str, list[ChipChoice]]] = {}
        caps_cache: dict = {}
        for mb in microbatch_sizes(global_batch, opts):
            choices = chip_choices(
                cluster, model, mb, space_opts, table, caps_cache, num_microbatches=global_batch // mb
            )
            if all(choices[n] for n in self.names):
                self.space[mb] = choices
            self.tick()

    def tick(self) -> None:
        if time.perf_counter() > self.deadline:
            raise _OutOfTime

    def size(self, width: int | None, n_orders: int) -> int:
        """(microbatch, configuration, order) triples of a round with this beam."""
        total = 0
        for choices in self.space.values():
            total += math.prod(len(cs) if width is None else min(width, len(cs)) for cs in choices.values())
        return total * n_orders

    def quick_bounds(self) -> None:
        """A first lower bound per microbatch size, cheap enough to order the first round by:
        ``(m - 1) B_lb + L min a`` (the slot-time bound alone)."""
        for mb in self.space:
            helds = self.helds(mb, None)
            b = slot_time_bound(helds, self.L)
            self.mb_bound[mb] = (self.gb // mb - 1) * b + self.L * min(h.amin for h in helds)
            self.tick()

    def helds(self, mb: int, schedule: Schedule | None) -> list[_Held]:
        """The :class:`_Held` of every chip type's choices at microbatch `mb` under `schedule`."""
        key = (mb, schedule)
        hit = self._helds.get(key)
        if hit is None:
            hit = self._helds[key] = [_Held(cs, schedule) for cs in self.space[mb].values()]
        return hit

    def fixed_s(self, mb: int, schedule: Schedule) -> float:
        """The cheapest embedding and head's fill under `schedule` at microbatch `mb`."""
        key = (mb, schedule)
        hit = self._fixed.get(key)
        if hit is None:
            shapes = self._shapes.get(mb)  # one choice per (tensor, data): all the embedding and head depend on
            if shapes is None:
                shapes = self._shapes[mb] = {
                    n: list({(c.tensor, c.data): c for c in cs}.values()) for n, cs in self.space[mb].items()
                }
            hit = _fixed_parts_s(self.cluster, self.model, shapes, mb, self.table, (schedule,))
            self._fixed[key] = hit
        return hit

    def lower_bound(self, *, timed: bool = True) -> float:
        """:func:`root_bound` over every microbatch size, per schedule with its own memory caps
        and fills, the least over the schedules (each kept: a size or a schedule whose bound
        cannot beat the best plan so far is skipped by every round). A size whose bound with
        the loosest caps and fills of every schedule cannot beat the best plan already is not
        bounded per schedule: that bound holds for each of them."""
        for mb, choices in self.space.items():
            m = self.gb // mb
            fixed = min(self.fixed_s(mb, s) for s in self.schedules)
            loose = (
                root_bound(choices, m=m, L=self.L, fixed_s=fixed, helds=self.helds(mb, None))
                if len(self.schedules) > 1
                else -INF
            )
            if loose >= self.best:
                self.schedule_bound.update({(mb, s): loose for s in self.schedules})
            else:
                for schedule in self.schedules:
                    self.schedule_bound[mb, schedule] = root_bound(
                        choices,
                        m=m,
                        L=self.L,
                        fixed_s=self.fixed_s(mb, schedule),
                        schedule=schedule,
                        helds=self.helds(mb, schedule),
                    )
                    if timed:
                        self.tick()
            self.mb_bound[mb] = min(self.schedule_bound[mb, s] for s in self.schedules)
        return min(self.mb_bound.values(), default=INF)

    def hopeless(self, mb: int) -> bool:
        return self.mb_bound.get(mb, 0.0) >= self.best

    def live(self, mb: int, limit: float) -> list[str]:
        """The schedules whose plans at microbatch `mb` may beat `limit` by their root bound."""
        return [s for s in self.schedules if self.schedule_bound.get((mb, s), 0.0) < limit]

    def beats(self, config: Sequence[ChipChoice], mb: int, m: int, schedule: Schedule, limit: float) -> bool:
        """Whether a plan of `config` under `schedule` may beat `limit`: T >= (m - 1) max_s t_s +
        sum_s fill_s, so it needs a slot time b = (limit - L min fill - embedding and head) /
        (m - 1) at which the config's stages hold all L blocks within their memory caps."""
        rest = limit - self.L * min(c.caps[schedule].fill_s for c in config) - self.fixed_s(mb, schedule)
        if rest <= 0:
            return False
        if m == 1:
            return True
        b = rest / (m - 1)
        return sum(float(c.layers_within(b, schedule)) for c in config) >= self.L

    def round(self, width: int | None, orders: Sequence[tuple[str, ...]], *, quick: bool = False) -> None:
        """Every configuration of the beam `width` (None: all) in every order of `orders`
        (`quick`: in the best plan's order and the first of `orders` only), pruned by the
        bounds against the best plan so far."""
        per_mb = []
        for mb, choices in self.space.items():
            if self.hopeless(mb):
                continue
            if width is not None:
                choices = beam(choices, self.L, width, self.helds(mb, None))
            live = self.live(mb, self.best)
            # one schedule left: its own caps and fills; several: the loosest over them
            one = live[0] if len(live) == 1 else None
            fixed = min(self.fixed_s(mb, s) for s in live)
            per_mb.append(_Bounds(choices, self.names, self.gb // mb, mb, self.L, schedule=one, fixed_s=fixed))
            self.tick()
        per_mb.sort(key=lambda bd: bd.root)
        for bd in per_mb:
            if bd.root >= self.best:
                break
            self._dfs(bd, list(orders), quick)

    def _keyed(self, mb: int) -> dict[str, dict[tuple[int, int], ChipChoice]]:
        """Per chip type, its choices at microbatch `mb` by (stages, tensor)."""
        hit = self._keyed_cache.get(mb)
        if hit is None:
            hit = {n: {(c.stages, c.tensor): c for c in cs} for n, cs in self.space[mb].items()}
            self._keyed_cache[mb] = hit
        return hit

    def _ranked(self, mb: int) -> dict[str, list[ChipChoice]]:
        """Per chip type, its choices by the blocks they hold at the slot-time bound (best first)."""
        hit = self._ranked_cache.get(mb)
        if hit is None:
            widest = max(len(cs) for cs in self.space[mb].values())
            hit = beam(self.space[mb], self.L, widest, self.helds(mb, None))
            self._ranked_cache[mb] = hit
        return hit

    def seeds(self, orders: Sequence[tuple[str, ...]]) -> None:
        """A few configurations per microbatch size: each chip type's best-ranked choice, and
        every chip type with the same stage count K (its best-ranked choice with K stages)
        for K = 1, 2, 3, 4, 6, 8, ...: the stage count is the dimension the ranking judges
        worst (more stages hold more blocks, but the first ones hold more microbatches)."""
        by_bound = sorted(self.space, key=lambda b: self.mb_bound.get(b, 0.0))
        for mb in by_bound:  # a first plan fast (anytime: a short budget still gets one)
            if math.isfinite(self.best):
                break
            first = tuple(cs[0] for cs in self._ranked(mb).values())
            self.evaluate(first, mb, self.gb // mb, list(orders[:1]))
        for mb in by_bound:
            if self.hopeless(mb):
                continue
            ranked = self._ranked(mb)
            configs = [tuple(cs[0] for cs in ranked.values())]
            top = max(c.stages for cs in ranked.values() for c in cs)
            stage_counts = sorted({1, 2, 3, *(int(round(2 ** (e / 2))) for e in range(4, 2 * int(math.log2(top)) + 2))})
            for K in stage_counts:
                pick = []
                for cs in ranked.values():
                    same = [c for c in cs if c.stages == K] or [min(cs, key=lambda c: (abs(c.stages - K), c.stages))]
                    pick.append(same[0])
                configs.append(tuple(pick))
            for config in dict.fromkeys(configs):
                self.stats["configs"] += 1
                cutoff = self.best * SEED_SLACK
                value, order = self.evaluate(config, mb, self.gb // mb, list(orders), cutoff=cutoff, screen=True)
                if order is not None:
                    self.starts.append((value, config, mb, order, self.last_schedule))

    def best_order(self) -> tuple[str, ...] | None:
        if self.best_plan is None:
            return None
        return tuple(dict.fromkeys(c.chip for c in self.best_plan[0]))

    def quick_orders(self, orders: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
        """The orders a configuration is first tried in: the best plan's and the first of
        `orders` (memory-descending); all of `orders` before any plan is known, or when
        they are at most 4."""
        best = self.best_order()
        return list(orders) if best is None or len(orders) <= 4 else list(dict.fromkeys([best, orders[0]]))

    def reorder(self, orders: Sequence[tuple[str, ...]]) -> None:
        """The best configuration in every order of `orders` and every adjacent swap of the
        best plan's order, until no order helps."""
        tried: set = set()
        while self.best_config is not None:
            config, mb = self.best_config
            best = self.best_order()
            swaps = []
            for i in range(len(best) - 1):
                o = list(best)
                o[i], o[i + 1] = o[i + 1], o[i]
                swaps.append(tuple(o))
            fresh = [o for o in dict.fromkeys([*orders, *swaps]) if (config, mb, o) not in tried]
            if not fresh:
                return
            tried.update((config, mb, o) for o in fresh)
            before = self.best
            self.evaluate(config, mb, self.gb // mb, fresh)
            if self.best >= before:
                return

    def local(self, orders: Sequence[tuple[str, ...]]) -> None:
        """Coordinate descent (:meth:`_climb`) from the best configuration and from the best
        other seeds (up to LOCAL_STARTS in all: a climb from one start alone stops where two
        changes at once would be needed, e.g. both chip types' stage counts and the order),
        then the order of the best one (:meth:`reorder`)."""
        self.reorder(orders)
        starts: dict[tuple, tuple[float, tuple[str, ...], str]] = {}
        if self.best_config is not None:
            starts[self.best_config] = (self.best, self.best_order(), self.best_plan[5])
        for value, config, mb, order, schedule in sorted(self.starts, key=lambda r: r[0]):
            if len(starts) >= LOCAL_STARTS:
                break
            starts.setdefault((config, mb), (value, order, schedule))
        self.starts = []
        for (config, mb), (value, order, schedule) in starts.items():
            self._climb(config, mb, value, order, orders, schedule)
        self.reorder(orders)

    def _climb(
        self,
        config: tuple[ChipChoice, ...],
        mb: int,
        value: float,
        order: tuple[str, ...],
        orders: Sequence[tuple[str, ...]],
        schedule: Schedule,
    ) -> None:
        """Steepest descent from one configuration: change one chip type's stage count (by
        up to 2, half or double) and tensor degree (any) together, or the microbatch size
        (halved or doubled, every type keeping its stages and tensor degree), in its order
        and the first of `orders` (all of them when they are at most 4), while a move beats
        where it stands. Moves keep the schedule; where none helps, the other schedules of
        the same configuration are one more move."""
        tried: set = set()
        while True:
            moves: list[tuple[tuple[ChipChoice, ...], int]] = []
            keyed = self._keyed(mb)
            for i, c in enumerate(config):
                near = {c.stages + d for d in (-2, -1, 0, 1, 2)} | {c.stages // 2, c.stages * 2}
                for (k, _), alt in keyed[c.chip].items():
                    if alt != c and k in near:
                        moves.append((config[:i] + (alt,) + config[i + 1 :], mb))
            for mb2 in (mb // 2, mb * 2):
                if mb2 in self.space:
                    k2 = self._keyed(mb2)
                    alt = tuple(k2[c.chip].get((c.stages, c.tensor)) for c in config)
                    if all(a is not None for a in alt):
                        moves.append((alt, mb2))
            step = None
            for move in moves:
                if move in tried or self.hopeless(move[1]):
                    continue
                tried.add(move)
                self.stats["configs"] += 1
                try_orders = list(dict.fromkeys([order, *(orders if len(orders) <= 4 else orders[:1])]))
                v, o = self.evaluate(move[0], move[1], self.gb // move[1], try_orders, cutoff=value, only=schedule)
                if v < value:
                    value, step = v, (move, o)
            if step is None:
                others = [s for s in self.schedules if s != schedule]
                v, o = (
                    self.evaluate(config, mb, self.gb // mb, [order], cutoff=value, only=others)
                    if others
                    else (INF, None)
                )
                if v >= value:
                    return
                value, order, schedule = v, o, self.last_schedule
                continue
            (config, mb), order = step

    def _dfs(self, bd: _Bounds, orders: list[tuple[str, ...]], quick: bool) -> None:
        names, L = self.names, self.L
        chosen: list[ChipChoice] = []

        def visit(i: int, held: np.ndarray, amin: float, nstages: int) -> None:
            self.ticks += 1
            if self.ticks % 64 == 0:
                self.tick()
            if nstages + (len(names) - i) > L:
                return
            if bd.bound(held + bd.suffix[i], min(amin, bd.suffix_amin[i])) >= self.best:
                return
            if i == len(names):
                self.stats["configs"] += 1
                self.evaluate(chosen, bd.mb, bd.m, self.quick_orders(orders) if quick else orders, screen=quick)
                return
            for c, grid, fill in zip(bd.lists[i], bd.grids[i], bd.fills[i]):
                chosen.append(c)
                visit(i + 1, held + grid, min(amin, fill), nstages + c.stages)
                chosen.pop()

        try:
            visit(0, np.zeros_like(bd.grid), INF, 0)
        finally:
            visit = None  # noqa: F841 -- the closure refers to itself: a cycle holding bd and the run

    def evaluate(
        self,
        config: Sequence[ChipChoice],
        mb: int,
        m: int,
        orders: list[tuple[str, ...]],
        cutoff: float | None = None,
        only: Schedule | Sequence[Schedule] | None = None,
        screen: bool = False,
    ) -> tuple[float, tuple[str, ...] | None]:
        """Solve `config` in each of `orders` (and each schedule, or `only` these); keep it if it
        beats the best plan. Returns its best time and order among those below `cutoff`
        (default: the best plan's time; a higher cutoff prices configurations that cannot win
        yet, for local search to start from), else (inf, None); `last_schedule` says which
        schedule gave that time. A schedule is solved only where its bounds (:meth:`live`,
        :meth:`beats`: its own memory caps and fills) leave it a chance. `screen` (the rounds
        before the exact one): the chunked schedules only in the order the one-chunk ones found
        best for this configuration (in every order where none beat the cutoff)."""
        schedules = self.schedules if only is None else [only] if isinstance(only, Schedule) else list(only)
        start = self.best if cutoff is None else max(cutoff, self.best)  # the limit only falls from here
        # solved before with a limit at least this one (another climb, a later round): the solves are
        # exact below their limit, so the best under it was `value`, and anything under this one is
        memo_key = (tuple(map(id, config)), mb, tuple(orders), tuple(schedules), screen)
        hit = self._memo.get(memo_key)
        if hit is not None and hit[0] >= start:
            _, value, order, schedule = hit
            if value < start:
                self.last_schedule = schedule
                return value, order
            return INF, None
        schedules = [s for s in self.live(mb, start) if s in schedules and self.beats(config, mb, m, s, start)]
        self.stats["solved"] += 1
        own, own_order = INF, None
        if screen and len(orders) > 1:
            chunked = [s for s in schedules if s.chunks > 1]
            flat = [s for s in schedules if s not in chunked]
            if chunked and flat:
                own, own_order = self._orders(config, mb, m, orders, cutoff, flat, own, own_order)
                own, own_order = self._orders(
                    config, mb, m, [own_order] if own_order else orders, cutoff, chunked, own, own_order
                )
                self._memo[memo_key] = (start, own, own_order, self.last_schedule)
                return own, own_order
        own, own_order = self._orders(config, mb, m, orders, cutoff, schedules, own, own_order)
        self._memo[memo_key] = (start, own, own_order, self.last_schedule)
        return own, own_order

    def _orders(
        self,
        config: Sequence[ChipChoice],
        mb: int,
        m: int,
        orders: list[tuple[str, ...]],
        cutoff: float | None,
        schedules: Sequence[str],
        own: float,
        own_order: tuple[str, ...] | None,
    ) -> tuple[float, tuple[str, ...] | None]:
        """:meth:`evaluate`'s solves: `config` in each of `orders` under each of `schedules`,
        from its best so far (`own` in `own_order`)."""
        opts, solver, L = self.opts, self.solver, self.L
        by_chip = {c.chip: c for c in config}
        for order in orders:
            limit = min(own, self.best if cutoff is None else max(cutoff, self.best))
            self.tick()
            seq = [by_chip[name] for name in order for _ in range(by_chip[name].stages)]
            S = len(seq)
            if S > L:
                return own, own_order
            groups = [by_chip[name] for name in order]
            ends = list(itertools.accumulate(c.stages for c in groups))  # a chip type's stages end here
            xfer = solver.transfers(groups, mb)
            shapes: dict[int, tuple[list[tuple[ChipChoice, bool, bool]], list[int]]] = {}  # by head
            for schedule in schedules:  # the schedule: one more dimension, split ones first
                if not schedule.runs(S, m, L):
                    continue
                limit = min(own, self.best if cutoff is None else max(cutoff, self.best))
                counts = solver.counts(schedule, S, m)  # awaiting (B, W)
                head = schedule.head_stage(S)  # the V's last chunk is stage 0's
                cut = shapes.get(head)
                if cut is None:
                    # the stages as runs of one shape: a chip type's stages, the first and the head apart
                    cuts = sorted({0, 1, head, head + 1, *ends} - {S + 1})
                    cut = shapes[head] = (
                        [(seq[a], a == 0, a == head) for a in cuts[:-1]],
                        [b - a for a, b in zip(cuts, cuts[1:])],
                    )
                tables = [solver.stage_pricing(c, mb, first, last, schedule) for c, first, last in cut[0]]
                self.stats["orders"] += 1
                res = solver.solve(tables, cut[1], counts, schedule, m, xfer, limit)
                if res is None:
                    continue
                value, layers, recompute = res[0], list(res[1]), list(res[2])
                if self.shared:  # contention on the host: price in full, then improve the split
                    value, layers, recompute = polish_split(
                        seq,
                        layers,
                        recompute,
                        lambda ls, rc, seq=seq, schedule=schedule: _full_time(
                            build_plan(seq, ls, rc, global_batch=self.gb, num_microbatches=m, schedule=schedule),
                            self.model,
                            self.cluster,
                            self.table,
                            opts.cost,
                        ),
                        allow_recompute=opts.allow_recompute,
                        min_layers=schedule.chunks,
                    )
                    if value >= limit:
                        continue
                own, own_order = value, tuple(order)
                self.last_schedule = schedule
                if value < self.best:
                    self.best = value
                    self.best_plan = (list(seq), layers, recompute, mb, m, schedule)
                    self.found_s = time.perf_counter() - self.start
                    self.best_config = (tuple(config), mb)
        return own, own_order


def _why_none(run: _Run) -> str:
    """Why no plan of a fully searched space fits, with the numbers (and the measured rows
    the space was held to, where it was)."""
    why = _why_none_of_space(run)
    if run.opts.measured_only:
        held = {n: measured_rows(run.table, n, run.model) for n in run.names}
        held = {n: rows for n, rows in held.items() if rows}
        if held:
            why += "; searched only the measured rows of " + "; ".join(
                f"{n} ((tensor, sequences per device) {', '.join(map(str, sorted(rows)))})" for n, rows in held.items()
            )
    return why


def _why_none_of_space(run: _Run) -> str:
    L = run.L
    if not run.space:
        poor = []
        for chip, _ in run.cluster.chips:
            if not any(
                chip_choices(
                    run.cluster.only(chip.name), run.model, mb, run.opts, run.table, num_microbatches=run.gb // mb
                )[chip.name]
                for mb in microbatch_sizes(run.gb, run.opts)
            ):
                poor.append(f"{chip.name} ({chip.memory_gib:g} GiB per device)")
        return (
            f"no stage of {', '.join(poor) or 'some chip type'} holds even one of the model's blocks in memory, "
            "at any tensor degree and microbatch size"
        )
    held = max(sum(_Held(cs).most(INF) for cs in choices.values()) for choices in run.space.values())
    mem = ", ".join(f"{n} x {p.name} ({p.memory_gib:g} GiB)" for p, n in run.cluster.chips)
    if held < L:
        return (
            f"the chips' memory holds at most {held:.0f} of the model's {L} blocks at once "
            f"(best case, every stage with recompute and the fewest microbatches in flight; {mem} nodes)"
        )
    return f"no split of the model's {L} blocks fits every stage's memory ({mem} nodes)"


def _fields(opts: SearchOptions) -> dict:
    return {f: getattr(opts, f) for f in opts.__dataclass_fields__}


def _rounds(run: _Run, cluster: Cluster, opts: SearchOptions) -> list[tuple[str, int | None, list]]:
    """The rounds of an auto search, cheapest first; the last one is the whole space."""
    orders = chip_orders(cluster, opts)
    if opts.max_options_per_chip is not None:
        return [("fixed beam", opts.max_options_per_chip, orders)]
    if not opts.auto or run.size(None, len(orders)) <= EXACT_DIRECT:
        return [("exact", None, orders)]
    neigh = [o for o in order_neighbourhood(cluster) if o in set(orders)] or orders[:1]
    if len(orders) <= len(neigh):
        neigh = orders
    widest = max(len(cs) for choices in run.space.values() for cs in choices.values())
    out: list[tuple[str, int | None, list]] = [("seeds", None, neigh), ("local", None, neigh)]
    width = 2
    while width < widest and run.size(width, len(neigh)) < run.size(None, len(orders)):
        out += [("beam", width, neigh), ("local", None, neigh)]
        width = width + 1 if width < 4 else width * 2
    return [*out, ("exact", None, orders)]


def _cycle_collection_paused(fn):
    """`fn` with Python's cyclic garbage collector paused (and restored after): a search allocates
    ~10^5 small objects and frees them by reference counting, and the collector's passes over
    them cost 3-5 % of a search and find nothing (it makes no reference cycles:
    tests/plan/test_search_effort.py checks)."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return paused


@_cycle_collection_paused
def search(
    cluster: Cluster,
    model: ModelShape,
    *,
    global_batch: int,
    table: ProfileTable | None = None,
    opts: SearchOptions = SearchOptions(),
) -> SearchResult:
    """The fastest plan of the space (see module docstring) that fits, with its lower bound and timing."""
    t0 = time.perf_counter()
    deadline = t0 + opts.time_budget_s if opts.time_budget_s is not None else INF
    done: list[str] = []
    exhaustive_ = False
    lower = INF
    run: _Run | None = None
    stop = "time budget spent"
    try:
        run = _Run(cluster, model, global_batch, table, opts, deadline, t0)
        rounds = _rounds(run, cluster, opts)
        if rounds[0][0] == "seeds":
            run.quick_bounds()  # the full bound after the seeds: a first plan comes first
        else:
            lower = run.lower_bound()
        stale = 0
        # a space this small gets to its exact round whenever the budget allows (no convergence stop)
        patient = run.size(None, len(chip_orders(cluster, opts))) <= EXACT_AFTER_LOCAL
        for kind, width, orders in rounds:
            before, t_round = run.best, time.perf_counter()
            if kind == "seeds":
                run.seeds(orders)
                lower = run.lower_bound()
            elif kind == "local":
                run.local(orders)
            else:
                run.round(width, orders, quick=kind == "beam")
            label = kind + (f" {width}" if width else "") + f", {len(orders)} orders"
            done.append(f"{label} ({time.perf_counter() - t_round:.2f} s)")
            if kind == "exact":
                exhaustive_ = opts.orders == "memory" or len(orders) == math.factorial(len(cluster.names))
                stop = "exact" if exhaustive_ else f"exact over {len(orders)} stage orders"
                break
            if kind == "fixed beam":
                stop = "every configuration of the fixed beam"
                break
            if kind == "beam":
                stale = stale + 1 if run.best >= before * (1 - 1e-6) else 0
                patience = PATIENCE * (opts.time_budget_s if opts.time_budget_s is not None else INF)
                if not patient and stale >= 2 and math.isfinite(run.best) and time.perf_counter() - t0 >= patience:
                    stop = "converged: two beam rounds without improvement"
                    break
    except _OutOfTime:
        if run is not None and run.best_plan is not None and not math.isfinite(lower):
            lower = run.lower_bound(timed=False)  # the answer's quality is part of the answer
    elapsed = time.perf_counter() - t0
    note = f"{stop}; rounds: {', '.join(done) or 'none complete'}"
    stats = run.stats if run is not None else {"configs": 0, "solved": 0, "orders": 0}
    dp = run.solver.dp_solves if run is not None else 0
    if run is None or run.best_plan is None:
        if exhaustive_:
            note = _why_none(run)
        return SearchResult(
            None,
            None,
            INF,
            lower,
            elapsed,
            stats["configs"],
            stats["solved"],
            stats["orders"],
            dp,
            note=note,
            exhaustive=exhaustive_,
            rounds=tuple(done),
        )
    seq, layers, recompute, mb, m, schedule = run.best_plan
    plan = build_plan(seq, layers, recompute, global_batch=global_batch, num_microbatches=m, schedule=schedule)
    cost = estimate(plan, model, cluster, table=table, opts=opts.cost)
    elapsed = time.perf_counter() - t0
    return SearchResult(
        plan,
        cost,
        cost.iteration_s,
        lower,
        elapsed,
        stats["configs"],
        stats["solved"],
        stats["orders"],
        dp,
        memory_descending=is_memory_descending(plan, cluster),
        note=note,
        exhaustive=exhaustive_,
        rounds=tuple(done),
        found_s=run.found_s,
    )


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


def _has_fill(schedule: Schedule) -> bool:
    """Whether a stage's fill term may differ from its time t (split or chunked schedules)."""
    return schedule.split_backward or schedule.chunks > 1


# -- the reference: every plan of the same space --------------------------------------------------


def _compositions(total: int, parts: int) -> Iterable[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def exhaustive(
    cluster: Cluster,
    model: ModelShape,
    *,
    global_batch: int,
    table: ProfileTable | None = None,
    opts: SearchOptions = SearchOptions(),
) -> tuple[Plan | None, float, int]:
    """Brute force over the search space: (best plan, its estimated time, plans priced).

    Every (microbatch, order, per-chip choice, layer split, recompute flags, schedule) is
    built as a Plan and priced by :func:`estimate`; nothing is pruned (GPipe included where
    the search skips it). For tests on small instances.
    """
    L = model.n_layers
    best, best_plan, count = INF, None, 0
    flags = (False, True) if opts.allow_recompute else (False,)
    searched_labels(opts)  # refuses what is no schedule
    given = (opts.schedule,) if opts.schedule is not None else tuple(opts.schedules)
    schedules = expand_chunks(tuple(dict.fromkeys(as_schedule(s) for s in given)), opts.interleaved_chunks)
    for mb in microbatch_sizes(global_batch, opts):
        m = global_batch // mb
        choices = chip_choices(cluster, model, mb, opts, table, num_microbatches=m)
        names = cluster.names
        if any(not choices[n] for n in names):
            continue
        for order in chip_orders(cluster, opts):
            for combo in itertools.product(*(choices[n] for n in order)):
                seq = [c for c in combo for _ in range(c.stages)]
                S = len(seq)
                if S > L:
                    continue
                for split in _compositions(L, S):
                    for rc, schedule in itertools.product(itertools.product(flags, repeat=S), schedules):
                        if schedule.chunks > 1 and (
                            min(split) < schedule.chunks or not schedule.runs(S, m, L)
                        ):  # what chunked_variant refuses
                            continue
                        plan = build_plan(
                            seq, split, rc, global_batch=global_batch, num_microbatches=m, schedule=schedule
                        )
                        cost = estimate(plan, model, cluster, table=table, opts=opts.cost)
                        count += 1
                        if cost.fits and cost.iteration_s < best:
                            best, best_plan = cost.iteration_s, plan
    return best_plan, best, count
