"""The reference: every plan of the same space, priced one by one."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from h2jax.plan._cost import (
    estimate,
    expand_chunks,
)
from h2jax.plan._plan import (
    Plan,
)
from h2jax.plan._profiles import Cluster, ModelShape, ProfileTable
from h2jax.plan._search._options import INF, SearchOptions
from h2jax.plan._search._space import build_plan, chip_choices, chip_orders, microbatch_sizes, searched_labels
from h2jax.plan.schedules import as_schedule

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
