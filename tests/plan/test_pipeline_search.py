"""The search over plans of several pipelines (h2jax.plan._pipeline_search): its space, the share
program, and the whole search against brute force on small instances."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest
import yaml

from h2jax.plan import (
    Cluster,
    ModelShape,
    Plan,
    Searcher,
    StageSpec,
    estimate_pipelines,
    lower_bound,
    pipelines_bound,
    same_batch,
    search,
    search_pipelines,
)
from h2jax.plan._balance import rebatch
from h2jax.plan._pipeline_search import best_shares, compositions, exact_space, runs, set_partitions, space
from h2jax.plan._search import SearchCache

ROOT = Path(__file__).resolve().parents[2]
BELL = {1: 1, 2: 2, 3: 5, 4: 15, 5: 52}


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_set_partitions_are_every_partition_once(k):
    items = [f"c{i}" for i in range(k)]
    parts = list(set_partitions(items))
    assert len(parts) == BELL[k]
    canon = {frozenset(frozenset(g) for g in p) for p in parts}
    assert len(canon) == len(parts)  # no partition twice
    for p in parts:
        assert sorted(x for g in p for x in g) == sorted(items) and all(g for g in p)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_runs_are_the_partitions_into_consecutive_items(k):
    order = [f"c{i}" for i in range(k)]
    got = list(runs(order))
    assert len(got) == 2 ** (k - 1) and len(set(got)) == len(got)
    for p in got:
        assert [x for g in p for x in g] == order


def test_the_space_is_every_partition_up_to_four_chip_types_then_runs():
    names = ["a", "b", "c", "d"]
    parts, every = space(names, names)
    assert every and len(parts) == BELL[4] - 1 and all(len(p) > 1 for p in parts)
    # smallest largest group first (cheapest searches, shared most), then fewest pipelines
    key = [(max(map(len, p)), len(p)) for p in parts]
    assert key == sorted(key) and parts[0] == (("a",), ("b",), ("c",), ("d",))
    assert max(map(len, parts[-1])) == 3 and len(parts[-1]) == 2
    names5 = ["a", "b", "c", "d", "e"]
    parts, every = space(names5, ["e", "d", "c", "b", "a"])
    assert not every and len(parts) == 2**4 - 1 and (("e", "d"), ("c", "b", "a")) in parts


@pytest.mark.parametrize("total,parts", [(8, 1), (8, 3), (5, 5), (4, 5), (12, 4)])
def test_compositions(total, parts):
    got = list(compositions(total, parts))
    assert len(got) == math.comb(total + parts - 1, parts - 1) and len(set(got)) == len(got)
    assert all(sum(c) == total and min(c) >= 0 and len(c) == parts for c in got)


@pytest.mark.parametrize("seed", range(12))
def test_best_shares_make_the_slowest_fastest(seed):
    rng = random.Random(seed)
    g, n = rng.choice([4, 6, 8]), rng.choice([2, 3, 4])
    times = [[None] + [(None if rng.random() < 0.2 else (rng.uniform(0.1, 1.0) * j, None)) for j in range(1, g + 1)]]
    times += [
        [None] + [(None if rng.random() < 0.2 else (rng.uniform(0.1, 1.0) * j, None)) for j in range(1, g + 1)]
        for _ in range(n - 1)
    ]
    brute = None
    for js in compositions(g, n):  # a group given 0 does not train
        if all(t[j] is not None for t, j in zip(times, js) if j):
            slowest = max(t[j][0] for t, j in zip(times, js) if j)
            brute = slowest if brute is None else min(brute, slowest)
    got = best_shares(times, g)
    if brute is None:
        assert got is None
        return
    assert sum(got) == g and max(t[j][0] for t, j in zip(times, got) if j) == pytest.approx(brute)


def test_rebatch_keeps_stages_and_microbatch_size():
    p = Plan((StageSpec("a", (0, 2)), StageSpec("b", (2, 4))), global_batch=8, num_microbatches=4, schedule="1f1b")
    q = rebatch(p, 12, 4)
    assert q.stages == p.stages and q.microbatch_size == 2 and q.num_microbatches == 6 and q.schedule == p.schedule
    assert rebatch(p, 7, 4) is None  # 7 sequences are not microbatches of 2
    assert rebatch(p, 8, 4) is p


def _three_types(gb: int) -> tuple[Cluster, ModelShape]:  # noqa: ARG001 (the same chips at any batch)
    cluster = Cluster.from_dict(
        {"chips": {"h100_sxm": {"nodes": 1}, "gaudi2": {"nodes": 1}, "mi250x": {"nodes": 1}}}, name="three"
    )
    model = ModelShape.from_config(
        {"n_layers": 4, "d_model": 512, "n_heads": 8, "d_ff": 2048, "vocab_size": 1024, "seq_len": 256}
    )
    return cluster, model


@pytest.fixture(scope="module")
def searchers():
    """One Searcher per global batch of the three-type instance, shared by the tests (its
    searches are kept)."""
    cache = {}

    def get(gb):
        if gb not in cache:
            cache[gb] = Searcher(*_three_types(gb))
        return cache[gb]

    return get


@pytest.mark.parametrize("gb", [6, 8])
def test_search_equals_brute_force_on_small_instances(gb, searchers):
    """Every partition of three chip types into two or three pipelines, every split of the batch
    (a group given nothing does not train), each pipeline the search's best plan of its chips at
    its share, priced whole: the search returns the fastest."""
    searcher = searchers(gb)
    cluster, model = searcher.cluster, searcher.model
    names = list(cluster.names)
    got = search_pipelines(searcher, gb)
    parts, _ = space(names, names)
    assert exact_space(parts, gb) and got.every_partition and got.priced == got.partitions == BELL[3] - 1
    brute = None
    for part in parts:
        for js in compositions(gb, len(part)):  # a group given 0 sequences does not train
            rs = [searcher(grp, j) if j else None for grp, j in zip(part, js)]
            if any(r is not None and r.plan is None for r in rs):
                continue
            order = sorted((i for i in range(len(part)) if js[i]), key=lambda i: -js[i])
            cost = estimate_pipelines(Plan(pipelines=tuple(rs[i].plan for i in order)), model, cluster)
            if cost.fits and (brute is None or cost.iteration_s < brute.iteration_s):
                brute = cost
    assert brute is not None and got.cost is not None
    assert got.cost.iteration_s == pytest.approx(brute.iteration_s, rel=1e-12)
    assert sum(got.shares) == gb and got.plan.global_batch == gb
    assert set(c for g in got.groups for c in g) <= set(names)
    # one pipeline per chip type is in the space and priced: never faster than the best
    assert got.per_chip is not None and got.per_chip.iteration_s >= got.cost.iteration_s


@pytest.mark.parametrize("gb", [6, 8])
def test_the_bound_over_the_space_is_its_parts_least_and_below_its_optimum(gb, searchers):
    """pipelines_bound: each (group, share)'s bound (the search's lower bound; where the group's
    search at that share was exhaustive, its optimum) lies below that optimum; the space's bound is the least, over the one pipeline and every
    partition and split, of the largest bound of its trained groups (brute force over the
    splits); so it lies below the best plan of several pipelines and the one pipeline's optimum."""
    searcher = searchers(gb)
    cluster, model = searcher.cluster, searcher.model
    names = tuple(cluster.names)
    several = search_pipelines(searcher, gb)  # every group at every share, exhaustively (the test above)
    one = search(cluster, model, global_batch=gb, opts=searcher.mixed_opts)
    assert one.exhaustive and several.cost is not None
    got = pipelines_bound(searcher, gb)
    assert got.complete and got.partitions == BELL[3] and got.every_partition
    checked = 0
    for (group, share), r in searcher._done.items():
        assert r.exhaustive, (group, share)
        assert searcher.lower_bound(group, share) == r.iteration_s  # an exhaustive search's optimum is its bound
        if r.plan is not None:
            raw = lower_bound(cluster.only(*group), model, global_batch=share, opts=searcher.opts_of(group))
            assert 0 < raw <= r.iteration_s, (group, share)
            checked += 1
    assert checked >= 7 * 4
    expect, at = searcher.lower_bound(names, gb), ((names,), (gb,))
    parts, _ = space(list(names), list(names))
    for part in parts:
        for js in compositions(gb, len(part)):
            worst = max(searcher.lower_bound(grp, j) for grp, j in zip(part, js) if j)
            if worst < expect:
                expect, at = worst, (part, js)
    assert got.bound_s == expect and (got.groups, got.shares) == at
    assert 0 < got.bound_s <= min(several.iteration_s, one.iteration_s)
    fresh = Searcher(cluster, model, workers=1)  # nothing bounded yet: the one pipeline, then the budget is spent
    short = pipelines_bound(fresh, gb, budget_s=1e-9)
    assert not short.complete and short.bounded == 1 and short.bound_s == searcher.lower_bound(names, gb)


def test_the_ratio_lines_say_what_the_space_bound_proves_and_when_it_did_not_end(searchers):
    """h2jax plan's lines under 100 % (cli_compare.bounds): a bound over every partition gives
    the space's ratio and says whether it decides; one that ran out of --prove's seconds says
    so and claims no ratio."""
    from h2jax.cli_compare import bounds
    from h2jax.plan import matched_total

    searcher = searchers(8)
    cluster, model = searcher.cluster, searcher.model
    res = search(cluster, model, global_batch=8, opts=searcher.mixed_opts)
    matched, several = matched_total(searcher, 8), search_pipelines(searcher, 8)
    tps = 0.5 * matched.tokens_per_s  # a chosen plan at half the baseline: under 100 %
    whole = pipelines_bound(searcher, 8)
    got = bounds(res, None, several, matched, cluster, 8, model, tps, whole, 30.0)
    ratio = matched.ratio(8 * model.seq_len / whole.bound_s)
    assert got["space_max_ratio"] == round(ratio, 4) and got["space_bound"]["partitions_bounded"] == BELL[3]
    assert got["space_below"] == (ratio < 1.0 or got["one_pipeline_exact"] and len(cluster.names) == 2)
    assert any(line.startswith("no plan of the space (4 partitions into several pipelines") for line in got["lines"])
    short = pipelines_bound(Searcher(cluster, model, workers=1), 8, budget_s=1e-9)  # nothing bounded yet
    cut = bounds(res, None, several, matched, cluster, 8, model, tps, short, 1e-9)
    assert cut["space_max_ratio"] is None and not cut["space_below"]
    assert any("did not end within 1e-09 s" in line for line in cut["lines"])


def test_max_pipelines_and_time_budget_limit_the_partitions(searchers):
    searcher = searchers(8)
    two = search_pipelines(searcher, 8, max_pipelines=2)
    assert two.partitions == 3 and len(two.groups) <= 2
    # a budget spent at once still prices the first partition: one pipeline per chip type
    first = search_pipelines(searcher, 8, time_budget_s=1e-9)
    assert first.priced == 1 and first.per_chip is not None
    assert all(len(g) == 1 for g in first.groups) and first.cost.iteration_s == first.per_chip.iteration_s


def test_a_chip_type_too_small_for_the_model_leaves_no_plan_for_its_groups():
    """Groups whose chips cannot hold the model at any share have no plan: the partitions that
    need them are skipped, not priced with a made-up time."""
    cluster = Cluster.from_dict({"chips": {"h100_sxm": {"nodes": 1}, "gaudi2": {"nodes": 1}}}, name="tiny")
    model = ModelShape.from_config(
        {"n_layers": 80, "d_model": 8192, "n_heads": 64, "d_ff": 28672, "vocab_size": 32000, "seq_len": 4096}
    )
    got = search_pipelines(Searcher(cluster, model), 8)
    assert got.plan is None and got.cost is None and got.describe() == "no plan of several pipelines"


def test_groups_are_disjoint_and_use_only_their_chips(searchers):
    searcher = searchers(8)
    cluster = searcher.cluster
    got = search_pipelines(searcher, 8)
    for grp, pipe in zip(got.groups, got.plan.pipeline_plans()):
        assert {s.chip for s in pipe.stages} <= set(grp)
    used = {}
    for s in got.plan.stages:
        used[s.chip] = used.get(s.chip, 0) + s.num_devices
    assert all(used[c] <= cluster.devices(c) for c in used)
    assert list(itertools.chain(*got.groups)) and got.cost.fits


def test_beyond_the_exact_size_the_search_prices_what_it_returns_and_never_beats_the_optimum(searchers, monkeypatch):
    """Past EXACT_UP_TO (forced here) the shares come from the program over each group's times
    (several-type groups searched at their compute's share, then at the share given): the plan
    returned costs what it says, and is no faster than the exact search's optimum."""
    import h2jax.plan._pipeline_search as ps

    searcher = searchers(8)
    exact = search_pipelines(searcher, 8)
    monkeypatch.setattr(ps, "EXACT_UP_TO", 0)
    fast = search_pipelines(searcher, 8)
    assert fast.plan is not None and fast.priced == fast.partitions
    again = estimate_pipelines(fast.plan, searcher.model, searcher.cluster)
    assert again.iteration_s == pytest.approx(fast.cost.iteration_s, rel=1e-12)
    assert fast.cost.iteration_s >= exact.cost.iteration_s * (1 - 1e-12)


def test_h2jax_plan_chooses_and_writes_the_faster_plan_of_the_search_over_pipelines(tmp_path):
    """h100_sxm beside mi250x on a small model: the one-pipeline search must give both chip types
    stages, the search over pipelines finds h100_sxm alone faster (mi250x given no share): the
    CLI chooses it, writes it, and says why mi250x is idle; --max-pipelines 1 keeps one pipeline."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    cfg = tmp_path / "pair.yaml"
    model = {"n_layers": 8, "d_model": 1024, "n_heads": 16, "d_ff": 4096, "vocab_size": 8192, "seq_len": 512}
    cfg.write_text(
        yaml.safe_dump({"chips": {"h100_sxm": {"nodes": 1}, "mi250x": {"nodes": 1}}, "model": model, "global_batch": 8})
    )

    def plan(*args):
        r = subprocess.run(
            [sys.executable, "-m", "h2jax.cli", "plan", str(cfg), *args],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=root,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    out = plan("--out", str(tmp_path / "p"), "--prove", "60")
    assert "mi250x not trained" in out and "chosen" in out and "not chosen" not in out
    report = json.loads((tmp_path / "p" / "comparison.json").read_text())
    hs = report["heterospeedup"]
    assert hs["chosen"] == "several pipelines" and report["chips_used"]["mi250x"][0] == 0
    assert "no pipeline" in report["idle"]["mi250x"]
    written = Plan.from_yaml(tmp_path / "p" / "plan.yaml")
    assert {s.chip for s in written.stages} == {"h100_sxm"} and written.global_batch == 8
    assert report["tokens_per_s"] > hs["one_pipeline"]["tokens_per_s"]
    # below 100 % at the matched total: the one-pipeline optimum (this search is exact) bounds the
    # one pipeline, and with two chip types that proves no plan of the space reaches 100 %
    assert hs["matched_total"]["ratio"] < 1.0
    bound = hs["bound"]
    assert {k: bound[k] for k in ("one_pipeline_max_ratio", "one_pipeline_exact", "space_below")} == {
        "one_pipeline_max_ratio": hs["one_pipeline"]["ratio_matched_total"],
        "one_pipeline_exact": True,
        "space_below": True,
    }
    assert "so no plan of the space reaches 100 %" in out
    # --prove also bounds the space of several pipelines (here one per chip type, and one pipeline):
    # every partition, below the chosen plan's step
    space = bound["space_bound"]
    assert space["partitions_bounded"] == space["partitions"] == 2 and space["every_partition"]
    assert space["bound_s"] > 0 and 8 * model["seq_len"] / space["bound_s"] >= report["tokens_per_s"] * (1 - 1e-3)
    assert bound["space_max_ratio"] >= hs["matched_total"]["ratio"]
    words = " ".join(out.split())  # the console wraps long lines
    assert "no plan of the space (1 partition into several pipelines, and one pipeline) exceeds" in words
    one = plan("--max-pipelines", "1", "--out", str(tmp_path / "q"))
    assert "several pipelines:" not in one
    kept = Plan.from_yaml(tmp_path / "q" / "plan.yaml")
    assert {s.chip for s in kept.stages} == {"h100_sxm", "mi250x"}


def test_searches_sharing_a_cache_find_the_plans_of_searches_without_one(searchers):
    """A Searcher's searches share memory caps and stage pricings (SearchCache) across chip
    groups and batches; each finds the plan a search of its own finds without the cache."""
    searcher = searchers(8)
    search_pipelines(searcher, 8)  # every group, at every share: the cache filled by all of them
    cluster, model = searcher.cluster, searcher.model
    assert searcher.cache._caps and searcher.cache._pricings
    compared = 0
    for (group, gb), got in searcher._done.items():
        alone = search(cluster.only(*group), model, global_batch=gb, opts=searcher.opts_of(group))
        assert alone.exhaustive and got.exhaustive, (group, gb)
        assert (got.plan, got.iteration_s) == (alone.plan, alone.iteration_s), (group, gb)
        compared += got.plan is not None
    assert compared >= 7 * 4  # every group of the three types, at least four shares each with a plan


def test_a_search_finds_the_same_plan_whatever_its_cache_holds():
    """ZB-H1's memory caps of a stage shape are priced over the ranks its choices reach: a100_80gb
    at 64 sequences (microbatches of 2 over 2 replicas) reaches fewer than at 32 (1 over 1) with the
    same sequences per device, and its caps were kept for both: the search at 32 after one at 64
    pruned its best plan (3.92 s against 3.76 s), though exact."""
    path = ROOT / "configs" / "clusters" / "hetero_2432.yaml"
    cluster, model = Cluster.load(path), ModelShape.from_config(yaml.safe_load(path.read_text())["model"])
    a100 = cluster.only("a100_80gb")
    opts = Searcher(cluster, model, workers=1).opts
    alone = search(a100, model, global_batch=32, opts=opts)
    cache = SearchCache(model, None)
    search(a100, model, global_batch=64, opts=opts, cache=cache)
    after = search(a100, model, global_batch=32, opts=opts, cache=cache)
    assert alone.exhaustive and after.exhaustive
    assert (after.plan, after.iteration_s) == (alone.plan, alone.iteration_s)


def test_the_bound_is_the_same_on_worker_processes(monkeypatch):
    """pipelines_bound with the Searcher's workers (a share per task) equals the bound computed
    in this process, group by group and share by share."""
    monkeypatch.setattr("h2jax.plan._baselines.WORTH_S", 0.0)  # these searches are milliseconds: workers all the same
    here, there = (Searcher(*_three_types(8), workers=w) for w in (1, 2))
    try:
        for s in (here, there):  # as h2jax plan does: the baselines first (their times decide on the workers)
            same_batch(s, 8)
        got = [pipelines_bound(s, 8) for s in (here, there)]
        assert there._pool is not None and here._pool is None  # the workers bounded
    finally:
        there.close()
    assert got[0].complete and got[1].complete
    assert (got[0].bound_s, got[0].groups, got[0].shares) == (got[1].bound_s, got[1].groups, got[1].shares)
    assert here._bounds == there._bounds and len(here._bounds) >= 5 * 8  # the pairs and singles not searched at 8


def test_the_search_over_pipelines_on_worker_processes_finds_the_same_plan(monkeypatch):
    """Beyond the exact space (three chip types at 16 sequences in 16 shares: 6 groups x 16) the groups
    of several types are searched on the Searcher's workers, begun ahead of the partitions
    that need them; with no time budget pressing, the plan is the one found in this process."""
    monkeypatch.setattr("h2jax.plan._baselines.WORTH_S", 0.0)  # these searches are milliseconds: workers all the same
    here, there = (Searcher(*_three_types(16), workers=w) for w in (1, 2))
    try:
        for s in (here, there):  # as h2jax plan does: the baselines first (their times decide on the workers)
            same_batch(s, 16)
        got = [search_pipelines(s, 16, grid=16) for s in (here, there)]
        assert there._pool is not None and here._pool is None  # the workers searched
    finally:
        there.close()
    assert not exact_space(space(list(here.cluster.names), list(here.cluster.names))[0], 16 // got[0].unit)
    assert got[1].priced == got[1].partitions and got[0].priced == got[0].partitions
    assert (got[1].groups, got[1].shares) == (got[0].groups, got[0].shares)
    assert got[1].iteration_s == got[0].iteration_s
    mixed = [k for k in there._done if len(k[0]) > 1]
    assert mixed and all(
        (there._done[k].plan, there._done[k].iteration_s) == (here._done[k].plan, here._done[k].iteration_s)
        for k in mixed
    )
