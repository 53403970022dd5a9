"""pipeline == sequential: the test everything else rests on.

For each plan the loss and every parameter gradient of one step equal a single-device
``jax.value_and_grad`` of the same model and batch within 1e-5 (fp32), and the parameters
after 3 optimizer steps equal those of a single-device optax loop within 1e-5.

Why the optimizer runs with eps=1e-3 here: gradients of the pipeline and of the reference
differ only by summation order (tensor-parallel all-reduces, microbatch accumulation), e.g.
1.3650e-6 vs 1.3648e-6 on one element of blocks/3/attn/wo (2e-10 absolute). Adam divides by
sqrt(v) + eps, and with eps=1e-8 an element whose gradient is ~1e-6 turns that 2e-10 into a
1.3e-5 parameter difference after one update (measured). With eps=1e-3 such elements stay
well-conditioned while every gradient above ~1e-3 is still normalised as Adam does, so the
test exercises the real AdamW + clipping + schedule path and still sees any real error.
The per-step gradients are compared at every step too.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from h2jax.config import load_config
from h2jax.models import build_model
from h2jax.plan import check_execution
from h2jax.runtime import Trainer, flatten, make_optimizer, reference_loss_and_grads

TOL = 1e-5

MODEL = ["model.vocab_size=256", "model.seq_len=16", "model.d_model=32", "model.n_heads=4", "model.d_ff=64"]
CLUSTER = "cluster.chips={sim_a: {nodes: 2}, sim_b: {nodes: 2}, sim_c: {nodes: 1}, sim_d: {nodes: 1}}"


def S(chip, layers, data=1, tensor=1, recompute=False):
    return {"chip": chip, "layers": list(layers), "data": data, "tensor": tensor, "recompute": recompute}


PLANS = {
    # 2 stages, uneven split, different mesh shapes on either side (the default job's shape)
    "2st-1f1b-2x2-to-4x1": (4, "1f1b", [S("sim_a", (0, 3), 2, 2), S("sim_b", (3, 4), 4, 1)]),
    # pure tensor parallel into pure data parallel, recompute on the first stage, GPipe
    "2st-gpipe-tp4-recompute": (4, "gpipe", [S("sim_a", (0, 1), 1, 4, True), S("sim_b", (1, 4), 2, 1)]),
    # 3 stages, recompute in the middle, vocab-parallel head (tensor=2 on the last stage)
    "3st-1f1b-mixed": (5, "1f1b", [S("sim_a", (0, 1), 2, 1), S("sim_b", (1, 3), 1, 2, True), S("sim_c", (3, 5), 2, 2)]),
    # 4 stages on 4 chip types, every shape different, recompute on/off
    "4st-1f1b-4chips": (
        6,
        "1f1b",
        [S("sim_a", (0, 2), 1, 2), S("sim_b", (2, 3), 4, 1, True), S("sim_c", (3, 4), 2, 1), S("sim_d", (4, 6), 1, 4)],
    ),
    # 4 stages, two chip types each holding two stages on separate nodes, GPipe
    "4st-gpipe-2chips": (
        4,
        "gpipe",
        [S("sim_a", (0, 1), 2, 2), S("sim_b", (1, 2), 2, 1), S("sim_a", (2, 3), 1, 1, True), S("sim_b", (3, 4), 1, 4)],
    ),
    # 3 stages, GPipe, all recompute, uneven 1/1/3
    "3st-gpipe-recompute": (
        5,
        "gpipe",
        [S("sim_c", (0, 1), 4, 1, True), S("sim_a", (1, 2), 1, 1, True), S("sim_d", (2, 5), 2, 2, True)],
    ),
}


def make_cfg(name: str, **extra: str):
    n_layers, schedule, stages = PLANS[name]
    return plan_cfg(n_layers, schedule, stages, **extra)


def plan_cfg(n_layers: int, schedule: str, stages: list, **extra: str):
    """The equivalence tests' experiment: the small model on the test cluster under this plan."""
    plan = {"global_batch": 16, "num_microbatches": 4, "schedule": schedule, "stages": stages}
    overrides = MODEL + [
        CLUSTER,
        f"model.n_layers={n_layers}",
        f"plan={plan}",
        "train.progress=false",
        "train.tensorboard=false",
        "optimizer.warmup_steps=1",
        "optimizer.lr=1e-2",
        "optimizer.eps=1e-3",
        "train.steps=3",
        "optimizer.clip_norm=0.5",
    ]
    overrides += [f"{k}={v}" for k, v in extra.items()]
    return load_config(None, overrides)


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def reference_update(tx):
    """One optax step of the single-device reference, (grads, opt_state, params) -> (params,
    opt_state), as one jitted program (op by op it takes seconds a step)."""

    def update(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(update)


# the fast lane keeps one plan (2 chip types, different meshes, 1F1B); the full suite runs all
FAST_PLAN = "2st-1f1b-2x2-to-4x1"


@pytest.mark.parametrize(
    "name", [n if n == FAST_PLAN else pytest.param(n, marks=pytest.mark.slow) for n in sorted(PLANS)]
)
def test_pipeline_equals_sequential(name, tmp_path):
    cfg = make_cfg(name)
    reference_model = build_model(cfg.model, seed=cfg.seed)
    trainer = Trainer(cfg, run_dir=tmp_path)

    # -- one step: loss and every gradient --------------------------------------------------
    tokens, targets = trainer.batch(0)
    ref_loss, ref_grads = reference_loss_and_grads(reference_model, tokens, targets)
    loss = float(trainer.forward_backward(0))
    assert abs(loss - ref_loss) <= TOL, (loss, ref_loss)
    got = trainer.grads_by_layer()
    want = flatten(ref_grads)
    assert sorted(got) == sorted(want), "pipeline stages must hold exactly the model's parameters"
    bad = {k: _max_diff(got[k], want[k]) for k in want if _max_diff(got[k], want[k]) > TOL}
    assert not bad, f"gradients differ: {bad}"
    # the gradient really is sharded as the stage's parameters are
    for st in trainer.stages:
        for g, p in zip(jax.tree.leaves(st.grads()), jax.tree.leaves(st.params)):
            assert g.sharding.is_equivalent_to(p.sharding, g.ndim)

    # -- 3 optimizer steps vs a single-device optax loop ---------------------------------------
    tx, _ = make_optimizer(cfg)
    tx = optax.chain(optax.clip_by_global_norm(cfg.optimizer.clip_norm), tx)
    graphdef, params = nnx.split(reference_model, nnx.Param)
    params = jax.device_put(params, jax.devices("cpu")[0])
    opt_state = tx.init(params)
    update = reference_update(tx)
    for step in range(3):
        if step > 0:
            loss = float(trainer.forward_backward(step))
            tokens, targets = trainer.batch(step)
            ref_loss, ref_grads = reference_loss_and_grads(nnx.merge(graphdef, params), tokens, targets)
            assert abs(loss - ref_loss) <= TOL, (step, loss, ref_loss)
            got, want = trainer.grads_by_layer(), flatten(ref_grads)
            bad = {k: _max_diff(got[k], want[k]) for k in want if _max_diff(got[k], want[k]) > TOL}
            assert not bad, f"gradients of step {step} differ: {bad}"
        trainer.finish_step()
        params, opt_state = update(ref_grads, opt_state, params)
    got = trainer.params_by_layer()
    want = flatten(params)
    bad = {k: _max_diff(got[k], want[k]) for k in want if _max_diff(got[k], want[k]) > TOL}
    assert not bad, f"parameters after 3 steps differ: {bad}"
    trainer.close()


@pytest.mark.slow
def test_recorded_timeline_obeys_the_schedule(tmp_path):
    """The order in which a real run executed equals what the schedule allows."""
    for name in ("4st-1f1b-4chips", "4st-gpipe-2chips"):
        cfg = make_cfg(name, **{"plan.num_microbatches": 8, "plan.global_batch": 32})
        trainer = Trainer(cfg, run_dir=tmp_path / name)
        trainer.run(steps=2)
        p, m = cfg.plan.num_stages, cfg.plan.num_microbatches
        for step in range(2):
            ev = trainer.timeline.events(step)
            compute = [
                (e.stage, "F" if e.kind == "fwd" else "B", e.microbatch, e.start_us, e.end_us)
                for e in ev
                if e.kind in ("fwd", "bwd")
            ]
            assert len(compute) == 2 * p * m
            kw = (
                {"max_in_flight": trainer.schedule.max_in_flight()}
                if cfg.plan.schedule.name == "1f1b"
                else {"forwards_first": True}
            )
            # eps: 1 ns, the rounding of (start - t0) * 1e6 vs start_us + dur_us
            assert check_execution(compute, num_stages=p, num_microbatches=m, eps=1e-3, **kw) == []
            sends = [e for e in ev if e.kind == "send"]
            recvs = [e for e in ev if e.kind == "recv"]
            assert len(sends) == len(recvs) == 2 * (p - 1) * m  # every boundary, both directions
            # a transfer starts after the program that produced it ended
            fwd_end = {(e[0], e[2]): e[4] for e in compute if e[1] == "F"}
            for e in sends:
                if e.extra["phase"] == "F":
                    assert e.start_us >= fwd_end[(e.stage, e.microbatch)]
