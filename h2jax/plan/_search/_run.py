"""One search: its rounds, the best plan so far, the caches and the clock."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence

import numpy as np

from h2jax.plan._search._bounds import _Bounds, _chip_fixed_parts, _fixed_sum, _OutOfTime, root_bound
from h2jax.plan._search._options import (
    INF,
    LOCAL_STARTS,
    SEED_SLACK,
    ChipChoice,
    SearchCache,
    SearchOptions,
    _fields,
)
from h2jax.plan._search._solver import _full_time, _Solver, has_shared_host, polish_split
from h2jax.plan._search._space import (
    _Held,
    beam,
    build_plan,
    chip_choices,
    held_of,
    kept,
    microbatch_sizes,
    searched_labels,
    slot_time_bound,
)
from h2jax.plan.schedules import Schedule


class _Run:
    """One search: the best plan so far (kept across rounds, so every round prunes with it),
    the caches, and the clock."""

    def __init__(
        self,
        cluster,
        model,
        global_batch,
        table,
        opts: SearchOptions,
        deadline: float,
        start: float,
        cache: SearchCache | None = None,
    ):
        self.cluster, self.model, self.gb, self.table, self.opts = cluster, model, global_batch, table, opts
        self.deadline, self.start = deadline, start
        self.found_s = INF  # when the best plan so far was found, in seconds from `start`
        self.L = model.n_layers
        self.names = cluster.names
        self.solver = _Solver(model, cluster, table, opts, cache)
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
        self.starts: list[tuple[float, tuple[ChipChoice, ...], int, tuple[str, ...], str]] = []
        self.last_schedule: Schedule | None = None  # the schedule of evaluate's result
        self._ranked_cache: dict[int, dict] = {}
        self._helds: dict[tuple[int, str | None], list[_Held]] = {}
        self._memo: dict[tuple, tuple] = {}  # evaluate's results by (config, mb, orders, schedules, screen)
        space_opts = SearchOptions(**{**_fields(opts), "max_options_per_chip": None})
        self.space: dict[int, dict[str, list[ChipChoice]]] = {}
        caps_cache: dict = cache.caps(space_opts, len(self.names)) if cache is not None else {}
        shared = cache.choices(space_opts, len(self.names)) if cache is not None else None
        self.keep: dict = shared if shared is not None else {}  # what depends on a chip type's choices alone
        for mb in microbatch_sizes(global_batch, opts):
            choices = chip_choices(
                cluster, model, mb, space_opts, table, caps_cache, num_microbatches=global_batch // mb, keep=shared
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
            hit = self._helds[key] = [held_of(self.keep, cs, schedule) for cs in self.space[mb].values()]
        return hit

    def fixed_s(self, mb: int, schedule: Schedule) -> float:
        """The cheapest embedding and head's fill under `schedule` at microbatch `mb`."""
        key = (mb, schedule)
        hit = self._fixed.get(key)
        if hit is None:
            parts = []
            for name, cs in self.space[mb].items():  # each chip type's, kept with its choices
                mine = kept(self.keep, cs)
                part = mine.get(("fixed", schedule))
                if part is None:
                    chip = self.cluster.profile(name)
                    part = mine["fixed", schedule] = _chip_fixed_parts(
                        chip, self.model, cs, mb, self.table, (schedule,)
                    )
                parts.append(part)
            hit = self._fixed[key] = _fixed_sum(parts)
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
