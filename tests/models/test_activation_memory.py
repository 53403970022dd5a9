"""The planner's per-block activation bytes equal what XLA keeps for the backward.

XLA's compiled memory analysis of one block's forward-with-residuals program (``jax.vjp``,
as the runtime's stage programs run it) against `roofline_costs(...)["block"].act_bytes`, at
two sequence lengths, both compute dtypes, grouped-query attention, and tensor degrees that
split the key/value heads and that replicate them. The estimate is within 25 % (the issue's
bar); it is in fact within 0.1 % here (docs/LOG.md), and a per-score term -- what an
attention that keeps its [s, s] probabilities would add -- would break the bar at the longer
sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from h2jax.models import GPTConfig, build_model, partition_specs
from h2jax.plan import ModelShape
from h2jax.plan._profiles import ChipProfile, roofline_costs

CPU = ChipProfile(name="cpu", memory_gib=16, peak_tflops=1, mem_bw_gbps=10, intra_node_gbps=10, inter_node_gbps=10)
BATCH = 2


def kept_bytes(cfg: GPTConfig, tensor: int) -> int:
    """Per-device bytes of one block's forward outputs: its output and the vjp residuals."""
    block = build_model(cfg, seed=0).blocks[0]
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)
    mesh = Mesh(np.array(jax.devices("cpu")[:tensor]).reshape(1, tensor), ("data", "tensor"))
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), partition_specs(block, tensor=tensor))
    params = jax.device_put(params, shardings)
    x = jax.device_put(jnp.zeros((BATCH, cfg.seq_len, cfg.d_model), jnp.dtype(cfg.dtype)), NamedSharding(mesh, P()))

    def fwd(params, x):
        return jax.vjp(lambda p, x_: nnx.merge(graphdef, p, rest)(x_), params, x)

    return jax.jit(fwd).lower(params, x).compile().memory_analysis().output_size_in_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(  # the fast lane: one device, and tensor 4 with split KV heads
    ("n_kv_heads", "tensor"),
    [(2, 1), pytest.param(2, 2, marks=pytest.mark.slow), pytest.param(2, 4, marks=pytest.mark.slow), (8, 4)],
)
def test_block_activation_bytes_match_the_estimate(dtype, n_kv_heads, tensor):
    for seq_len in (128, 512):
        cfg = GPTConfig(
            vocab_size=256, seq_len=seq_len, d_model=256, n_heads=8, n_kv_heads=n_kv_heads, n_layers=1, d_ff=704,
            dtype=dtype,
        )  # fmt: skip
        measured = kept_bytes(cfg, tensor)
        estimate = roofline_costs(ModelShape.from_config(cfg), CPU, tensor=tensor, microbatch=BATCH)["block"].act_bytes
        assert abs(measured - estimate) <= 0.25 * measured, (seq_len, measured, estimate)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tie", [False, True])
def test_head_activation_bytes_match_the_estimate(dtype, tie):
    """The head's count (norm, fp32 cross-entropy, the cast weight; its input is the last block's
    output, which the block's count holds) for an own lm_head and a tied embedding alike."""
    cfg = GPTConfig(vocab_size=512, seq_len=128, d_model=256, n_heads=8, n_kv_heads=2, n_layers=1, d_ff=704,
                    dtype=dtype, tie_embeddings=tie)  # fmt: skip
    head = build_model(cfg, seed=0).head
    graphdef, params, rest = nnx.split(head, nnx.Param, ...)
    x = jnp.zeros((BATCH, cfg.seq_len, cfg.d_model), jnp.dtype(cfg.dtype))
    targets = jnp.zeros((BATCH, cfg.seq_len), jnp.int32)

    def fwd(params, x):
        return jax.vjp(lambda p, x_: nnx.merge(graphdef, p, rest)(x_, targets), params, x)

    measured = jax.jit(fwd).lower(params, x).compile().memory_analysis().output_size_in_bytes
    hidden = x.size * x.dtype.itemsize
    estimate = roofline_costs(ModelShape.from_config(cfg), CPU, tensor=1, microbatch=BATCH)["head"].act_bytes + hidden
    assert abs(measured - estimate) <= 0.01 * measured, (measured, estimate)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["auto", "xla"])
def test_llama7b_block_activation_bytes_on_cuda(attention):
    """The same count on a real GPU for a LLaMA-7B-shaped block (d 4096, 32 heads, 8 kv heads,
    d_ff 11008, bf16, microbatch 1) at seq 2048 and 4096: ``auto`` lets the backend pick its fused
    attention (cuDNN on NVIDIA), ``xla`` is the portable path. Skips without a CUDA device."""
    try:
        gpu = jax.devices("cuda")[0]
    except RuntimeError:
        pytest.skip("no CUDA device")
    from h2jax.plan._profiles import load_chip

    h200, _ = load_chip("h200")
    for seq_len in (2048, 4096):
        cfg = GPTConfig(vocab_size=32000, seq_len=seq_len, d_model=4096, n_heads=32, n_kv_heads=8, n_layers=1,
                        d_ff=11008, dtype="bfloat16", attention=attention)  # fmt: skip
        with jax.default_device(gpu):
            block = build_model(cfg, seed=0).blocks[0]
            graphdef, params, rest = nnx.split(block, nnx.Param, ...)
            params = jax.device_put(params, gpu)
            x = jax.device_put(jnp.zeros((1, seq_len, cfg.d_model), jnp.bfloat16), gpu)

            def fwd(params, x):
                return jax.vjp(lambda p, x_: nnx.merge(graphdef, p, rest)(x_), params, x)

            measured = jax.jit(fwd).lower(params, x).compile().memory_analysis().output_size_in_bytes
        estimate = roofline_costs(ModelShape.from_config(cfg), h200, tensor=1, microbatch=1)["block"].act_bytes
        print(f"{attention} seq {seq_len}: measured {measured / 2**20:.0f} MiB, estimate {estimate / 2**20:.0f} MiB")
        assert abs(measured - estimate) <= 0.25 * measured, (seq_len, measured, estimate)
