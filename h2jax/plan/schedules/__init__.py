"""Pipeline schedules: one object per schedule that the plan, the runtime, the simulator, the
cost model and the search all ask (:mod:`h2jax.plan.schedules._base`), the built-in families
(GPipe, 1F1B, ZB-H1, interleaved, ZB-V), schedules read from a file, and the task vocabulary
and timeline checks they are written in."""

from h2jax.plan.schedules._base import (
    BoundSchedule,
    Schedule,
    ScheduleError,
    register,
    schedule_family,
    schedule_names,
    timed_events,
)
from h2jax.plan.schedules._builtin import GPipe, Interleaved, OneFOneB, ZeroBubbleH1, ZeroBubbleV
from h2jax.plan.schedules._file import FileSchedule
from h2jax.plan.schedules._lookup import as_schedule, get_schedule
from h2jax.plan.schedules._tasks import (
    BACKWARD,
    FORWARD,
    KINDS,
    WEIGHT,
    Event,
    Grid,
    Task,
    backward_peaks,
    bubble_fraction,
    check_execution,
    grid_events,
    idle_fraction,
    place,
    stage_tasks,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "KINDS",
    "WEIGHT",
    "BoundSchedule",
    "Event",
    "FileSchedule",
    "GPipe",
    "Grid",
    "Interleaved",
    "OneFOneB",
    "Schedule",
    "ScheduleError",
    "Task",
    "ZeroBubbleH1",
    "ZeroBubbleV",
    "as_schedule",
    "backward_peaks",
    "bubble_fraction",
    "check_execution",
    "get_schedule",
    "grid_events",
    "idle_fraction",
    "place",
    "register",
    "schedule_family",
    "schedule_names",
    "stage_tasks",
    "timed_events",
]
