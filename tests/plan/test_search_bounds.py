"""The search's memory caps and lower bounds are valid: the count floors under-count every
schedule's real (awaiting B, awaiting W) counts, fewer microbatches than stages included,
and the bounds never exceed the optimum the brute force finds."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from h2jax.plan import ChipProfile, Cluster, ModelShape, SearchOptions, as_schedule, exhaustive, search


@pytest.mark.parametrize(
    "schedule", ["gpipe", "1f1b", "zb-h1", "interleaved:2", "interleaved:3", "interleaved:4", "zb-v"]
)
def test_count_floors_under_count_every_placement(schedule):
    # every pipeline of p <= 9 stages, m <= 11 microbatches, every set of k positions one chip
    # type may hold (n_types - 1 stages at least left to the others): the stages ranked by
    # their count awaiting B need, for any non-negative memory per microbatch (alpha awaiting
    # B, beta awaiting W), at least what the rank's cheapest floor point needs
    rng = random.Random(0)
    weights = [(1.0, 0.0), (0.0, 1.0), (1.0, 1.0)] + [(rng.random(), rng.random()) for _ in range(6)]
    checked = 0
    for p in range(1, 10):
        for m in range(1, 12):
            sched = as_schedule(schedule)
            if sched.shape_error(p, m) is not None:  # a shape it does not run (interleaved: m % p)
                continue
            counts = sched.memory_counts(p, m)
            for n_types in range(1, p + 1):
                for k in range(1, p - n_types + 2):
                    floors = sched.count_floors(k=k, m=m, n_types=n_types, L=p)
                    for pos in itertools.combinations(range(p), k):
                        ranked = sorted((counts[s] for s in pos), key=lambda c: c[0])
                        for r, (j, q) in enumerate(ranked):
                            for a, b in weights:
                                least = min(a * fj[r] + b * fq[r] for fj, fq in floors)
                                assert a * j + b * q >= least - 1e-12, (schedule, p, m, n_types, pos, r, (j, q))
                        checked += 1
    assert checked > 900  # zb-v runs only m >= 2p - 1, interleaved only m a multiple of p: fewer shapes


def _few_microbatches():
    # a stage with one microbatch in flight holds 2 of the 8 blocks, with two only 1: with one
    # microbatch (m = 1) four stages of one chip type each hold 1 in flight, not 1, 2, 3, 4
    model = ModelShape(n_layers=8, d_model=64, n_heads=4, d_ff=128, vocab_size=256, seq_len=64, act_bytes=4)
    chip = ChipProfile(
        name="c",
        memory_gib=0.0034,
        peak_tflops=0.1,
        mem_bw_gbps=20.0,
        intra_node_gbps=10.0,
        inter_node_gbps=5.0,
        devices_per_node=4,
    )
    return Cluster(((chip, 1),), name="few_microbatches"), model


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", None])
def test_fewer_microbatches_than_stages_keeps_the_bound_valid(schedule):
    cluster, model = _few_microbatches()
    opts = SearchOptions(schedule=schedule, allow_recompute=False)
    want_plan, want, _ = exhaustive(cluster, model, global_batch=1, opts=opts)
    got = search(cluster, model, global_batch=1, opts=opts)
    assert (got.plan is None) == (want_plan is None), (got.note, want_plan)
    if want_plan is not None:
        assert math.isclose(got.iteration_s, want, rel_tol=1e-9)
        assert got.lower_bound_s <= got.iteration_s * (1 + 1e-12)


def test_fewer_microbatches_than_stages_finds_the_plan():
    cluster, model = _few_microbatches()
    got = search(cluster, model, global_batch=1, opts=SearchOptions(schedule="1f1b", allow_recompute=False))
    assert got.plan is not None, got.note  # the caps once charged the j-th stage j > m microbatches
    assert got.plan.num_microbatches == 1


def _random(seed: int):
    rng = random.Random(9000 + seed)
    chips = tuple(
        (
            ChipProfile(
                name=f"c{i}",
                memory_gib=rng.choice([0.003, 0.004, 0.006, 0.008, 0.015]),
                peak_tflops=rng.choice([0.02, 0.05, 0.1, 0.3]),
                mem_bw_gbps=rng.choice([10.0, 20.0, 40.0]),
                intra_node_gbps=rng.choice([5.0, 10.0, 50.0]),
                inter_node_gbps=rng.choice([1.0, 5.0]),
                devices_per_node=4,
            ),
            1,
        )
        for i in range(rng.choice([1, 2]))
    )
    model = ModelShape(
        n_layers=rng.randint(4, 7),
        d_model=64,
        n_heads=4,
        d_ff=128,
        vocab_size=256,
        seq_len=rng.choice([32, 64]),
        act_bytes=rng.choice([2, 4]),
    )
    opts = SearchOptions(schedule=None, max_stages_per_chip=4, allow_recompute=rng.random() < 0.5)
    return Cluster(chips, name=f"r{seed}"), model, rng.choice([1, 2, 4]), opts


# seed 0's brute force prices tens of thousands of plans (about 40 s on 2 busy cores): -m long
@pytest.mark.parametrize("seed", [pytest.param(0, marks=[pytest.mark.slow, pytest.mark.long]), *range(1, 12)])
def test_bound_below_the_brute_force_optimum_with_few_microbatches(seed):
    cluster, model, gb, opts = _random(seed)
    want_plan, want, _ = exhaustive(cluster, model, global_batch=gb, opts=opts)
    got = search(cluster, model, global_batch=gb, opts=opts)
    assert (got.plan is None) == (want_plan is None), got.note
    if want_plan is not None:
        assert math.isclose(got.iteration_s, want, rel_tol=1e-9), (got.plan, want_plan)
        assert got.lower_bound_s <= want * (1 + 1e-12)
        pinned = search(cluster, model, global_batch=gb, opts=dataclasses.replace(opts, schedule="1f1b"))
        assert pinned.lower_bound_s <= pinned.iteration_s * (1 + 1e-12)


@pytest.mark.timeout(20)
def test_root_bound_is_infinite_where_a_chip_type_holds_no_block_under_the_schedule():
    # the other chip type holds the whole model within the slot-time bound, but every chip type
    # needs a stage: no plan of this schedule exists -- the bound says so (it used to search
    # for a first feasible slot time forever: hetero_10000 at its largest microbatch, 1F1B)
    import numpy as np

    from h2jax.plan._search import ChipChoice, StageCaps, root_bound

    ONE = as_schedule("1f1b")

    def choice(chip, stages, under_1f1b, loose):
        caps = {
            ONE: StageCaps(np.array(under_1f1b, float), np.array(under_1f1b, float), 1.0),
            None: StageCaps(np.array(loose, float), np.array(loose, float), 0.5),
        }
        return ChipChoice(chip, stages, 1, 1, 1.0, 1.5, caps)

    choices = {"big": [choice("big", 2, [4, 4], [4, 4])], "small": [choice("small", 1, [0], [2])]}
    assert root_bound(choices, m=2, L=4, schedule=ONE) == math.inf
    loose = root_bound(choices, m=2, L=4, schedule=None)  # the loosest caps let "small" hold two
    assert math.isfinite(loose) and loose > 0


def test_least_fill_sum_never_exceeds_the_exact_split():
    # the cheap prune before the exact split's dynamic program: on random rows shaped like the
    # search's (inf below a chunk's least blocks and past the memory cap, steps of any size,
    # a recompute jump) it stays at or below the dynamic program's optimum, is inf exactly
    # where no split exists, and equals the optimum where every row is affine
    import numpy as np

    from h2jax.plan import _planner

    rng = np.random.default_rng(0)
    checked = affine_checked = 0
    for _ in range(400):
        L, S = int(rng.integers(2, 25)), int(rng.integers(1, 7))
        affine = rng.random() < 0.3
        fills = np.full((S, L + 1), np.inf)
        for s in range(S):
            lo, cap = int(rng.integers(1, 3)), int(rng.integers(1, L + 1))
            if affine:
                row = rng.exponential(2.0) + rng.exponential(1.0) * np.arange(L + 1)
            else:
                steps = rng.exponential(1.0, L + 1) * rng.choice([1.0, 0.0], p=[0.9, 0.1], size=L + 1)
                row = rng.exponential(2.0) + np.cumsum(steps)
                row[int(rng.integers(1, L + 1)) :] += rng.exponential(3.0)  # recompute from here on
            fills[s, lo : cap + 1] = row[lo : cap + 1]
        full = np.array([int(np.isfinite(fills[s, 1:]).nonzero()[0].max(initial=-1)) + 1 for s in range(S)])
        exact = _planner.min_split(fills, full) if full.min() >= 1 else None
        bound = _planner.least_fill_sum(np.ascontiguousarray(fills[:, 1:]), full, L)
        if exact is None:
            assert bound == math.inf  # the rows are finite on one range each: no split, no relaxed one
            continue
        checked += 1
        assert bound <= exact[0] * (1 + 1e-12), (bound, exact[0])
        if affine:
            affine_checked += 1
            assert bound == pytest.approx(exact[0], rel=1e-9)
    assert checked >= 150 and affine_checked >= 40


def test_the_compiled_split_is_the_least_over_every_split():
    # the dynamic program under the exact round (h2jax.plan._planner.min_split) against every
    # composition of L blocks into S stages within the caps, on random rows with inf entries
    import itertools

    import numpy as np

    from h2jax.plan import _planner

    rng = np.random.default_rng(1)
    found = none = 0
    for _ in range(300):
        L, S = int(rng.integers(1, 10)), int(rng.integers(1, 5))
        fills = np.cumsum(rng.exponential(1.0, (S, L + 1)), axis=1)
        fills[:, 0] = np.inf
        fills[rng.random((S, L + 1)) < 0.1] = np.inf
        caps = rng.integers(1, L + 1, S)
        best = np.inf
        for cuts in itertools.combinations(range(1, L), S - 1):
            split = [b - a for a, b in zip((0, *cuts), (*cuts, L))]
            if any(n > c for n, c in zip(split, caps)):
                continue
            best = min(best, sum(float(fills[s, n]) for s, n in enumerate(split)))
        got = _planner.min_split(fills, caps)
        if not np.isfinite(best):
            assert got is None
            none += 1
            continue
        found += 1
        assert got is not None and got[0] == pytest.approx(best, rel=1e-12)
        assert sum(got[1]) == L and all(1 <= n <= c for n, c in zip(got[1], caps))
        assert sum(float(fills[s, n]) for s, n in enumerate(got[1])) == pytest.approx(best, rel=1e-12)
    assert found >= 100 and none >= 20


def test_the_compiled_stage_rows_are_the_definition():
    # h2jax.plan._planner.stage_rows (what the exact split prices per stage and layer count)
    # against its definition in numpy, entry for entry: a stage fits l blocks without recompute
    # where mem1 + (j - 1) per_j + q per_q <= limit, else with recompute where that table fits.
    # Memory affine and growing in l, as the search prices it (the kernel's by-range path), and
    # noisy or with a count of zero (its entry-by-entry path).
    import numpy as np

    from h2jax.plan import _planner

    rng = np.random.default_rng(2)
    paths = {"by range": 0, "entry by entry": 0}
    for trial in range(400):
        L, runs = int(rng.integers(1, 12)), [int(n) for n in rng.integers(1, 4, int(rng.integers(1, 4)))]
        S = sum(runs)
        affine = trial % 2 == 0
        tables = []
        for _ in runs:
            tab = np.empty((2, 7, L + 1))
            layers = np.arange(L + 1, dtype=np.float64)
            for rc in range(2):
                v0, v1 = rng.exponential(1.0, 6), rng.exponential(1.0, 6)
                v1[:3] += v0[:3]  # time, fill and end grow with l
                tab[rc, :6] = v0[:, None] + layers * (v1 - v0)[:, None]
                if affine:
                    tab[rc, 3:6] = v0[3:6, None] + layers * rng.exponential(0.5, 3)[:, None]
                else:
                    tab[rc, 3:6] = rng.exponential(2.0, (3, L + 1))
                tab[rc, 6] = rng.uniform(1.0, 8.0)
            tables.append(tab)
        counts = np.stack([rng.integers(0 if not affine else 1, 5, S), rng.integers(0, 3, S)], axis=1)
        allow, chunks, has_fill = bool(rng.random() < 0.8), int(rng.integers(1, 3)), bool(rng.random() < 0.5)
        priced = [_planner.Pricing(tab) for tab in tables]
        assert all(p.monotone for p in priced) or not affine  # affine and growing: a threshold in l
        t, g, recompute, fill = _planner.stage_rows(priced, runs, counts.astype(np.int64), allow, chunks, has_fill)
        per_stage = [(tab, pr) for tab, pr, n in zip(tables, priced, runs) for _ in range(n)]
        for s, ((tab, pr), (j, q)) in enumerate(zip(per_stage, counts)):
            fits = tab[:, 3] + (j - 1) * tab[:, 4] + q * tab[:, 5] <= tab[:, 6]  # [flag, l]
            plain, rc = fits[0], ~fits[0] & allow & fits[1]
            want_t = np.where(plain, tab[0, 0], np.where(rc, tab[1, 0], np.inf))
            want_t[0] = np.inf
            assert np.array_equal(t[s], want_t)
            assert np.array_equal(g[s], np.where(plain, tab[0, 2], tab[1, 2]))
            assert np.array_equal(recompute[s], ~plain)
            if has_fill:
                want_f = np.where(plain, tab[0, 1], np.where(rc, tab[1, 1], np.inf))
                want_f[:chunks] = np.inf
                assert np.array_equal(fill[s], want_f)
            else:
                assert fill is None
            if not plain.any() or plain.all():
                continue  # no threshold inside the range
            paths["by range" if pr.monotone and j >= 1 and q >= 0 else "entry by entry"] += 1
    assert paths["by range"] >= 100 and paths["entry by entry"] >= 100


def test_the_compiled_caps_priced_for_the_ranks_asked_equal_the_whole_rows():
    # caps_at with `ranks` (row r of stage ranks priced for its first ranks[r] only, the search's
    # ZB-H1 caps per floor total) equals the full pricing there and is 0 after
    import numpy as np

    from h2jax.plan import _planner

    rng = np.random.default_rng(3)
    for _ in range(200):
        R, L = int(rng.integers(1, 6)), int(rng.integers(1, 20))
        mm = np.concatenate([rng.exponential(1.0, (2, 6)), rng.uniform(5.0, 50.0, (2, 1))], axis=1)
        points = [
            (rng.integers(0, 9, (R, L)).astype(float), rng.integers(0, 5, (R, L)).astype(float)) for _ in range(2)
        ]
        js, qs = [j for j, _ in points], [q for _, q in points]
        ranks = rng.integers(1, L + 1, R).astype(np.int64)
        allow = bool(rng.random() < 0.7)
        full_n, full_r = (a.reshape(R, L) for a in _planner.caps_at(mm, js, qs, L, allow))
        got_n, got_r = (a.reshape(R, L) for a in _planner.caps_at(mm, js, qs, L, allow, ranks))
        used = np.arange(L)[None, :] < ranks[:, None]
        for full, got in ((full_n, got_n), (full_r, got_r)):
            assert np.array_equal(got[used], full[used]) and not got[~used].any()


def test_data_degrees_are_the_largest_divisor_that_fits():
    # every stage count's data degree against its definition, walked over every integer: the
    # largest d dividing the microbatch with k stages of d x t devices within the chip type's
    # devices (stage_in_node: each stage inside a node, k stages packing into the nodes), and
    # with measured rows only the sequences per device they hold
    import numpy as np

    from h2jax.plan._search import data_degrees

    rng = np.random.default_rng(2)
    for _ in range(300):
        per_node = int(rng.choice([1, 2, 4, 8]))
        nodes = int(rng.integers(1, 6))
        chip = ChipProfile(name="c", memory_gib=1.0, peak_tflops=1.0, mem_bw_gbps=1.0, devices_per_node=per_node)
        tensor = int(rng.choice([t for t in (1, 2, 4, 8) if t <= per_node]))
        mb = int(rng.integers(1, 65))
        in_node = bool(rng.random() < 0.5)
        per_device = frozenset(int(x) for x in rng.integers(1, 65, 4)) if rng.random() < 0.3 else None
        kmax = int(rng.integers(1, 20))
        want = []
        for k in range(1, kmax + 1):
            top = nodes * per_node // (k * tensor)
            if in_node:
                top = min(top, per_node // tensor)
            d = next(
                (
                    d
                    for d in range(top, 0, -1)
                    if mb % d == 0
                    and (per_device is None or mb // d in per_device)
                    and not (in_node and k > nodes * (per_node // (d * tensor)))
                ),
                0,
            )
            want.append(d)
        got = data_degrees(
            chip, nodes, max_stages=kmax, tensor=tensor, microbatch=mb, stage_in_node=in_node, per_device=per_device
        )
        assert got == want, (nodes, per_node, tensor, mb, in_node, per_device)
