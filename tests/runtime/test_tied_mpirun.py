"""Tied embeddings under mpirun: stages in different processes (one per stage, or one per
device) exchange the table's gradient shares and new values through the host
(World.from_stage_to); the boundaries travel by the ffi or host transport.

Against the sequential model, in this process: each step's loss and every gradient within
1e-5 of ``jax.value_and_grad`` of the whole model (test_tied.py's reasons), the parameters
after 3 steps within 1e-5 of a sequential optax loop, both copies of the table and of its
moments identical (``==``) across the processes; and the run's checkpoint restores, in one
process, under a plan whose single stage holds the embedding and the head.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from h2jax.data import load_dataset, step_batch
from h2jax.launch import find_mpirun
from h2jax.models import build_model
from h2jax.runtime import Trainer, flatten, make_optimizer, reference_loss_and_grads
from tests.runtime.test_one_runtime import _env
from tests.runtime.test_pipeline_equivalence import TOL, S, _max_diff, plan_cfg, reference_update
from tests.runtime.test_tied import TABLE, TIED, make_cfg

pytestmark = [pytest.mark.multiproc, pytest.mark.skipif(find_mpirun() is None, reason="mpirun not installed")]

JOB = Path(__file__).with_name("tied_job.py")
REPO = Path(__file__).resolve().parents[2]


def _reference(cfg):
    """Per step (loss, flat gradients) and the flat parameters after 3 steps, sequentially."""
    data = cfg.data
    dataset = load_dataset(
        corpus=data.corpus, token_file=data.token_file, tokenizer=data.tokenizer, token_dtype=data.token_dtype
    )
    tx, _ = make_optimizer(cfg)
    tx = optax.chain(optax.clip_by_global_norm(cfg.optimizer.clip_norm), tx)
    graphdef, params = nnx.split(build_model(cfg.model, seed=cfg.seed), nnx.Param)
    params = jax.device_put(params, jax.devices("cpu")[0])
    opt_state = tx.init(params)
    update = reference_update(tx)
    steps = []
    for step in range(3):
        tokens, targets = step_batch(dataset, cfg, step)
        loss, grads = reference_loss_and_grads(nnx.merge(graphdef, params), tokens, targets)
        steps.append((loss, flatten(grads)))
        params, opt_state = update(grads, opt_state, params)
    return steps, flatten(params)


@pytest.mark.parametrize(
    "plan,transport,nproc",
    [
        ("2st-1f1b", "ffi", 2),
        pytest.param("3st-gpipe", "host", 3, marks=[pytest.mark.slow, pytest.mark.long]),
        pytest.param("2st-per-device", "ffi", 4, marks=[pytest.mark.slow, pytest.mark.long]),
    ],
)
def test_tied_under_mpirun_equals_sequential(plan, transport, nproc, tmp_path):
    cmd = [find_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", str(nproc)]
    cmd += [sys.executable, str(JOB), str(tmp_path), plan, f"train.transport={transport}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(nproc)]

    cfg = make_cfg(plan)
    steps, want_params = _reference(cfg)
    for r, got in enumerate(ranks):  # every process knows the loss and the global norm
        np.testing.assert_allclose(got["losses"], [loss for loss, _ in steps], atol=TOL, rtol=0, err_msg=f"rank {r}")
        want_norms = [float(optax.tree.norm(g)) for _, g in steps]
        np.testing.assert_allclose(got["norms"], want_norms, atol=TOL, rtol=TOL, err_msg=f"rank {r}")
    for step, (_, want) in enumerate(steps):
        got = {k.split("/", 2)[2]: v for rk in ranks for k, v in rk.items() if k.startswith(f"grads/{step}/")}
        assert sorted(got) == sorted(want), "the processes hold the model's parameters, the table once"
        bad = {k: _max_diff(got[k], want[k]) for k in want if _max_diff(got[k], want[k]) > TOL}
        assert not bad, f"gradients of step {step} differ: {bad}"
    got = {k[len("params/") :]: v for rk in ranks for k, v in rk.items() if k.startswith("params/")}
    assert sorted(got) == sorted(want_params)
    bad = {k: _max_diff(got[k], want_params[k]) for k in want_params if _max_diff(got[k], want_params[k]) > TOL}
    assert not bad, f"parameters after 3 steps differ: {bad}"

    # both copies of the table, and of its moments, equal bit for bit across the processes
    copies = {k: v for rk in ranks for k, v in rk.items() if k.startswith("copy/")}
    moments = {k: v for rk in ranks for k, v in rk.items() if k.startswith("moment/")}
    last = str(cfg.plan.num_stages - 1)
    assert sorted(copies) == ["copy/0", f"copy/{last}"]
    assert np.array_equal(copies["copy/0"], copies[f"copy/{last}"])
    assert np.array_equal(copies["copy/0"], got[TABLE])
    for name in ("0/mu", "0/nu"):
        assert np.array_equal(moments[f"moment/0/{name}"], moments[f"moment/{last}/{name}"]), name

    # the multi-process checkpoint, restored in one process onto one stage holding both uses
    one = plan_cfg(cfg.model.n_layers, "1f1b", [S("sim_a", (0, cfg.model.n_layers), 2, 2)], **TIED)
    trainer = Trainer(one, run_dir=tmp_path / "one")
    assert not trainer.tied
    assert trainer.restore(tmp_path / "run" / "checkpoints") == 3
    restored = {k: np.asarray(v) for k, v in trainer.params_by_layer().items()}
    trainer.close()
    assert sorted(restored) == sorted(got)
    for k, v in got.items():
        assert np.array_equal(restored[k], v), k
