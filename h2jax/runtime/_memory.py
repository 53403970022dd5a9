"""Per-device memory of this process's stages against their chips' declared memory.

A stage of one chunk holds its parameters, gradients, optimizer state, the activations of
the microbatches the schedule keeps in flight on it, and its programs' workspace. A stage of
several chunks holds every chunk's parameters, gradients and optimizer state, and at its
peak the activations the schedule's order of its tasks keeps alive
(:func:`chunk_activation_peak`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from h2jax._units import GIB
from h2jax.config import ConfigError, ExperimentConfig, format_bytes
from h2jax.runtime._stage import StageMemory


def check_memory(cfg: ExperimentConfig, pipe: Any) -> list[StageMemory]:
    """The memory of each local stage of pipeline ``pipe`` (h2jax.runtime._wiring.Pipe; in
    stage order); every stage that does not fit its chip is named in one ConfigError, in stage
    order."""
    schedule, boundaries, runners = pipe.schedule, pipe.boundaries, pipe.runners
    in_flight = schedule.max_in_flight()
    mb, seq = pipe.plan.microbatch_size, cfg.model.seq_len
    where = f"plan.pipelines[{pipe.index}].stages" if cfg.plan.pipelines else "plan.stages"
    out, over = [], []
    for runner in runners:
        s = runner.stage_idx - pipe.stage_base  # its stage in the pipeline
        mems = []
        for st in runner.programs:
            like = (
                jax.ShapeDtypeStruct((mb, seq), jnp.int32)
                if st.first
                else boundaries[st.position - pipe.first_position - 1]
            )
            x = jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=st.act_sharding)
            t = jax.ShapeDtypeStruct((mb, seq), jnp.int32, sharding=st.act_sharding) if st.last else None
            # packed data (data.sources): every stage's programs take the microbatch's segment ids
            seg = jax.ShapeDtypeStruct((mb, seq), jnp.int32, sharding=st.act_sharding)
            seg = seg if cfg.data.sources and cfg.data.packing else None
            mems.append(st.memory(x, t, in_flight=1 if runner.chunked else in_flight[s], example_segments=seg))
        if runner.chunked:
            peak, count = chunk_activation_peak(
                schedule.stage_ops(s), [m.activations for m in mems], split=runner.split
            )
            mem = StageMemory(
                params=sum(m.params for m in mems),
                grads=sum(m.grads for m in mems),
                opt_state=sum(m.opt_state for m in mems),
                activations=peak,
                workspace=max(m.workspace for m in mems),
            )
            held = f"{count} in-flight (chunk, microbatch) activations at the peak"
        else:
            mem, held = mems[0], f"activations of {in_flight[s]} in-flight microbatches"
        out.append(mem)
        chip = runner.program.spec.chip
        limit = cfg.cluster.chips[chip].memory_gib * GIB
        if mem.total > limit:
            b = format_bytes
            over.append(
                (
                    f"{where}[{s}]",
                    f"needs {b(mem.total)} per device (params {b(mem.params)}, grads {b(mem.grads)}, optimizer "
                    f"{b(mem.opt_state)}, {held} {b(mem.activations)}, workspace {b(mem.workspace)}); chip "
                    f"{chip} has {b(limit)} (try recompute: true, more microbatches, or a larger tensor degree)",
                )
            )
    if over:  # every stage that does not fit, in stage order (as the processes of a job report them)
        (key, first), rest = over[0], over[1:]
        raise ConfigError(key, "; ".join([first, *(f"{k}: {m}" for k, m in rest)]))
    return out


def chunk_activation_peak(ops: Any, per_chunk: Any, *, split: bool) -> tuple[int, int]:
    """(bytes, count) at the peak of the activations a stage of several chunks keeps, walking
    its ops in order: chunk c's forward adds ``per_chunk[c]`` (one microbatch's), its last
    backward task (W when ``split``, else B) frees it -- the schedule's in-flight count, each
    entry weighed by its own chunk's size (chunks may be uneven)."""
    freed_by = "W" if split else "B"
    held = count = peak = peak_count = 0
    for task in ops:
        if task.kind == "F":
            held, count = held + per_chunk[task.chunk], count + 1
            if held > peak:
                peak, peak_count = held, count
        elif task.kind == freed_by:
            held, count = held - per_chunk[task.chunk], count - 1
    return peak, peak_count
