"""What a heterogeneous plan is compared with: each chip type training alone, as its own job.

HeteroSpeedupRatio = the heterogeneous plan's tokens/s / the sum of the homogeneous jobs'
tokens/s (DESIGN.md, "Words"). Which global batch each homogeneous job trains at decides what
the ratio means, so two are computed and always named:

- **matched total** (:func:`matched_total`): the homogeneous jobs' global batches sum to the
  heterogeneous job's -- the same sequences per step, shared among the chip types -- and the
  split is searched: each chip type's share is a multiple of ``global_batch / grid`` (0: that
  chip type does not train), each job at its share is planned by the same search, and a
  dynamic program over the chip types picks the split whose jobs add up to the most tokens/s.
  This is "the sum of its parts on the same data": the fair test of a claim that the mixed
  cluster beats its chip types run apart. A coarser grid can only miss a better split, which
  would lower the baseline and raise the ratio: eighths missed 8 % of the best split's tokens/s
  at 10,000 chips of eight types and 1.7 % at 2,432 of four (docs/LOG.md, session 43), so the
  grid starts at :data:`GRID` steps and is doubled while the best split gains at least
  :data:`REFINE_GAIN`, up to :data:`MAX_GRID` steps, and the grids tried are printed with their
  best splits' tokens/s (at 10,000 chips each doubling still gains ~1 %, to 64 steps: the
  printed gain says so). Then the split is balanced to the sequence near it
  (h2jax.plan._balance), each chip type searched at its new share, and kept where its jobs add
  up to more, as the search over several pipelines balances its pipelines: both sides of the
  ratio get the same granularity.
- **same batch** (:func:`same_batch`): every homogeneous job at the whole global batch. Each
  job then takes as many sequences per step as the whole mixed cluster, with a smaller
  bubble than its share would give it, so this baseline is the larger and the ratio the lower;
  H2's paper compares at the same batch.

Pure: no jax. Every search here runs with the search's own effort over its own space (the
hand settings that restrict a heterogeneous search -- grouping, beam -- would exclude the
plans one chip type alone needs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from h2jax.plan._balance import candidates, fine_split, window
from h2jax.plan._search import SearchCache, SearchOptions, SearchResult, lower_bound, search

GRID = 8  # matched total: shares in multiples of global_batch / GRID (or the largest divisor below it) ...
REFINE_GAIN = 0.005  # ... the grid doubled while the best split gains at least this share of its tokens/s
MAX_GRID = 32  # ... up to this many steps (each doubling searches every chip type at as many new shares)


@dataclass(frozen=True)
class Baseline:
    """The homogeneous jobs of one comparison: each chip type's global batch (its share; 0 where
    that chip type does not train) and the best plan of its chips alone at that batch."""

    kind: str  # "matched total" | "same batch"
    global_batch: int  # the heterogeneous job's
    shares: dict[str, int]
    results: dict[str, SearchResult | None]  # None where the share is 0
    unit: int = 0  # matched total: the shares' step (global_batch / the grid)
    coarser: tuple[tuple[int, float], ...] = ()  # matched total: (step, best tokens/s) of the grids before it
    grid_tokens_per_s: float = 0.0  # matched total balanced to the sequence: the grid's best split's (else 0)

    @property
    def tokens_per_s(self) -> float:
        """The jobs' tokens/s added up (the chip types with a plan)."""
        return sum(r.cost.tokens_per_s for r in self.results.values() if r is not None and r.plan is not None)

    def ratio(self, hetero_tokens_per_s: float) -> float:
        """HeteroSpeedupRatio against these jobs (nan when none of them has a plan)."""
        total = self.tokens_per_s
        return hetero_tokens_per_s / total if total > 0 else float("nan")

    def without_plan(self) -> list[str]:
        """Chip types given a share whose chips alone have no plan at it."""
        return [n for n, r in self.results.items() if r is not None and r.plan is None]

    def describe(self) -> str:
        """The split in words: "gaudi2 at 192, h100_sxm at 320 (of 512; shares in steps of 32 (steps
        of 64: -0.4 %))", the other grids tried with their best split's tokens/s against this one's."""
        parts = [f"{n} at {b}" if b else f"{n} not run" for n, b in self.shares.items()]
        step = f"; shares in steps of {self.unit}" if self.unit else ""
        if self.coarser:  # each other grid's best split, against this one's
            step += (
                " (steps of "
                + ", ".join(
                    f"{u}: {100 * (t / self.tokens_per_s - 1):+.1f} %" if self.tokens_per_s > 0 else f"{u}"
                    for u, t in self.coarser
                )
                + ")"
            )
        if self.grid_tokens_per_s:
            step += f", then balanced to the sequence ({100 * (self.tokens_per_s / self.grid_tokens_per_s - 1):+.1f} %)"
        return f"{', '.join(parts)} (of {self.global_batch}{step})"

    def to_dict(self, hetero_tokens_per_s: float) -> dict[str, Any]:
        """What the plan's files keep of it."""
        return {
            "global_batch": self.global_batch,
            "shares": dict(self.shares),
            "share_step": self.unit or None,
            "coarser_steps": {str(u): round(t, 1) for u, t in self.coarser} or None,
            "grid_tokens_per_s": round(self.grid_tokens_per_s, 1) or None,
            "tokens_per_s": {
                n: (round(r.cost.tokens_per_s, 1) if r is not None and r.plan is not None else None)
                for n, r in self.results.items()
            },
            "ratio": round(self.ratio(hetero_tokens_per_s), 4),
        }


def default_workers(chip_types: int) -> int:
    """Processes for the baselines' searches: one per core this process may run on, at most one
    per chip type (a chip type's searches run on one worker, sharing its tables)."""
    return max(1, min(len(os.sched_getaffinity(0)), chip_types))


_WORKER: Searcher | None = None  # in a worker process: the Searcher its tasks run on
WORTH_S = 1.0  # the workers start only for more seconds of searches than this (spawning two takes ~0.4 s)


@contextlib.contextmanager
def _ctrl_c_ignored() -> Iterator[None]:
    """SIGINT ignored while the workers are spawned: a spawned process keeps an ignored signal
    ignored for life, so Ctrl-C, sent to the whole foreground group, reaches the CLI alone (it
    stops; the workers end with its pipes), not workers still importing. A Ctrl-C pressed
    within these milliseconds is lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


def _start_worker(cluster: Any, model: Any, table: Any, opts: SearchOptions, mixed_opts: SearchOptions) -> None:
    global _WORKER
    _WORKER = Searcher(cluster, model, table=table, workers=1)
    _WORKER.opts, _WORKER.mixed_opts = opts, mixed_opts


def _search_all(group: tuple[str, ...], batches: list[int]) -> list[SearchResult]:
    assert _WORKER is not None
    return [_WORKER(group, b) for b in batches]


def _search_one(group: tuple[str, ...], batch: int, budget_s: float | None) -> SearchResult:
    assert _WORKER is not None
    return _WORKER(group, batch, time_budget_s=budget_s)


def _bounds_at(batch: int, groups: list[tuple[str, ...]]) -> list[float]:
    """The search's lower bound of each group at `batch`, the groups sharing one SearchCache that
    keeps the chip types' choices (of this batch alone: it bounds the memory)."""
    w = _WORKER
    assert w is not None
    scope = SearchCache(w.model, w.table, keep_choices=True)
    return [
        lower_bound(w.cluster.only(*g), w.model, global_batch=batch, table=w.table, opts=w.opts_of(g), cache=scope)
        for g in groups
    ]


class Searcher:
    """Each chip type's best homogeneous plan at a global batch, searched once per (chip type,
    batch) and kept: the same-batch and matched-total baselines share their searches (and the
    search over several pipelines, whose groups of several chip types are searched with the
    heterogeneous search's own options, grouping and beam included).

    `workers`: processes that run the baselines' searches (:meth:`prefetch`), each chip type's
    on one of them, the bounds of :func:`h2jax.plan.pipelines_bound` (:meth:`bound_batches`) and
    the searches begun ahead (:meth:`start`), started where the searches would take longer than
    :data:`WORTH_S` here (timed on the first) and kept until :meth:`close` (1, the default:
    everything in this process; ``h2jax plan`` takes :func:`default_workers`). They are spawned,
    so a script that asks for them starts its work under ``if __name__ == "__main__":``. The
    searches of one chip type are exhaustive (h2jax.plan.search: a space that small runs on to
    its exact round), so their plans are the same wherever they run."""

    def __init__(
        self,
        cluster: Any,
        model: Any,
        *,
        table: Any = None,
        opts: SearchOptions | None = None,
        workers: int = 1,
    ):
        self.cluster, self.model, self.table = cluster, model, table
        base = opts if opts is not None else SearchOptions()
        self.opts = dataclasses.replace(base, group_size=None, max_options_per_chip=None, auto=True)
        self.mixed_opts = base  # several chip types together: the heterogeneous search's own options
        self._done: dict[tuple[tuple[str, ...], int], SearchResult] = {}
        self._bounds: dict[tuple[tuple[str, ...], int], float] = {}
        self.cache = SearchCache(model, table)  # memory caps and stage pricings, shared by its searches
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._started: dict[tuple[tuple[str, ...], int], Future] = {}  # searches begun on the workers

    def prefetch(self, requests: Iterable[tuple[tuple[str, ...], int]]) -> None:
        """Run the searches of `requests` ((chip types, global batch) pairs) not yet kept on the
        workers, each group's in one task, and keep their results; with one worker, or one group
        to search, nothing (each runs in this process when asked for)."""
        todo: dict[tuple[str, ...], list[int]] = {}
        for group, b in dict.fromkeys(requests):
            if (group, b) not in self._done and b > 0:
                todo.setdefault(group, []).append(b)
        if self.workers < 2 or len(todo) < 2:
            return
        if self._pool is None and not self._done:  # one search here, to tell what the rest would take
            group = next(iter(todo))
            self(group, todo[group].pop(0))
            todo = {g: bs for g, bs in todo.items() if bs}
        if len(todo) < 2 or not self._pays(sum(map(len, todo.values()))):
            return
        # the chip types with the most searches first, so the last task to start is a short one
        groups = sorted(todo, key=lambda g: -len(todo[g]))
        for group, results in zip(groups, self._workers().map(_search_all, groups, [todo[g] for g in groups])):
            for b, r in zip(todo[group], results):
                self._done[(group, b)] = r

    def bound_batches(
        self, groups: Sequence[tuple[str, ...]], batches: Sequence[int], *, deadline: float | None = None
    ) -> bool:
        """:meth:`lower_bound` of every group at every batch, kept. Each batch's groups are bounded
        together, sharing a SearchCache that keeps their chip types' choices (of that batch alone:
        it bounds the memory); each batch is a task on the workers (in this process with one), in
        order while `deadline` (a ``time.perf_counter`` time; None: no limit) is not passed; the
        bounds kept already, and the exhaustive searches' optima, are not computed again. Whether
        every batch was bounded (past the deadline the batches in progress on workers run to their
        end)."""
        todo = [(b, [g for g in groups if not self._bounded(g, b)]) for b in batches]
        if not self._pays(sum(len(gs) for _, gs in todo)):  # a bound takes about what a search does
            for b, gs in todo:
                scope = SearchCache(self.model, self.table, keep_choices=True)
                for g in gs:
                    if deadline is not None and time.perf_counter() > deadline:
                        return False
                    self.lower_bound(g, b, cache=scope)
            return True
        futures = [(b, gs, self._workers().submit(_bounds_at, b, gs)) for b, gs in todo if gs]
        try:
            for b, gs, f in futures:
                left = None if deadline is None else max(0.0, deadline - time.perf_counter())
                try:
                    values = f.result(timeout=left)
                except TimeoutError:
                    return False
                for g, v in zip(gs, values):
                    self._bounds[(g, b)] = v
        finally:
            for *_, f in futures:
                f.cancel()
        return True

    def _pays(self, searches: int) -> bool:
        """Whether `searches` searches go to the workers: they are running, or that many searches,
        at the mean time of those run so far, take more than :data:`WORTH_S`."""
        if self.workers < 2:
            return False
        if self._pool is not None:
            return True
        times = [r.search_s for r in self._done.values()]
        return bool(times) and searches * sum(times) / len(times) > WORTH_S

    def _bounded(self, group: tuple[str, ...], batch: int) -> bool:
        """Whether :meth:`lower_bound` of `group` at `batch` needs no computing."""
        done = self._done.get((group, batch))
        return (done is not None and done.exhaustive) or (group, batch) in self._bounds

    def _workers(self) -> ProcessPoolExecutor:
        """The worker processes, started on first use, all at once (a task each with none idle)."""
        if self._pool is None:
            pool = ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=multiprocessing.get_context("spawn"),  # the caller may hold threads (jax's): no fork
                initializer=_start_worker,
                initargs=(self.cluster, self.model, self.table, self.opts, self.mixed_opts),
            )
            with _ctrl_c_ignored():
                for _ in range(self.workers):
                    pool.submit(os.getpid)
            weakref.finalize(self, pool.shutdown, cancel_futures=True)
            self._pool = pool
        return self._pool

    def start(self, chips: str | tuple[str, ...], global_batch: int, *, time_budget_s: float | None = None) -> None:
        """Begin :meth:`__call__`'s search on a worker, which then returns its result (nothing with
        one worker, or where that search is kept or begun already)."""
        group = (chips,) if isinstance(chips, str) else tuple(chips)
        key = (group, global_batch)
        if self._pays(1) and key not in self._done and key not in self._started:
            self._started[key] = self._workers().submit(_search_one, group, global_batch, time_budget_s)

    def running(self) -> int:
        """Searches begun on the workers and not yet ended."""
        return sum(not f.done() for f in self._started.values())

    def cancel_started(self) -> None:
        """Drop the searches begun and not taken (those running end on their own budget)."""
        for f in self._started.values():
            f.cancel()
        self._started.clear()

    def close(self) -> None:
        """Stop the worker processes (a later :meth:`prefetch` starts new ones)."""
        self.cancel_started()
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def opts_of(self, group: tuple[str, ...]) -> SearchOptions:
        """The options a group of chip types is searched (and bounded) under: one type its own
        space, several the heterogeneous search's options."""
        return self.opts if len(group) == 1 else self.mixed_opts

    def __call__(
        self, chips: str | tuple[str, ...], global_batch: int, *, time_budget_s: float | None = None
    ) -> SearchResult:
        """The best plan of chip type `chips` alone (or of the chip types `chips` together: one
        pipeline of a plan of several) at `global_batch`; `time_budget_s`: a tighter budget for
        this search than the options' (its result is kept all the same)."""
        group = (chips,) if isinstance(chips, str) else tuple(chips)
        key = (group, global_batch)
        begun = self._started.pop(key, None)
        if key not in self._done and begun is not None and not begun.cancelled():
            self._done[key] = begun.result()  # :meth:`start`'s, with the budget it was begun with
        if key not in self._done:
            opts = self.opts_of(group)
            if time_budget_s is not None and (opts.time_budget_s is None or time_budget_s < opts.time_budget_s):
                opts = dataclasses.replace(opts, time_budget_s=time_budget_s)
            self._done[key] = search(
                self.cluster.only(*group),
                self.model,
                global_batch=global_batch,
                table=self.table,
                opts=opts,
                cache=self.cache,
            )
        return self._done[key]

    def lower_bound(
        self, chips: str | tuple[str, ...], global_batch: int, *, cache: SearchCache | None = None
    ) -> float:
        """The lower bound of every plan the search of `chips` at `global_batch` (:meth:`__call__`)
        searches among, without searching (:func:`h2jax.plan.lower_bound`; inf: none holds the
        model), kept; where that search has run and was exhaustive, its optimum (inf: no plan).
        `cache`: the SearchCache to bound with (one that keeps the chip types' choices, shared by
        the bounds of other groups at this batch); None: the searches' own."""
        group = (chips,) if isinstance(chips, str) else tuple(chips)
        key = (group, global_batch)
        done = self._done.get(key)
        if done is not None and done.exhaustive:
            return done.iteration_s
        if key not in self._bounds:
            self._bounds[key] = lower_bound(
                self.cluster.only(*group),
                self.model,
                global_batch=global_batch,
                table=self.table,
                opts=self.opts_of(group),
                cache=self.cache if cache is None else cache,
            )
        return self._bounds[key]

    def tokens_per_s(self, chip: str, global_batch: int) -> float | None:
        """tokens/s of the chip type alone at `global_batch`; None where no plan fits (0 sequences: 0)."""
        if global_batch == 0:
            return 0.0
        r = self(chip, global_batch)
        return r.cost.tokens_per_s if r.plan is not None else None


def same_batch(searcher: Searcher, global_batch: int) -> Baseline:
    """Every chip type alone at the whole `global_batch` (module docstring)."""
    names = list(searcher.cluster.names)
    searcher.prefetch(((n,), global_batch) for n in names)
    return Baseline(
        "same batch",
        global_batch,
        {n: global_batch for n in names},
        {n: searcher(n, global_batch) for n in names},
    )


def share_unit(global_batch: int, grid: int = GRID) -> int:
    """The step of the matched-total shares: global_batch / g for the largest g <= `grid` that
    divides it (so the shares add up to the global batch exactly)."""
    g = max(d for d in range(1, min(grid, global_batch) + 1) if global_batch % d == 0)
    return global_batch // g


def matched_total(
    searcher: Searcher, global_batch: int, *, grid: int = GRID, refine: bool = True, balance: bool = True
) -> Baseline:
    """The chip types alone on shares of `global_batch` that sum to it, the split searched
    (module docstring): the split with the most tokens/s added up over the jobs that have a
    plan at their share. Where no split gives every share a plan, each chip type without one
    takes 0 (it is not run); a Baseline whose tokens/s is 0 when no chip type has a plan at any
    share. `refine`: the grid doubled from `grid` steps while the best split gains at least
    :data:`REFINE_GAIN`, up to :data:`MAX_GRID` steps or the finest the batch allows (each
    grid's searches kept: a finer one searches only its new shares); the best split of every
    grid tried is returned, the coarser grids' with it. `balance`: then the split balanced to the
    sequence (:func:`_to_the_sequence`)."""
    best = _matched_on(searcher, global_batch, grid)
    tried: list[tuple[int, float]] = []
    while refine and grid < MAX_GRID:
        grid *= 2
        unit = share_unit(global_batch, grid)
        if unit == best.unit or any(unit == u for u, _ in tried):
            break  # no finer step divides the batch
        finer = _matched_on(searcher, global_batch, grid)
        gain = finer.tokens_per_s / best.tokens_per_s - 1 if best.tokens_per_s > 0 else float("inf")
        if finer.tokens_per_s > best.tokens_per_s:
            tried.append((best.unit, best.tokens_per_s))
            best = finer
        else:  # a step that is not a divisor of the last one can miss its splits: the better one kept
            tried.append((finer.unit, finer.tokens_per_s))
        if gain < REFINE_GAIN:
            break
    best = dataclasses.replace(best, coarser=tuple(tried))
    return _to_the_sequence(searcher, best) if balance else best


def _to_the_sequence(searcher: Searcher, base: Baseline) -> Baseline:
    """`base`'s split balanced to the sequence (h2jax.plan._balance): each chip type's plans at
    the grid shares near its share, taken at every share near it, the split with the most tokens/s
    chosen; then each chip type searched at its new share (the Baseline's jobs are searched plans)
    and the split kept where those jobs add up to more than the grid's."""
    from h2jax.plan._cost import estimate

    gb, unit, n_layers = base.global_batch, base.unit, searcher.model.n_layers
    if not unit or unit == 1 or base.tokens_per_s <= 0:
        return base
    cands = []
    for n, share in base.shares.items():
        near = window(share, unit, gb)
        plans = [r.plan for b in range(unit, gb + 1, unit) if b in near and (r := searcher(n, b)).plan is not None]
        cluster = searcher.cluster.only(n)

        def price(p: Any, cluster: Any = cluster) -> tuple[float, None] | None:
            c = estimate(p, searcher.model, cluster, table=searcher.table, opts=searcher.opts.cost)
            return (-c.tokens_per_s, None) if c.fits else None

        cands.append({s: -v for s, (v, _) in candidates(plans, near, price, n_layers).items()})
    split = fine_split(cands, gb, most_sum=True)
    if split is None or split == tuple(base.shares.values()):
        return base
    shares = dict(zip(base.shares, split))
    searcher.prefetch(((n,), b) for n, b in shares.items() if b)
    results = {n: (searcher(n, b) if b else None) for n, b in shares.items()}
    if any(r is not None and r.plan is None for r in results.values()):
        return base
    fine = dataclasses.replace(base, shares=shares, results=results, grid_tokens_per_s=base.tokens_per_s)
    return fine if fine.tokens_per_s > base.tokens_per_s else base


def _matched_on(searcher: Searcher, global_batch: int, grid: int) -> Baseline:
    """:func:`matched_total` on one grid: the best split of `global_batch` in steps of
    ``share_unit(global_batch, grid)``, by a dynamic program over the chip types."""
    names = list(searcher.cluster.names)
    unit = share_unit(global_batch, grid)
    g = global_batch // unit
    searcher.prefetch(((n,), j * unit) for n in names for j in range(1, g + 1))
    # best[j] = (tokens/s, shares) over the chip types so far with j units given out
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for n in names:
        tps = [searcher.tokens_per_s(n, j * unit) for j in range(g + 1)]
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for used, (total, shares) in best.items():
            for j in range(g + 1 - used):
                if tps[j] is None:
                    continue
                cand = (total + tps[j], (*shares, j))
                if used + j not in nxt or cand[0] > nxt[used + j][0]:
                    nxt[used + j] = cand
        best = nxt
    _, units = best.get(g, (0.0, (0,) * len(names)))
    shares = {n: j * unit for n, j in zip(names, units)}
    return Baseline(
        "matched total",
        global_batch,
        shares,
        {n: (searcher(n, b) if b else None) for n, b in shares.items()},
        unit=unit,
    )


def idle_chips(result: SearchResult, cluster: Any) -> dict[str, tuple[int, str]]:
    """{chip type: (chips the plan leaves idle, why)} for every chip type the plan does not use
    whole. The data degree of a stage is the largest that divides the microbatch and fits its
    share of the chip type's devices (``h2jax.plan.data_degrees``), so devices are left over
    where the next larger data degree would not divide the microbatch or not fit."""
    plan, cost = result.plan, result.cost
    out: dict[str, tuple[int, str]] = {}
    for chip in cluster.names:
        n = cluster.devices(chip)
        used = cost.devices_by_chip.get(chip, 0)
        if used >= n:
            continue
        stages = [s for s in plan.stages if s.chip == chip]
        if not stages:
            why = "the best plan found has no stage on it (a stage there made the step slower or did not fit)"
        else:
            s0 = stages[0]
            k, t, d, mb = len(stages), s0.tensor, s0.data, plan.microbatch_size
            what = f"{k} stage{'s' if k > 1 else ''} of data x tensor {d} x {t}"
            larger = [x for x in range(d + 1, mb + 1) if mb % x == 0]
            if not larger:
                why = f"{what}: the data degree is the whole microbatch ({mb} sequences), one sequence per replica"
            elif k * larger[0] * t > n:
                why = (
                    f"{what}: the data degree divides the microbatch ({mb} sequences) and the next divisor, "
                    f"{larger[0]}, would need {k * larger[0] * t} chips"
                )
            else:
                why = f"{what}: a data degree of {larger[0]} (the next divisor of the microbatch) does not fit a node"
        out[chip] = (n - used, why)
    return out
