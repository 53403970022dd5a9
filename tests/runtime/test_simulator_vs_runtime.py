"""simulator == runtime: replaying a real run's measured per-stage durations through the
discrete-event simulator gives the order of events that run's trace shows."""

from __future__ import annotations

import pytest

from h2jax.config import load_config
from h2jax.plan import simulate
from h2jax.runtime import Trainer

MODEL = ["model.vocab_size=256", "model.seq_len=16", "model.d_model=32", "model.n_heads=4", "model.d_ff=64"]
CLUSTER = "cluster.chips={sim_a: {nodes: 2}, sim_b: {nodes: 2}, sim_c: {nodes: 1}, sim_d: {nodes: 1}}"


def S(chip, layers, data=1, tensor=1, recompute=False):
    return {"chip": chip, "layers": list(layers), "data": data, "tensor": tensor, "recompute": recompute}


PLANS = {
    "3st-1f1b": (5, "1f1b", 6, [S("sim_a", (0, 1), 2, 1), S("sim_b", (1, 3), 1, 2, True), S("sim_c", (3, 5))]),
    "2st-gpipe": (4, "gpipe", 4, [S("sim_a", (0, 3), 2, 2), S("sim_b", (3, 4), 4, 1)]),
}


def _run(name, tmp_path):
    n_layers, schedule, m, stages = PLANS[name]
    plan = {"global_batch": 4 * m, "num_microbatches": m, "schedule": schedule, "stages": stages}
    cfg = load_config(
        None,
        MODEL
        + [
            CLUSTER,
            f"model.n_layers={n_layers}",
            f"plan={plan}",
            "train.timeline=true",
            "train.progress=false",
            "train.tensorboard=false",
            "train.steps=2",
            "optimizer.warmup_steps=1",
        ],
    )
    trainer = Trainer(cfg, run_dir=tmp_path)
    trainer.run()
    return cfg, trainer.timeline.events(1)  # step 1: compiled, steady


@pytest.mark.parametrize(  # the fast lane: 2 stages under gpipe
    "name", [n if n == "2st-gpipe" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(PLANS)]
)
def test_simulated_order_equals_trace(name, tmp_path):
    cfg, events = _run(name, tmp_path)
    n, m = cfg.plan.num_stages, cfg.plan.num_microbatches
    fwd = [[0.0] * m for _ in range(n)]
    bwd = [[0.0] * m for _ in range(n)]
    xf, xb = [0.0] * (n - 1), [0.0] * (n - 1)
    for e in events:
        if e.kind == "fwd":
            fwd[e.stage][e.microbatch] = e.dur_us * 1e-6
        elif e.kind == "bwd":
            bwd[e.stage][e.microbatch] = e.dur_us * 1e-6
        elif e.kind == "send":
            peer = e.extra["peer"]
            lst = xf if peer > e.stage else xb
            b = min(peer, e.stage)
            lst[b] = max(lst[b], e.dur_us * 1e-6)  # the slowest transfer of the boundary
    sim = simulate(schedule=cfg.plan.schedule, num_microbatches=m, fwd=fwd, bwd=bwd, transfer_fwd=xf, transfer_bwd=xb)
    # per stage: the same sequence of forwards and backwards
    for s in range(n):
        trace_order = [
            ("F" if e.kind == "fwd" else "B", e.microbatch)
            for e in sorted((e for e in events if e.stage == s and e.kind in ("fwd", "bwd")), key=lambda e: e.start_us)
        ]
        assert sim.stage_order(s) == trace_order, f"stage {s}"
    # Across stages the trace is not compared event by event: emulated stages share this
    # host's two cores, so a stage runs slower while another one computes. The durations
    # replayed here were measured under that sharing already (so no `hosts=` here: sharing
    # them again would count it twice), but how long each op ran depends on what else ran
    # at that moment, which per-op averages cannot reproduce; a 10 %-of-step margin still
    # flipped pairs under load. The cross-stage dependencies themselves are checked on real
    # traces by tests/runtime/test_pipeline_equivalence.py::test_recorded_timeline_obeys_the_schedule.
    assert {(e.stage, e.kind, e.microbatch) for e in sim.events if e.kind in ("fwd", "bwd")} == {
        (e.stage, e.kind, e.microbatch) for e in events if e.kind in ("fwd", "bwd")
    }
