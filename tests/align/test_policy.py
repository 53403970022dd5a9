"""A policy really changes the compiled program, and computes what it says."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from h2jax.align import Fault, NumericsPolicy, apply_policy, module_scopes, trace
from h2jax.models import GPTConfig, build_model


def _matmul(a, b):
    return jnp.tanh(a @ b)


def _args():
    rng = np.random.default_rng(0)
    return rng.standard_normal((8, 16), np.float32), rng.standard_normal((16, 4), np.float32)


def test_rounding_is_a_real_op_of_the_compiled_program():
    a, b = _args()
    exact = jax.jit(apply_policy(_matmul, NumericsPolicy())).lower(a, b)
    bf16 = jax.jit(apply_policy(_matmul, NumericsPolicy(matmul_input_rounding="bf16"))).lower(a, b)
    tf32 = jax.jit(apply_policy(_matmul, NumericsPolicy(matmul_input_rounding="tf32"))).lower(a, b)
    assert "reduce_precision" not in exact.as_text()
    assert bf16.as_text().count("reduce_precision") == 2  # both operands
    assert "format = e8m7" in bf16.as_text() and "format = e8m10" in tf32.as_text()
    assert "reduce-precision" in bf16.compile().as_text()  # survives XLA's optimisation


def test_precision_config_is_set_on_every_matmul():
    a, b = _args()
    text = {
        p: jax.jit(apply_policy(_matmul, NumericsPolicy(matmul_precision=p))).lower(a, b).as_text()
        for p in ("default", "high", "highest")
    }
    assert "precision = [DEFAULT, DEFAULT]" in text["default"]
    assert "precision = [HIGH, HIGH]" in text["high"]
    assert "precision = [HIGHEST, HIGHEST]" in text["highest"]


def test_bf16_inputs_compute_the_bf16_rounded_product():
    a, b = _args()
    got = jax.jit(apply_policy(_matmul, NumericsPolicy(matmul_input_rounding="bf16")))(a, b)
    a16, b16 = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) for x in (a, b))
    want = np.tanh(a16 @ b16)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    exact = jax.jit(apply_policy(_matmul, NumericsPolicy()))(a, b)
    np.testing.assert_array_equal(np.asarray(exact), np.asarray(jax.jit(_matmul)(a, b)))
    assert np.abs(np.asarray(got) - np.asarray(exact)).max() > 1e-4  # the rounding is visible


def test_model_ops_carry_module_path_direction_and_source():
    cfg = GPTConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=32)
    graphdef, params = nnx.split(build_model(cfg, seed=0), nnx.Param)
    tokens = np.zeros((2, 8), np.int32)

    def loss(p):
        model = nnx.merge(graphdef, p)
        with module_scopes(model):
            return model(tokens, tokens)

    prog = trace(jax.value_and_grad(loss), params)
    dots = [op for op in prog.ops if op.name == "dot_general"]
    assert {op.direction for op in dots} == {"fwd", "bwd"}
    assert {"blocks.0.attn", "blocks.1.mlp", "head"} <= {op.module for op in dots}
    assert all("_llama.py:" in op.source or "_gpt.py:" in op.source for op in dots)
    # the same module's fwd ops come before its bwd ops
    mlp = [op for op in dots if op.module == "blocks.1.mlp"]
    assert mlp[0].direction == "fwd" and mlp[-1].direction == "bwd"


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_a_fault_perturbs_only_its_scope(direction):
    prog_fault = Fault("mul", 1e-2, module="blocks.1", direction=direction)
    cfg = GPTConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=2, n_layers=2, d_ff=32)
    graphdef, params = nnx.split(build_model(cfg, seed=0), nnx.Param)
    tokens = np.ones((2, 8), np.int32)

    def loss(p):
        model = nnx.merge(graphdef, p)
        with module_scopes(model):
            return model(tokens, tokens)

    fn = jax.value_and_grad(loss)
    (l0, g0) = jax.jit(apply_policy(fn, NumericsPolicy()))(params)
    (l1, g1) = jax.jit(apply_policy(fn, NumericsPolicy(), fault=prog_fault))(params)
    same_head = np.array_equal(np.asarray(g0["head"]["lm_head"][...]), np.asarray(g1["head"]["lm_head"][...]))
    if direction == "bwd":
        assert float(l0) == float(l1)  # the forward is untouched
        assert same_head  # the head's gradient comes before blocks.1's backward
    else:
        assert float(l0) != float(l1)
    assert not np.array_equal(
        np.asarray(g0["blocks"][1]["mlp"]["w_up"][...]), np.asarray(g1["blocks"][1]["mlp"]["w_up"][...])
    )
