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
    # it shares with the second pipeline's one stage (sim_a, data 2) and sends the values back,
    # in 2 pieces (the smaller mesh's devices) over the slower chip's inter-node
    # link, the receiver all-gathering its half over its data axis on its intra-node link. One
    # process drives these emulated chips: every transfer in turn
    eff, prof = Efficiency(), cluster.profiles

    def rate(src, dst):  # seconds per byte
        link = min(prof[src].inter_node_gbps, prof[dst].inter_node_gbps) * 1e9 * eff.link
        return 1 / (2 * link) + 0.5 / (prof[dst].intra_node_gbps * 1e9 * eff.link)

    g0 = 4 * (4 * model.block_params + model.embed_params)
    g1 = 4 * (2 * model.block_params + model.head_params)
    lat = eff.collective_latency_s
    summed = g0 * rate("sim_a", "sim_a") + lat + g1 * rate("sim_a", "sim_b") + lat
    copied = g0 * rate("sim_a", "sim_a") + lat + g1 * rate("sim_b", "sim_a") + lat
    assert both.exchange_summed_s == pytest.approx(summed)
    assert both.exchange_s == pytest.approx(summed + copied)
    # emulated chips share the host (one process drives them): nothing of the sum overlaps a backward
    assert both.exchange_overlap_s == 0 and both.exchange.pairs == ()
    assert not both.device_direct_priced and not one.device_direct_priced  # in one process: as it runs
    assert both.exchange_note == "" == one.exchange_note
    assert both.devices_by_chip == {"sim_a": 4, "sim_b": 2} and both.fits
    assert both.tokens_per_step == 32 * model.seq_len


def test_on_chips_with_processes_of_their_own_the_last_stages_sum_while_the_first_drain():
    """Real chips (each stage its own processes): each (owner, mirror) pair's gradient sum starts
    once both stages are done with their own ops (the mirror posts, the owner adds its mirrors in
    turn), so the last stages' sum overlaps the first stages' drain; the simulator replays the
    same pairs. The copies back: each mirror takes its owners' values one after the other."""
    import dataclasses

    from h2jax.plan import simulate_plan
    from h2jax.plan._pipelines import stage_ready_s

    cluster, model = _sim_mix()
    cluster = Cluster(tuple((dataclasses.replace(p, host=None, emulated=False), n) for p, n in cluster.chips))
    a = Plan((StageSpec("sim_a", (0, 3), 1, 1), StageSpec("sim_b", (3, 6), 1, 1)), global_batch=16, num_microbatches=4)
    b = Plan((StageSpec("sim_a", (0, 2), 1, 1), StageSpec("sim_b", (2, 6), 1, 1)), global_batch=8, num_microbatches=4)
    plan = Plan(pipelines=(a, b))
    job = estimate_pipelines(plan, model, cluster)
    pairs = job.exchange.pairs
    assert [(o, m) for o, m, _ in pairs] == [(0, 2), (1, 3), (0, 3)]
    # everyone done at once: owner 0 adds its two mirrors' in turn, owner 1 its one beside it
    assert job.exchange_summed_s == pytest.approx(max(pairs[0][2] + pairs[2][2], pairs[1][2]))
    ready, _ = stage_ready_s(a, job.pipelines[0])
    assert ready[1] < ready[0]  # 1f1b: the last stage's last backward ends first
    slowest = max(c.iteration_s for c in job.pipelines)
    assert job.exchange_overlap_s > 0 and slowest <= job.iteration_s < slowest + job.exchange_s
    # between processes the runtime moves the tensors whole through host memory: priced faster, said so
    assert job.device_direct_priced and "through host memory" in job.exchange_note
    sim, _ = simulate_plan(plan, model, cluster)
    (start,) = [e.start for e in sim.events if e.extra.get("with") == 3 and e.stage == 1]
    assert start < max(e.end for e in sim.events if e.stage == 0 and e.kind == "bwd")


def test_the_exchange_between_chips_of_one_host_is_priced_from_the_profiled_exchange():
    """Emulated chips share a host: each (owner, mirror) pair costs the profiled exchange -- a
    fixed part per list plus a part per block's worth of parameters, the gradient sum and the copy
    back apart, the receiver's row -- and the one driver runs the pairs in turn (added up)."""
    from h2jax.plan import EXCHANGE, EXCHANGE_CALL, LayerCost, ProfileTable
    from h2jax.plan._pipelines import exchange_parts

    cluster, model = _sim_mix()
    assert cluster.profile("sim_a").host == cluster.profile("sim_b").host == "local"
    a = Plan((StageSpec("sim_a", (0, 4), 1, 1), StageSpec("sim_b", (4, 6), 1, 1)), global_batch=8, num_microbatches=2)
    b = Plan((StageSpec("sim_a", (0, 6), 1, 1),), global_batch=8, num_microbatches=2)
    plan = Plan(pipelines=(a, b))
    rows = {"sim_a": (1e-3, 3e-3, 5e-3, 7e-3), "sim_b": (2e-3, 4e-3, 6e-3, 8e-3)}  # block f, b; call f, b

    def cost(f, b, pb=0.0):
        return LayerCost(f, b, pb, 0.0, 0.0, 0.0, estimated=False)

    table = ProfileTable()
    for chip, (bf, bb, cf, cb) in rows.items():
        parts = {EXCHANGE: cost(bf, bb, 4.0 * model.block_params), EXCHANGE_CALL: cost(cf, cb)}
        table.add(chip, model.key(), 1, 8, parts)
    summed, copied = exchange_parts(plan, model, cluster.profiles, table=table)
    # pair (stage 0 sim_a, mirror sim_a): 4 blocks + embedding; pair (stage 1 sim_b, mirror sim_a): 2 + head
    n0 = 4 + model.embed_params / model.block_params
    n1 = 2 + model.head_params / model.block_params
    # the sum's receiver is the owner (sim_a, then sim_b), the copy back's the mirror (sim_a both times)
    assert summed == pytest.approx(5e-3 + n0 * 1e-3 + 6e-3 + n1 * 2e-3)
    assert copied == pytest.approx(2 * 7e-3 + (n0 + n1) * 3e-3)
    priced = estimate_pipelines(plan, model, cluster, table=table)
    assert priced.exchange_s == pytest.approx(summed + copied) and priced.exchange_summed_s == pytest.approx(summed)
    # without the rows: the link model at the boundary-transfer rate (another figure)
    assert sum(exchange_parts(plan, model, cluster.profiles)) != pytest.approx(summed + copied)
