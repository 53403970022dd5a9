"""The search space's options, the per-chip choices and caps, and the result."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from h2jax.plan import _planner
from h2jax.plan._cost import (
    CostOptions,
    PlanCost,
)
from h2jax.plan._plan import (
    INTERLEAVED_CHUNKS,
    Plan,
)
from h2jax.plan._profiles import ModelShape, ProfileTable
from h2jax.plan.schedules import Schedule, schedule_names

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
    converge: with a time budget, end an auto search when two beam rounds in a row find
        nothing better (past a share of the budget, ``PATIENCE``). False: run on to the
        exact round unless the budget ends it first (:func:`h2jax.plan.prove`: the exact
        round's optimum bounds every plan of the space).
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
    converge: bool = True
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


class SearchCache:
    """What several searches of one model and profile table over chip types of one cluster may
    share (:class:`h2jax.plan.Searcher`'s: the baselines' searches and the groups of a plan of
    several pipelines): the chip shapes' memory models and caps, and the stage pricings. Neither
    depends on which other chip types a search holds, only on the options they are computed
    under (and the caps on the chip type count, through the schedules' count floors), which key
    them here. A search given one computes what it lacks and leaves it for the next.

    `keep_choices`: also each chip type's choices (and what depends on them alone: their
    holdings, the embedding's and head's fills), for searches and bounds of other chip types at
    the same microbatch size and count (:meth:`choices`). They grow with every batch searched
    (hundreds of MB per batch at 10,000 chips), so only a cache of one batch keeps them
    (:func:`h2jax.plan.pipelines_bound`: every group at one share)."""

    def __init__(self, model: ModelShape, table: ProfileTable | None, *, keep_choices: bool = False):
        self.model, self.table = model, table
        self._caps: dict[tuple, dict] = {}
        self._pricings: dict[tuple, tuple[dict, dict, dict]] = {}
        self._choices: dict[tuple, dict] | None = {} if keep_choices else None

    def check(self, model: ModelShape, table: ProfileTable | None) -> None:
        if model is not self.model or table is not self.table:
            raise ValueError("a SearchCache serves the searches of one model and profile table")

    @staticmethod
    def _key(opts: SearchOptions, n_types: int) -> tuple:
        return (opts.cost, opts.allow_recompute, opts.schedule, tuple(opts.schedules), opts.interleaved_chunks, n_types)

    def caps(self, opts: SearchOptions, n_types: int) -> dict:
        """The memory models and caps of :func:`h2jax.plan._search._space.chip_choices`."""
        return self._caps.setdefault(self._key(opts, n_types), {})

    def choices(self, opts: SearchOptions, n_types: int) -> dict | None:
        """The chip types' choices kept (`keep_choices`; None: not kept), for searches of
        `n_types` chip types under `opts`."""
        return None if self._choices is None else self._choices.setdefault(self._key(opts, n_types), {})

    def pricings(self, opts: SearchOptions) -> tuple[dict, dict, dict]:
        """The stage pricings, boundary transfers and schedule counts of
        :class:`h2jax.plan._search._solver._Solver`."""
        return self._pricings.setdefault((opts.cost,), ({}, {}, {}))


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


def _fields(opts: SearchOptions) -> dict:
    return {f: getattr(opts, f) for f in opts.__dataclass_fields__}
