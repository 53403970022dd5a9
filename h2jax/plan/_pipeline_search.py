"""The search over plans of several pipelines: how many, which chip types each, their batch shares.

A plan of several pipelines (``Plan.pipelines``) gives each group of chip types its own pipeline
on its share of every step's sequences; the step is the slowest pipeline's plus the exchange of
the layers' copies (h2jax.plan._pipelines). The space searched here:

- **groups**: a partition of the cluster's chip types, each group one pipeline on all chips of
  its types. With up to :data:`ALL_PARTITIONS_UP_TO` chip types every partition (the Bell
  number: 15 for four); with more, the partitions into runs of consecutive chip types in the
  order the one-pipeline plan puts them (2^(k-1): 128 for eight), which keeps chip types that
  the one-pipeline search found good neighbours together. The partition into one group is the
  one-pipeline plan itself (the incumbent, searched by :func:`h2jax.plan.search`).
- **shares**: each group's global batch a multiple of ``global_batch / GRID`` (the matched-total
  baseline's step, so the comparison with the chip types trained alone is on the same grid); a
  group given 0 does not train (its chips are left idle, as the baseline leaves a chip type
  whose job would add nothing). Then the splits of the :data:`BALANCE_TOP` fastest partitions (and
  one pipeline per chip type's) are balanced to the sequence near the grid's (h2jax.plan._balance:
  the same pipelines with more or fewer microbatches; the step waits for the slowest pipeline,
  and a grid step is coarse for that), priced whole and kept where faster; this runs after the
  time budget (0.2-1.4 s at 1,024-10,000 chips) and is part of the search time reported.
- **each pipeline**: its stages, meshes and schedule are the one-pipeline search's best plan of
  the group's chips at its share.

Where the space is small (at most :data:`EXACT_UP_TO` (group, share) pairs) every group is
searched at every share and every split of every partition is priced whole: the result is the
space's optimum (tests/plan/test_pipeline_search.py checks it against brute force). Beyond
that, per partition a dynamic program picks the shares that make the slowest pipeline fastest,
from each group's time at every share: a one-type group's plan at every share is searched (the
matched-total baseline's searches, shared through :class:`h2jax.plan.Searcher`); a group of
several types is searched at the share its chips' compute gives it (its peak FLOP/s over the
cluster's) and priced at the other shares with the same stages and microbatch size, more or
fewer microbatches (a valid plan, not necessarily that share's best: the search can only miss a
faster plan, never report a slower one as faster); then each group is searched at the share the
program gave it and the shares chosen again (:data:`REFINE_ROUNDS` times at most).

Each partition's chosen shares are priced whole (:func:`estimate_pipelines`: the slowest pipeline,
the exchange, the shared hosts' cores) and the fastest plan of several pipelines is returned; the
caller compares it with the one-pipeline plan. One pipeline per chip type is priced first, then
the other partitions, those whose largest group has the fewest chip types first (fewer groups
first among them) while ``time_budget_s`` lasts: a group's search costs more the more chip types
it orders (up to k! orders), and each group is searched once for every partition that holds it,
so partitions of small groups share their searches and cover the most of the space per second
(at 10,000 chips the plan the whole space's search finds is of groups of two and four types).
Each search of a group of several chip types gets at most a quarter of the budget, at least
:data:`MIN_GROUP_SEARCH_S`, and returns its best plan so far; every search shares the memory caps
and stage pricings of the others (the Searcher's :class:`h2jax.plan.SearchCache`). Where the
Searcher has worker processes (``h2jax plan``: one per core), the groups' searches at their first
share are begun on them ahead of the partitions that need them, one per free worker, and each
partition's re-searches at once. The result says how many of the space's partitions were priced.

:func:`pipelines_bound` bounds the whole space from below, the plans of one pipeline included:
each pipeline of a plan takes at least the one-pipeline search's lower bound of its group at its
share, so a partition's plans at least the least, over its splits, of its trained groups' largest
bound. It costs a bound per group and share (in one process: 7 s at 1,024 chips in 8 steps of
the batch, 33 s at 2,432 in 32, 285 s at 10,000 in 32; a share per task on the Searcher's
workers), so ``h2jax plan`` computes it under ``--prove``, within its budget.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from h2jax.plan._balance import candidates, fine_split, window
from h2jax.plan._baselines import GRID, Searcher, share_unit
from h2jax.plan._pipelines import PipelinesCost, estimate_pipelines
from h2jax.plan._plan import Plan

REFINE_ROUNDS = 2  # a partition's shares re-chosen after searching its groups at them
GROUP_SEARCHES_PER_BUDGET = 4  # under a time budget a group of several types is searched for at most 1/4 of it
MIN_GROUP_SEARCH_S = 0.2  # ... and at least this long, also past the budget (its best plan so far)
ALL_PARTITIONS_UP_TO = 4  # chip types: every partition up to this many; beyond, runs of consecutive types
BALANCE_TOP = 3  # the fastest partitions whose splits are balanced to the sequence (h2jax.plan._balance)


@dataclass(frozen=True)
class PipelinesResult:
    """What :func:`search_pipelines` found: the fastest plan of several pipelines (None: none of
    the partitions priced has a plan for every group), its cost, each pipeline's chip types and
    share, and how much of the space was priced."""

    plan: Plan | None
    cost: PipelinesCost | None
    groups: tuple[tuple[str, ...], ...]
    shares: tuple[int, ...]
    priced: int  # partitions priced
    partitions: int  # partitions in the space (every partition into two groups or more)
    search_s: float
    unit: int  # the shares' step
    every_partition: bool  # the space holds every partition (else: runs of consecutive chip types)
    per_chip: PipelinesCost | None = None  # one pipeline per chip type, the best shares (priced first)
    per_chip_link: str = ""  # the slowest link its exchange crosses, in words
    untrained: tuple[str, ...] = ()  # chip types the best plan gives no share (their chips idle)
    balanced: bool = False  # the fastest splits were balanced to the sequence (not in an exact space)

    @property
    def iteration_s(self) -> float:
        return self.cost.iteration_s if self.cost is not None else float("inf")

    def to_dict(self, matched: Any) -> dict[str, Any]:
        """What the plan's files keep of it (`matched`: the matched-total Baseline, for ratios)."""
        out: dict[str, Any] = {
            "partitions_priced": self.priced,
            "partitions": self.partitions,
            "every_partition": self.every_partition,
            "share_step": self.unit,
            "balanced_to_the_sequence": self.balanced,
            "search_s": round(self.search_s, 3),
            "best": None,
            "per_chip": None,
        }
        if self.cost is not None:
            out["best"] = {
                "pipelines": [{"chips": list(g), "global_batch": b} for g, b in zip(self.groups, self.shares)],
                "iteration_s": round(self.cost.iteration_s, 4),
                "exchange_s": round(self.cost.exchange_s, 4),
                "exchange_overlap_s": round(self.cost.exchange_overlap_s, 4),
                "tokens_per_s": round(self.cost.tokens_per_s, 1),
                "ratio_matched_total": round(matched.ratio(self.cost.tokens_per_s), 4),
            }
            if self.cost.exchange_note:
                out["best"]["exchange_note"] = self.cost.exchange_note
        if self.per_chip is not None:
            out["per_chip"] = {
                "shares": {p.stages[0].chip: p.global_batch for p in self.per_chip.plan.pipeline_plans()},
                "iteration_s": round(self.per_chip.iteration_s, 4),
                "exchange_s": round(self.per_chip.exchange_s, 4),
                "exchange_overlap_s": round(self.per_chip.exchange_overlap_s, 4),
                "ratio_matched_total": round(matched.ratio(self.per_chip.tokens_per_s), 4),
            }
        return out

    def describe(self) -> str:
        """ "2 pipelines: gaudi2 at 192, h100_sxm at 320 (of 512)"; the chip types not trained named."""
        if self.plan is None:
            return "no plan of several pipelines"
        parts = [f"{'+'.join(g)} at {b}" for g, b in zip(self.groups, self.shares)]
        n = len(self.groups)
        idle = f"; {', '.join(self.untrained)} not trained" if self.untrained else ""
        return f"{n} pipeline{'s' if n > 1 else ''}: {', '.join(parts)} (of {sum(self.shares)}{idle})"


def set_partitions(items: Sequence[str]) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every partition of `items` into non-empty groups (each group in `items`' order)."""
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield ((first,), *part)
        for i in range(len(part)):
            yield (*part[:i], (first, *part[i]), *part[i + 1 :])


def runs(order: Sequence[str]) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every partition of `order` into runs of consecutive items."""
    n = len(order)
    for cuts in range(1 << (n - 1)):
        groups, start = [], 0
        for i in range(1, n):
            if cuts >> (i - 1) & 1:
                groups.append(tuple(order[start:i]))
                start = i
        groups.append(tuple(order[start:]))
        yield tuple(groups)


def space(names: Sequence[str], order: Sequence[str]) -> tuple[list[tuple[tuple[str, ...], ...]], bool]:
    """The partitions searched (module docstring), two groups or more, in the order they are
    priced (the largest group's chip types, then the group count, fewest first); and whether
    they are every partition."""
    every = len(names) <= ALL_PARTITIONS_UP_TO
    parts = list(set_partitions(list(names))) if every else list(runs(list(order)))
    parts = [p for p in parts if len(p) > 1]
    parts.sort(key=lambda p: (max(map(len, p)), len(p)))
    return parts, every


class _Groups:
    """Each group's plans and iteration seconds at every share (module docstring), kept: a
    group's time at a share is the fastest of the plans searched for it at any share, each
    priced at this one with its own stages and microbatch size."""

    def __init__(
        self,
        searcher: Searcher,
        global_batch: int,
        unit: int,
        *,
        exact: bool = False,
        deadline: float | None = None,
        budget_s: float = 0.0,
    ):
        self.searcher, self.gb, self.unit, self.exact = searcher, global_batch, unit, exact
        self.deadline = deadline  # perf_counter time: a group of several types is searched within what is left
        self.budget_s = budget_s
        cluster = searcher.cluster
        self.flops = {c: cluster.devices(c) * cluster.profile(c).peak_tflops for c in cluster.names}
        self.searched: dict[tuple[str, ...], set[int]] = {}
        self._times: dict[tuple[str, ...], list[tuple[float, Plan] | None]] = {}

    def nominal(self, group: tuple[str, ...]) -> int:
        """The steps of the share the group's compute gives it (its peak FLOP/s over the cluster's)."""
        g = self.gb // self.unit
        share = sum(self.flops[c] for c in group) / sum(self.flops.values())
        return min(g, max(1, round(share * g)))

    def __call__(self, group: tuple[str, ...]) -> list[tuple[float, Plan] | None]:
        """[(seconds, plan) or None] at j steps of the share, j = 0 .. global_batch / unit."""
        if group not in self._times:
            g = self.gb // self.unit
            self._times[group] = [None] * (g + 1)
            for j in range(1, g + 1) if len(group) == 1 or self.exact else (self.nominal(group),):
                self.search(group, j)
        return self._times[group]

    def budget(self, group: tuple[str, ...]) -> float | None:
        """The seconds a search of `group` may take now (module docstring; None: its options')."""
        if self.deadline is None or len(group) < 2:
            return None
        left = self.deadline - time.perf_counter()
        return max(MIN_GROUP_SEARCH_S, min(left, self.budget_s / GROUP_SEARCHES_PER_BUDGET))

    def start(self, group: tuple[str, ...], j: int) -> None:
        """Begin the search of `group` at j steps on the Searcher's workers (:meth:`search` takes it)."""
        if j not in self.searched.get(group, ()):
            self.searcher.start(group, j * self.unit, time_budget_s=self.budget(group))

    def search(self, group: tuple[str, ...], j: int) -> None:
        """Search the group at j steps (once) and price its plan at every share."""
        done = self.searched.setdefault(group, set())
        if j in done:
            return
        done.add(j)
        s = self.searcher
        r = s(group, j * self.unit, time_budget_s=self.budget(group))
        if r.plan is None:
            return
        times = self._times[group]
        if self.exact or (len(group) == 1 and r.exhaustive):
            # each share's own best plan: exhaustive, no plan of the space at j is faster (and a
            # group of one type is searched at every share, so its plan is no share's but j's best)
            times[j] = (r.iteration_s, r.plan)
            return
        shares = range(self.unit, self.gb + 1, self.unit)
        for b, (t, p) in candidates([r.plan], shares, lambda p: _seconds(s, p, r), s.model.n_layers).items():
            k = b // self.unit
            if times[k] is None or t < times[k][0]:
                times[k] = (t, p)


def _seconds(searcher: Searcher, plan: Plan, found: Any = None) -> tuple[float, Plan] | None:
    """(iteration seconds, plan) of one pipeline of a plan of several, None where it does not fit;
    `found`: a search's result, whose own plan is priced already."""
    from h2jax.plan._cost import estimate

    s = searcher
    c = found.cost if found is not None and plan is found.plan else None
    if c is None:
        c = estimate(plan, s.model, s.cluster, table=s.table, opts=s.opts.cost)
    return (c.iteration_s, plan) if c.fits else None


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write `total` as `parts` integers >= 0, in order (a 0: that group does not train)."""
    if parts == 1:
        yield (total,)
        return
    for j in range(total + 1):
        for rest in compositions(total - j, parts - 1):
            yield (j, *rest)


def best_shares(times: Sequence[Sequence[tuple[float, Any] | None]], g: int) -> tuple[int, ...] | None:
    """The steps of each group (each >= 0, adding up to g; 0: the group does not train) that make
    the slowest group fastest, by a dynamic program over the groups; None where no such split has
    a plan for every group it gives a share."""
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for t in times:
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for used, (slowest, js) in best.items():
            for j in range(g + 1 - used):
                if j and t[j] is None:
                    continue
                cand = (max(slowest, t[j][0]) if j else slowest, (*js, j))
                if used + j not in nxt or cand[0] < nxt[used + j][0]:
                    nxt[used + j] = cand
        best = nxt
    return best[g][1] if g in best else None


EXACT_UP_TO = 64  # (group, share) searches: every group searched at every share, every split priced


def exact_space(parts: Sequence[tuple[tuple[str, ...], ...]], g: int) -> bool:
    """Whether the space is small enough to search every group at every share and price every
    split (then the result is the space's optimum: tests/plan/test_pipeline_search.py)."""
    return len({grp for part in parts for grp in part}) * g <= EXACT_UP_TO


def _price(searcher: Searcher, part: tuple, times: list, js: Sequence[int], unit: int) -> tuple | None:
    """(cost, groups, shares) of one split of one partition (`js` grid steps), priced whole."""
    return _price_plans(searcher, [(j * unit, grp, t[j][1]) for j, grp, t in zip(js, part, times) if j])


def _price_plans(searcher: Searcher, pipes: Sequence[tuple[int, tuple[str, ...], Plan]]) -> tuple | None:
    """(cost, groups, shares) of the pipelines `pipes` ((share, group, plan), the untrained left
    out), priced whole; the largest share's pipeline first (it owns every layer: the exchange's
    hub; ties in the partition's order)."""
    ranked = sorted(pipes, key=lambda x: -x[0])
    plan = Plan(pipelines=tuple(p for _, _, p in ranked))
    cost = estimate_pipelines(plan, searcher.model, searcher.cluster, table=searcher.table, opts=searcher.opts.cost)
    if not cost.fits:
        return None
    return cost, tuple(grp for _, grp, _ in ranked), tuple(b for b, _, _ in ranked)


def _balance(searcher: Searcher, part: tuple, times: list, found: tuple, unit: int, global_batch: int) -> tuple | None:
    """`found` (cost, groups, shares: one split of `part`, whose groups' tables are `times`) with
    its shares balanced to the sequence (h2jax.plan._balance): each group's plans at the grid
    shares near its share, taken at every share near it, the split whose slowest pipeline is
    fastest, priced whole (the exchange included); the faster of it and `found`."""
    s = searcher
    given = dict(zip(found[1], found[2]))
    cands = []
    for grp, t in zip(part, times):
        near = window(given.get(grp, 0), unit, global_batch)
        plans = [t[k][1] for k in range(1, len(t)) if t[k] is not None and k * unit in near]
        cands.append(candidates(plans, near, lambda p: _seconds(s, p), s.model.n_layers))
    split = fine_split([{b: v for b, (v, _) in c.items()} for c in cands], global_batch)
    if split is None or all(given.get(grp, 0) == b for grp, b in zip(part, split)):
        return found
    return _better(found, _price_plans(s, [(b, grp, c[b][1]) for b, grp, c in zip(split, part, cands) if b]))


def _better(a: tuple | None, b: tuple | None) -> tuple | None:
    """The faster of two priced splits (the first on a tie)."""
    if b is None:
        return a
    return b if a is None or b[0].iteration_s < a[0].iteration_s else a


def _partitions(
    names: Sequence[str], order: Sequence[str] | None, max_pipelines: int | None
) -> tuple[list[tuple[tuple[str, ...], ...]], bool, tuple | None]:
    """:func:`space` with at most `max_pipelines` groups, one pipeline per chip type first (and
    returned apart: None where the space lacks it); `order` as :func:`search_pipelines` takes it."""
    order = [c for c in (order or []) if c in names]
    order += [c for c in names if c not in order]
    parts, every = space(names, order)
    if max_pipelines:
        parts = [p for p in parts if len(p) <= max_pipelines]
    singles = next((p for p in parts if all(len(grp) == 1 for grp in p)), None)
    if singles is not None:
        parts.remove(singles)
        parts.insert(0, singles)
    return parts, every, singles


def search_pipelines(
    searcher: Searcher,
    global_batch: int,
    *,
    order: Sequence[str] | None = None,
    time_budget_s: float | None = None,
    max_pipelines: int | None = None,
    grid: int = GRID,
) -> PipelinesResult:
    """The fastest plan of several pipelines in the space of the module docstring. `order`: the
    chip types in the one-pipeline plan's stage order (the runs' order with more than
    :data:`ALL_PARTITIONS_UP_TO` types; the cluster's order where None or partial).
    `max_pipelines`: partitions into at most this many groups (None: any). One pipeline per chip
    type is priced first (its searches are the matched-total baseline's), then the others in
    :func:`space`'s order, while `time_budget_s` lasts (None or 0: no limit)."""
    t0 = time.perf_counter()
    cluster = searcher.cluster
    names = list(cluster.names)
    unit = share_unit(global_batch, grid)
    g = global_batch // unit
    parts, every, singles = _partitions(names, order, max_pipelines)
    exact = exact_space(parts, g)
    deadline = t0 + time_budget_s if time_budget_s else None
    groups = _Groups(searcher, global_batch, unit, exact=exact, deadline=deadline, budget_s=time_budget_s or 0.0)
    # the groups of several types at their first share, in the order the partitions need them:
    # begun on the Searcher's workers (if any) while one is free
    ahead = [] if exact else list(dict.fromkeys(grp for part in parts for grp in part if len(grp) > 1))
    best = per_chip = None
    priced = 0
    tried: list[tuple] = []  # (cost, groups, shares) of each partition's split, the partition, its tables
    for part in parts:
        if time_budget_s and priced and time.perf_counter() - t0 > time_budget_s:
            break
        while ahead and searcher.running() < searcher.workers:
            grp = ahead.pop(0)
            groups.start(grp, groups.nominal(grp))
        priced += 1
        times = [groups(grp) for grp in part]
        if exact:  # every split priced whole
            splits = [js for js in compositions(g, len(part)) if all(t[j] is not None for t, j in zip(times, js) if j)]
        else:
            js = best_shares(times, g)
            for _ in range(REFINE_ROUNDS):  # search each group at the share it was given, if not yet
                todo = [(grp, j) for grp, j in zip(part, js or ()) if j and j not in groups.searched[grp]]
                if not todo:
                    break
                for grp, j in todo:  # at once, where the Searcher has workers
                    groups.start(grp, j)
                for grp, j in todo:
                    groups.search(grp, j)
                js = best_shares(times, g)
            splits = [js] if js is not None else []
        for js in splits:
            found = _price(searcher, part, times, js, unit)
            best = _better(best, found)
            if part == singles:
                per_chip = _better(per_chip, found)
            if found is not None and not exact:
                tried.append((found, part, times))
    searcher.cancel_started()
    # the fastest few partitions' splits (and one pipeline per chip type's) balanced to the sequence
    tried.sort(key=lambda x: x[0][0].iteration_s)
    for found, part, times in tried[:BALANCE_TOP] + [x for x in tried[BALANCE_TOP:] if x[1] == singles]:
        balanced = _balance(searcher, part, times, found, unit, global_batch)
        best = _better(best, balanced)
        if part == singles:
            per_chip = _better(per_chip, balanced)
    slowest = min(names, key=lambda c: cluster.profile(c).inter_node_gbps)
    return PipelinesResult(
        plan=best[0].plan if best else None,
        cost=best[0] if best else None,
        groups=best[1] if best else (),
        shares=best[2] if best else (),
        priced=priced,
        partitions=len(parts),
        search_s=time.perf_counter() - t0,
        unit=unit,
        every_partition=every,
        per_chip=per_chip[0] if per_chip else None,
        untrained=tuple(c for c in names if best and not any(c in grp for grp in best[1])),
        balanced=bool(tried) and unit > 1,
        per_chip_link=f"{slowest}'s inter-node link at most, {cluster.profile(slowest).inter_node_gbps:g} GB/s",
    )


@dataclass(frozen=True)
class PipelinesBound:
    """What :func:`pipelines_bound` found: no plan of the partitions it bounded is faster than
    ``bound_s``; where that is reached (the partition and shares whose pipelines' bounds are
    least); how many of the space's partitions it bounded (the one pipeline counted as one)."""

    bound_s: float  # inf: no plan of the partitions bounded holds the model
    groups: tuple[tuple[str, ...], ...]
    shares: tuple[int, ...]
    bounded: int
    partitions: int
    every_partition: bool  # the space holds every partition (else: runs of consecutive chip types)
    seconds: float

    @property
    def complete(self) -> bool:
        """Every partition of the space bounded: the bound holds for every plan of it."""
        return self.bounded == self.partitions

    def describe(self) -> str:
        """ "2 pipelines: gaudi2 at 192, h100_sxm at 320" (or "one pipeline at 512")."""
        if len(self.groups) == 1:
            return f"one pipeline at {self.shares[0]}"
        parts = [f"{'+'.join(g)} at {b}" for g, b in zip(self.groups, self.shares) if b]
        idle = [c for g, b in zip(self.groups, self.shares) if not b for c in g]
        rest = f" ({', '.join(idle)} not trained)" if idle else ""
        return f"{len(parts)} pipeline{'s' if len(parts) > 1 else ''}: {', '.join(parts)}{rest}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "bound_s": round(self.bound_s, 4) if self.bound_s < float("inf") else None,
            "at": self.describe() if self.groups else None,
            "partitions_bounded": self.bounded,
            "partitions": self.partitions,
            "every_partition": self.every_partition,
            "seconds": round(self.seconds, 3),
        }


def pipelines_bound(
    searcher: Searcher,
    global_batch: int,
    *,
    order: Sequence[str] | None = None,
    max_pipelines: int | None = None,
    grid: int = GRID,
    budget_s: float | None = None,
) -> PipelinesBound:
    """A lower bound on the step of every plan of :func:`search_pipelines`'s space (the same
    `order`, `max_pipelines` and `grid`), the plans of one pipeline included.

    A plan of several pipelines takes at least its slowest pipeline's own iteration
    (h2jax.plan._pipelines: the slowest pipeline, then what the exchange adds), and each of its
    pipelines is a plan of one pipeline over its group's chips at its share, so it takes at
    least the search's lower bound of that group at that share
    (:meth:`h2jax.plan.Searcher.lower_bound`, the search's own space and options). So a
    partition's plans take at least the least, over its splits of the batch, of the largest of
    its trained groups' bounds (:func:`best_shares`, the search's own program over the splits,
    on the bounds), and the space's at least the least over its partitions and the one pipeline
    (the whole cluster's bound at the whole batch). It bounds the plans whose shares are on the
    grid: the splits :func:`search_pipelines` balances to the sequence lie off it and are not
    covered (a group's bound at every share would cost the grid's step times more). It leaves out
    the exchange and is as loose
    as the one-pipeline bounds it is made of (h2jax.plan._search: on mid-size instances the
    one-pipeline optimum lies 20-80 % above its bound).

    `budget_s`: the one pipeline first, then every group at each share in turn
    (:meth:`h2jax.plan.Searcher.bound_batches`: one share a task on the Searcher's workers) while
    it lasts (None or 0: no limit); where it ends first, the bound holds for the one pipeline only
    (``complete`` says so).
    """
    t0 = time.perf_counter()
    names = list(searcher.cluster.names)
    unit = share_unit(global_batch, grid)
    g = global_batch // unit
    parts, every, _ = _partitions(names, order, max_pipelines)
    whole = tuple(names)
    best = (searcher.lower_bound(whole, global_batch), (whole,), (global_batch,))
    groups = list(dict.fromkeys(grp for part in parts for grp in part))
    shares = [j * unit for j in range(1, g + 1)]
    complete = searcher.bound_batches(groups, shares, deadline=t0 + budget_s if budget_s else None)
    tables: dict[tuple[str, ...], list[tuple[float, None] | None]] = {}
    for grp in groups if complete else ():
        bounds = [searcher.lower_bound(grp, b) for b in shares]
        tables[grp] = [None] + [(b, None) if b < float("inf") else None for b in bounds]
    for part in parts if complete else ():
        times = [tables[grp] for grp in part]
        js = best_shares(times, g)
        if js is None:
            continue
        value = max(t[j][0] for t, j in zip(times, js) if j)
        if value < best[0]:
            best = (value, part, tuple(j * unit for j in js))
    return PipelinesBound(
        bound_s=best[0],
        groups=best[1] if best[0] < float("inf") else (),
        shares=best[2] if best[0] < float("inf") else (),
        bounded=len(parts) + 1 if complete else 1,
        partitions=len(parts) + 1,
        every_partition=every,
        seconds=time.perf_counter() - t0,
    )
