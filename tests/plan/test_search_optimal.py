"""HeteroAuto is exact: on random small instances the search's plan is as fast as the best
plan found by brute force over the same space (every microbatch size, stage order, per-chip
stage count and tensor degree, layer split and recompute flag), each priced by `estimate`;
and again with every chip on one shared host (emulated chips), where the host term counts."""

from __future__ import annotations

import math
import random

import pytest

from h2jax.plan import (
    ChipProfile,
    Cluster,
    CostOptions,
    ModelShape,
    SearchOptions,
    check_plan,
    estimate,
    exhaustive,
    search,
)

N_INSTANCES = 60
N_SHARED = 20
# the fast lane checks the first instances of each test; the rest run with the slow tests (the
# largest brute force among them prices about 110,000 plans: 16 s on 2 busy cores)
FAST = 20
FAST_SHARED = 10


def _seeds(n: int, fast: int) -> list:
    return [seed if seed < fast else pytest.param(seed, marks=pytest.mark.slow) for seed in range(n)]


def _instance(seed: int):
    rng = random.Random(seed)
    n_types = rng.choice([2, 2, 3])
    chips = []
    total = 0
    for i in range(n_types):
        per_node = rng.choice([2, 4])
        nodes = rng.choice([1, 1, 2])
        total += per_node * nodes
        chips.append(
            (
                ChipProfile(
                    name=f"c{i}",
                    memory_gib=rng.choice(
                        [0.004, 0.008, 0.015, 0.03, 0.2]
                    ),  # tight enough to force recompute/rejections
                    peak_tflops=rng.choice([0.02, 0.05, 0.1, 0.3]),
                    mem_bw_gbps=rng.choice([10.0, 20.0, 40.0]),
                    intra_node_gbps=rng.choice([5.0, 10.0, 50.0]),
                    inter_node_gbps=rng.choice([1.0, 5.0]),
                    devices_per_node=per_node,
                ),
                nodes,
            )
        )
    assert total <= 32
    max_layers = {2: 8, 3: 5}[n_types]
    if n_types == 2 and rng.random() < 0.25:
        max_layers = 16  # few stages, many layers
        max_per_chip = 1
    else:
        max_per_chip = 2
    model = ModelShape(
        n_layers=rng.randint(n_types, max_layers),
        d_model=64,
        n_heads=4,
        d_ff=128,
        vocab_size=256,
        seq_len=rng.choice([32, 64]),
        act_bytes=rng.choice([2, 4]),
    )
    opts = SearchOptions(
        schedule=rng.choice(["1f1b", "1f1b", "gpipe"]),
        max_stages_per_chip=max_per_chip,
        stage_in_node=rng.random() < 0.5,
        max_microbatch=4,
        cost=CostOptions(grad_sync=rng.choice(["step", "microbatch"])),
    )
    return Cluster(tuple(chips), name=f"random{seed}"), model, rng.choice([4, 8]), opts


@pytest.mark.parametrize("seed", _seeds(N_INSTANCES, FAST))
def test_search_equals_exhaustive(seed):
    cluster, model, global_batch, opts = _instance(seed)
    want_plan, want, count = exhaustive(cluster, model, global_batch=global_batch, opts=opts)
    got = search(cluster, model, global_batch=global_batch, opts=opts)
    assert count > 0
    if want_plan is None:
        assert got.plan is None, f"search found {got.plan} where brute force found nothing"
        return
    assert got.plan is not None, f"search found nothing, brute force {want} s with {want_plan}"
    assert got.exhaustive, got.note  # the defaults cover a space this small exactly
    # the search's time is the estimate of the plan it returns, and equals the brute-force optimum
    again = estimate(got.plan, model, cluster, opts=opts.cost)
    assert again.fits, again.reasons
    assert math.isclose(again.iteration_s, got.iteration_s, rel_tol=1e-12)
    assert math.isclose(got.iteration_s, want, rel_tol=1e-9), (got.plan, got.iteration_s, want_plan, want)
    assert got.lower_bound_s <= got.iteration_s * (1 + 1e-12)
    check_plan(
        got.plan,
        num_layers=model.n_layers,
        chip_devices={p.name: n * p.devices_per_node for p, n in cluster.chips},
        devices_per_node={p.name: p.devices_per_node for p, _ in cluster.chips} if opts.stage_in_node else None,
    )


@pytest.mark.parametrize("seed", _seeds(N_SHARED, FAST_SHARED))
def test_search_equals_exhaustive_on_a_shared_host(seed):
    # the same instances with every chip computing on one host of 1, 2 or 4 cores (emulated
    # chips): the contention depends on the layer split too (how much of the host each stage
    # wants while they run together), so the search improves the T_pipe-optimal split by the
    # full estimate -- and must still match the brute force
    import dataclasses

    cluster, model, global_batch, opts = _instance(seed)
    cores = random.Random(1000 + seed).choice([1, 2, 4])
    cluster = Cluster(
        tuple((dataclasses.replace(p, host="h", host_cores=cores), k) for p, k in cluster.chips), name=cluster.name
    )
    want_plan, want, _ = exhaustive(cluster, model, global_batch=global_batch, opts=opts)
    got = search(cluster, model, global_batch=global_batch, opts=opts)
    assert (got.plan is None) == (want_plan is None)
    if want_plan is not None:
        assert math.isclose(got.iteration_s, want, rel_tol=1e-9), (got.plan, got.iteration_s, want_plan, want)
        assert got.cost.host_bound_s  # the host term was priced
