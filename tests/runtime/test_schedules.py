"""Split-backward schedules in the runtime: the B/W split is real, and zb-h1 == sequential.

- XLA's compiled cost analysis of one block-heavy stage: B (input gradient) does at most
  0.6 x the FLOPs of the unsplit backward, B + W at most 1.1 x -- W is not an empty step
  and B does not secretly compute the weight gradient.
- pipeline == sequential for zb-h1 exactly as tests/runtime/test_pipeline_equivalence.py
  checks gpipe and 1f1b (loss and every gradient within 1e-5 of ``jax.value_and_grad``,
  parameters after 3 AdamW steps within 1e-5; tests/_harness.py explains eps=1e-3).
- the recorded timeline obeys the schedule: one F, B and W per (stage, microbatch), every
  dependency, and the in-flight bound.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from h2jax.config import load_config
from h2jax.models import StageModule, build_model
from h2jax.plan import StageSpec, check_execution
from h2jax.runtime import StageProgram, Trainer
from tests._harness import (
    MP_BASE,
    MPIRUN,
    TOL,
    assert_pipeline_equals_sequential,
    final_params,
    max_diff,
    mpirun_train,
)
from tests._harness import SPLIT_PLANS as PLANS
from tests._harness import split_cfg as make_cfg

# -- the split is real ------------------------------------------------------------------------


def _flops(jitted, *args) -> float:
    cost = jitted.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


def test_split_backward_flops_from_xla_cost_analysis():
    """A middle stage of 4 wide blocks: matmuls dominate, as in a real model's stage."""
    cfg = load_config(
        None,
        [
            "model.vocab_size=256",
            "model.seq_len=16",
            "model.d_model=256",
            "model.n_heads=4",
            "model.d_ff=1024",
            "model.n_layers=6",
        ],
    )
    model = build_model(cfg.model, seed=0)
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]).reshape(1, 1), ("data", "tensor"))
    spec = StageSpec(chip="cpu", layers=(1, 5), data=1, tensor=1, recompute=False)
    module = StageModule(model, layers=(1, 5), first=False, last=False)
    st = StageProgram(1, spec, mesh, module, optax.sgd(0.1), first=False, last=False, label="s1")
    x = jax.device_put(jax.random.normal(jax.random.key(0), (8, 16, 256), jnp.float32), st.act_sharding)
    dy = jax.device_put(jax.random.normal(jax.random.key(1), (8, 16, 256), jnp.float32), st.act_sharding)

    _, saved = jax.jit(st.forward_fn)(st.params, x, None)
    unsplit = _flops(jax.jit(st.backward_fn), st.params, saved, None, dy, st.acc)
    _, saved_split = jax.jit(st.split_forward_fn)(st.params, x, None)
    b = jax.jit(st.input_grad_fn)
    w = jax.jit(st.weight_grad_fn)
    b_flops = _flops(b, st.params, saved_split, None, dy)
    dx, kept = b(st.params, saved_split, None, dy)
    w_flops = _flops(w, st.params, kept, st.acc)
    assert b_flops <= 0.6 * unsplit, (b_flops, w_flops, unsplit)
    assert b_flops + w_flops <= 1.1 * unsplit, (b_flops, w_flops, unsplit)
    assert w_flops >= 0.3 * unsplit, "W must do the weight-gradient work"

    # and B + W give exactly the unsplit backward's gradients
    acc_ref, dx_ref = jax.jit(st.backward_fn)(st.params, saved, None, dy, st.acc)
    acc, _ = w(st.params, kept, jax.tree.map(jnp.zeros_like, st.acc))
    assert max_diff(dx, dx_ref) <= TOL
    for a, r in zip(jax.tree.leaves(acc), jax.tree.leaves(acc_ref)):
        assert max_diff(a, r) <= TOL


# -- pipeline == sequential for zb-h1 -----------------------------------------------------------


@pytest.mark.parametrize(
    "name", [n if n == "2st-2x2-to-4x1" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(PLANS)]
)
def test_zb_h1_pipeline_equals_sequential(name, tmp_path):
    cfg = make_cfg(name)
    trainer = Trainer(cfg, run_dir=tmp_path)
    assert all(r.split for r in trainer.runners)
    assert_pipeline_equals_sequential(cfg, trainer, 3)
    trainer.close()


def _compute_events(trainer, step):
    out = []
    for e in trainer.timeline.events(step):
        if e.kind == "fwd":
            out.append((e.stage, "F", e.microbatch, e.start_us, e.end_us))
        elif e.kind == "bwd":
            out.append((e.stage, e.extra.get("part", "B"), e.microbatch, e.start_us, e.end_us))
    return out


@pytest.mark.slow  # the fast lane checks zb-h1 against the sequential model (above)
def test_zb_h1_recorded_timeline_obeys_the_schedule(tmp_path):
    cfg = make_cfg("3st-mixed", **{"plan.num_microbatches": 8, "plan.global_batch": 32})
    trainer = Trainer(cfg, run_dir=tmp_path)
    trainer.run(steps=2)
    p, m = cfg.plan.num_stages, cfg.plan.num_microbatches
    for step in range(2):
        compute = _compute_events(trainer, step)
        assert len(compute) == 3 * p * m
        errs = check_execution(
            compute,
            num_stages=p,
            num_microbatches=m,
            max_in_flight=trainer.schedule.max_in_flight(),
            split_backward=True,
            eps=1e-3,
        )
        assert errs == []
        # each stage ran its tasks in the schedule's order
        for s in range(p):
            order = [f"{k}{mb}" for _, k, mb, *_ in sorted((e for e in compute if e[0] == s), key=lambda e: e[3])]
            assert order == [str(t) for t in trainer.schedule.stage_ops(s)]
    trainer.close()


# -- under mpirun -------------------------------------------------------------------------------

MP_PLAN = [
    "cluster.chips={sim_a: {nodes: 1}, sim_b: {nodes: 1}}",
    "plan.schedule=zb-h1",
    "plan.stages=[{chip: sim_a, data: 2, tensor: 2, layers: [0, 3]}, "
    "{chip: sim_b, data: 4, tensor: 1, layers: [3, 4], recompute: true}]",
]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed")
@pytest.mark.parametrize("transport", ["host", "ffi"])
def test_zb_h1_under_mpirun_equals_one_process(transport, tmp_path):
    """2 ranks, one stage each, 3 zb-h1 steps: the same losses and final parameters (<= 1e-6)
    as the one-process run (which equals the sequential model, above), and every rank's
    timeline holds one F, B and W per microbatch."""
    cfg = load_config(None, MP_BASE + MP_PLAN)
    trainer = Trainer(cfg, run_dir=tmp_path / "single")
    want_losses = [h.loss for h in trainer.run()]
    want_params = {k: np.asarray(v) for k, v in trainer.params_by_layer().items()}
    trainer.close()

    proc = mpirun_train(
        2, [*MP_BASE, *MP_PLAN, f"train.transport={transport}", "--run-dir", str(tmp_path / "run")], tmp_path
    )
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["transport"] == transport
    np.testing.assert_allclose(summary["losses"], want_losses, atol=1e-6, rtol=0)
    got = final_params(run)
    assert sorted(got) == sorted(want_params)
    for k, v in want_params.items():
        np.testing.assert_allclose(got[k], v, atol=1e-6, rtol=0, err_msg=k)
    trace = json.loads((run / "trace.json").read_text())
    parts = [
        (e["args"]["stage"], e["args"].get("part"), e["args"]["step"])
        for e in trace["traceEvents"]
        if e["ph"] == "X" and e["args"]["kind"] == "bwd"
    ]
    for stage in (0, 1):
        for part in ("B", "W"):
            assert sum(1 for e in parts if e[:2] == (stage, part) and e[2] == 2) == 4, (stage, part, parts[:8])
