"""A job of several pipelines (``plan.pipelines``) equals the sequential model.

Each plan below splits the global batch among 2 or 3 pipelines with unequal shares and
microbatch sizes, different layer splits, tensor degrees, schedules and recompute, over two to
four chip types. For 3 AdamW steps (tests/_harness.py: its experiment and tolerance) the loss
and every gradient equal ``jax.value_and_grad`` of the whole model over the whole global batch
within 1e-5, the global norm too, and the parameters after the last update; after every update
each layer's copies in the pipelines are identical (``==``). Then checkpoints: a run of three
pipelines restores into one pipeline and one pipeline into three, and each trains on as the
sequential model does. Plus the plan's own checks (what is refused, in one line naming the key).
"""

from __future__ import annotations

import numpy as np
import pytest

from h2jax.config import ConfigError, load_config
from h2jax.plan import Plan
from h2jax.runtime import Trainer
from tests._harness import CLUSTER, MODEL, TIED, P, S, assert_pipeline_equals_sequential, differing, sequential_steps
from tests._harness import PIPELINE_PLANS as PLANS
from tests._harness import pipelines_cfg as make_cfg


def assert_copies_identical(trainer) -> None:
    """Every parameter's copies (one per pipeline) are the same bits after an update."""
    copies = trainer.tied.copies()
    assert copies, "every layer is held by every pipeline: the copies are tied"
    for name, by_stage in copies.items():
        arrays = [np.asarray(a) for a in by_stage.values()]
        assert len(arrays) >= 2, name
        assert all(np.array_equal(a, arrays[0]) for a in arrays[1:]), f"the copies of {name} differ"


FAST = ("2p-zbv-1f1b",)  # the fast lane runs one; the others run with the slow tests


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in sorted(PLANS)])
def test_pipelines_equal_the_sequential_model(name, tmp_path):
    n_layers, pipelines = PLANS[name]
    cfg = make_cfg(pipelines, n_layers)
    assert cfg.plan.global_batch == 16 and len(cfg.plan.pipelines) == len(pipelines)
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    try:
        assert_pipeline_equals_sequential(
            cfg, trainer, 3, check_norm=True, after_update=lambda step: assert_copies_identical(trainer)
        )
    finally:
        trainer.close()


@pytest.mark.slow
def test_pipelines_with_a_tied_embedding_equal_the_sequential_model(tmp_path):
    """The LLaMA model whose head reuses the embedding table: in each pipeline the table sits on
    the first and the last stage (other chip types and tensor degrees); all four copies train as one."""
    pipelines = [
        P(8, 4, "1f1b", [S("sim_a", (0, 2), 2, 2), S("sim_b", (2, 4), 1, 4)]),
        P(8, 2, "zb-h1", [S("sim_c", (0, 3), 2, 1), S("sim_d", (3, 4), 1, 2)]),
    ]
    cfg = make_cfg(pipelines, 4, **TIED)
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    try:
        assert len(trainer.tied.copies()["embed/embedding"]) == 4
        assert_pipeline_equals_sequential(cfg, trainer, 3, after_update=lambda step: assert_copies_identical(trainer))
    finally:
        trainer.close()


def _train_steps(trainer, steps: int) -> None:
    for _ in range(steps):
        trainer.train_step()


@pytest.mark.slow
def test_a_checkpoint_of_three_pipelines_restores_into_one_and_back(tmp_path):
    """3 pipelines train 2 steps and save; one pipeline restores that checkpoint and trains the
    third step; and the other way round: both end where the sequential model's third step does."""
    n_layers, pipelines = PLANS["3p-three-types"]
    three = make_cfg(pipelines, n_layers)
    one = make_cfg([P(16, 4, "1f1b", [S("sim_a", (0, 3), 1, 2), S("sim_b", (3, 5), 2, 1)])], n_layers)
    _, want = sequential_steps(three)  # the batches of a step are any plan's
    for first, then in ((three, one), (one, three)):
        src = tmp_path / f"src{len(first.plan.pipelines)}"
        a = Trainer(first, run_dir=src)
        try:
            _train_steps(a, 2)
            a.save_checkpoint()
            a.close_checkpoints()
        finally:
            a.close()
        b = Trainer(then, run_dir=tmp_path / f"dst{len(then.plan.pipelines)}")
        try:
            assert b.restore(src / "checkpoints") == 2
            _train_steps(b, 1)
            bad = differing({k: np.asarray(v) for k, v in b.params_by_layer().items()}, want)
            assert not bad, f"{len(first.plan.pipelines)} -> {len(then.plan.pipelines)} pipelines: {bad}"
        finally:
            b.close()


def test_a_plan_of_pipelines_round_trips_through_yaml(tmp_path):
    n_layers, pipelines = PLANS["2p-zbv-1f1b"]
    plan = make_cfg(pipelines, n_layers).plan
    path = tmp_path / "plan.yaml"
    plan.to_yaml(path)
    again = Plan.from_yaml(path)
    assert again == plan and again.global_batch == 16 and again.num_stages == 4
    assert again.sequence_ranges() == ((0, 8), (8, 16)) and again.stage_offsets() == (0, 2)
    assert again.positions() == ((0, 0), (1, 0), (1, 1), (0, 1), (2, 0), (3, 0))
    assert "2 pipelines (zb-v 4 x 2, 1f1b 2 x 4), global batch 16" == plan.describe()


@pytest.mark.parametrize(
    "edit, key, words",
    [
        (lambda p: p.update(global_batch=12), "plan.global_batch", "global batches add up to 6 + 10 = 16"),
        (lambda p: p.update(schedule="gpipe"), "plan.schedule", "sets it in each of plan.pipelines"),
        (
            lambda p: p["pipelines"][1].update(num_microbatches=3),
            "plan.pipelines[1].num_microbatches",
            "does not divide",
        ),
        (lambda p: p["pipelines"][0]["stages"][1].update(layers=[2, 3]), "plan.pipelines[0].stages", "end at layer 3"),
        (
            lambda p: [s.update(chip="sim_a", data=2, tensor=2, recompute=False) for s in p["pipelines"][1]["stages"]],
            "plan.pipelines",
            "stages on chip sim_a need 1+4+4 = 9 devices, the cluster has 8",
        ),
    ],
)
def test_a_bad_plan_of_pipelines_is_refused_in_one_line(edit, key, words):
    plan = {"pipelines": [dict(p, stages=[dict(s) for s in p["stages"]]) for p in PLANS["2p-1f1b-gpipe"][1]]}
    edit(plan)
    with pytest.raises(ConfigError) as e:
        load_config(None, MODEL + [CLUSTER, "model.n_layers=4", f"plan={plan}"])
    assert e.value.key == key and words in e.value.message, (e.value.key, e.value.message)
    assert "\n" not in str(e.value)
