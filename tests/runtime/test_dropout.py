"""Models with dropout train in the pipeline, with the sequential model's masks.

Dropout keys are a pure function of (seed, step, microbatch, layer, site)
(``h2jax.models._dropout``), so:

- a pipelined step equals the sequential reference drawing the same masks
  (``reference_loss_and_grads(..., step=k)``) in loss and every gradient within 1e-5, on a
  2-stage and a 3-stage plan (two chip types, recompute on one stage: the recompute must
  redraw the forward's masks) under 1F1B and zb-h1 (B and W must use one mask);
- the masks differ between microbatches and between steps, and dropout changes the loss;
- dropout 0 builds no dropout layer: the default model and its programs are unchanged;
- a run SIGKILLed after a checkpoint resumes bit-exactly (the masks come from the step);
- evaluation and ``h2jax align`` run the model deterministically;
- other non-Param state is refused in one line naming it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from h2jax.models import Dropout, GPTConfig, StageModule, build_model, dropout_step
from h2jax.runtime import StageProgram, Trainer, flatten, reference_loss_and_grads
from tests._harness import (
    MP_BASE,
    MPIRUN,
    QUIET,
    TINY,
    TOL,
    S,
    cli_env,
    differing,
    final_params,
    load_step,
    max_diff,
    mpirun_train,
    plan_cfg,
    run_losses,
    train_cli,
)

RATE = 0.1

PLANS = {
    # 2 stages on two chip types: tensor-parallel first stage with recompute, data-parallel second
    "2st-tp4-recompute": (4, [S("sim_a", (0, 1), 1, 4, True), S("sim_b", (1, 4), 2, 1)]),
    # 3 stages, recompute in the middle, vocab-parallel head
    "3st-mixed": (5, [S("sim_a", (0, 1), 2, 1), S("sim_b", (1, 3), 1, 2, True), S("sim_c", (3, 5), 2, 2)]),
}
CASES = [("2st-tp4-recompute", "1f1b"), ("3st-mixed", "1f1b"), ("2st-tp4-recompute", "zb-h1"), ("3st-mixed", "zb-h1")]
FAST = ("2st-tp4-recompute", "1f1b")
SLOW = ("3st-mixed", "zb-h1")


@pytest.mark.parametrize(
    "name,schedule",
    # the default run: FAST (fast lane) and 3 stages under zb-h1; the other two with -m long
    [
        c
        if c == FAST
        else pytest.param(*c, marks=pytest.mark.slow if c == SLOW else [pytest.mark.slow, pytest.mark.long])
        for c in CASES
    ],
    ids=[f"{n}-{s}" for n, s in CASES],
)
def test_dropout_pipeline_equals_sequential_with_the_same_masks(name, schedule, tmp_path):
    n_layers, stages = PLANS[name]
    cfg = plan_cfg(n_layers, schedule, stages, **{"model.dropout": RATE})
    trainer = Trainer(cfg, run_dir=tmp_path)
    assert all(st.dropout for st in trainer.stages)
    assert all(r.split for r in trainer.runners) == (schedule == "zb-h1")
    reference = build_model(cfg.model, seed=cfg.seed)
    # dropout does something: without masks step 0 has another loss, and gradients that differ
    # by far more than the tolerance (about 10 % of their size at rate 0.1)
    tokens, targets = trainer.batch(0)
    masked_loss, masked_grads = reference_loss_and_grads(reference, tokens, targets, step=0)
    plain_loss, plain_grads = reference_loss_and_grads(reference, tokens, targets)
    assert abs(plain_loss - masked_loss) > 10 * TOL, (plain_loss, masked_loss)
    masked, plain = flatten(masked_grads), flatten(plain_grads)
    assert max(max_diff(masked[k], plain[k]) / float(np.max(np.abs(plain[k]))) for k in plain) > 0.01
    for step in (0, 1):  # same parameters, two steps: other batches and other masks
        tokens, targets = trainer.batch(step)
        if step == 0:
            ref_loss, ref_grads = masked_loss, masked_grads
        else:
            ref_loss, ref_grads = reference_loss_and_grads(reference, tokens, targets, step=step)
        loss = float(trainer.forward_backward(step))
        assert abs(loss - ref_loss) <= TOL, (step, loss, ref_loss)
        bad = differing(trainer.grads_by_layer(), flatten(ref_grads))
        assert not bad, f"gradients of step {step} differ: {bad}"
        for st in trainer.stages:
            st.zero_grads()
    trainer.close()


SMALL = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)


def _loss_fn(model, tokens):
    """One compiled program: counter (uint32 [step, microbatch]) -> the model's loss under it."""
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def f(c):
        with dropout_step(c):
            return nnx.merge(graphdef, params)(tokens, tokens)

    return lambda counter: float(f(np.array(counter, np.uint32)))


def test_masks_differ_between_microbatches_and_steps_and_repeat_for_the_same_pair():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)
    model = build_model(dataclasses.replace(SMALL, dropout=RATE), seed=0)
    loss = _loss_fn(model, tokens)
    losses = {c: loss(c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]}
    assert len(set(losses.values())) == 4, losses  # every (step, microbatch) draws other masks
    assert loss((1, 0)) == losses[(1, 0)]  # a pure function: the same pair, the same loss
    # the seed is part of the key
    assert _loss_fn(build_model(dataclasses.replace(SMALL, dropout=RATE), seed=1), tokens)((0, 0)) != losses[(0, 0)]
    # outside dropout_step (evaluation, align, inference) the model is deterministic: the dropout-free loss
    plain = build_model(SMALL, seed=0)
    assert model(tokens, tokens) == plain(tokens, tokens)
    assert all(abs(v - float(plain(tokens, tokens))) > 10 * TOL for v in losses.values())
    # the rate is what is dropped: about RATE of a large tensor is zero, the rest scaled by 1 / (1 - RATE)
    drop = Dropout(RATE, seed=0, layer=3, site=1)
    with dropout_step(jnp.array([5, 2], jnp.uint32)):
        out = np.asarray(drop(jnp.ones((256, 256), jnp.float32)))
    zero = float(np.mean(out == 0))
    assert abs(zero - RATE) < 0.01, zero
    np.testing.assert_allclose(out[out != 0], 1 / (1 - RATE), rtol=1e-6)


def test_dropout_zero_builds_no_dropout_layer_and_the_same_parameters():
    plain, dropped = build_model(SMALL, seed=0), build_model(dataclasses.replace(SMALL, dropout=RATE), seed=0)
    assert not any(isinstance(m, Dropout) for _, m in nnx.iter_graph(plain))
    assert sum(isinstance(m, Dropout) for _, m in nnx.iter_graph(dropped)) == 1 + 2 * SMALL.n_layers
    a, b = flatten(nnx.state(plain, nnx.Param)), flatten(nnx.state(dropped, nnx.Param))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _one_device_stage(module) -> StageProgram:
    spec = dataclasses.replace(
        plan_cfg(2, "1f1b", [S("sim_a", (0, 1)), S("sim_b", (1, 2))]).plan.stages[0], layers=(0, 2)
    )
    mesh = Mesh(np.array(jax.devices("cpu")[:1]).reshape(1, 1), ("data", "tensor"))
    return StageProgram(0, spec, mesh, module, optax.sgd(0.1), first=True, last=True, label="s0")


def test_a_stage_without_dropout_runs_the_dropout_free_programs():
    model = build_model(SMALL, seed=0)
    st = _one_device_stage(StageModule(model, layers=(0, 2), first=True, last=True))
    assert not st.dropout and st.rng(3, 1) is None  # no [step, microbatch] argument: the programs are unchanged


class _StatefulBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, stateful: str):
        self.w = nnx.Param(jnp.eye(4, dtype=jnp.float32))
        if stateful == "rng":
            self.drop = nnx.Dropout(0.1, rngs=rngs)  # keeps an RNG stream (key and count) in the model
        else:
            self.norm = nnx.BatchNorm(4, rngs=rngs)  # keeps running statistics

    def __call__(self, h):
        return h @ self.w[...]


class _StatefulModel(nnx.Module):
    def __init__(self, stateful: str):
        rngs = nnx.Rngs(0)
        self.embed = lambda t: jax.nn.one_hot(t, 4)  # noqa: E731 -- no parameters
        self.blocks = nnx.List([_StatefulBlock(rngs, stateful)])
        self.head = lambda h, t: jnp.mean(h)  # noqa: E731


@pytest.mark.parametrize(
    "stateful,name,hint", [("rng", "blocks/0/drop/rngs", "h2jax.models.Dropout"), ("bn", "blocks/0/norm/", "")]
)
def test_other_non_param_state_is_refused_in_one_line_naming_it(stateful, name, hint):
    model = _StatefulModel(stateful)
    with pytest.raises(TypeError) as err:
        _one_device_stage(StageModule(model, layers=(0, 1), first=True, last=True))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("stage 0: the model holds non-Param state ") and name in msg, msg
    assert "h2jax trains Params only" in msg and hint in msg, msg
    with pytest.raises(TypeError, match="the model holds non-Param state"):
        reference_loss_and_grads(model, np.zeros((1, 1, 4), np.int32), np.zeros((1, 1, 4), np.int32))


ALIGN_CONFIG = str(Path(__file__).parents[1] / "align" / "align_small.yaml")


def test_align_runs_a_dropout_model_deterministically():
    """h2jax align's step loss (what its op and layer levels differentiate) on a dropout
    model: no crash, and the dropout-free model's loss to the bit (alignment compares chip
    types, not masks)."""
    from h2jax.align._targets import load_experiment, step_loss
    from h2jax.config import load_config

    losses = []
    for rate in (0.0, RATE):
        exp = load_experiment(load_config(ALIGN_CONFIG, [f"model.dropout={rate}"]))
        tokens, targets = exp.whole_batch()
        losses.append(float(jax.jit(step_loss(exp.graphdef))(exp.params, tokens, targets)))
    assert losses[0] == losses[1], losses


@pytest.mark.slow
def test_the_align_command_passes_on_a_dropout_model(tmp_path):
    from h2jax.cli_align import main

    argv = [ALIGN_CONFIG, f"model.dropout={RATE}", "--chips", "sim_a", "sim_b", "--out", str(tmp_path)]
    assert main(argv) == 0


@pytest.mark.slow
def test_bit_exact_resume_after_sigkill_with_dropout(tmp_path):
    """Through the CLI: a run with dropout SIGKILLed right after step 3's checkpoint is
    committed resumes with the masks the uninterrupted run drew (they depend on the step
    alone): the same losses (==) and the same final parameters and optimizer state."""
    import signal

    from h2jax.checkpoint import CheckpointStore

    args = [TINY, *QUIET, f"model.dropout={RATE}", "train.steps=6", "checkpoint.every_steps=3"]
    straight = train_cli([*args, "--run-dir", "straight"], tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = train_cli([*args, "--run-dir", "resumed"], tmp_path, env=cli_env(H2JAX_FAULT="kill:committed:3"))
    assert killed.returncode == -signal.SIGKILL
    assert CheckpointStore(tmp_path / "resumed" / "checkpoints").committed_steps() == [3]
    resumed = train_cli([*args, "--run-dir", "resumed"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step 3" in resumed.stderr
    a, b = run_losses(tmp_path / "straight"), run_losses(tmp_path / "resumed")
    assert sorted(b) == list(range(6))
    assert [a[s] for s in range(3, 6)] == [b[s] for s in range(3, 6)]  # ==, not approx
    sa, sb = load_step(tmp_path / "straight" / "checkpoints", 6), load_step(tmp_path / "resumed" / "checkpoints", 6)
    assert sa.keys() == sb.keys() and any(k.startswith("opt_state/") for k in sa)
    for k in sa:
        assert np.array_equal(sa[k], sb[k]), k


@pytest.mark.multiproc
@pytest.mark.slow
def test_dropout_under_mpirun_with_in_program_transfers_equals_one_process(tmp_path):
    """2 ranks, one stage each, the ffi channel's transfers traced into the stage programs
    beside the dropout keys: the same losses and final parameters (<= 1e-6) as one process."""
    import json

    from h2jax.config import load_config

    if MPIRUN is None:
        pytest.skip("mpirun not installed")
    plan = [
        "cluster.chips={sim_a: {nodes: 1}, sim_b: {nodes: 1}}",
        f"model.dropout={RATE}",
        "plan.stages=[{chip: sim_a, data: 2, tensor: 2, layers: [0, 3]}, "
        "{chip: sim_b, data: 4, tensor: 1, layers: [3, 4], recompute: true}]",
    ]
    trainer = Trainer(load_config(None, MP_BASE + plan), run_dir=tmp_path / "single")
    want_losses = [h.loss for h in trainer.run()]
    want_params = {k: np.asarray(v) for k, v in trainer.params_by_layer().items()}
    trainer.close()
    proc = mpirun_train(2, [*MP_BASE, *plan, "train.transport=ffi", "--run-dir", str(tmp_path / "run")], tmp_path)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["transport"] == "ffi"
    np.testing.assert_allclose(summary["losses"], want_losses, atol=1e-6, rtol=0)
    got = final_params(tmp_path / "run")
    assert sorted(got) == sorted(want_params)
    for k, v in want_params.items():
        np.testing.assert_allclose(got[k], v, atol=1e-6, rtol=0, err_msg=k)
