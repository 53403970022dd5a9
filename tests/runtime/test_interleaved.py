"""Chunked schedules (interleaved, zb-v): the plan schema and its validation.

A stage of an ``interleaved`` or ``zb-v`` plan holds several layer chunks on its mesh
(``chunks: [[0, 2], [4, 6]]`` in place of ``layers``); the schedule says where chunk c of
stage s sits in the model (interleaved: c * p + s; zb-v: s, then 2p - 1 - s).
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from h2jax.config import ConfigError, load_config
from h2jax.plan import Plan, PlanError, StageSpec, check_execution, check_plan
from h2jax.runtime import Trainer
from tests._harness import (
    MP_BASE,
    MPIRUN,
    TOL,
    C,
    S,
    Sequential,
    assert_pipeline_equals_sequential,
    differing,
    final_params,
    mpirun_train,
    plan_cfg,
)

INTERLEAVED = {
    "global_batch": 8,
    "num_microbatches": 4,
    "schedule": "interleaved",
    "stages": [
        {"chip": "sim_a", "data": 1, "tensor": 1, "chunks": [[0, 2], [4, 5]], "recompute": False},
        {"chip": "sim_b", "data": 2, "tensor": 1, "chunks": [[2, 4], [5, 8]], "recompute": True},
    ],
}
ZBV = {
    "global_batch": 8,
    "num_microbatches": 4,
    "schedule": "zb-v",
    "stages": [
        {"chip": "sim_a", "data": 1, "tensor": 1, "chunks": [[0, 1], [5, 8]], "recompute": False},
        {"chip": "sim_b", "data": 1, "tensor": 2, "chunks": [[1, 3], [3, 5]], "recompute": False},
    ],
}


def _error(plan: dict, num_layers: int = 8) -> PlanError:
    with pytest.raises(PlanError) as info:
        check_plan(Plan.from_dict(plan), num_layers=num_layers)
    return info.value


# -- schema ----------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [INTERLEAVED, ZBV], ids=["interleaved", "zb-v"])
def test_chunks_round_trip_dict_and_yaml(raw, tmp_path):
    plan = Plan.from_dict({**raw, "model": None})
    check_plan(plan, num_layers=8)
    assert plan.to_dict() == {**raw, "model": None}
    assert Plan.from_dict(plan.to_dict()) == plan
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    assert Plan.from_yaml(path) == plan
    assert "chunks: [[" in path.read_text() and "layers:" not in path.read_text().split("stages:")[1]


def test_one_chunk_stage_writes_layers():
    spec = StageSpec("sim_a", chunks=[[0, 3]])
    assert spec == StageSpec("sim_a", (0, 3)) and spec.chunks == () and spec.layer_chunks == ((0, 3),)
    plan = Plan((StageSpec("sim_a", (0, 3)), StageSpec("sim_b", (3, 4))), 8, 4, "1f1b")
    assert [sorted(s) for s in plan.to_dict()["stages"]] == [["chip", "data", "layers", "recompute", "tensor"]] * 2
    assert plan.num_chunks == 1 and plan.positions() == ((0, 0), (1, 0))


def test_positions_follow_the_schedule():
    inter = Plan.from_dict(INTERLEAVED)
    assert inter.num_chunks == 2
    assert inter.positions() == ((0, 0), (1, 0), (0, 1), (1, 1))  # c * p + s
    assert [s.layers for s in inter.position_specs()] == [(0, 2), (2, 4), (4, 5), (5, 8)]
    assert inter.stages[0].num_layers == 3 and inter.stages[1].num_layers == 5
    zbv = Plan.from_dict(ZBV)
    assert zbv.positions() == ((0, 0), (1, 0), (1, 1), (0, 1))  # the V: s, then 2p - 1 - s
    assert [s.layers for s in zbv.position_specs()] == [(0, 1), (1, 3), (3, 5), (5, 8)]
    assert all(s.tensor == 2 for s in zbv.position_specs()[1:3])


# -- validation: one line naming the key ----------------------------------------------------


def _stages(*chunks, schedule="interleaved", m=4, gb=8):
    return {
        "global_batch": gb,
        "num_microbatches": m,
        "schedule": schedule,
        "stages": [{"chip": c, "chunks": [list(r) for r in ch]} for c, ch in zip(("sim_a", "sim_b", "sim_a"), chunks)],
    }


@pytest.mark.parametrize(
    "plan,key,texts",
    [
        # chunks laid out contiguously per stage, as a one-chunk plan would: wrong model positions
        (
            _stages([(0, 2), (2, 4)], [(4, 6), (6, 8)]),
            "plan.stages[1].chunks[0]",
            ["chunk 0 of stage 1 sits at model position 1", "starts at layer 4, expected 2", "c * num_stages + s"],
        ),
        # zb-v: chunk 1 of the last stage comes right after its chunk 0 (the turn of the V)
        (
            _stages([(0, 1), (6, 8)], [(1, 3), (5, 6)], schedule="zb-v"),
            "plan.stages[1].chunks[1]",
            ["chunk 1 of stage 1 sits at model position 2 and starts at layer 5, expected 3"],
        ),
        # the chunks stop short of the model
        (_stages([(0, 2), (4, 5)], [(2, 4), (5, 7)]), "plan.stages", ["end at layer 7", "num_layers=8"]),
        # an empty chunk
        (_stages([(0, 2), (4, 4)], [(2, 4), (4, 8)]), "plan.stages[0].chunks[1]", ["holds no layer"]),
        # v differs between stages
        (_stages([(0, 2), (4, 5)], [(2, 4), (5, 6), (6, 8)]), "plan.stages[1].chunks", ["holds 3 layer chunk(s)"]),
        # zb-v needs exactly 2 chunks
        (
            _stages([(0, 1), (2, 3), (4, 5)], [(1, 2), (3, 4), (5, 8)], schedule="zb-v"),
            "plan.stages[0].chunks",
            ["holds 3 layer chunk(s); schedule zb-v needs exactly 2"],
        ),
        # interleaved: microbatches in groups of num_stages
        (
            _stages([(0, 2), (4, 5)], [(2, 4), (5, 8)], m=3, gb=6),
            "plan.num_microbatches",
            ["num_microbatches=3 is not a multiple of num_stages=2"],
        ),
        # zb-v: the V's warm-up needs 2p - 1 microbatches
        (
            _stages([(0, 1), (5, 8)], [(1, 3), (3, 5)], schedule="zb-v", m=2),
            "plan.num_microbatches",
            ["num_microbatches=2 < 2 * num_stages - 1 = 3"],
        ),
        # chunks under a one-chunk schedule
        (
            _stages([(0, 2), (4, 5)], [(2, 4), (5, 8)], schedule="1f1b"),
            "plan.stages[0].chunks",
            ["schedule '1f1b' runs one layer range per stage", "interleaved or zb-v"],
        ),
    ],
)
def test_chunk_errors(plan, key, texts):
    err = _error(plan)
    assert err.key == key, str(err)
    for text in texts:
        assert text in err.message, str(err)
    assert "\n" not in str(err)


def test_layers_and_chunks_are_exclusive():
    raw = {**INTERLEAVED, "stages": [{**INTERLEAVED["stages"][0], "layers": [0, 2]}, INTERLEAVED["stages"][1]]}
    with pytest.raises(PlanError, match=r"plan.stages\[0\].layers: give exactly one of layers"):
        Plan.from_dict(raw)
    with pytest.raises(PlanError, match=r"plan.stages\[0\].chunks\[1\]: got \[4\]; expected 2 items"):
        Plan.from_dict({**INTERLEAVED, "stages": [{"chip": "sim_a", "chunks": [[0, 2], [4]]}]})


def test_config_validation_names_the_key():
    """`h2jax train` / check-config refuse a bad chunked plan before any device (exit 2 line)."""
    base = [
        "cluster.chips={sim_a: {nodes: 1}, sim_b: {nodes: 1}}",
        "model.n_layers=8",
        "model.vocab_size=256",
        "model.d_model=32",
        "model.n_heads=4",
        "model.d_ff=64",
        "model.seq_len=16",
    ]
    cfg = load_config(None, [*base, f"plan={yaml.safe_dump(ZBV, default_flow_style=True, width=1000).strip()}"])
    assert cfg.plan.schedule.name == "zb-v" and cfg.plan.stages[0].chunks == ((0, 1), (5, 8))
    bad = {**ZBV, "num_microbatches": 2, "global_batch": 4}
    with pytest.raises(ConfigError, match=r"plan.num_microbatches: zb-v: num_microbatches=2 < 2"):
        load_config(None, [*base, f"plan={yaml.safe_dump(bad, default_flow_style=True, width=1000).strip()}"])


# -- pipeline == sequential ------------------------------------------------------------------
# As tests/runtime/test_pipeline_equivalence.py checks gpipe and 1f1b (tests/_harness.py explains
# the optimizer's eps=1e-3): the loss and every gradient of each step within 1e-5 of
# ``jax.value_and_grad`` of the whole model, the parameters after 3 AdamW steps within 1e-5.


# name -> (n_layers, schedule, stages, overrides)
CHUNKED_PLANS = {
    # 2 stages, v = 2, uneven chunks (2+1 | 1+2), 2x2 into 4x1, recompute on stage 1
    "interleaved-2st-uneven-tp": (
        6,
        "interleaved",
        [C("sim_a", [(0, 2), (3, 4)], 2, 2), C("sim_b", [(2, 3), (4, 6)], 4, 1, True)],
        {},
    ),
    # 3 stages on two chip types (stage 2 on sim_a's second node), v = 2, the wrap 2 -> 0 twice; m = 6
    "interleaved-3st": (
        7,
        "interleaved",
        [
            C("sim_a", [(0, 1), (3, 5)], 2, 1),
            C("sim_b", [(1, 2), (5, 6)], 1, 2, True),
            C("sim_a", [(2, 3), (6, 7)], 1, 2),
        ],
        {"plan.num_microbatches": 6, "plan.global_batch": 12},
    ),
    # 2 stages, v = 3, recompute on stage 0, data parallel stage 1
    "interleaved-2st-v3": (
        7,
        "interleaved",
        [C("sim_a", [(0, 1), (2, 4), (5, 6)], 1, 1, True), C("sim_b", [(1, 2), (4, 5), (6, 7)], 2, 1)],
        {},
    ),
    # 2 stages, v = 2, recompute everywhere, tensor 4 into data 4
    "interleaved-2st-recompute": (
        4,
        "interleaved",
        [C("sim_b", [(0, 1), (2, 3)], 1, 4, True), C("sim_a", [(1, 2), (3, 4)], 4, 1, True)],
        {},
    ),
    # 2 stages: stage 0 holds the embedding and the head; the turn of the V on stage 1 (no transfer)
    "zb-v-2st-uneven-tp": (
        6,
        "zb-v",
        [C("sim_a", [(0, 1), (4, 6)], 2, 2), C("sim_b", [(1, 3), (3, 4)], 1, 4, True)],
        {},
    ),
    # 3 stages on two chip types, m = 6 >= 2p - 1, recompute on the turn
    "zb-v-3st": (
        7,
        "zb-v",
        [
            C("sim_a", [(0, 1), (6, 7)], 1, 2),
            C("sim_b", [(1, 2), (5, 6)], 2, 1),
            C("sim_a", [(2, 4), (4, 5)], 2, 2, True),
        ],
        {"plan.num_microbatches": 6, "plan.global_batch": 12},
    ),
    # 2 stages, recompute everywhere, data 4 | tensor 2
    "zb-v-2st-recompute": (
        6,
        "zb-v",
        [C("sim_a", [(0, 2), (5, 6)], 4, 1, True), C("sim_b", [(2, 3), (3, 5)], 1, 2, True)],
        {},
    ),
    # the head tied to the embedding table: both uses on stage 0, in its two chunk programs
    "zb-v-2st-tied": (
        4,
        "zb-v",
        [C("sim_b", [(0, 1), (3, 4)], 1, 2), C("sim_a", [(1, 2), (2, 3)], 2, 1)],
        {"model.n_kv_heads": "2", "model.tie_embeddings": "true"},
    ),
}
FAST = ("interleaved-2st-uneven-tp", "zb-v-2st-uneven-tp")  # the timeline and dropout tests' plans
SMALL = {  # the fast lane: one step on one-device stages (compiling four chunk programs dominates)
    "interleaved": (4, [C("sim_a", [(0, 1), (2, 3)]), C("sim_b", [(1, 2), (3, 4)], recompute=True)]),
    "zb-v": (4, [C("sim_a", [(0, 1), (3, 4)]), C("sim_b", [(1, 2), (2, 3)], recompute=True)]),
    # v = 1: interleaved's grouping of forwards with one range per stage (no chunk 1 tasks)
    "interleaved-v1": (4, [C("sim_a", [(0, 2)]), C("sim_b", [(2, 4)])]),
}


def chunked_cfg(name: str, **extra: str):
    n_layers, schedule, stages, overrides = CHUNKED_PLANS[name]
    return plan_cfg(n_layers, schedule, stages, **{**overrides, **extra})


@pytest.mark.parametrize(
    "schedule", [s if s != "interleaved-v1" else pytest.param(s, marks=pytest.mark.slow) for s in sorted(SMALL)]
)  # the fast lane: interleaved and zb-v with two chunks a stage
def test_one_chunked_step_equals_sequential(schedule, tmp_path):
    """The fast lane's check: the loss and every gradient of one step (the slow test below
    runs 3 steps with updates on 8 plans)."""
    import jax

    n_layers, stages = SMALL[schedule]
    cfg = plan_cfg(n_layers, schedule.removesuffix("-v1"), stages)
    trainer = Trainer(cfg, run_dir=tmp_path)
    assert len(trainer.stages) == 2 * cfg.plan.num_chunks
    # the memory check: one entry per stage, every chunk's parameters (4 blocks + embed + head over 2 stages)
    assert len(trainer.memory) == 2 and all(m.activations > 0 for m in trainer.memory)
    params = sum(m.params for m in trainer.memory)
    assert params == sum(x.nbytes for st in trainer.stages for x in jax.tree.leaves(st.params))
    ref_loss, want = Sequential(cfg).grads(*trainer.batch(0))
    loss = float(trainer.forward_backward(0))
    assert abs(loss - ref_loss) <= TOL, (loss, ref_loss)
    bad = differing(trainer.grads_by_layer(), want)
    assert not bad, f"gradients differ: {bad}"
    trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHUNKED_PLANS))
def test_chunked_pipeline_equals_sequential(name, tmp_path):
    cfg = chunked_cfg(name)
    trainer = Trainer(cfg, run_dir=tmp_path)
    v = cfg.plan.num_chunks
    assert len(trainer.stages) == v * cfg.plan.num_stages and all(len(r.programs) == v for r in trainer.runners)
    assert all(r.split == cfg.plan.schedule.split_backward for r in trainer.runners)

    def one_tied_table(step):  # a tied table: one value on every holder
        for path, copies in trainer.tied.copies().items():
            values = [np.asarray(a) for a in copies.values()]
            assert len(values) == 2 and all((x == values[0]).all() for x in values), path

    assert_pipeline_equals_sequential(cfg, trainer, 3, after_update=one_tied_table)
    trainer.close()


# -- the recorded timeline obeys the schedule -------------------------------------------------


def _chunk_events(trainer, step):
    """(stage, F/B/W, microbatch, start, end, chunk) of every compute event of ``step``."""
    out = []
    for e in trainer.timeline.events(step):
        if e.kind in ("fwd", "bwd"):
            kind = "F" if e.kind == "fwd" else e.extra.get("part", "B")
            out.append((e.stage, kind, e.microbatch, e.start_us, e.end_us, e.extra["chunk"]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", FAST)
def test_recorded_timeline_obeys_the_schedule(name, tmp_path):
    """One F and one B (and for zb-v one W) per (stage, chunk, microbatch), every dependency
    between model positions, the in-flight bound, and each stage's tasks in the grid's order;
    the Gantt chart and the memory check of a chunked run."""
    cfg = chunked_cfg(name, **{"plan.num_microbatches": 8, "plan.global_batch": 32})
    trainer = Trainer(cfg, run_dir=tmp_path)
    trainer.run(steps=2)
    sched = trainer.schedule
    p, m, v = cfg.plan.num_stages, cfg.plan.num_microbatches, cfg.plan.num_chunks
    kinds = 3 if sched.split_backward else 2
    for step in range(2):
        compute = _chunk_events(trainer, step)
        assert len(compute) == kinds * p * v * m
        errs = check_execution(
            compute,
            num_stages=p,
            num_microbatches=m,
            max_in_flight=sched.max_in_flight(),
            split_backward=sched.split_backward,
            num_chunks=v,
            virtual_stage=sched.virtual_stage,
            eps=1e-3,
        )
        assert errs == []
        for s in range(p):
            ran = sorted((e for e in compute if e[0] == s), key=lambda e: e[3])
            order = [f"{k}{mb}" + (f"c{c}" if c else "") for _, k, mb, _, _, c in ran]
            assert order == [str(t) for t in sched.stage_ops(s)]
    summary = trainer.summary
    assert 0 <= summary["bubble_fraction_gantt_step"] < 1 and (tmp_path / "gantt.png").stat().st_size > 0
    assert "layers 0-" in summary["stages"][0]["label"] and ", " in summary["stages"][0]["label"]
    assert all(s["memory_gib"] > 0 for s in summary["stages"])
    trainer.close()


def test_chunk_activation_peak_weighs_each_chunk():
    """The memory check's activation peak walks the stage's ops: F adds its chunk's size, the
    last backward task of it (W split, B unsplit) frees it; uneven chunks weigh differently."""
    from h2jax.plan import Task
    from h2jax.plan.schedules import Interleaved, ZeroBubbleV
    from h2jax.runtime._memory import chunk_activation_peak

    ops = [Task("F", 0, 0), Task("F", 0, 1), Task("B", 0, 1), Task("F", 1, 0), Task("B", 0, 0), Task("B", 1, 0)]
    assert chunk_activation_peak(ops, [10, 1], split=False) == (20, 2)  # two chunk-0 microbatches
    assert chunk_activation_peak(ops, [1, 10], split=False) == (11, 2)
    # with unit sizes the peak count is the schedule's in-flight bound
    for sched in (Interleaved().bind(2, 4), Interleaved(3).bind(3, 6), ZeroBubbleV().bind(3, 6)):
        for s in range(sched.num_stages):
            peak, count = chunk_activation_peak(sched.stage_ops(s), [1] * sched.num_chunks, split=sched.split_backward)
            assert peak == count <= sched.max_in_flight()[s]


# -- checkpoints: keyed by model path, restored under any plan ----------------------------------


@pytest.mark.slow
def test_checkpoint_of_a_chunked_plan_restores_into_a_plain_one(tmp_path):
    cfg = chunked_cfg("zb-v-2st-uneven-tp", **{"checkpoint.enabled": "true", "train.steps": "1"})
    trainer = Trainer(cfg, run_dir=tmp_path / "zbv")
    trainer.run()
    want = {k: np.asarray(x) for k, x in trainer.params_by_layer().items()}
    trainer.close()
    plain = plan_cfg(6, "1f1b", [S("sim_a", (0, 4), 2, 2), S("sim_b", (4, 6), 4, 1)])
    other = Trainer(plain, run_dir=tmp_path / "plain")
    assert other.restore(tmp_path / "zbv" / "checkpoints") == 1
    got = {k: np.asarray(x) for k, x in other.params_by_layer().items()}
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    other.close()


# -- under mpirun: one process per stage equals one process -------------------------------------

MP_PLANS = {
    # interleaved: the wrap from stage 1 back to stage 0 and two boundaries stage 0 -> 1 (tag lanes)
    "interleaved": [
        "cluster.chips={sim_a: {nodes: 1}, sim_b: {nodes: 1}}",
        "plan.schedule=interleaved",
        "plan.stages=[{chip: sim_a, data: 2, tensor: 2, chunks: [[0, 1], [2, 3]]}, "
        "{chip: sim_b, data: 4, tensor: 1, chunks: [[1, 2], [3, 4]], recompute: true}]",
    ],
    # zb-v: embedding and head on rank 0, the turn of the V on rank 1 (handed over, no transfer)
    "zb-v": [
        "cluster.chips={sim_a: {nodes: 1}, sim_b: {nodes: 1}}",
        "plan.schedule=zb-v",
        "plan.stages=[{chip: sim_a, data: 2, tensor: 2, chunks: [[0, 1], [3, 4]]}, "
        "{chip: sim_b, data: 4, tensor: 1, chunks: [[1, 2], [2, 3]], recompute: true}]",
    ],
}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,transport",
    [
        # each schedule under mpirun once in the default run, the other transport with -m long
        pytest.param("interleaved", "host", marks=pytest.mark.long),
        ("interleaved", "ffi"),
        pytest.param("zb-v", "ffi", marks=pytest.mark.long),
        ("zb-v", "host"),
    ],
)
def test_chunked_under_mpirun_equals_one_process(schedule, transport, tmp_path):
    """2 ranks, one stage (two chunks) each, 3 steps: the same losses and final parameters
    (<= 1e-6) as one process (which equals the sequential model, above), and every rank's
    timeline of the last step holds one F and one B (zb-v: and one W) per (chunk, microbatch)."""
    import json

    if MPIRUN is None:
        pytest.skip("mpirun not installed")
    cfg = load_config(None, MP_BASE + MP_PLANS[schedule])
    trainer = Trainer(cfg, run_dir=tmp_path / "single")
    want_losses = [h.loss for h in trainer.run()]
    want_params = {k: np.asarray(v) for k, v in trainer.params_by_layer().items()}
    trainer.close()

    run = tmp_path / "run"
    proc = mpirun_train(
        2, [*MP_BASE, *MP_PLANS[schedule], f"train.transport={transport}", "--run-dir", str(run)], tmp_path
    )
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["transport"] == transport
    np.testing.assert_allclose(summary["losses"], want_losses, atol=1e-6, rtol=0)
    got = final_params(run)
    assert sorted(got) == sorted(want_params)
    for k, v in want_params.items():
        np.testing.assert_allclose(got[k], v, atol=1e-6, rtol=0, err_msg=k)
    trace = json.loads((run / "trace.json").read_text())
    compute = [
        (e["args"]["stage"], e["args"]["chunk"], e["name"][0])
        for e in trace["traceEvents"]
        if e["ph"] == "X" and e["args"]["kind"] in ("fwd", "bwd") and e["args"]["step"] == 2
    ]
    kinds = "FBW" if schedule == "zb-v" else "FB"
    for stage in (0, 1):
        for chunk in (0, 1):
            for kind in kinds:
                assert compute.count((stage, chunk, kind)) == 4, (stage, chunk, kind, compute[:8])


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [FAST[0], pytest.param(FAST[1], marks=pytest.mark.long)]
)  # zb-v's chunks with dropout: -m long
def test_chunked_dropout_draws_the_sequential_masks(name, tmp_path):
    """Dropout keys are a pure function of (seed, step, microbatch, layer, site): a chunk's
    blocks keep their model layer indices, so a chunked step draws the sequential model's
    masks (loss and every gradient within 1e-5 of the masked reference, which differs from
    the unmasked one)."""
    from h2jax.models import build_model
    from h2jax.runtime import flatten, reference_loss_and_grads

    cfg = chunked_cfg(name, **{"model.dropout": 0.1})
    trainer = Trainer(cfg, run_dir=tmp_path)
    assert all(st.dropout for st in trainer.stages)
    reference = build_model(cfg.model, seed=cfg.seed)
    for step in (0, 1):
        tokens, targets = trainer.batch(step)
        ref_loss, ref_grads = reference_loss_and_grads(reference, tokens, targets, step=step)
        plain_loss, _ = reference_loss_and_grads(reference, tokens, targets)
        assert abs(plain_loss - ref_loss) > 10 * TOL
        loss = float(trainer.forward_backward(step))
        assert abs(loss - ref_loss) <= TOL, (step, loss, ref_loss)
        bad = differing(trainer.grads_by_layer(), flatten(ref_grads))
        assert not bad, f"gradients of step {step} differ: {bad}"
        for st in trainer.stages:
            st.zero_grads()
    trainer.close()


def test_the_planner_prices_every_chunk_of_a_chunked_plan():
    """The cost model and the simulator price a chunked plan by all of its chunks (not its first
    ones only): interleaved's stages cost what one-range stages with their block counts cost,
    plus nothing (this roofline table has no per-call cost); zb-v's stage 0 carries the head
    too; the replay runs one forward per (stage, chunk, microbatch)."""
    import dataclasses

    from h2jax.plan import ChipProfile, ModelShape, estimate, simulate_plan

    model = ModelShape(n_layers=8, d_model=64, n_heads=4, d_ff=128, vocab_size=256, seq_len=16, act_bytes=4)
    spec = dict(memory_gib=1.0, peak_tflops=0.1, mem_bw_gbps=40, intra_node_gbps=10, inter_node_gbps=5)
    chips = {n: ChipProfile(n, devices_per_node=4, **spec) for n in ("sim_a", "sim_b")}
    inter = Plan.from_dict(INTERLEAVED)
    flat = dataclasses.replace(
        inter,
        schedule="1f1b",
        stages=tuple(
            StageSpec(s.chip, (a, a + s.num_layers), s.data, s.tensor, s.recompute)
            for s, a in zip(inter.stages, (0, inter.stages[0].num_layers))
        ),
    )
    got, want = estimate(inter, model, chips), estimate(flat, model, chips)
    for g, w in zip(got.stages, want.stages):
        assert g.fwd_s == pytest.approx(w.fwd_s, rel=1e-12) and g.bwd_s == pytest.approx(w.bwd_s, rel=1e-12)
    zbv = Plan.from_dict(ZBV)
    cost = estimate(zbv, model, chips)

    def fwd(a: int) -> list[float]:  # two one-range stages on sim_a 1x1, split at block a
        split = (StageSpec("sim_a", (0, a)), StageSpec("sim_a", (a, 8)))
        return [s.fwd_s for s in estimate(dataclasses.replace(flat, stages=split), model, chips).stages]

    (embed_3, blocks_5_head), (_, blocks_3_head) = fwd(3), fwd(5)
    block = (blocks_5_head - blocks_3_head) / 2
    # zb-v's stage 0 (sim_a 1x1, blocks 0 and 5-7): the embedding, 4 blocks and the head
    assert cost.stages[0].fwd_s == pytest.approx(embed_3 + blocks_3_head - 2 * block, rel=1e-9)
    for plan in (inter, zbv):
        sim, _ = simulate_plan(plan, model, chips)
        fwds = sorted((e.stage, e.extra.get("chunk", 0), e.microbatch) for e in sim.events if e.kind == "fwd")
        assert fwds == sorted((s, c, m) for s in range(2) for c in range(2) for m in range(4))
