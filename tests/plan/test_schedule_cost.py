"""The cost model prices the one-chunk schedules (gpipe, 1f1b, zb-h1): the B/W split of the backward from
FLOPs, ZB-H1's time, and the memory W keeps alive. Hand-computed numbers. (The chunked ones:
tests/plan/test_chunked_cost.py.)"""

from __future__ import annotations

import math
import random

import pytest

from h2jax.plan import (
    ChipProfile,
    LayerCost,
    ModelShape,
    Plan,
    ProfileTable,
    Schedule,
    StageSpec,
    as_schedule,
    estimate,
    get_schedule,
    simulate_plan,
)
from h2jax.plan._cost import (
    pipeline_time,
    transfer_s,
    weight_grad_keep_bytes,
    weight_grad_share,
)
from h2jax.plan._profiles import PROGRAM
from h2jax.plan.schedules import backward_peaks

MODEL = ModelShape(n_layers=4, d_model=64, n_heads=4, d_ff=128, vocab_size=256, seq_len=16, act_bytes=4)
SPEC = dict(memory_gib=1.0, peak_tflops=0.1, mem_bw_gbps=40, intra_node_gbps=10, inter_node_gbps=5, devices_per_node=4)
CHIPS = {n: ChipProfile(n, **SPEC) for n in ("a", "b")}


def _part(fwd, bwd, update):
    return LayerCost(
        fwd_s=fwd,
        bwd_s=bwd,
        param_bytes=1e3,
        act_bytes=1e3,
        input_bytes=1e3,
        temp_bytes=1e3,
        estimated=False,
        update_s=update,
    )


def _table() -> ProfileTable:
    t = ProfileTable()
    parts = {
        "embed": _part(0.0, 0.0, 0.01),
        "block": _part(1.0, 2.0, 0.1),
        "head": _part(0.0, 0.0, 0.01),
        PROGRAM: _part(0.1, 0.1, 0.08),
    }
    for chip in CHIPS:
        t.add(chip, MODEL.key(), 1, 2, parts)
    return t


def _plan(schedule, m=4):
    return Plan(
        stages=(StageSpec("a", (0, 2), 1, 1), StageSpec("b", (2, 4), 1, 1)),
        global_batch=2 * m,
        num_microbatches=m,
        schedule=schedule,
    )


def test_weight_gradient_share_from_flops():
    # d 64, d_ff 128, 4 heads of 16, seq 16: weights per token 2*64^2 + 3*64*128 + 2*64*64 = 40960,
    # attention 4*16*64 = 4096; forward 2*40960 + 4096, backward 2x that + 4096/2 = 174080;
    # W = 2*40960 = 81920 = 8/17 of it
    share = weight_grad_share(MODEL, tensor=1)
    assert share["block"] == pytest.approx(8 / 17, rel=1e-12)
    assert share["embed"] == 1.0 and share["head"] == 0.5
    # the stage XLA's compiled FLOPs split (docs/LOG.md): W 0.494, B 0.505 of the backward
    measured = ModelShape(n_layers=4, d_model=256, n_heads=4, d_ff=1024, vocab_size=256, seq_len=16, act_bytes=4)
    assert weight_grad_share(measured, tensor=1)["block"] == pytest.approx(0.494, abs=0.005)
    # the same share at any tensor degree (every term is divided by it)
    assert weight_grad_share(measured, tensor=2)["block"] == pytest.approx(
        weight_grad_share(measured, tensor=1)["block"]
    )


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("m", range(1, 17))
def test_memory_counts_of_each_schedule(p, m):
    gpipe, one, zb = (get_schedule(n, p, m).memory_counts() for n in ("gpipe", "1f1b", "zb-h1"))
    for s in range(p):
        assert gpipe[s] == (m, 0)
        assert one[s] == (min(p - s, m), 0)
        # ZB-H1 holds 1F1B's activations awaiting B, and up to s + 1 microbatches awaiting W
        assert zb[s] == (min(p - s, m), min(s + 1, m))


@pytest.mark.parametrize(
    ("name", "v"),
    [("gpipe", None), ("1f1b", None), ("zb-h1", None), ("zb-v", None), ("interleaved", 2), ("interleaved", 3)],
)
def test_closed_form_counts_equal_the_walk_of_the_op_lists(name, v):
    for p in range(1, 9):
        for m in range(1, 33):
            try:
                sched = get_schedule(name, p, m, num_chunks=v)
            except ValueError:  # interleaved: m a multiple of p; zb-v: m >= 2p - 1
                continue
            assert sched.memory_counts() == tuple(backward_peaks(sched.stage_ops(s)) for s in range(p)), (p, m)
            assert sched.max_in_flight() == Schedule.max_in_flight(sched.schedule, p, m), (p, m)


def test_zb_h1_time_and_memory_hand_computed():
    table = _table()
    one = estimate(_plan("1f1b"), MODEL, CHIPS, table=table)
    zb = estimate(_plan("zb-h1"), MODEL, CHIPS, table=table)
    w_block = 2.0 * 8 / 17
    for s1, sz in zip(one.stages, zb.stages):
        # 2 blocks: forward 2 + one call 0.1; backward 4 + a call 0.1, and W's own call 0.1
        assert math.isclose(s1.fwd_s, 2.1) and math.isclose(s1.bwd_s, 4.1) and s1.w_s == 0
        assert math.isclose(sz.bwd_s, 4.2) and math.isclose(sz.w_s, 2 * w_block + 0.1)
        assert math.isclose(sz.b_s, 4.2 - sz.w_s)
        assert math.isclose(sz.w_hidden_s, 2 * min(w_block, 1.0))
    x = transfer_s(MODEL, CHIPS["a"], (1, 1), CHIPS["b"], (1, 1), microbatch=2)
    tail = 2 * 0.1 + 0.01 + 0.08  # both stages: two blocks, the embedding or head, one program
    assert math.isclose(one.iteration_s, 3 * 6.2 + 2 * 6.2 + 2 * x + tail)
    h = 2 * w_block
    assert math.isclose(zb.iteration_s, 3 * 6.3 + 2 * (6.3 - 2 * h) + 2 * x + tail + 2 * h)
    assert zb.iteration_s < one.iteration_s
    # memory: 2 stages, m = 4: stage 0 awaits B for 2 microbatches and W for 1, stage 1 for 1 and 2
    assert [s.in_flight for s in zb.stages] == [2, 1] and [s.pending_w for s in zb.stages] == [1, 2]
    keep = weight_grad_keep_bytes(MODEL, tensor=1, microbatch_per_device=2)
    tokens = 2 * 16
    # per token: inputs 4 * (2*64 + 64 + 128) + 4 * 2 * 64, cotangents 4 * (64 + 2*64 + 64 + 2*128 + 64 + 2*64)
    assert keep["block"] == tokens * (1792 + 2816)
    assert keep["embed"] == tokens * (4 + 4 * 64) and keep["head"] == tokens * (8 * 64 + 4 * 256 + 4 * 64)
    act = 1e3  # per part per microbatch in the table
    assert one.stages[0].memory.activations == 2 * 3 * act and one.stages[1].memory.activations == 1 * 3 * act
    assert zb.stages[0].memory.activations == 2 * 3 * act + 1 * (2 * keep["block"] + keep["embed"])
    assert zb.stages[1].memory.activations == 1 * 3 * act + 2 * (2 * keep["block"] + keep["head"])
    # the replay of the same durations agrees: equal stages, so only W's program call (which
    # no bubble hides in the formula) separates them
    sim, _ = simulate_plan(_plan("zb-h1"), MODEL, CHIPS, table=table)
    assert sim.iteration_s <= zb.iteration_s <= sim.iteration_s + 2 * 0.1 + 1e-9
    assert {e.extra.get("part") for e in sim.events if e.kind == "bwd"} == {"B", "W"}


def test_zb_h1_on_equal_stages_is_the_paper_formula():
    # pipeline_time on equal stages with W <= F: m (F + B + W) + (p - 1)(F + B - W)
    from h2jax.plan._cost import StageCost, StageMemoryEstimate

    mem = StageMemoryEstimate(0, 0, 0, 0, 0)
    for f, b, w in [(1.0, 1.0, 1.0), (1.0, 1.5, 0.7), (2.0, 1.0, 1.0)]:
        for p in range(2, 9):
            stages = [StageCost(f, b + w, 0.0, 0.0, mem, 1.0, 1, False, w_s=w, w_hidden_s=min(w, f)) for _ in range(p)]
            for m in range(p, 4 * p + 1):
                t = pipeline_time(stages, as_schedule("zb-h1"), m, transfers=0.0)
                assert math.isclose(t, m * (f + b + w) + (p - 1) * (f + b - w))
                assert math.isclose(
                    pipeline_time(stages, as_schedule("1f1b"), m, transfers=0.0), (m + p - 1) * (f + b + w)
                )


def test_zb_h1_estimate_against_the_replay_on_uneven_plans():
    rng = random.Random(0)
    model = ModelShape(n_layers=8, d_model=64, n_heads=4, d_ff=128, vocab_size=256, seq_len=16, act_bytes=4)
    for _ in range(60):
        chips = {
            n: ChipProfile(
                n,
                memory_gib=8,
                peak_tflops=rng.uniform(0.05, 0.4),
                mem_bw_gbps=40,
                intra_node_gbps=10,
                inter_node_gbps=rng.uniform(1, 20),
                devices_per_node=4,
            )
            for n in "abc"
        }
        p = rng.randint(2, 4)
        m = rng.choice([p, 2 * p, 3 * p])
        cuts = sorted(rng.sample(range(1, 8), p - 1))
        bounds = [0, *cuts, 8]
        stages = tuple(
            StageSpec(rng.choice("abc"), (bounds[i], bounds[i + 1]), 1, 1, rng.random() < 0.3) for i in range(p)
        )
        plans = {s: Plan(stages=stages, global_batch=2 * m, num_microbatches=m, schedule=s) for s in ("1f1b", "zb-h1")}
        est = {s: estimate(plan, model, chips) for s, plan in plans.items()}
        sim, _ = simulate_plan(plans["zb-h1"], model, chips)
        # ZB-H1 never costs more than 1F1B for the same plan, and holds at least its memory
        assert est["zb-h1"].iteration_s <= est["1f1b"].iteration_s
        for a, b in zip(est["zb-h1"].stages, est["1f1b"].stages):
            assert a.memory.total >= b.memory.total
        # like 1F1B's formula, mostly above the replay (transfers are summed, not overlapped)
        assert -0.02 <= est["zb-h1"].iteration_s / sim.iteration_s - 1 <= 0.2
