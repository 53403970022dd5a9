"""The cost of a job of several pipelines (h2jax.plan._pipelines): the slowest pipeline plus the
exchange across them, and what a one-pipeline plan costs unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from h2jax.plan import (
    Cluster,
    Efficiency,
    ModelShape,
    Plan,
    StageSpec,
    estimate,
    estimate_pipelines,
)

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
    # what the exchange moves: stage 0 of the first pipeline (sim_a, data 2) holds the embedding and
    # 4 blocks, stage 1 (sim_b, data 2) 2 blocks and the head; each receives the gradient of what
    # it shares with the second pipeline's one stage (sim_a, data 2) and sends values and two
    # moments back, in 2 pieces (the smaller mesh's devices) over the slower chip's inter-node
    # link, the receiver all-gathering its half over its data axis on its intra-node link
    eff, prof = Efficiency(), cluster.profiles

    def rate(src, dst):  # seconds per byte
        link = min(prof[src].inter_node_gbps, prof[dst].inter_node_gbps) * 1e9 * eff.link
        return 1 / (2 * link) + 0.5 / (prof[dst].intra_node_gbps * 1e9 * eff.link)

    g0 = 4 * (4 * model.block_params + model.embed_params)
    g1 = 4 * (2 * model.block_params + model.head_params)
    x0 = g0 * (rate("sim_a", "sim_a") + 3 * rate("sim_a", "sim_a")) + 2 * eff.collective_latency_s
    x1 = g1 * (rate("sim_a", "sim_b") + 3 * rate("sim_b", "sim_a")) + 2 * eff.collective_latency_s
    assert both.exchange_s == pytest.approx(max(x0, x1))
    assert both.devices_by_chip == {"sim_a": 4, "sim_b": 2} and both.fits
    assert both.tokens_per_step == 32 * model.seq_len
