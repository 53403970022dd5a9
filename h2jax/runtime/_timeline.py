"""The recorded timeline of a training run: what ran where, and when.

The 1F1B driver calls :meth:`Timeline.add` for every forward, backward, boundary
transfer and optimizer update it issues. The events, their Chrome trace and Gantt chart
and the bubble fraction are :mod:`h2jax._trace`'s, shared with the planner's simulator.

Times arrive as ``time.perf_counter()`` seconds and are stored as microseconds
relative to the timeline's origin ``t0``. No JAX here: the driver decides when a
device result counts as finished (e.g. after ``block_until_ready`` in a profiling
run); this module only records what it is told.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from h2jax._trace import (
    COMM_KINDS,
    COMPUTE_KINDS,
    EVENT_KINDS,
    TraceEvent,
    bubble_fraction,
    chrome_trace,
    colour_key,
    load_trace,
    plot_gantt,
    sort_events,
    stage_busy,
    write_trace,
)

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "EVENT_KINDS",
    "Timeline",
    "TraceEvent",
    "bubble_fraction",
    "colour_key",
    "load_trace",
    "plot_gantt",
    "stage_busy",
]


class Timeline:
    """Thread-safe recorder of :class:`TraceEvent` s for one run.

    Args:
        stage_labels: one human label per stage, e.g. ``"stage 0 · sim_a (2x2)"``;
            used for trace row names and the Gantt chart.
        t0: origin in ``time.perf_counter()`` seconds; default: now.
    """

    def __init__(self, *, stage_labels: Sequence[str], t0: float | None = None) -> None:
        self._stage_labels: tuple[str, ...] = tuple(stage_labels)
        self._t0: float = time.perf_counter() if t0 is None else float(t0)
        self._events: list[TraceEvent] = []
        self._lock = threading.Lock()

    @property
    def stage_labels(self) -> tuple[str, ...]:
        """The per-stage labels given at construction."""
        return self._stage_labels

    @property
    def t0(self) -> float:
        """Origin of the timeline in ``time.perf_counter()`` seconds."""
        return self._t0

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    def add(
        self,
        kind: str,
        *,
        stage: int,
        step: int,
        microbatch: int | None,
        start: float,
        end: float,
        chip: str = "",
        **extra: Any,
    ) -> TraceEvent:
        """Record one interval; ``start``/``end`` are ``time.perf_counter()`` seconds.

        Any further keyword (``bytes=..., peer=..., transport=...``) lands in
        :attr:`TraceEvent.extra`. Returns the stored event.

        Raises:
            ValueError: unknown ``kind`` or ``end < start``.
        """
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}; expected one of {EVENT_KINDS}")
        if end < start:
            raise ValueError(f"{kind} event on stage {stage} ends before it starts (start={start!r} s, end={end!r} s)")
        event = TraceEvent(
            kind=kind,
            stage=int(stage),
            step=int(step),
            microbatch=None if microbatch is None else int(microbatch),
            start_us=(start - self._t0) * 1e6,
            dur_us=(end - start) * 1e6,
            chip=chip,
            extra=dict(extra),
        )
        with self._lock:
            self._events.append(event)
        return event

    def extend(self, events: Iterable[TraceEvent]) -> None:
        """Add events recorded elsewhere (another process's timeline with the same origin)."""
        with self._lock:
            self._events.extend(events)

    def events(self, step: int | None = None) -> list[TraceEvent]:
        """Recorded events (of ``step`` only, if given), sorted by start time."""
        with self._lock:
            snapshot = list(self._events)
        if step is not None:
            snapshot = [ev for ev in snapshot if ev.step == step]
        return sort_events(snapshot)

    def steps(self) -> list[int]:
        """The distinct steps that have events, ascending."""
        with self._lock:
            return sorted({ev.step for ev in self._events})

    def to_chrome_trace(self, step: int | None = None) -> dict[str, Any]:
        """The timeline (or one ``step`` of it) as Chrome/Perfetto trace JSON.

        One complete event (``ph: "X"``, ``ts``/``dur`` in µs) per recorded event;
        ``pid`` = stage, ``tid`` 0 = compute (fwd/bwd/update), 1 = communication
        (send/recv), 2 = other. Metadata events name each stage row and its threads.
        """
        return chrome_trace(self.events(step), self._stage_labels)

    def save(self, path: str | Path, *, step: int | None = None) -> Path:
        """Write :meth:`to_chrome_trace` as JSON to ``path`` (parents created)."""
        return write_trace(path, self.to_chrome_trace(step))
