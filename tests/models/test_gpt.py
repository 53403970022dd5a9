"""GPT in the stageable form: shapes, causality, init loss, stages, tensor-parallel equivalence."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from h2jax.models import (
    GPT,
    TENSOR,
    GPTConfig,
    StageModule,
    build_model,
    check_stageable,
    partition_specs,
    tensor_divisible_dims,
)

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4, d_ff=64)
BATCH = 4


def _batch(cfg: GPTConfig, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    tokens = jax.random.randint(jax.random.key(seed), (BATCH, cfg.seq_len + 1), 0, cfg.vocab_size)
    tokens = tokens.astype(jnp.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _variables(module: nnx.Module) -> dict[int, nnx.Param]:
    """Param objects reachable from `module`, keyed by identity."""
    return {id(node): node for _, node in nnx.iter_graph(module) if isinstance(node, nnx.Param)}


def _loss_and_grads(model: nnx.Module, tokens: jax.Array, targets: jax.Array):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, tokens, targets):
        return nnx.merge(graphdef, params, rest)(tokens, targets)

    return jax.jit(jax.value_and_grad(loss_fn))(params, tokens, targets)


def test_config_validation_and_head_dim():
    assert CFG.head_dim == 8
    with pytest.raises(ValueError, match="not divisible"):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="floating"):
        GPTConfig(dtype="int32")
    expected = {"model.n_heads": 4, "model.d_ff": 64, "model.vocab_size": 64}
    assert tensor_divisible_dims(CFG) == expected


def test_shapes_and_dtypes():
    model = build_model(CFG, seed=0)
    tokens, targets = _batch(CFG)
    h = model.embed(tokens)
    assert h.shape == (BATCH, CFG.seq_len, CFG.d_model)
    assert len(model.blocks) == CFG.n_layers and isinstance(model.blocks, nnx.List)
    for block in model.blocks:
        h = block(h)
        assert h.shape == (BATCH, CFG.seq_len, CFG.d_model)
    loss = model.head(h, targets)
    assert loss.shape == () and loss.dtype == jnp.float32
    _, params = nnx.split(model, nnx.Param)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}


def test_bfloat16_compute_keeps_float32_params_and_loss():
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=2, n_layers=1, d_ff=64, dtype="bfloat16")
    model = build_model(cfg, seed=0)
    tokens, targets = _batch(cfg)
    assert model.embed(tokens).dtype == jnp.bfloat16
    assert model(tokens, targets).dtype == jnp.float32
    _, params = nnx.split(model, nnx.Param)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}


def test_same_seed_same_params():
    a = nnx.split(build_model(CFG, seed=3), nnx.Param)[1]
    b = nnx.split(build_model(CFG, seed=3), nnx.Param)[1]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_causal():
    model = build_model(CFG, seed=0)
    tokens, _ = _batch(CFG)
    t = CFG.seq_len // 2
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % CFG.vocab_size)
    h, h_changed = model.hidden(tokens), model.hidden(changed)
    np.testing.assert_array_equal(h[:, :t], h_changed[:, :t])
    assert not np.allclose(h[:, t:], h_changed[:, t:])


def test_init_loss_is_log_vocab():
    model = build_model(CFG, seed=0)
    loss = model(*_batch(CFG))
    # logits at init have std init_std*sqrt(d_model) ~ 0.11, so loss exceeds ln V by ~var/2
    assert abs(float(loss) - math.log(CFG.vocab_size)) < 0.05


def test_num_params_matches_count():
    odd = GPTConfig(vocab_size=50, d_model=48, n_heads=3, n_layers=2, d_ff=80)
    for cfg in (CFG, GPTConfig(), odd):
        _, params = nnx.split(build_model(cfg, seed=0), nnx.Param)
        assert sum(leaf.size for leaf in jax.tree.leaves(params)) == cfg.num_params()


def test_check_stageable():
    check_stageable(build_model(CFG, seed=0))

    class NoBlocks(nnx.Module):
        def __init__(self):
            self.embed = self.head = lambda *a: a

    with pytest.raises(TypeError, match="lacks blocks"):
        check_stageable(NoBlocks())
    with pytest.raises(TypeError, match="not a flax.nnx.Module"):
        check_stageable(object())


def test_stages_compose_to_full_model_and_partition_params():
    model = build_model(CFG, seed=0)
    tokens, targets = _batch(CFG)
    stage0 = StageModule(model, layers=(0, 1), first=True, last=False)
    stage1 = StageModule(model, layers=(1, 4), first=False, last=True)
    assert stage0.head is None and stage1.embed is None and len(stage1.blocks) == 3

    loss_full = jax.jit(lambda m: m(tokens, targets))(model)
    loss_staged = jax.jit(lambda s0, s1: s1(s0(tokens), targets))(stage0, stage1)
    np.testing.assert_array_equal(loss_full, loss_staged)

    full, in0, in1 = _variables(model), _variables(stage0), _variables(stage1)
    assert not in0.keys() & in1.keys(), "a parameter is held by two stages"
    assert in0.keys() | in1.keys() == full.keys(), "a parameter is held by no stage"
    assert stage0.blocks[0] is model.blocks[0]  # shared, not copied

    with pytest.raises(ValueError, match="needs targets"):
        stage1(stage0(tokens))
    with pytest.raises(ValueError, match="not a range"):
        StageModule(model, layers=(2, 5), first=False, last=True)


def test_partition_specs_cover_every_param():
    model = build_model(CFG, seed=0)
    _, params = nnx.split(model, nnx.Param)
    specs = partition_specs(model)
    assert jax.tree.structure(specs) == jax.tree.structure(params)
    expected = {
        "embedding": P(None, TENSOR),
        "wq": P(None, TENSOR),
        "wk": P(None, TENSOR),
        "wv": P(None, TENSOR),
        "wo": P(TENSOR, None),
        "w_gate": P(None, TENSOR),
        "w_up": P(None, TENSOR),
        "w_down": P(TENSOR, None),
        "lm_head": P(None, TENSOR),
        "scale": P(None),
    }
    leaves = jax.tree.leaves_with_path(specs)
    assert len(leaves) == len(jax.tree.leaves(params))
    for path, spec in leaves:
        name = path[-2].key  # [..., <param name>, <Param.value>]
        assert isinstance(spec, P), path
        assert spec == expected[name], (path, spec)
    # the stage's specs are the full model's specs of the same params
    stage = StageModule(model, layers=(1, 3), first=False, last=True)
    stage_leaves = jax.tree.leaves(partition_specs(stage))
    assert len(stage_leaves) == len(jax.tree.leaves(nnx.split(stage, nnx.Param)[1]))


def test_tensor_parallel_equals_single_device():
    devices = jax.devices("cpu")
    assert len(devices) >= 4, "tests/conftest.py should give 8 host CPU devices"
    model = build_model(CFG, seed=0)
    tokens, targets = _batch(CFG)
    loss_ref, grads_ref = _loss_and_grads(model, tokens, targets)

    mesh = Mesh(np.array(devices[:4]).reshape(2, 2), ("data", TENSOR))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), partition_specs(model))
    params = jax.device_put(params, shardings)
    batch_sharding = NamedSharding(mesh, P("data"))
    tokens_tp, targets_tp = jax.device_put((tokens, targets), batch_sharding)

    wq = params["blocks"][0]["attn"]["wq"][...]
    assert TENSOR in wq.sharding.spec
    half_columns = (CFG.d_model, CFG.d_model // 2)
    assert {shard.data.shape for shard in wq.addressable_shards} == {half_columns}

    def loss_fn(params, tokens, targets):
        return nnx.merge(graphdef, params, rest)(tokens, targets)

    replicated = NamedSharding(mesh, P())
    step = jax.jit(jax.value_and_grad(loss_fn), out_shardings=(replicated, shardings))
    loss_tp, grads_tp = step(params, tokens_tp, targets_tp)

    np.testing.assert_allclose(loss_tp, loss_ref, rtol=0, atol=1e-5)
    flat_ref = jax.tree.leaves_with_path(grads_ref)
    flat_tp = jax.tree.leaves(grads_tp)
    assert len(flat_ref) == len(flat_tp)
    for (path, g_ref), g_tp in zip(flat_ref, flat_tp, strict=True):
        np.testing.assert_allclose(np.asarray(g_tp), np.asarray(g_ref), rtol=0, atol=1e-5, err_msg=str(path))
    assert grads_tp["blocks"][0]["attn"]["wq"][...].sharding.spec == wq.sharding.spec


def test_gpt_is_exported_model_class():
    assert isinstance(build_model(CFG, seed=0), GPT)
