"""The search: rounds of growing effort until the space is covered, the rounds stop improving, or the budget is spent."""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import time

from h2jax.plan._cost import (
    estimate,
)
from h2jax.plan._profiles import Cluster, ModelShape, ProfileTable
from h2jax.plan._search._bounds import _OutOfTime
from h2jax.plan._search._options import (
    EXACT_AFTER_LOCAL,
    EXACT_DIRECT,
    INF,
    PATIENCE,
    SearchCache,
    SearchOptions,
    SearchResult,
)
from h2jax.plan._search._run import _Run
from h2jax.plan._search._space import (
    _Held,
    build_plan,
    chip_choices,
    chip_orders,
    is_memory_descending,
    measured_rows,
    microbatch_sizes,
    order_neighbourhood,
)


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
    if run.size(None, len(orders)) <= EXACT_AFTER_LOCAL:  # no beams: the exact round soon (package docstring)
        return [*out, ("exact", None, orders)]
    width = 2
    while width < widest and run.size(width, len(neigh)) < run.size(None, len(orders)):
        out += [("beam", width, neigh), ("local", None, neigh)]
        width = width + 1 if width < 4 else width * 3 // 2  # 2, 3, 4, 6, 9, 13, ...: why, in the package docstring
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
    cache: SearchCache | None = None,
) -> SearchResult:
    """The fastest plan of the space (see module docstring) that fits, with its lower bound and
    timing. `cache`: what this search may take from earlier searches of the same model and
    table over chip types of the same cluster, and leave for later ones (the same plans as
    without it, sooner)."""
    if cache is not None:
        cache.check(model, table)
    t0 = time.perf_counter()
    deadline = t0 + opts.time_budget_s if opts.time_budget_s is not None else INF
    done: list[str] = []
    exhaustive_ = False
    lower = INF
    run: _Run | None = None
    stop = "time budget spent"
    try:
        run = _Run(cluster, model, global_batch, table, opts, deadline, t0, cache)
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
                replayed = [s.label for s in run.schedules if not s.closed_form]
                if replayed:  # ranked by the one-range (t, tail) proxy, priced by replay
                    exhaustive_ = False
                    stop += f" on the proxy of {', '.join(replayed)} (priced by replay: its split not proven optimal)"
                break
            if kind == "fixed beam":
                stop = "every configuration of the fixed beam"
                break
            if kind == "beam":
                stale = stale + 1 if run.best >= before * (1 - 1e-6) else 0
                patience = PATIENCE * (opts.time_budget_s if opts.time_budget_s is not None else INF)
                if (
                    opts.converge
                    and not patient
                    and stale >= 2
                    and math.isfinite(run.best)
                    and time.perf_counter() - t0 >= patience
                ):
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


def prove(
    cluster: Cluster,
    model: ModelShape,
    *,
    global_batch: int,
    table: ProfileTable | None = None,
    opts: SearchOptions = SearchOptions(),
    budget_s: float,
) -> SearchResult:
    """The search of `opts` run on to its exact round (no convergence stop) within `budget_s`:
    where it ends exhaustive, its plan is the optimum of the one-pipeline space, so its time
    bounds every plan of one pipeline (``h2jax plan --prove``); where the budget ends it first,
    its lower bound is the bound (``exhaustive`` says which)."""
    return search(
        cluster,
        model,
        global_batch=global_batch,
        table=table,
        opts=dataclasses.replace(opts, time_budget_s=budget_s, converge=False),
    )


def lower_bound(
    cluster: Cluster,
    model: ModelShape,
    *,
    global_batch: int,
    table: ProfileTable | None = None,
    opts: SearchOptions = SearchOptions(),
    cache: SearchCache | None = None,
) -> float:
    """The search's lower bound on every plan of its space (one pipeline over `cluster`'s chip
    types at `global_batch`; :func:`root_bound` per microbatch size and schedule, the least),
    without searching: each schedule bounded with its own caps and fills, as a search does before
    it has a plan. inf: no plan of the space holds the model. `cache`: as for :func:`search`
    (and the chip types' choices, their holdings and fills, where it keeps them)."""
    if cache is not None:
        cache.check(model, table)
    run = _Run(cluster, model, global_batch, table, opts, INF, time.perf_counter(), cache)
    return run.lower_bound(timed=False)
