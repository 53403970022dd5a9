"""The cost of a job of several pipelines, and the plan of one pipeline per chip type.

A job of several pipelines (``Plan.pipelines``) runs its pipelines at once, each on its own
chips and its share of the step's sequences; the step ends when the slowest pipeline's last
update has run and every layer's copies have been summed and copied back. So its time is

    max over pipelines of its own iteration (h2jax.plan.estimate of that pipeline alone)
    + the exchange across pipelines

where the exchange prices what the runtime does (h2jax.runtime._tied): each layer's gradient
sent from every other pipeline's copy to the first pipeline's, added there, and the new values
and moments (three times the gradient's bytes, fp32) sent back; each stage of the first pipeline
receives its layers' shares one pipeline after the other over the slowest inter-node link of
the chip types involved, the stages in parallel. Not overlapped with the backward (the runtime
sums after the step's last backward).

With shared hosts (emulated chips) the pipelines' stages also share the host's cores: the step
is at least every pipeline's host work over the cores, as for one pipeline (h2jax.plan._cost).

:func:`per_chip_pipelines` builds the plan the issue calls the floor of the sum of the parts: one
pipeline per chip type, each the search's best plan of that chip type alone at its share of the
global batch, the shares chosen (in multiples of a step) to make the slowest pipeline fastest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from h2jax.plan._plan import Plan

GRID = 8  # per_chip_pipelines: shares in multiples of global_batch / GRID (the matched-total baseline's: its searches serve both)


@dataclass(frozen=True)
class PipelinesCost:
    """What :func:`estimate_pipelines` gives: each pipeline's cost, the exchange and the step."""

    plan: Plan
    pipelines: tuple[Any, ...]  # each pipeline's PlanCost
    exchange_s: float
    iteration_s: float
    tokens_per_step: int
    devices_by_chip: dict[str, int]
    cluster_devices_by_chip: dict[str, int]
    reasons: list[str] = field(default_factory=list)
    host_bound_s: float = 0.0

    @property
    def fits(self) -> bool:
        return not self.reasons

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.iteration_s if self.iteration_s > 0 else 0.0


def exchange_s(plan: Plan, model: Any, profiles: dict[str, Any]) -> float:
    """Seconds of the exchange across ``plan``'s pipelines (module docstring); 0 for one pipeline."""
    pipes = plan.pipeline_plans()
    if len(pipes) < 2:
        return 0.0
    chips = {s.chip for s in plan.stages}
    bw = min(profiles[c].inter_node_gbps for c in chips) * 1e9  # bytes/s
    first = pipes[0]
    worst = 0.0
    for i, s in enumerate(first.stages):
        params = s.num_layers * model.block_params
        if i == 0:
            params += model.embed_params
        if i == first.num_stages - 1:
            params += model.embed_params  # the head (untied: its own table-sized matrix)
        grads = 4 * params  # fp32
        worst = max(worst, (len(pipes) - 1) * (grads + 3 * grads) / bw)
    return worst


def estimate_pipelines(plan: Plan, model: Any, cluster: Any, *, table: Any = None, opts: Any = None) -> PipelinesCost:
    """Price a plan of one or several pipelines (module docstring)."""
    from h2jax.plan._cost import CostOptions, estimate

    opts = opts if opts is not None else CostOptions()
    costs = tuple(estimate(p, model, cluster, table=table, opts=opts) for p in plan.pipeline_plans())
    profiles = cluster.profiles
    x = exchange_s(plan, model, profiles)
    step = max(c.iteration_s for c in costs) + x
    work: dict[str, float] = {}
    cores: dict[str, int] = {}
    for c in costs:
        for h, w in c.host_work_s.items():
            work[h] = work.get(h, 0.0) + w
            cores[h] = c.host_cores[h]
    bound = max((work[h] / cores[h] for h in work), default=0.0)
    used: dict[str, int] = {}
    for s in plan.stages:
        used[s.chip] = used.get(s.chip, 0) + s.num_devices
    reasons = [f"pipeline {p}: {r}" for p, c in enumerate(costs) for r in c.reasons]
    for chip, n in used.items():
        if n > cluster.devices(chip):
            reasons.append(f"the pipelines use {n} {chip} chips, the cluster has {cluster.devices(chip)}")
    return PipelinesCost(
        plan=plan,
        pipelines=costs,
        exchange_s=x,
        iteration_s=max(step, bound),
        tokens_per_step=plan.global_batch * model.seq_len,
        devices_by_chip=used,
        cluster_devices_by_chip={c: cluster.devices(c) for c in cluster.names},
        reasons=reasons,
        host_bound_s=bound,
    )


def per_chip_pipelines(searcher: Any, global_batch: int, *, grid: int = GRID) -> tuple[Plan | None, dict[str, int]]:
    """One pipeline per chip type (module docstring): (the plan, each chip type's share; 0: not
    used), or (None, {}) when no split gives every used chip type a plan. ``searcher``:
    h2jax.plan.Searcher (each chip type's best plan alone at a batch, searched once)."""
    from h2jax.plan._baselines import share_unit

    names = list(searcher.cluster.names)
    unit = share_unit(global_batch, grid)
    g = global_batch // unit

    def time_of(chip: str, j: int) -> float | None:
        if j == 0:
            return 0.0
        r = searcher(chip, j * unit)
        return r.iteration_s if r.plan is not None else None

    # best[j] = (the slowest pipeline's time, units per chip type so far) with j units given out
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for n in names:
        times = [time_of(n, j) for j in range(g + 1)]
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for used, (slowest, units) in best.items():
            for j in range(g + 1 - used):
                if times[j] is None:
                    continue
                cand = (max(slowest, times[j]), (*units, j))
                if used + j not in nxt or cand[0] < nxt[used + j][0]:
                    nxt[used + j] = cand
        best = nxt
    if g not in best:
        return None, {}
    shares = {n: j * unit for n, j in zip(names, best[g][1])}
    pipes = tuple(searcher(n, b).plan for n, b in shares.items() if b)
    plan = pipes[0] if len(pipes) == 1 else Plan(pipelines=pipes)
    return plan, shares
