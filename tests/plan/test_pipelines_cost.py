"""The cost of a job of several pipelines (h2jax.plan._pipelines): the slowest pipeline plus the
exchange across them, what a one-pipeline plan costs unchanged, and the one-pipeline-per-chip-type
plan whose shares make the slowest pipeline fastest."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from h2jax.plan import Cluster, ModelShape, Plan, StageSpec, estimate, estimate_pipelines, per_chip_pipelines
from h2jax.plan._baselines import share_unit

ROOT = Path(__file__).resolve().parents[2]


def _sim_mix():
    raw = yaml.safe_load((ROOT / "configs" / "clusters" / "sim_mix.yaml").read_text())
    return Cluster.load(ROOT / "configs" / "clusters" / "sim_mix.yaml"), ModelShape.from_config(raw["model"])


def test_two_pipelines_cost_the_slowest_plus_the_exchange_and_one_costs_as_before():
    cluster, model = _sim_mix()
    a = Plan((StageSpec("sim_a", (0, 4), 2, 1), StageSpec("sim_b", (4, 6), 2, 1)), global_batch=12, num_microbatches=3)
    b = Plan((StageSpec("sim_a", (0, 6), 2, 1),), global_batch=20, num_microbatches=5, schedule="gpipe")
    one = estimate_pipelines(a, model, cluster)
    assert one.exchange_s == 0 and one.iteration_s == pytest.approx(estimate(a, model, cluster).iteration_s)
    both = estimate_pipelines(Plan(pipelines=(a, b)), model, cluster)
    slowest = max(estimate(p, model, cluster).iteration_s for p in (a, b))
    assert both.exchange_s > 0 and both.iteration_s >= slowest + both.exchange_s - 1e-12
    # what the exchange moves: stage 0 of the first pipeline holds the embedding and 4 blocks, and
    # receives their gradient once and sends values and two moments back, over sim_b's slower link
    grads = 4 * (4 * model.block_params + model.embed_params)
    bw = min(cluster.profiles[c].inter_node_gbps for c in ("sim_a", "sim_b")) * 1e9
    assert both.exchange_s == pytest.approx(
        max(4 * grads / bw, 4 * 4 * (2 * model.block_params + model.embed_params) / bw)
    )
    assert both.devices_by_chip == {"sim_a": 4, "sim_b": 2} and both.fits
    assert both.tokens_per_step == 32 * model.seq_len


class TimeSearcher:
    """A stand-in Searcher: fixed iteration seconds per (chip type, batch); None: no plan."""

    def __init__(self, times):
        self.cluster = SimpleNamespace(names=list(times))
        self.times = times

    def __call__(self, chip, b):
        t = self.times[chip][b]
        plan = None if t is None else Plan((StageSpec(chip, (0, 1)),), global_batch=b, num_microbatches=1)
        return SimpleNamespace(plan=plan, iteration_s=t)


@pytest.mark.parametrize("seed", range(10))
def test_the_per_chip_shares_make_the_slowest_pipeline_fastest(seed):
    rng = random.Random(seed)
    gb = rng.choice([16, 32, 48])
    unit = share_unit(gb, 8)
    names = [f"c{i}" for i in range(rng.choice([2, 3]))]
    times = {
        n: {b: (None if rng.random() < 0.15 else rng.uniform(0.1, 1.0) * b) for b in range(unit, gb + 1, unit)}
        for n in names
    }
    s = TimeSearcher(times)
    plan, shares = per_chip_pipelines(s, gb)
    best = None
    for units in itertools.product(range(gb // unit + 1), repeat=len(names)):
        if sum(units) * unit != gb:
            continue
        ts = [0.0 if j == 0 else times[n][j * unit] for n, j in zip(names, units)]
        if None not in ts:
            best = max(ts) if best is None else min(best, max(ts))
    if best is None:
        assert plan is None
        return
    assert sum(shares.values()) == gb
    assert max((times[n][b] for n, b in shares.items() if b), default=0.0) == pytest.approx(best)
    used = [n for n, b in shares.items() if b]
    assert plan.num_pipelines == len(used) and plan.global_batch == gb
