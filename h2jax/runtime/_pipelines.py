"""One step of a job of several pipelines, on this process.

A plan of several pipelines (``plan.pipelines``) gives each pipeline its own stages,
schedule and microbatches and its share of every step's global batch: the step's sequences
are the same as any plan's (h2jax.data: a pure function of the seed and step, or of the
position in the stream), pipeline p taking rows ``plan.sequence_ranges()[p]`` of them, cut
into its own microbatches. Every microbatch's loss counts in the step's loss by its share of
the step's targets (its real targets over the step's: ``b_p / B`` for pipeline p's
microbatches of ``b_p`` sequences when nothing is padded), passed to its last stage as the
cotangent of its loss, so the gradients the pipelines accumulate add up to the gradient of the
mean loss over the whole global batch. The pipelines share every layer: their copies are tied
parameters (h2jax.runtime._tied), whose gradients are summed into the first pipeline's copy,
clipped by the one global norm, updated once and copied back, so one step equals the
sequential model's on the whole batch.

In one process every pipeline's runners run at once, each pipeline on its own threads and
local hub (its stages' chip types overlap as any stages do); a failure in any of them ends
the step, naming the stage.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from h2jax.comm import PipelineAborted
from h2jax.runtime._feed import place_ends, place_segments, step_loss
from h2jax.runtime._procgroup import global_array, local_value
from h2jax.runtime._runner import StageFailure, run_stages


def cut(pipe: Any, rows: np.ndarray | None) -> np.ndarray | None:
    """Pipeline ``pipe``'s rows of a step's batch [1, global batch, seq] (or [global batch, seq]),
    as its microbatches [microbatches, microbatch, seq]."""
    if rows is None:
        return None
    flat = rows.reshape(-1, rows.shape[-1])
    a, b = pipe.rows
    return flat[a:b].reshape(pipe.plan.num_microbatches, pipe.plan.microbatch_size, -1)


def shares(pipes: Sequence[Any], targets: np.ndarray) -> list[np.ndarray]:
    """Each pipeline's microbatches' shares of the step's loss: their real targets (>= 0) over
    the step's (module docstring); float32 [microbatches] per pipeline."""
    total = max(int((targets >= 0).sum()), 1)
    out = []
    for pipe in pipes:
        t = cut(pipe, targets)
        out.append(((t >= 0).reshape(len(t), -1).sum(axis=1) / total).astype(np.float32))
    return out


def _programs(pipe: Any) -> list[Any]:
    return [st for r in pipe.runners for st in r.programs]


def run_pipelines(
    pipes: Sequence[Any],
    step: int,
    tokens: np.ndarray,
    targets: np.ndarray,
    segments: np.ndarray | None,
    *,
    own_hubs: bool,
    forward_only: bool = False,
) -> dict[int, float]:
    """Every pipeline's forwards (and backwards) of ``step`` on this process's stages, all at
    once; gradients accumulate in the stages. ``tokens``, ``targets``, ``segments``: the step's
    batch (h2jax.runtime._feed). Returns {pipeline: its loss} (the sum of its microbatches'
    losses, each times its share of the step) of the pipelines whose last stage is here."""
    weights = shares(pipes, targets)
    losses: dict[int, Any] = {}
    errors: list[tuple[int, BaseException]] = []

    def work(pipe: Any) -> None:
        programs = _programs(pipe)
        tok, tgt = place_ends(programs, cut(pipe, tokens), cut(pipe, targets))
        last = next((st for st in programs if st.last), None)
        w = None if last is None else [global_array(np.float32(x), last.scalar_sharding) for x in weights[pipe.index]]
        segs = place_segments(pipe.runners, cut(pipe, segments))
        hub = pipe.hub if own_hubs else None
        try:
            got = run_stages(pipe.runners, step, tok, tgt, hub=hub, forward_only=forward_only, segments=segs, weights=w)
            if got:
                losses[pipe.index] = step_loss(got, w)
        except PipelineAborted as e:
            err = pipe.hub.error if pipe.hub is not None else None
            errors.append((pipe.index, e if err is None else StageFailure(err.stage, step, err.what, err.cause)))
        except BaseException as e:  # noqa: BLE001 -- re-raised below, the first pipeline's first
            errors.append((pipe.index, e))

    threads = [  # the pipelines with a stage on this process
        threading.Thread(target=work, args=(pipe,), name=f"h2jax-pipeline-{pipe.index}", daemon=True)
        for pipe in pipes
        if pipe.runners
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
    return {p: float(local_value(x)) for p, x in losses.items()}


def total_loss(world: Any, pipes: Sequence[Any], losses: dict[int, float]) -> float:
    """The step's loss on every process: the pipelines' losses (each already its microbatches'
    shares of the step's) added up, each from the process of its last stage."""
    if not world.multiprocess:
        return sum(losses[pipe.index] for pipe in pipes)
    return sum(float(world.from_stage(pipe.loss_stage, losses.get(pipe.index))) for pipe in pipes)


def exchange(fn: Callable[[], None], what: str, timeline: Any, runners: Sequence[Any], step: int) -> None:
    """Run ``fn`` (the tied parameters' gradient sum or copy: across pipelines, every layer);
    with a timeline, wait for what it wrote and record it as one ``other`` event per local stage,
    "across pipelines: <what>"."""
    t0 = time.perf_counter()
    fn()
    if timeline is None:
        return
    import jax

    jax.block_until_ready([(st.acc, st.params) for r in runners for st in r.programs])
    t1 = time.perf_counter()
    for r in runners:
        if r.timeline is not None:
            chip = r.program.spec.chip
            timeline.add(
                "other",
                stage=r.stage_idx,
                step=step,
                microbatch=None,
                start=t0,
                end=t1,
                chip=chip,
                name=f"across pipelines: {what}",
            )
