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
from h2jax.runtime._links import resolve_engine
from h2jax.runtime._procgroup import global_array, stage_label
from h2jax.runtime._runner import StageRunner
from h2jax.runtime._stage import StageProgram
from h2jax.runtime._tied import TiedParams, check_tieable
from h2jax.runtime._timeline import Timeline
from h2jax.runtime._world import World


@dataclass
class Pipe:
    """One pipeline of the job, on this process: its plan (a one-pipeline plan), its bound
    schedule, and its local runners (a job of one pipeline has one Pipe)."""

    index: int
    plan: Any  # this pipeline as a one-pipeline Plan
    schedule: Any  # its schedule bound to its stages and microbatches
    stage_base: int  # the job's stage index of its stage 0
    first_position: int  # the job's position of its embedding
    rows: tuple[int, int]  # its [start, end) of a step's global batch
    runners: list[StageRunner]  # one per local stage of it, in stage order
    boundaries: list[Any]  # the shape and dtype of each boundary between its positions
    loss_stage: int  # the job's stage of its head
    hub: LocalHub | None


@dataclass
class Wiring:
    """The objects the step loop uses, for this process's stages."""

    stages: list[StageProgram]  # one per (local stage, chunk), in stage then chunk order
    runners: list[StageRunner]  # one per local stage, in stage order
    tied: TiedParams  # parameters several positions hold (a head tied to the embedding; every layer
    # of a job of several pipelines)
    labels: list[str]  # every stage's label (chip type, mesh), in stage order
    backends: dict[int, str]  # the backend of each local stage
    lp: SimpleNamespace  # the local programs' one-chunk specs, for naming their trees by model path
    timeline: Timeline | None
    pipes: list[Pipe]  # the job's pipelines (one for a one-pipeline plan)
    own_hub: bool  # the hubs were made here (the trainer closes them)
    engine: str = ""  # comm.engine resolved: mpi or ucx under ffi / ffi-call ("" for local, host)

    @property
    def hub(self) -> LocalHub | None:
        return self.pipes[0].hub

    @property
    def boundaries(self) -> list[Any]:
        return self.pipes[0].boundaries

    @property
    def loss_stage(self) -> int:  # the head's stage (zb-v: stage 0); of pipeline 0 with several
        return self.pipes[0].loss_stage


def wire(
    cfg: ExperimentConfig,
    model: nnx.Module,
    world: World,
    *,
    tx: Any,
    hub: LocalHub | None = None,
) -> Wiring:
    """Cut ``model`` into this process's stage programs, place them on their meshes, and give
    each local stage its channels and runner walking its row of its pipeline's schedule.
    ``hub``: the local transport's hub (made here when None and the transport is local; one
    per pipeline). A job of several pipelines is one chain of positions per pipeline, every
    pipeline holding every layer: the parameters they share are tied (h2jax.runtime._tied),
    so their gradients are summed over the pipelines and every copy takes the same update."""
    plan, w, transport = cfg.plan, world, cfg.train.transport
    group = w.group
    positions = plan.positions()
    pipe_of = plan.position_pipelines()
    stage_of = [s for s, _ in positions]
    specs = plan.position_specs()
    ends = [q == 0 or pipe_of[q - 1] != pipe_of[q] for q in range(len(positions))]  # each pipeline's first
    lasts = [q == len(positions) - 1 or pipe_of[q + 1] != pipe_of[q] for q in range(len(positions))]
    by_position = SimpleNamespace(num_stages=len(positions), stages=specs, firsts=ends, lasts=lasts)
    shared = shared_parameters(model, by_position)  # a head tied to the embedding; the pipelines' copies
    check_tieable(shared)
    n = plan.num_stages
    local = w.local_stages
    labels = [stage_label(i, st) for i, st in enumerate(plan.stages)]
    if plan.pipelines:  # which pipeline each stage is in
        labels = [f"pipeline {plan.pipeline_of_stage(i)} · {label}" for i, label in enumerate(labels)]
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
        module = StageModule(model, layers=spec.layers, first=ends[q], last=lasts[q])
        stages.append(
            StageProgram(
                s,
                spec,
                meshes[s],
                module,
                tx,
                first=ends[q],
                last=lasts[q],
                label=labels[s],
                numerics=cfg.cluster.chips[spec.chip].numerics,
                position=q,
                chunk=c,
                local_in=not ends[q] and stage_of[q - 1] == s,
                local_out=not lasts[q] and stage_of[q + 1] == s,
            )
        )
    tied = TiedParams(shared, by_position, stages, w, stage_of=stage_of)
    lp = SimpleNamespace(stages=tuple(st.spec for st in stages))
    # one time origin for every process's events (perf_counter is the host's monotonic clock)
    t0 = w.from_stage(0, time.perf_counter()) if w.multiprocess else None
    timeline = Timeline(stage_labels=labels, t0=t0) if cfg.train.timeline else None
    own_hub = hub is None
    record = group is None or group.is_leader  # a stage over several processes records once
    engine = resolve_engine(cfg, w)  # comm.engine: what moves the bytes under ffi / ffi-call
    pipes: list[Pipe] = []
    q0 = 0
    for p, (pipe, base, rows) in enumerate(zip(plan.pipeline_plans(), plan.stage_offsets(), plan.sequence_ranges())):
        nq = len(pipe.positions())
        qs = range(q0, q0 + nq)
        boundaries = boundary_shapes(
            model, SimpleNamespace(num_stages=nq, stages=specs[q0 : q0 + nq]), (pipe.microbatch_size, cfg.model.seq_len)
        )
        schedule = pipe.schedule.bind(pipe.num_stages, pipe.num_microbatches)
        chunked = pipe.schedule.chunks > 1  # interleaved may run v = 1 (one chunk each)
        pipe_hub = hub if p == 0 and hub is not None else None
        if transport == "local" and pipe_hub is None:
            pipe_hub = LocalHub(nq)
        mesh_shapes = [(plan.stages[stage_of[q]].data, plan.stages[stage_of[q]].tensor) for q in qs]
        grid = schedule.tasks()
        runners: list[StageRunner] = []
        for s in (s for s in local if base <= s < base + pipe.num_stages):
            programs = [st for st in stages if st.stage_idx == s]
            channels, shared_comm = [], {}  # the chunks of a stage share one communicator (make_channel)
            for st in programs:
                link = stage_links(
                    mesh_shapes,
                    boundaries,
                    stage_idx=st.position - q0,
                    mesh=st.mesh,
                    sharding=st.act_sharding,
                    ranks=None if ranks is None else [ranks[stage_of[q]] for q in qs],
                    stages=[stage_of[q] for q in qs] if chunked else None,
                    chunks=[positions[q][1] for q in qs] if chunked else None,
                )
                channel = _channel(cfg, link, w.comm, pipe_hub, st.spec.chip, shared=shared_comm, engine=engine)
                st.build(channel)
                channels.append(channel)
            last = next((st for st in programs if st.last), None)
            # d(step loss)/d(a microbatch's loss): 1 / microbatches; several pipelines pass each
            # microbatch's share of the whole step instead (h2jax.runtime._pipelines)
            dloss = global_array(np.float32(1.0 / pipe.num_microbatches), last.scalar_sharding) if last else None
            runners.append(
                StageRunner(
                    programs, channels, stage_tasks(grid, s - base), dloss=dloss, timeline=timeline, record=record
                )
            )
        pipes.append(Pipe(p, pipe, schedule, base, q0, rows, runners, boundaries, stage_of[q0 + nq - 1], pipe_hub))
        q0 += nq
    return Wiring(
        stages=stages,
        runners=[r for pipe in pipes for r in pipe.runners],
        tied=tied,
        labels=labels,
        backends=backends,
        lp=lp,
        timeline=timeline,
        pipes=pipes,
        own_hub=own_hub,
        engine=engine,
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


def _channel(
    cfg: ExperimentConfig, link: Any, comm: Any, hub: LocalHub | None, chip: str, *, shared: dict, engine: str
) -> Any:
    from h2jax.comm import FfiUnavailableError, RoutingUnsupported, UcxVersionMismatch

    transport = cfg.train.transport
    try:
        return make_channel(
            transport,
            link,
            comm=comm,
            hub=hub,
            chip=chip,
            timeout_s=cfg.train.transfer_timeout_s,
            shared=shared,
            engine=engine or "mpi",
        )
    except RoutingUnsupported as e:
        raise ConfigError("train.transport", f"{transport!r} cannot carry this plan's boundaries: {e}") from e
    except FfiUnavailableError as e:  # the engine's extension or library does not load: say which and how
        raise ConfigError("comm.engine" if engine == "ucx" else "train.transport", str(e)) from e
    except UcxVersionMismatch as e:
        raise ConfigError("comm.engine", str(e)) from e
