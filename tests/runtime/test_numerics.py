"""A chip type's numerics policy reaches its stage programs: the compiled program changes, the
numbers change by what the policy says, and the exact policy changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from h2jax.config import ConfigError, load_config
from h2jax.runtime import Trainer

BASE = [
    "model.vocab_size=256",
    "model.seq_len=16",
    "model.d_model=32",
    "model.n_heads=4",
    "model.d_ff=64",
    "model.n_layers=2",
    "plan.global_batch=8",
    "plan.num_microbatches=2",
    "train.progress=false",
    "train.tensorboard=false",
    "train.timeline=false",
    "checkpoint.enabled=false",
    "cluster.chips={sim_a: {nodes: 1}, sim_b: {nodes: 1, numerics: {matmul_input_rounding: bf16}}}",
    "plan.stages=[{chip: sim_a, data: 1, tensor: 1, layers: [0, 1]}, {chip: sim_b, data: 1, tensor: 2, layers: [1, 2]}]",
]
EXACT = "cluster.chips={sim_a: {nodes: 1}, sim_b: {nodes: 1}}"


def _loss_and_grads(cfg, tmp_path):
    tr = Trainer(cfg, run_dir=tmp_path)
    loss = float(tr.forward_backward(0))
    grads = {k: np.asarray(v) for k, v in tr.grads_by_layer().items()}
    return tr, loss, grads


def test_the_policy_changes_the_compiled_program_of_its_chip_only(tmp_path):
    tr, loss, grads = _loss_and_grads(load_config(None, BASE), tmp_path / "bf16")
    exact_tr, exact_loss, exact_grads = _loss_and_grads(load_config(None, [*BASE, EXACT]), tmp_path / "exact")
    (a, b), (_, eb) = tr.stages, exact_tr.stages
    mb = tr.cfg.plan.microbatch_size
    x = np.zeros((mb, 16, 32), np.float32)
    t = np.zeros((mb, 16), np.int32)

    def hlo(st):
        import jax

        return (
            jax.jit(st.forward_fn)
            .lower(st.params, jax.device_put(x, st.act_sharding), jax.device_put(t, st.act_sharding))
            .as_text()
        )

    assert "reduce_precision" in hlo(b) and "reduce_precision" not in hlo(eb)
    # sim_a keeps the exact policy: its program has no rounding
    assert "reduce_precision" not in jax_text(a, mb)
    # bf16-rounded matmul inputs move the loss by about bf16's resolution, not more
    assert loss != exact_loss and abs(loss - exact_loss) / exact_loss < 1e-2
    for k in ("blocks/1/mlp/w_up", "head/lm_head"):
        key = next(n for n in grads if n.startswith(k))
        rel = np.linalg.norm(grads[key] - exact_grads[key]) / np.linalg.norm(exact_grads[key])
        assert 1e-5 < rel < 5e-2, (key, rel)
    for t_ in (tr, exact_tr):
        t_.close()


def jax_text(st, mb):
    import jax
    import jax.numpy as jnp

    tok = jax.device_put(jnp.zeros((mb, 16), jnp.int32), st.act_sharding)
    return jax.jit(st.forward_fn).lower(st.params, tok, None).as_text()


def test_a_per_chip_compute_dtype_is_refused_by_the_runtime(tmp_path):
    cfg = load_config(None, [*BASE, "cluster.chips.sim_b.numerics={compute_dtype: bfloat16}"])
    with pytest.raises(ConfigError) as e:
        Trainer(cfg, run_dir=tmp_path)
    assert e.value.key == "cluster.chips.sim_b.numerics.compute_dtype"
