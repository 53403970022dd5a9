"""Evaluation (``train.eval_every``): on a 1-stage and a 3-stage zb-v plan the eval loss equals
the sequential model's loss on the same validation sequences within 1e-6, and an evaluation
changes no parameter, optimizer state or gradient accumulator; the CLI reports it in metrics
and the summary, and under mpirun it is the one-process eval loss."""

from __future__ import annotations

import json

import numpy as np
import pytest

from h2jax.config import ConfigError, load_config
from h2jax.data import write_megatron
from h2jax.runtime import Trainer
from tests._harness import QUIET, TINY, C, S, Sequential, plan_cfg
from tests._harness import train_cli as _run

EVAL_TOL = 1e-6


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval_stores")
    rng = np.random.default_rng(0)
    for name, n in (("train", 300), ("val", 120)):
        write_megatron(d / name, [rng.integers(0, 256, size=int(rng.integers(5, 50))) for _ in range(n)])
    return d


PLANS = {  # (layers, schedule, stages, overrides)
    "1-stage": (2, "1f1b", [S("sim_a", (0, 2), data=2)], {}),
    "3-stage-zb-v": (
        6,
        "zb-v",
        [C("sim_a", [(0, 1), (5, 6)]), C("sim_b", [(1, 2), (4, 5)], tensor=2), C("sim_c", [(2, 3), (3, 4)])],
        {"plan.num_microbatches": "8"},  # the V's warm-up needs 2 x 3 - 1
    ),
}


def _state(trainer) -> list[np.ndarray]:
    return [
        np.asarray(x) for st in trainer.stages for x in (*_leaves(st.params), *_leaves(st.opt_state), *_leaves(st.acc))
    ]


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_the_eval_loss_is_the_sequential_loss_on_the_validation_sequences(stores, name, tmp_path):
    n_layers, schedule, stages, extra = PLANS[name]
    cfg = plan_cfg(
        n_layers,
        schedule,
        stages,
        **{
            "data.sources": json.dumps({str(stores / "train"): 1}),
            "data.val_sources": json.dumps({str(stores / "val"): 1}),
            "train.eval_every": "1",
            "train.eval_batches": "2",
            **extra,
        },
    )
    trainer = Trainer(cfg, run_dir=tmp_path)
    before = _state(trainer)
    got = trainer.evaluate()
    after = _state(trainer)
    assert len(before) == len(after) and all(np.array_equal(a, b) for a, b in zip(before, after))
    ref = Sequential(cfg)
    val = trainer.val_data()
    p = cfg.plan
    want = []
    for i in range(2):
        b = val.batch(i * p.global_batch, p.global_batch)
        rows = b.tokens.reshape(p.num_microbatches, p.microbatch_size, -1)
        segs = b.segments[:, :-1].reshape(p.num_microbatches, p.microbatch_size, -1)
        want.append(ref.grads(rows[..., :-1], rows[..., 1:], segs)[0])
    assert abs(got - float(np.mean(want))) <= EVAL_TOL, (got, want)
    # a training step after it is the step without it: the evaluation left nothing behind
    loss = float(trainer.forward_backward(0))
    assert abs(loss - ref.grads(*trainer.batch(0), trainer.segments(0))[0]) <= EVAL_TOL
    trainer.close()


def test_evaluation_needs_validation_data_and_no_dropout():
    with pytest.raises(ConfigError, match="train.eval_every: eval_every=5 needs validation data"):
        load_config(None, ["train.eval_every=5"], check_files=False)
    with pytest.raises(ConfigError, match="would drop units"):
        load_config(None, ["train.eval_every=5", "data.val_sources={x: 1}", "model.dropout=0.1"], check_files=False)


@pytest.mark.multiproc
def test_the_eval_loss_under_mpirun_is_the_one_process_eval_loss(stores, tmp_path):
    import sys

    from tests._harness import mpirun

    src = "data.sources=" + json.dumps({str(stores / "train"): 1})
    common = [TINY, *QUIET, src, "data.holdout=0.1", "train.eval_every=2", "train.steps=3", "checkpoint.enabled=false"]
    one = _run([*common, "name=one"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    # the one-process run's records: metrics rows after 2 steps and after the last (3), and the summary
    rows = [json.loads(x) for x in (tmp_path / "runs" / "one" / "metrics.jsonl").read_text().splitlines()]
    evals = [(row["step"], row["eval_loss"]) for row in rows if "eval_loss" in row]
    assert [s for s, _ in evals] == [1, 2]
    summary = json.loads((tmp_path / "runs" / "one" / "summary.json").read_text())
    assert summary["eval_losses"] == [[2, evals[0][1]], [3, evals[1][1]]]
    assert summary["data"]["sequences_consumed"] == 3 * 8
    mp = mpirun(2, [sys.executable, "-m", "h2jax.cli", "train", *common, "name=mp"], tmp_path)  # ffi transport
    assert mp.returncode == 0, mp.stderr[-3000:]
    got = json.loads((tmp_path / "runs" / "mp" / "summary.json").read_text())["eval_losses"]
    assert [s for s, _ in got] == [2, 3]
    for (_, a), (_, b) in zip(summary["eval_losses"], got):
        assert abs(a - b) <= EVAL_TOL, (summary["eval_losses"], got)
