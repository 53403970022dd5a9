"""Shares balanced to the sequence (h2jax.plan._balance): the split program against brute force,
and the balance of the matched-total baseline and of the search over several pipelines on real
instances: valid plans, priced as they say, never worse than the grid's split."""

from __future__ import annotations

import itertools
import random

import pytest

from h2jax.plan import Cluster, ModelShape, Searcher, estimate_pipelines, matched_total, search_pipelines
from h2jax.plan._balance import candidates, fine_split, window


def _brute(cands, total, most_sum):
    best = None
    for split in itertools.product(*(sorted(c) for c in cands)):
        if sum(split) != total:
            continue
        vals = [c[s] for c, s in zip(cands, split)]
        v = sum(vals) if most_sum else max(vals)
        if best is None or (v > best if most_sum else v < best):
            best = v
    return best


@pytest.mark.parametrize("seed", range(16))
def test_the_fine_split_is_the_best_split_of_the_candidates(seed):
    rng = random.Random(seed)
    total = rng.randint(4, 24)
    cands = [
        {s: rng.uniform(0.5, 9.0) for s in rng.sample(range(total + 1), rng.randint(1, min(8, total + 1)))}
        for _ in range(rng.randint(1, 4))
    ]
    for most_sum in (False, True):
        want = _brute(cands, total, most_sum)
        got = fine_split(cands, total, most_sum=most_sum)
        if want is None:
            assert got is None
            continue
        assert sum(got) == total and all(s in c for s, c in zip(got, cands))
        vals = [c[s] for c, s in zip(cands, got)]
        assert (sum(vals) if most_sum else max(vals)) == pytest.approx(want, rel=1e-12)


def test_candidates_are_the_plans_at_the_shares_their_microbatch_divides():
    from h2jax.plan import Plan, StageSpec

    p2 = Plan((StageSpec("a", (0, 2)), StageSpec("b", (2, 4))), global_batch=8, num_microbatches=4, schedule="1f1b")
    p3 = Plan((StageSpec("a", (0, 4)),), global_batch=9, num_microbatches=3, schedule="1f1b")
    near = window(8, 4, 12)  # two grid steps of 4 each side, within the batch: 0..12
    assert near == range(0, 13)
    got = candidates([p2, p3, p2], near, lambda p: (p.global_batch / p.microbatch_size, p), 4)
    assert got[0] == (0.0, None)
    assert sorted(s for s in got if s) == [2, 3, 4, 6, 8, 9, 10, 12]
    assert got[6][0] == 2.0 and got[6][1].microbatch_size == 3  # 3 microbatches of 2 or 2 of 3: the least
    assert all(v[1].global_batch == s for s, v in got.items() if s)


def _three(nodes: int) -> Searcher:
    cluster = Cluster.from_dict(
        {"chips": {"h100_sxm": {"nodes": nodes}, "gaudi2": {"nodes": nodes}, "a100_80gb": {"nodes": nodes}}},
        name="three",
    )
    model = ModelShape.from_config(
        {"n_layers": 8, "d_model": 1024, "n_heads": 16, "d_ff": 4096, "vocab_size": 32000, "seq_len": 8192}
    )
    return Searcher(cluster, model)


def test_pipelines_balanced_to_the_sequence_are_valid_and_no_slower_than_the_grid(monkeypatch):
    """Beyond the exact size (forced), one pipeline per chip type on a grid of 24 sequences, then
    balanced: here the balance moves the shares off the grid and makes the step faster; every
    pipeline's microbatch divides its share, and the plan costs what the result says."""
    import h2jax.plan._pipeline_search as ps

    searcher = _three(2)
    monkeypatch.setattr(ps, "EXACT_UP_TO", 0)
    balance = ps._balance
    monkeypatch.setattr(ps, "_balance", lambda s, part, times, found, unit, gb: found)
    grid = search_pipelines(searcher, 96, grid=4)
    monkeypatch.setattr(ps, "_balance", balance)
    got = search_pipelines(searcher, 96, grid=4)
    assert got.unit == grid.unit == 24
    assert got.iteration_s <= grid.iteration_s
    assert got.per_chip.iteration_s < grid.per_chip.iteration_s
    pipes = got.per_chip.plan.pipeline_plans()
    assert sum(p.global_batch for p in pipes) == 96 and any(p.global_batch % 24 for p in pipes)
    for cost in (got.cost, got.per_chip):
        assert all(p.global_batch % p.microbatch_size == 0 for p in cost.plan.pipeline_plans())
        again = estimate_pipelines(cost.plan, searcher.model, searcher.cluster)
        assert again.iteration_s == pytest.approx(cost.iteration_s, rel=1e-12)


def test_the_matched_total_balanced_to_the_sequence_lies_between_its_grid_and_every_split():
    """Three chip types at 12 sequences on a grid of 6: the balance finds a better split off the grid
    (its jobs searched at their shares), no better than the best split of single sequences."""
    from tests.plan.test_pipeline_search import _three_types

    searcher = Searcher(*_three_types(12))
    on_grid = matched_total(searcher, 12, grid=2, refine=False, balance=False)
    got = matched_total(searcher, 12, grid=2, refine=False)
    every = matched_total(searcher, 12, grid=12, refine=False, balance=False)
    assert on_grid.tokens_per_s < got.tokens_per_s <= every.tokens_per_s * (1 + 1e-12)
    assert got.grid_tokens_per_s == pytest.approx(on_grid.tokens_per_s) and got.unit == 6
    assert sum(got.shares.values()) == 12 and any(b % 6 for b in got.shares.values())
    assert all(r is None or r.plan.global_batch == got.shares[n] for n, r in got.results.items())
    assert "then balanced to the sequence (+" in got.describe()
