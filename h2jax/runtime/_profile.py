"""Measured per-part costs of a chip type: what ``h2jax profile --measure`` caches.

For each tensor degree and microbatch size, the embedding, one block and the head are
each built as a stage (``StageModule`` + ``StageProgram``, the very programs training
runs) on a (data=1, tensor=t) mesh of the chip type's devices, and their forward and
backward are timed (median of ``repeats`` after a warm-up, each blocked on its result; a
backward needs a fresh forward's residuals, so it is timed as forward+backward minus the
forward).
Bytes come from the arrays' shardings and XLA's compiled memory analysis. The rows are
``LayerCost``s with ``estimated=False``, keyed like the planner's roofline estimates.

On emulated chips the times are this host's CPU, not the accelerator the profile names.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from h2jax.config import ChipSpec
from h2jax.models import GPTConfig, StageModule, build_model
from h2jax.plan import LayerCost, StageSpec
from h2jax.runtime._cluster import stage_mesh, StagePlacement
from h2jax.runtime._stage import StageProgram
from h2jax.runtime._trainer import make_optimizer


def _backend_devices(chip_name: str, chip: ChipSpec) -> tuple[str, list]:
    if chip.emulated:
        from xla_plugins import register_emulated_chips

        backend = register_emulated_chips({chip_name: (1, chip.devices_per_node)})[chip_name][0]
    else:
        backend = chip.platform
    return backend, jax.devices(backend)


def _timed(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # warm-up (compilation)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile_chip(chip_name: str, chip: ChipSpec, model: GPTConfig, *, tensor_degrees: Sequence[int],
                 microbatches: Sequence[int], repeats: int = 5, seed: int = 0) -> dict[tuple[int, int], dict[str, LayerCost]]:
    """{(tensor, microbatch): {"embed" | "block" | "head": LayerCost}} measured on ``chip_name``."""
    from h2jax.config import ExperimentConfig

    backend, devices = _backend_devices(chip_name, chip)
    one_layer = dataclasses.replace(model, n_layers=1)
    gpt = build_model(one_layer, seed=seed)
    tx, _ = make_optimizer(ExperimentConfig(model=one_layer))
    parts = {"embed": dict(layers=(0, 0), first=True, last=False),
             "block": dict(layers=(0, 1), first=False, last=False),
             "head": dict(layers=(1, 1), first=False, last=True)}
    out: dict[tuple[int, int], dict[str, LayerCost]] = {}
    rng = np.random.default_rng(seed)
    for t in tensor_degrees:
        if t > len(devices):
            raise ValueError(f"tensor={t}: chip {chip_name} has {len(devices)} devices in a node")
        place = StagePlacement(0, chip_name, backend, 0, tuple(devices[:t]))
        mesh = stage_mesh(place, data=1, tensor=t)
        for b in microbatches:
            row: dict[str, LayerCost] = {}
            for name, kw in parts.items():
                spec = StageSpec(chip=chip_name, layers=kw["layers"], data=1, tensor=t)
                st = StageProgram(0, spec, mesh, StageModule(gpt, **kw), tx, first=kw["first"], last=kw["last"],
                                  label=f"profile {name}")
                shape = (b, one_layer.seq_len)
                if kw["first"]:
                    x = jax.device_put(rng.integers(0, one_layer.vocab_size, shape, dtype=np.int32), st.act_sharding)
                else:
                    x = jax.device_put(jnp.asarray(rng.normal(size=(*shape, one_layer.d_model)),
                                                   jnp.dtype(one_layer.dtype)), st.act_sharding)
                tgt = (jax.device_put(rng.integers(0, one_layer.vocab_size, shape, dtype=np.int32), st.act_sharding)
                       if kw["last"] else None)
                y, saved = st.forward(x, tgt)
                dy = (jax.device_put(jnp.float32(1.0), st.scalar_sharding) if kw["last"]
                      else jax.device_put(jnp.ones_like(y), st.act_sharding))
                fwd_s = _timed(lambda: st.forward(x, tgt)[0], repeats)
                bwd_s = _timed(lambda: st.backward(st.forward(x, tgt)[1], dy), repeats) - fwd_s
                mem = st.memory(x, tgt, in_flight=1)
                shard = x.sharding.shard_shape(x.shape)
                row[name] = LayerCost(fwd_s=fwd_s, bwd_s=max(bwd_s, 0.0), param_bytes=float(mem.params),
                                      act_bytes=float(mem.activations), input_bytes=float(np.prod(shard) * x.dtype.itemsize),
                                      temp_bytes=float(mem.workspace), estimated=False)
            out[(t, b)] = row
    return out
