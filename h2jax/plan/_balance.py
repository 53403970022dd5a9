"""Shares balanced to the sequence: a split searched on a grid of the global batch, re-chosen
sequence by sequence near it with the plans already found.

The matched-total baseline (h2jax.plan._baselines) and the search over several pipelines
(h2jax.plan._pipeline_search) choose each chip type's or pipeline's share of the global batch
as a multiple of a grid step (``global_batch / 32`` at most), since every share they consider
costs a search. How fast a job of several pipelines runs depends on its pipelines' balance (the
step waits for the slowest), and a grid step is coarse for that: at 10,000 chips a step of 64
sequences left a pipeline idle a fifth of each step (docs/LOG.md, session 46). So after the grid
the split is re-chosen near it, in single sequences, without searching: each plan found at a
grid share within :data:`WINDOW` steps of the chosen one is taken at every share of that window
that its microbatch size divides (:func:`rebatch`: the same stages and schedule, more or fewer
microbatches -- a valid plan, priced by the same cost model, not necessarily that share's
best), and a program over the groups picks the split (:func:`fine_split`). A share may also
fall to 0 or rise from it where the window reaches it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from h2jax.plan._plan import Plan, PlanError, check_plan

WINDOW = 2  # grid steps each side of a chosen share that the balance to the sequence looks at


def rebatch(plan: Plan, global_batch: int, num_layers: int) -> Plan | None:
    """`plan` with the same stages, schedule and microbatch size at `global_batch` (more or fewer
    microbatches); None where the size does not divide it or the schedule refuses the count."""
    mb = plan.microbatch_size
    if global_batch <= 0 or global_batch % mb:
        return None
    if global_batch == plan.global_batch:
        return plan
    try:
        p = Plan(plan.stages, global_batch=global_batch, num_microbatches=global_batch // mb, schedule=plan.schedule)
        check_plan(p, num_layers=num_layers)
    except (PlanError, ValueError):
        return None
    return p


def window(share: int, unit: int, total: int) -> range:
    """The shares the balance looks at for a group given `share` on a grid of step `unit`."""
    return range(max(0, share - WINDOW * unit), min(total, share + WINDOW * unit) + 1)


def candidates(plans: Sequence[Plan], shares: range, price: Any, num_layers: int) -> dict[int, tuple[float, Any]]:
    """{share: (value, what price returned)} over `shares`: each of `plans` (distinct) rebatched at
    every share its microbatch size divides, priced by ``price(plan) -> (value, payload) or None``
    (None: it does not fit), the least value kept; share 0 is (0.0, None) where it is in `shares`."""
    out: dict[int, tuple[float, Any]] = {0: (0.0, None)} if 0 in shares else {}
    seen: set[tuple] = set()
    for p0 in plans:
        key = (p0.stages, p0.microbatch_size, p0.schedule)
        if key in seen:
            continue
        seen.add(key)
        for s in shares:
            p = rebatch(p0, s, num_layers) if s else None
            if p is None:
                continue
            v = price(p)
            if v is not None and (s not in out or v[0] < out[s][0]):
                out[s] = v
    return out


def fine_split(cands: Sequence[Mapping[int, float]], total: int, *, most_sum: bool = False) -> tuple[int, ...] | None:
    """One share per group from its candidates ({share: value}) adding up to `total`: the split
    whose largest value is least (the pipelines' seconds: the slowest made fastest), or with
    `most_sum` whose values add up to the most (the baseline's tokens/s); None where no split of
    the candidates adds up to `total`. A program over the groups, one array of `total` + 1
    partial sums per group."""
    bad = -np.inf if most_sum else np.inf
    best = np.full(total + 1, bad)
    best[0] = 0.0
    back: list[np.ndarray] = []
    for c in cands:
        nxt = np.full(total + 1, bad)
        arg = np.full(total + 1, -1, dtype=np.int64)
        for s, v in sorted(c.items()):
            if s > total:
                continue
            prev = best[: total + 1 - s]
            val = prev + v if most_sum else np.maximum(prev, v)
            seg = nxt[s:]
            better = val > seg if most_sum else val < seg
            seg[better] = val[better]
            arg[s:][better] = s
        back.append(arg)
        best = nxt
    if not np.isfinite(best[total]):
        return None
    out, used = [], total
    for arg in reversed(back):
        s = int(arg[used])
        out.append(s)
        used -= s
    return tuple(reversed(out))
