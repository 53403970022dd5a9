"""Executes a Plan: stage meshes, jitted stage programs, the pipeline driver, metrics, timeline."""

from h2jax.runtime._cluster import StagePlacement, place_stages, setup_backends, stage_mesh
from h2jax.runtime._layout import flatten, model_layout
from h2jax.runtime._metrics import MetricsLogger, read_metrics
from h2jax.runtime._pipeline import Pipeline, StageFailure
from h2jax.runtime._reference import reference_loss_and_grads
from h2jax.runtime._stage import StageMemory, StageProgram
from h2jax.runtime._timeline import Timeline, TraceEvent, bubble_fraction, load_trace, plot_gantt
from h2jax.runtime._trainer import NonFiniteLossError, StepStats, Trainer, clip_scale, make_optimizer, train

__all__ = [
    "NonFiniteLossError",
    "Pipeline",
    "StageFailure",
    "StageMemory",
    "StagePlacement",
    "StageProgram",
    "StepStats",
    "Timeline",
    "TraceEvent",
    "Trainer",
    "bubble_fraction",
    "clip_scale",
    "flatten",
    "load_trace",
    "read_metrics",
    "MetricsLogger",
    "make_optimizer",
    "model_layout",
    "place_stages",
    "plot_gantt",
    "reference_loss_and_grads",
    "setup_backends",
    "stage_mesh",
    "train",
]
