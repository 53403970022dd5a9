"""Stages of one emulated node run one after another: a node is one PJRT client, and programs
on one client do not overlap (RECIPES.md). The cost model groups such stages, placed as the
runtime places them, and the steady-state period is at least their summed seconds."""

from __future__ import annotations

import dataclasses
import math

from h2jax.plan import Cluster, LayerCost, ModelShape, Plan, ProfileTable, StageSpec, estimate, load_chip
from h2jax.plan._cost import shared_clients
from h2jax.plan._profiles import PROGRAM

MODEL = ModelShape(n_layers=4, d_model=64, n_heads=4, d_ff=128, vocab_size=256, seq_len=16, act_bytes=4)


def _part(fwd: float, bwd: float, cores: float) -> LayerCost:
    return LayerCost(fwd, bwd, 1e3, 1e3, 1e3, 1e3, estimated=False, fwd_cores=cores, bwd_cores=cores)


def _cluster(nodes_a: int, cores: int) -> Cluster:
    chips = []
    for name, nodes in (("sim_a", nodes_a), ("sim_b", 1)):
        chip = load_chip(name)[0]
        chips.append((dataclasses.replace(chip, nodes=nodes, host_cores=cores), nodes))
    return Cluster(tuple(chips), name="clients")


def _table() -> ProfileTable:
    table = ProfileTable()
    parts = {
        "embed": _part(0.0, 0.0, 1.0),
        "block": _part(1.0, 2.0, 1.0),
        "head": _part(0.0, 0.0, 1.0),
        PROGRAM: _part(0.0, 0.0, 1.0),
    }
    for chip in ("sim_a", "sim_b"):
        table.add(chip, MODEL.key(), 1, 1, parts)
    return table


PLAN = Plan(
    stages=(StageSpec("sim_a", (0, 1), 1, 1), StageSpec("sim_a", (1, 2), 1, 1), StageSpec("sim_b", (2, 4), 1, 1)),
    global_batch=4,
    num_microbatches=4,
    schedule="1f1b",
)


def test_stages_on_one_node_are_grouped_as_the_runtime_places_them():
    one, two = _cluster(1, 8), _cluster(2, 8)
    assert shared_clients(PLAN, one.profiles, {p.name: n for p, n in one.chips}) == [(0, 1)]
    assert shared_clients(PLAN, two.profiles, {p.name: n for p, n in two.chips}) == []  # a node each
    real = {n: dataclasses.replace(p, emulated=False, host=None) for n, p in one.profiles.items()}
    assert shared_clients(PLAN, real) == []  # real chips: a process per stage


def test_a_shared_client_runs_its_stages_one_after_another():
    # 8 cores: no contention for cores. A block takes 3 s per microbatch (fwd 1 + bwd 2):
    # stage 0 (2 blocks) 6 s, stage 1 and stage 2 (1 block) 3 s each. On two sim_a nodes the
    # period is the slowest stage's 6 s; on one node stages 0 and 1 take turns: 9 s
    plan = dataclasses.replace(
        PLAN,
        stages=(StageSpec("sim_a", (0, 2), 1, 1), StageSpec("sim_a", (2, 3), 1, 1), StageSpec("sim_b", (3, 4), 1, 1)),
    )
    one = estimate(plan, MODEL, _cluster(1, 8), table=_table())
    two = estimate(plan, MODEL, _cluster(2, 8), table=_table())
    assert math.isclose(two.period_s, 6.0)  # the slowest stage: 2 blocks x 3 s
    assert math.isclose(one.period_s, 9.0)  # stages 0 and 1 in turn: 6 s + 3 s
    assert math.isclose(one.iteration_s - two.iteration_s, 3 * 3.0)  # (m - 1) x 3 s more
