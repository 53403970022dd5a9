"""Lower bounds that prune the search: per schedule, per microbatch size, per configuration."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from h2jax.plan import _planner
from h2jax.plan._cost import (
    part_costs,
    part_fill_s,
)
from h2jax.plan._profiles import ChipProfile, ModelShape, ProfileTable
from h2jax.plan._search._options import INF, ChipChoice
from h2jax.plan._search._space import _Held, slot_time_bound
from h2jax.plan.schedules import Schedule

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


def _chip_fixed_parts(
    chip: ChipProfile,
    model: ModelShape,
    choices: Sequence[ChipChoice],
    mb: int,
    table: ProfileTable | None,
    schedules: Sequence[Schedule],
) -> tuple[float, float]:
    """(the cheapest embedding, the cheapest head) over one chip type's choices (inf: none): fwd +
    bwd, less the W a split schedule hides. Stage 0 and the last stage run them besides their
    blocks, whatever the plan, so the least of each over the chip types bounds what every plan
    adds (:func:`_fixed_sum`)."""
    emb, head = INF, INF
    for t, d in {(c.tensor, c.data) for c in choices}:
        parts = part_costs(model, chip, table, tensor=t, microbatch_per_device=max(1, mb // d))
        emb = min(emb, part_fill_s(model, "embed", parts["embed"], tensor=t, schedules=schedules))
        head = min(head, part_fill_s(model, "head", parts["head"], tensor=t, schedules=schedules))
    return emb, head


def _fixed_sum(parts: Sequence[tuple[float, float]]) -> float:
    """The cheapest embedding plus the cheapest head, from each chip type's :func:`_chip_fixed_parts`."""
    emb = min((e for e, _ in parts), default=INF)
    head = min((h for _, h in parts), default=INF)
    return (emb if math.isfinite(emb) else 0.0) + (head if math.isfinite(head) else 0.0)
