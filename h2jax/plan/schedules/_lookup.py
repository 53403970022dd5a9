"""Reading a schedule from what a plan writes: a registered name, ``name:chunks``, or a
schedule file."""

from __future__ import annotations

import functools

from h2jax.plan.schedules._base import BoundSchedule, Schedule, ScheduleError, schedule_family, schedule_names
from h2jax.plan.schedules._file import FileSchedule, looks_like_file


@functools.cache
def _by_label(label: str) -> Schedule:
    name, sep, chunks = label.partition(":")
    if name in schedule_names():
        if not sep:
            return schedule_family(name).of()
        if not chunks.isdigit():
            raise ScheduleError(f"schedule {label!r}: {chunks!r} is no chunk count; expected {name}:<integer>")
        return schedule_family(name).of(int(chunks))
    if looks_like_file(label):
        return FileSchedule.load(label)
    return schedule_family(label).of()  # raises, naming the known schedules


def as_schedule(value: Schedule | str, *, chunks: int | None = None) -> Schedule:
    """The schedule `value` names: a registered name (``1f1b``), a name with its chunk count
    (``interleaved:3``), a schedule file (``my_schedule.csv``), or a Schedule itself; `chunks`
    (where the family's chunk count is a choice) overrides the default. ScheduleError otherwise."""
    if isinstance(value, Schedule):
        sched = value
    elif isinstance(value, str):
        sched = _by_label(value.strip())
    else:
        raise ScheduleError(f"schedule {value!r}: expected a name ({', '.join(schedule_names())}) or a schedule file")
    return sched.with_chunks(chunks) if chunks is not None else sched


def get_schedule(
    name: Schedule | str, num_stages: int, num_microbatches: int, *, num_chunks: int | None = None
) -> BoundSchedule:
    """The schedule `name` (see :func:`as_schedule`) bound to a pipeline shape."""
    return as_schedule(name, chunks=num_chunks).bind(num_stages, num_microbatches)
