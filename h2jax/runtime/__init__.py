"""Executes a Plan: stage meshes, jitted stage programs, the stage runners, the trainer, metrics, timeline.

One runtime for one process and for mpirun: :class:`Trainer` over a World
(:class:`LocalWorld` or :class:`MpiWorld`), one :class:`StageRunner` per stage, one
channel per stage (h2jax.comm). See docs/ARCHITECTURE.md.
"""

from h2jax.runtime._cluster import StagePlacement, place_stages, stage_mesh
from h2jax.runtime._faults import (
    CLOCK_ENV,
    ELASTIC_DIR_ENV,
    FAULT_KINDS,
    FAULTS_ENV,
    RESUME_ENV,
    ElasticHooks,
    stage_nodes,
    write_record,
)
from h2jax.runtime._job import run_job
from h2jax.runtime._layout import flatten, model_layout
from h2jax.runtime._metrics import MetricsLogger, read_metrics
from h2jax.runtime._outputs import LOCK_FILENAME, RunLock, mfu
from h2jax.runtime._profile import ProfileNoiseError, profile_chip, profile_driver
from h2jax.runtime._reference import reference_loss_and_grads
from h2jax.runtime._runner import StageFailure, StageRunner
from h2jax.runtime._stage import StageMemory, StageProgram
from h2jax.runtime._state import NonFiniteLossError, StepStats, clip_scale, make_optimizer
from h2jax.runtime._timeline import Timeline, TraceEvent, bubble_fraction, load_trace, plot_gantt
from h2jax.runtime._trainer import Trainer, TrainResult, train
from h2jax.runtime._world import JobError, LocalWorld, MpiWorld, ThreadGroup, World, setup_backends

__all__ = [
    "CLOCK_ENV",
    "RESUME_ENV",
    "ELASTIC_DIR_ENV",
    "FAULT_KINDS",
    "FAULTS_ENV",
    "ElasticHooks",
    "stage_nodes",
    "write_record",
    "LOCK_FILENAME",
    "JobError",
    "LocalWorld",
    "MetricsLogger",
    "MpiWorld",
    "NonFiniteLossError",
    "RunLock",
    "StageFailure",
    "StageMemory",
    "StagePlacement",
    "StageProgram",
    "StageRunner",
    "StepStats",
    "ThreadGroup",
    "Timeline",
    "TraceEvent",
    "TrainResult",
    "Trainer",
    "World",
    "bubble_fraction",
    "clip_scale",
    "flatten",
    "load_trace",
    "make_optimizer",
    "mfu",
    "model_layout",
    "place_stages",
    "plot_gantt",
    "ProfileNoiseError",
    "profile_chip",
    "profile_driver",
    "read_metrics",
    "reference_loss_and_grads",
    "run_job",
    "setup_backends",
    "stage_mesh",
    "train",
]
