"""The schedule as one more dimension of HeteroAuto's space: on random small instances the
search, free to choose among the one-chunk schedules (gpipe, 1f1b, zb-h1), finds a plan as fast
as the brute force over (every plan of the space) x (every schedule), each priced by
`estimate`. The chunked schedules join the space in tests/plan/test_chunked_cost.py."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from h2jax.plan import (
    ChipProfile,
    Cluster,
    CostOptions,
    ModelShape,
    SearchOptions,
    estimate,
    exhaustive,
    search,
)

# instances whose brute force takes over 20 s on 2 busy cores (tens of thousands of plans,
# each priced three times) run with the slow tests; a few of them only with -m long (the
# suite's time on 2 cores; the default run keeps seed 2 of these and 2 on a shared host)
HEAVY = {1, 2, 16, 17, 22}
# the fast lane checks the first instances; the rest run with the slow tests
FAST = 15

ONE_RANGE = ("gpipe", "1f1b", "zb-h1")  # the one-chunk schedules


def _seeds(n: int, long: set[int]) -> list:
    out = []
    for seed in range(n):
        if seed in HEAVY:
            out.append(
                pytest.param(seed, marks=[pytest.mark.slow, pytest.mark.long] if seed in long else pytest.mark.slow)
            )
        else:
            out.append(seed if seed < FAST else pytest.param(seed, marks=pytest.mark.slow))
    return out


SEEDS = _seeds(30, long={1, 16, 17, 22})
SHARED_SEEDS = _seeds(8, long={1})


def _instance(seed: int):
    """2-3 chip types of 2-8 devices, memory tight enough that ZB-H1's extra activations
    (the microbatches awaiting W) decide whether a split fits."""
    rng = random.Random(5000 + seed)
    n_types = rng.choice([2, 2, 3])
    chips = []
    for i in range(n_types):
        chips.append(
            (
                ChipProfile(
                    name=f"c{i}",
                    memory_gib=rng.choice([0.004, 0.006, 0.008, 0.015, 0.03, 0.2]),
                    peak_tflops=rng.choice([0.02, 0.05, 0.1, 0.3]),
                    mem_bw_gbps=rng.choice([10.0, 20.0, 40.0]),
                    intra_node_gbps=rng.choice([5.0, 10.0, 50.0]),
                    inter_node_gbps=rng.choice([1.0, 5.0]),
                    devices_per_node=rng.choice([2, 4]),
                ),
                rng.choice([1, 1, 2]),
            )
        )
    model = ModelShape(
        n_layers=rng.randint(n_types, {2: 7, 3: 5}[n_types]),
        d_model=64,
        n_heads=4,
        d_ff=128,
        vocab_size=256,
        seq_len=rng.choice([32, 64]),
        act_bytes=rng.choice([2, 4]),
    )
    opts = SearchOptions(
        schedule=None,
        schedules=ONE_RANGE,
        max_stages_per_chip=2,
        stage_in_node=rng.random() < 0.5,
        max_microbatch=4,
        cost=CostOptions(grad_sync=rng.choice(["step", "microbatch"])),
    )
    return Cluster(tuple(chips), name=f"random{seed}"), model, rng.choice([4, 8]), opts


def _check(cluster, model, gb, opts):
    want_plan, want, count = exhaustive(cluster, model, global_batch=gb, opts=opts)
    got = search(cluster, model, global_batch=gb, opts=opts)
    assert count > 0
    assert (got.plan is None) == (want_plan is None), (got.plan, want_plan)
    if want_plan is None:
        return None
    assert got.exhaustive, got.note
    assert got.plan.schedule.name in ONE_RANGE
    again = estimate(got.plan, model, cluster, opts=opts.cost)
    assert again.fits, again.reasons
    assert math.isclose(again.iteration_s, got.iteration_s, rel_tol=1e-12)
    assert math.isclose(got.iteration_s, want, rel_tol=1e-9), (got.plan, got.iteration_s, want_plan, want)
    assert got.lower_bound_s <= got.iteration_s * (1 + 1e-12)
    # pinned to the schedule it chose, the search finds the same optimum
    pinned = search(cluster, model, global_batch=gb, opts=dataclasses.replace(opts, schedule=got.plan.schedule))
    assert math.isclose(pinned.iteration_s, got.iteration_s, rel_tol=1e-9)
    return got.plan.schedule


@pytest.mark.parametrize("seed", SEEDS)
def test_search_with_the_schedule_free_equals_exhaustive(seed):
    _check(*_instance(seed))


def test_zb_h1_wins_where_it_fits():
    # no brute force here: the pinned searches are exact on these spaces (the test above)
    for seed in range(6):
        cluster, model, gb, opts = _instance(seed)
        free = search(cluster, model, global_batch=gb, opts=opts)
        one = search(cluster, model, global_batch=gb, opts=dataclasses.replace(opts, schedule="1f1b"))
        assert free.iteration_s <= one.iteration_s * (1 + 1e-12)
        if free.plan.schedule.name == "zb-h1":
            return
    raise AssertionError("ZB-H1 chosen on none of the instances")


@pytest.mark.parametrize("memory_gib", [0.005, 0.008])
def test_memory_that_zb_h1_overflows_keeps_1f1b(memory_gib):
    # a 4096-token vocabulary: the last stage's pending W's each keep an fp32 logits cotangent
    # of 64 x 2 x 4096 x 4 B = 2 MiB, so at 0.005 GiB ZB-H1 fits nowhere and at 0.008 GiB only
    # with layouts slower than 1F1B's
    model = ModelShape(n_layers=4, d_model=64, n_heads=4, d_ff=128, vocab_size=4096, seq_len=64, act_bytes=4)
    spec = dict(peak_tflops=0.1, mem_bw_gbps=20, intra_node_gbps=10, inter_node_gbps=5, devices_per_node=2)
    cluster = Cluster(
        (
            (ChipProfile("a", memory_gib=memory_gib, **spec), 1),
            (ChipProfile("b", memory_gib=1.5 * memory_gib, **{**spec, "peak_tflops": 0.05}), 1),
        ),
        name="tight",
    )
    opts = SearchOptions(schedule=None, schedules=ONE_RANGE, max_stages_per_chip=2, microbatch_sizes=(2,))
    assert _check(cluster, model, 8, opts).name == "1f1b"
    zb = search(cluster, model, global_batch=8, opts=dataclasses.replace(opts, schedule="zb-h1"))
    one = search(cluster, model, global_batch=8, opts=dataclasses.replace(opts, schedule="1f1b"))
    assert zb.plan is None or zb.iteration_s > one.iteration_s


@pytest.mark.parametrize("seed", SHARED_SEEDS)
def test_search_with_the_schedule_free_equals_exhaustive_on_a_shared_host(seed):
    cluster, model, gb, opts = _instance(seed)
    cores = random.Random(7000 + seed).choice([1, 2, 4])
    cluster = Cluster(
        tuple((dataclasses.replace(p, host="h", host_cores=cores), k) for p, k in cluster.chips),
        name=cluster.name,
    )
    _check(cluster, model, gb, opts)
