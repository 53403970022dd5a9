"""The LLaMA-family options of the model: grouped-query attention, tied embeddings, RoPE
scaling, their config checks, tensor-parallel layouts, and the planner's shape in step."""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from h2jax.models import TENSOR, GPTConfig, RopeScaling, StageModule, build_model, partition_specs
from h2jax.models._llama import rope_frequencies
from h2jax.plan import ModelShape

BASE = dict(vocab_size=64, seq_len=16, d_model=64, n_heads=8, n_layers=2, d_ff=96)
BATCH = 4


def _batch(cfg: GPTConfig) -> tuple[jax.Array, jax.Array]:
    tokens = jax.random.randint(jax.random.key(1), (BATCH, cfg.seq_len + 1), 0, cfg.vocab_size).astype(jnp.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _value_and_grad(graphdef, rest):
    def loss_fn(params, tokens, targets):
        return nnx.merge(graphdef, params, rest)(tokens, targets)

    return jax.value_and_grad(loss_fn)


@pytest.mark.parametrize(
    ("n_kv_heads", "tie", "tensor", "kv_split"),
    [  # the fast lane: split and replicated KV heads; the other two with the slow tests
        (2, False, 2, True),
        pytest.param(2, False, 4, False, marks=pytest.mark.slow),
        pytest.param(1, True, 4, False, marks=pytest.mark.slow),
        (4, True, 4, True),
    ],
)
def test_tensor_parallel_equals_single_device(n_kv_heads, tie, tensor, kv_split):
    cfg = GPTConfig(**BASE, n_kv_heads=n_kv_heads, tie_embeddings=tie)
    model = build_model(cfg, seed=0)
    tokens, targets = _batch(cfg)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss_ref, grads_ref = jax.jit(_value_and_grad(graphdef, rest))(params, tokens, targets)

    mesh = Mesh(np.array(jax.devices("cpu")[: 2 * tensor]).reshape(2, tensor), ("data", TENSOR))
    specs = partition_specs(model, tensor=tensor)
    assert specs["blocks"][0]["attn"]["wk"].get_value() == (P(None, TENSOR) if kv_split else P(None, None))
    assert specs["embed"]["embedding"].get_value() == (P(TENSOR, None) if tie else P(None, TENSOR))
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    params_tp = jax.device_put(params, shardings)
    batch = jax.device_put((tokens, targets), NamedSharding(mesh, P("data")))
    step = jax.jit(_value_and_grad(graphdef, rest), out_shardings=(NamedSharding(mesh, P()), shardings))
    loss_tp, grads_tp = step(params_tp, *batch)

    np.testing.assert_allclose(loss_tp, loss_ref, rtol=0, atol=1e-5)
    for (path, g_ref), g_tp in zip(jax.tree.leaves_with_path(grads_ref), jax.tree.leaves(grads_tp), strict=True):
        np.testing.assert_allclose(np.asarray(g_tp), np.asarray(g_ref), rtol=0, atol=1e-5, err_msg=str(path))


def test_tied_head_shares_the_embedding_param():
    cfg = GPTConfig(**BASE, tie_embeddings=True)
    model = build_model(cfg, seed=0)
    assert model.head.embedding is model.embed.embedding
    _, params = nnx.split(model, nnx.Param)
    assert "lm_head" not in params["head"] and set(params["head"]) == {"norm"}
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()
    assert cfg.num_params() == GPTConfig(**BASE).num_params() - cfg.d_model * cfg.vocab_size
    # one stage holding both ends: one parameter; its gradient sums the lookup's and the head's
    whole = StageModule(model, layers=(0, 2), first=True, last=True)
    graphdef, params, rest = nnx.split(whole, nnx.Param, ...)
    grads = jax.jit(jax.grad(lambda p: nnx.merge(graphdef, p, rest)(*_batch(cfg))))(params)
    assert set(grads["head"]) == {"norm"}
    logits = model.logits(_batch(cfg)[0])
    expected = jnp.einsum("bsd,vd->bsv", model.head.norm(model.hidden(_batch(cfg)[0])), model.embed.embedding[...])
    np.testing.assert_allclose(logits, expected, rtol=1e-6, atol=1e-6)


def test_gqa_param_count_and_shapes():
    cfg = GPTConfig(**BASE, n_kv_heads=2)
    model = build_model(cfg, seed=0)
    assert model.blocks[0].attn.wk[...].shape == (64, 2 * cfg.head_dim)
    _, params = nnx.split(model, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params() == ModelShape.from_config(cfg).num_params()
    # one kv head per query head: exactly multi-head attention (the default)
    a = build_model(GPTConfig(**BASE, n_kv_heads=8), seed=3)
    b = build_model(GPTConfig(**BASE), seed=3)
    np.testing.assert_array_equal(a(*_batch(cfg)), b(*_batch(cfg)))


def test_query_heads_of_a_group_read_their_kv_head():
    """GQA = MHA with each kv head repeated for its n_heads / n_kv_heads query heads (as HF's repeat_kv)."""
    gqa_cfg = GPTConfig(**BASE, n_kv_heads=2)
    gqa = build_model(gqa_cfg, seed=0)
    mha = build_model(GPTConfig(**BASE), seed=0)
    _, gp = nnx.split(gqa, nnx.Param)
    _, mp = nnx.split(mha, nnx.Param)
    hd, group = gqa_cfg.head_dim, 4
    for i in range(BASE["n_layers"]):
        for name in ("wk", "wv"):
            w = gp["blocks"][i]["attn"][name][...].reshape(64, 2, 1, hd)
            mp["blocks"][i]["attn"][name].set_value(jnp.broadcast_to(w, (64, 2, group, hd)).reshape(64, 8 * hd))
    for path in (("embed", "embedding"), ("head", "lm_head")):
        mp[path[0]][path[1]].set_value(gp[path[0]][path[1]][...])
    for i in range(BASE["n_layers"]):
        for mod, names in (("attn", ("wq", "wo")), ("mlp", ("w_gate", "w_up", "w_down"))):
            for name in names:
                mp["blocks"][i][mod][name].set_value(gp["blocks"][i][mod][name][...])
    nnx.update(mha, mp)
    tokens, _ = _batch(gqa_cfg)
    np.testing.assert_allclose(mha.logits(tokens), gqa.logits(tokens), rtol=0, atol=1e-5)


def test_rope_scaling_frequencies():
    plain = rope_frequencies(128, 500000.0, None)
    lin = rope_frequencies(128, 500000.0, RopeScaling(type="linear", factor=4.0))
    np.testing.assert_allclose(lin, plain / 4, rtol=1e-6)
    l3 = rope_frequencies(128, 500000.0, RopeScaling())  # LLaMA 3.1: factor 8, 1, 4, 8192
    wavelen = 2 * np.pi / plain
    assert np.array_equal(l3[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])  # high frequencies kept
    np.testing.assert_allclose(l3[wavelen > 8192], plain[wavelen > 8192] / 8, rtol=1e-6)  # low ones / factor
    mid = (wavelen > 2048) & (wavelen < 8192)
    assert mid.any() and np.all(l3[mid] < plain[mid]) and np.all(l3[mid] > plain[mid] / 8)
    # scaling changes the model's outputs (the frequencies reach the attention)
    tokens, _ = _batch(GPTConfig(**BASE))
    scaled = GPTConfig(**BASE, rope_theta=10.0, rope_scaling=RopeScaling(type="linear", factor=4.0))
    unscaled = GPTConfig(**BASE, rope_theta=10.0)
    assert not np.allclose(build_model(scaled, seed=0).logits(tokens), build_model(unscaled, seed=0).logits(tokens))


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        (dict(n_kv_heads=3), "model.n_kv_heads"),
        (dict(n_kv_heads=0), "model.n_kv_heads"),
        (dict(attention="flash"), "model.attention"),
        (dict(rope_scaling=RopeScaling(type="yarn")), "model.rope_scaling.type"),
        (dict(rope_scaling=RopeScaling(factor=0.0)), "model.rope_scaling.factor"),
        (dict(rope_scaling=RopeScaling(low_freq_factor=4.0, high_freq_factor=1.0)), "low_freq_factor"),
    ],
)
def test_bad_values_name_their_key(changes, key):
    with pytest.raises(ValueError, match=key):
        GPTConfig(**BASE, **changes)


def test_config_keys_from_the_command_line():
    from h2jax.config import ConfigError, load_config

    cfg = load_config(None, ["model.n_kv_heads=2", "model.tie_embeddings=true", "model.rope_scaling={factor: 2.0}"])
    assert cfg.model.kv_heads == 2 and cfg.model.tie_embeddings and cfg.model.rope_scaling == RopeScaling(factor=2.0)
    with pytest.raises(ConfigError, match="n_kv_heads=3"):
        load_config(None, ["model.n_kv_heads=3"])


def test_model_shape_key_unchanged_for_the_original_fields():
    """Cached profiles are keyed by ModelShape.key(): new fields at their defaults leave it as it was."""
    shape = ModelShape(n_layers=4, d_model=128, n_heads=4, d_ff=512, vocab_size=256, seq_len=128, act_bytes=4)
    old = {"d_model": 128, "n_heads": 4, "d_ff": 512, "vocab_size": 256, "seq_len": 128, "act_bytes": 4}
    digest = hashlib.sha1(json.dumps(old, sort_keys=True).encode()).hexdigest()[:8]
    assert shape.key() == f"d128h4f512v256s128a4-{digest}"
    assert (
        ModelShape.from_config(GPTConfig(**BASE, n_kv_heads=2)).key() != ModelShape.from_config(GPTConfig(**BASE)).key()
    )


def test_auto_attention_lowers_per_platform(monkeypatch):
    """With cuDNN present, "auto" puts the fused kernel in a `platform_dependent` branch for
    cuda; a CPU stage lowers the XLA branch. Here (no CUDA) the cuDNN call is stood in for, to
    check that the branching composes with jit and grad and that CPU takes the XLA path."""
    from h2jax.models import _llama

    real = jax.nn.dot_product_attention
    calls = []

    def stand_in(q, k, v, *, is_causal, implementation):
        calls.append(implementation)
        return real(q, k, v, is_causal=is_causal, implementation="xla")

    cfg = GPTConfig(**BASE, n_kv_heads=2, dtype="bfloat16")
    model = build_model(cfg, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens, targets = _batch(cfg)
    loss_xla, grads_xla = jax.jit(_value_and_grad(graphdef, rest))(params, tokens, targets)
    monkeypatch.setattr(_llama, "_have_cudnn", lambda: True)
    monkeypatch.setattr(jax.nn, "dot_product_attention", stand_in)
    loss, grads = jax.jit(_value_and_grad(graphdef, rest))(params, tokens, targets)
    assert "cudnn" in calls and "xla" in calls  # both branches traced
    assert float(loss) == float(loss_xla)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_xla), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cfg32 = GPTConfig(**BASE, n_kv_heads=2)  # float32: cuDNN has no fused kernel for it
    g32, p32, r32 = nnx.split(build_model(cfg32, seed=0), nnx.Param, ...)
    calls.clear()
    jax.eval_shape(_value_and_grad(g32, r32), p32, tokens, targets)
    assert calls and set(calls) == {"xla"}
