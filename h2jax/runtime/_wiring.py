"""This process's part of the pipeline, wired: stage programs on their meshes, tied
parameters, channels, runners and the timeline -- everything :class:`~h2jax.runtime._trainer.Trainer`'s
step loop walks, built in one place from the config, the model, the world and the schedule.

The pipeline is a chain of model *positions* (one layer chunk each; a stage per position
unless the schedule is chunked). Each local (stage, chunk) gets one
:class:`~h2jax.runtime._stage.StageProgram`, in stage then chunk order; each local stage one
:class:`~h2jax.runtime._runner.StageRunner` over its programs and their channels (one per
program, the chunks of a stage sharing one communicator).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
from flax import nnx

from h2jax.comm import LocalHub, make_channel, stage_links
from h2jax.config import ConfigError, ExperimentConfig
from h2jax.models import StageModule, boundary_shapes, shared_parameters
from h2jax.plan import stage_tasks
from h2jax.runtime._procgroup import global_array, stage_label
from h2jax.runtime._runner import StageRunner
from h2jax.runtime._stage import StageProgram
from h2jax.runtime._tied import TiedParams, check_tieable
from h2jax.runtime._timeline import Timeline
from h2jax.runtime._world import World


@dataclass
class Wiring:
    """The objects the step loop uses, for this process's stages."""

    stages: list[StageProgram]  # one per (local stage, chunk), in stage then chunk order
    runners: list[StageRunner]  # one per local stage, in stage order
    tied: TiedParams  # parameters several positions hold (a head tied to the embedding)
    boundaries: list[Any]  # the shape and dtype of each boundary between positions
    labels: list[str]  # every stage's label (chip type, mesh), in stage order
    backends: dict[int, str]  # the backend of each local stage
    loss_stage: int  # the stage of the head (zb-v: stage 0)
    lp: SimpleNamespace  # the local programs' one-chunk specs, for naming their trees by model path
    timeline: Timeline | None
    hub: LocalHub | None
    own_hub: bool  # the hub was made here (the trainer closes it)


def wire(
    cfg: ExperimentConfig,
    model: nnx.Module,
    world: World,
    schedule: Any,
    *,
    tx: Any,
    chunked: bool,
    hub: LocalHub | None = None,
) -> Wiring:
    """Cut ``model`` into this process's stage programs, place them on their meshes, and give
    each local stage its channels and runner walking its row of ``schedule``. ``chunked``:
    stages hold several chunks (the links then name each position's stage and chunk);
    ``hub``: the local transport's hub (made here when None and the transport is local)."""
    plan, w, transport = cfg.plan, world, cfg.train.transport
    group = w.group
    positions = plan.positions()
    n_pos = len(positions)
    stage_of = [s for s, _ in positions]
    by_position = SimpleNamespace(num_stages=n_pos, stages=plan.position_specs())
    shared = shared_parameters(model, by_position)  # e.g. a head tied to the embedding: trained as one (_tied)
    check_tieable(shared)
    n = plan.num_stages
    boundaries = boundary_shapes(model, by_position, (plan.microbatch_size, cfg.model.seq_len))
    local = w.local_stages
    labels = [stage_label(i, st) for i, st in enumerate(plan.stages)]
    if group is not None:
        meshes = {group.stage_idx: group.mesh}
        backends = {group.stage_idx: group.backend}
        ranks = [group.layout.device_ranks(i) for i in range(n)]
    else:
        from h2jax.runtime._cluster import place_stages, stage_mesh

        placements = place_stages(plan, cfg.cluster)
        meshes = {s: stage_mesh(placements[s], data=plan.stages[s].data, tensor=plan.stages[s].tensor) for s in local}
        backends = {s: placements[s].backend for s in local}
        ranks = None
    _check_compute_dtypes(cfg)
    stages: list[StageProgram] = []
    for q, (s, c) in sorted(enumerate(positions), key=lambda item: item[1]):
        if s not in local:
            continue
        spec = plan.stages[s].chunk_spec(c)
        first, last = q == 0, q == n_pos - 1
        module = StageModule(model, layers=spec.layers, first=first, last=last)
        stages.append(
            StageProgram(
                s,
                spec,
                meshes[s],
                module,
                tx,
                first=first,
                last=last,
                label=labels[s],
                numerics=cfg.cluster.chips[spec.chip].numerics,
                position=q,
                chunk=c,
                local_in=q > 0 and stage_of[q - 1] == s,
                local_out=q < n_pos - 1 and stage_of[q + 1] == s,
            )
        )
    tied = TiedParams(shared, by_position, stages, w, stage_of=stage_of)
    lp = SimpleNamespace(stages=tuple(st.spec for st in stages))
    grid = schedule.tasks()
    # one time origin for every process's events (perf_counter is the host's monotonic clock)
    t0 = w.from_stage(0, time.perf_counter()) if w.multiprocess else None
    timeline = Timeline(stage_labels=labels, t0=t0) if cfg.train.timeline else None
    own_hub = hub is None
    if transport == "local" and hub is None:
        hub = LocalHub(n_pos)
    mesh_shapes = [(plan.stages[s].data, plan.stages[s].tensor) for s in stage_of]  # per position
    record = group is None or group.is_leader  # a stage over several processes records once
    runners: list[StageRunner] = []
    for s in local:
        programs = [st for st in stages if st.stage_idx == s]
        channels, shared_comm = [], {}  # the chunks of a stage share one communicator (make_channel)
        for st in programs:
            link = stage_links(
                mesh_shapes,
                boundaries,
                stage_idx=st.position,
                mesh=st.mesh,
                sharding=st.act_sharding,
                ranks=None if ranks is None else [ranks[t] for t in stage_of],
                stages=stage_of if chunked else None,
                chunks=[c for _, c in positions] if chunked else None,
            )
            channel = _channel(cfg, link, w.comm, hub, st.spec.chip, shared=shared_comm)
            st.build(channel)
            channels.append(channel)
        last = next((st for st in programs if st.last), None)
        dloss = global_array(np.float32(1.0 / plan.num_microbatches), last.scalar_sharding) if last else None
        runners.append(
            StageRunner(programs, channels, stage_tasks(grid, s), dloss=dloss, timeline=timeline, record=record)
        )
    return Wiring(
        stages=stages,
        runners=runners,
        tied=tied,
        boundaries=boundaries,
        labels=labels,
        backends=backends,
        loss_stage=stage_of[-1],
        lp=lp,
        timeline=timeline,
        hub=hub,
        own_hub=own_hub,
    )


def _check_compute_dtypes(cfg: ExperimentConfig) -> None:
    for name, chip in cfg.cluster.chips.items():
        dtype = chip.numerics.compute_dtype
        if dtype is not None and dtype != cfg.model.dtype:
            raise ConfigError(
                f"cluster.chips.{name}.numerics.compute_dtype",
                f"compute_dtype={dtype!r} differs from model.dtype={cfg.model.dtype!r}; the runtime computes every "
                "stage in model.dtype (a per-chip compute dtype is measured by h2jax align only)",
            )


def _channel(cfg: ExperimentConfig, link: Any, comm: Any, hub: LocalHub | None, chip: str, *, shared: dict) -> Any:
    from h2jax.comm import RoutingUnsupported

    transport = cfg.train.transport
    try:
        return make_channel(
            transport, link, comm=comm, hub=hub, chip=chip, timeout_s=cfg.train.transfer_timeout_s, shared=shared
        )
    except RoutingUnsupported as e:
        raise ConfigError("train.transport", f"{transport!r} cannot carry this plan's boundaries: {e}") from e
