"""Tied embeddings across stages: the LLaMA-family model whose head reuses the embedding table
(``model.tie_embeddings=true``, grouped-query attention) split so that the first and the last
stage -- on different chip types, with different tensor degrees -- both hold the table.

pipeline == sequential as in test_pipeline_equivalence.py (its experiment, tolerance and
optimizer, which tests/_harness.py explains): the loss and every gradient of each step within
1e-5 of ``jax.value_and_grad`` of the whole model (the table's gradient is the sum of both
uses), the parameters after 3 steps within 1e-5 of a sequential optax loop, and after every
update both copies of the table identical (``==``). Then the
same through MpiWorld's logic with ranks as threads, and checkpoints that hold the table once
and restore under other plans (one where a single stage holds both uses). The mpirun runs are
in test_tied_mpirun.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from h2jax.comm import LocalHub
from h2jax.config import ConfigError
from h2jax.models import build_model, shared_parameters
from h2jax.runtime import MpiWorld, ThreadGroup, Trainer
from tests._harness import TABLE, TIED, TOL, S, assert_pipeline_equals_sequential, on_thread_ranks, plan_cfg
from tests._harness import TIED_PLANS as PLANS
from tests._harness import tied_cfg as make_cfg


def assert_copies_identical(trainers):
    """Every copy of the table on every stage of ``trainers``: equal bits. (A mirror's optimizer
    moments of it are never read, so they are not compared: h2jax.runtime._tied.)"""
    copies = {}
    for tr in trainers:
        copies.update(tr.tied.copies()[TABLE])
    assert len(copies) >= 2, copies.keys()
    arrays = [np.asarray(c) for c in copies.values()]
    for a in arrays[1:]:
        assert np.array_equal(a, arrays[0]), "the copies of the tied table differ"


def test_the_tied_table_is_found_on_the_first_and_last_stage():
    cfg = make_cfg("3st-gpipe")
    (sp,) = shared_parameters(build_model(cfg.model, seed=cfg.seed), cfg.plan)
    assert sp.name == TABLE and sp.stages == (0, 2) and sp.owner == 0
    assert dict(sp.paths) == {0: "embed/embedding", 2: "head/embedding"}


def check_three_steps(cfg, trainer):
    """Each of 3 steps against the sequential model: loss, every gradient, the global norm;
    after each update both copies identical; then the parameters."""

    def both_uses_summed(step, want):  # the table's gradient is the sum of both uses: neither alone is within TOL
        assert float(np.max(np.abs(np.asarray(want[TABLE])))) > 100 * TOL

    assert_pipeline_equals_sequential(
        cfg,
        trainer,
        3,
        check_norm=True,
        on_grads=both_uses_summed,
        after_update=lambda step: assert_copies_identical([trainer]),
    )


@pytest.mark.parametrize(
    "name",
    [
        "2st-1f1b",
        pytest.param("3st-gpipe", marks=[pytest.mark.slow, pytest.mark.long]),
        pytest.param("2st-zb-h1", marks=pytest.mark.slow),
    ],
)
def test_tied_pipeline_equals_sequential(name, tmp_path):
    cfg = make_cfg(name)
    trainer = Trainer(cfg, run_dir=tmp_path)
    (sp,) = trainer.tied.shared
    first, last = cfg.plan.stages[sp.stages[0]], cfg.plan.stages[sp.stages[-1]]
    assert first.chip != last.chip and (first.tensor != last.tensor or name != "2st-1f1b")
    check_three_steps(cfg, trainer)
    trainer.close()


@pytest.mark.gpu
def test_tied_table_on_a_gpu_stage_and_an_emulated_stage(tmp_path):
    """The first stage on a CUDA GPU, the last on the emulated CPU chip sim_a: two compilers,
    two arithmetics, one table (the config of test_gpu.py, tied, with grouped-query attention)."""
    try:
        dev = jax.devices("cuda")[0]
    except RuntimeError:
        pytest.skip("no CUDA device")
    chip = f"cuda:{dev.device_kind.split()[-1]}"
    cluster = f'{{"{chip}": {{profile: h200, nodes: 1, devices_per_node: 1, memory_gib: 100}}, sim_a: {{nodes: 1}}}}'
    cfg = plan_cfg(4, "1f1b", [S(chip, (0, 2)), S("sim_a", (2, 4), 2, 1)], **TIED, **{"cluster.chips": cluster})
    trainer = Trainer(cfg, run_dir=tmp_path)
    copies = trainer.tied.copies()[TABLE]
    assert [next(iter(copies[s].devices())).platform for s in (0, 1)] == ["gpu", "cpu"]
    check_three_steps(cfg, trainer)
    trainer.close()


def test_copies_stay_identical_when_a_holder_rounds_its_update_differently(tmp_path):
    """Chips of two vendors may round the same AdamW update differently in the last bit. The
    mirror's update is made to do so here (its table nudged by one part in 2^23 after every
    update): the copies still end equal, since each update's result is the
    owner's."""
    import jax.numpy as jnp

    trainer = Trainer(make_cfg("2st-1f1b"), run_dir=tmp_path)
    tied, mirror = trainer.tied, trainer.stages[1]
    (sp,) = tied.shared
    i = tied._param_index(sp, 1)
    update = mirror.apply_update

    def rounding_otherwise(scale: float) -> None:
        update(scale)
        leaves, treedef = jax.tree_util.tree_flatten(mirror.params)
        leaves[i] = leaves[i] * jnp.float32(1 + 2**-23)
        mirror.params = jax.tree_util.tree_unflatten(treedef, leaves)

    mirror.apply_update = rounding_otherwise
    for step in range(3):
        trainer.forward_backward(step)
        trainer.finish_step()
        assert_copies_identical([trainer])
    trainer.close()


def test_a_non_finite_share_is_counted_and_named(tmp_path):
    """A non-finite gradient in the last stage's use of the table: the global norm is
    non-finite and the abort names the stage it came from (and the owner, whose sum it spoiled)."""
    from h2jax.runtime._state import nonfinite_error

    trainer = Trainer(make_cfg("2st-1f1b"), run_dir=tmp_path)
    tied, mirror = trainer.tied, trainer.stages[1]
    i = tied._param_index(tied.shared[0], 1)
    sum_grads = tied.sum_grads

    def poisoned_head_share() -> None:
        leaves, treedef = jax.tree_util.tree_flatten(mirror.acc)
        leaves[i] = leaves[i].at[0, 0].set(np.inf)
        mirror.acc = jax.tree_util.tree_unflatten(treedef, leaves)
        sum_grads()

    tied.sum_grads = poisoned_head_share
    loss = float(trainer.forward_backward(0))
    sq = trainer._grad_sqnorms()
    assert np.isfinite(loss) and not np.isfinite(sum(sq))
    assert nonfinite_error(0, loss, float(np.sqrt(sum(sq))), sq).stages == [0, 1]
    trainer.close()


@pytest.mark.slow
def test_tied_thread_ranks_equal_one_process(tmp_path):
    """MpiWorld's logic (one stage per rank, the table's gradient and value exchanged
    point to point, TiedParams._move) with ranks as threads: the same losses, norms and parameters as one
    process, and the copies identical on the two ranks."""
    cfg = make_cfg("2st-1f1b", **{"train.steps": "3", "checkpoint.enabled": "false"})
    local = Trainer(cfg, run_dir=tmp_path / "local")
    want_hist = local.run()
    want = {k: np.asarray(v) for k, v in local.gathered_params().items()}
    local.close()

    group, hub = ThreadGroup(2), LocalHub(2)
    out: list = [None, None]

    def rank(r: int) -> None:
        tr = Trainer(cfg, run_dir=tmp_path / "ranks", world=MpiWorld(group.comm(r), [0, 1]), hub=hub)
        out[r] = (tr, tr.run(), {k: np.asarray(v) for k, v in tr.gathered_params().items()})
        tr.close()

    on_thread_ranks(rank, hub)
    for _, history, gathered in out:
        assert [h.loss for h in history] == pytest.approx([h.loss for h in want_hist], abs=1e-6)
        assert [h.grad_norm for h in history] == pytest.approx([h.grad_norm for h in want_hist], abs=1e-6)
        assert sorted(gathered) == sorted(want)
        for k in want:
            np.testing.assert_allclose(gathered[k], want[k], atol=1e-6, rtol=0, err_msg=k)
    assert TABLE in out[0][0].params_by_layer() and TABLE not in out[1][0].params_by_layer()  # the owner reports it
    assert_copies_identical([tr for tr, _, _ in out])


def _state(trainer) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in trainer.state_by_layer().items()}


@pytest.mark.slow
def test_tied_checkpoint_holds_the_table_once_and_restores_under_other_plans(tmp_path):
    cfg = make_cfg("2st-1f1b", **{"train.steps": "2", "checkpoint.enabled": "true"})
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    trainer.run()
    saved = _state(trainer)
    trainer.close()
    assert "params/embed/embedding" in saved and not [k for k in saved if "head/embedding" in k]
    assert {"opt_state/0/mu/embed/embedding", "opt_state/0/nu/embed/embedding"} <= set(saved)
    ckpt = tmp_path / "run" / "checkpoints"

    def restored(plan_stages, n_layers=4):
        other = plan_cfg(n_layers, "1f1b", plan_stages, **TIED, **{"train.steps": "2"})
        tr = Trainer(other, run_dir=tmp_path / "other")
        step = tr.restore(ckpt)
        state = _state(tr)
        return tr, step, state

    # the same plan: every array back, bit for bit, both copies from the one saved table
    for stages in (
        PLANS["2st-1f1b"][2],
        [S("sim_b", (0, 1), 1, 4), S("sim_c", (1, 2), 2, 1), S("sim_a", (2, 4), 1, 2)],  # 3 stages, other chips
        [S("sim_a", (0, 4), 2, 2)],  # one stage holds the embedding and the head: nothing to tie
    ):
        tr, step, state = restored(stages)
        assert step == 2 and sorted(state) == sorted(saved)
        for k, v in saved.items():
            assert np.array_equal(state[k], v), k
        if tr.tied:
            assert_copies_identical([tr])
        else:
            assert len(stages) == 1
        tr.close()

    # and back: a checkpoint of the one-stage plan restores onto both copies of a split plan
    one = plan_cfg(4, "1f1b", [S("sim_a", (0, 4), 2, 2)], **TIED, **{"train.steps": "1", "checkpoint.enabled": "true"})
    tr = Trainer(one, run_dir=tmp_path / "one")
    tr.run()
    want = _state(tr)
    tr.close()
    split = Trainer(cfg, run_dir=tmp_path / "split")
    split.restore(tmp_path / "one" / "checkpoints")
    got = _state(split)
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    assert_copies_identical([split])
    split.close()


def test_a_shared_integer_parameter_is_refused(tmp_path):
    """What cannot be summed keeps a one-line refusal naming the parameter and the stages."""
    import jax.numpy as jnp

    cfg = make_cfg("2st-1f1b")
    model = build_model(cfg.model, seed=cfg.seed)
    shared = nnx.Param(jnp.zeros((4,), jnp.int32))
    model.embed.ids = shared
    model.head.ids = shared
    with pytest.raises(ConfigError, match=r"plan\.stages: parameter embed/ids \(int32\) is held by stages 0 and 1"):
        Trainer(cfg, model=model, run_dir=tmp_path)
