"""What a pipeline schedule is to h2jax: one object that every part asks, never a name it compares.

A :class:`Schedule` is a small frozen value -- its family, and its chunk count where that is
the plan's choice. A plan holds one (``Plan.schedule``); the runtime walks its op lists, the
simulator replays them, the cost model prices it with its own terms, the search bounds its
memory with its own floors and chooses among several. ``bind(num_stages, num_microbatches)``
gives the op lists of one pipeline shape (:class:`BoundSchedule`).

What a family says about itself, and who asks:

- its op list per stage (``stage_ops``) and where chunk c of stage s sits in the model
  (``virtual_stage``): the runtime, the simulator, the replayed price of a file schedule;
- which pipeline shapes it runs (``shape_error``, ``runs``) and its chunk rule: the Plan's
  check, the search;
- what a stage holds awaiting B and W (``memory_counts``) and in flight (``max_in_flight``):
  the cost model's memory, the runtime's memory check;
- its (fill, end) terms of the iteration time and the least fill a block adds
  (``pipeline_terms``, ``least_fill``): the cost model and the search's lower bounds;
- the memory floors of a chip type's stages by rank (``count_floors``): the search's caps.

Adding a schedule is one subclass registered by name (:func:`register`) plus its tests; a
schedule written as a file (:mod:`h2jax.plan.schedules._file`) needs no code at all.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from h2jax.plan.schedules._tasks import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Event,
    Grid,
    Task,
    backward_peaks,
    grid_of,
    place,
)


class ScheduleError(ValueError):
    """A schedule that cannot be built or cannot run a pipeline shape; the message says why
    with the numbers (the Plan's check reports it under ``plan.schedule``)."""


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: the order of each stage's F / B / W tasks, and every fact the rest
    of h2jax asks of it (module docstring). Instances compare and hash by family and chunk
    count, so they key caches and dicts as names did."""

    chunks: int = 1
    """Layer chunks (virtual stages) per stage: 1 for one-range schedules."""

    name: ClassVar[str]
    """The registry key: what a plan's YAML writes under ``schedule``."""
    split_backward: ClassVar[bool] = False
    """B is the input gradient only and a separate W task computes the weight gradient."""
    chunk_choice: ClassVar[bool] = False
    """The chunk count per stage is the plan's choice (the search tries several); False: fixed
    at the family's ``default_chunks``."""
    default_chunks: ClassVar[int] = 1
    placement: ClassVar[str] = "stage s at model position s"
    """Where chunk c of stage s sits in the model, in words (errors, plan.yaml comments)."""
    dominated_by: ClassVar[str | None] = None
    """A schedule this one never beats on the cost model's terms (the same time, at least its
    memory): a search that offers both skips this one."""
    caps_within: ClassVar[tuple[str, ...]] = ()
    """Schedules whose memory floors never exceed this one's at any stage count: their memory
    caps are at least as loose as this schedule's (the search's loosest caps need not look
    at this one where one of them is searched)."""
    floors_need_k: ClassVar[bool] = False
    """The memory floors of a chip type's stages depend on its stage count k
    (:meth:`floor_key` groups the k with equal floors)."""
    closed_form: ClassVar[bool] = True
    """The cost model's (fill, end) terms price this schedule; False: its op lists are
    replayed instead (:meth:`pipeline_terms` is then the search's proxy)."""

    def __post_init__(self) -> None:
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int | np.integer) or self.chunks < 1:
            raise ScheduleError(f"{self.name}: chunks={self.chunks!r}; expected an integer >= 1")
        if not self.chunk_choice and self.chunks != self.default_chunks:
            raise ScheduleError(
                f"{self.name}: chunks={self.chunks}; its stages hold {self.default_chunks} layer chunk(s) each"
            )

    # -- identity ----------------------------------------------------------------------------

    @classmethod
    def of(cls, chunks: int | None = None) -> Schedule:
        """The family's schedule with `chunks` per stage (None: its default)."""
        return cls(cls.default_chunks if chunks is None else chunks)

    @property
    def label(self) -> str:
        """The name, with the chunk count where that is a choice (``interleaved:3``): what a
        search reports and :func:`as_schedule` reads back."""
        return f"{self.name}:{self.chunks}" if self.chunk_choice else self.name

    def __str__(self) -> str:
        return self.label

    def to_raw(self) -> str:
        """What a plan's YAML writes: the name (a chunk count comes from the stages' chunks)."""
        return self.name

    def with_chunks(self, chunks: int) -> Schedule:
        """The same family with `chunks` per stage (ScheduleError where the family's count is
        fixed at another)."""
        return self if chunks == self.chunks else type(self).of(chunks)

    @classmethod
    def search_variants(cls, chunk_counts: Sequence[int]) -> tuple[Schedule, ...]:
        """The schedules of this family a search tries: one per chunk count of `chunk_counts`
        (each >= 2) where the count is a choice, else the family's one."""
        if not cls.chunk_choice:
            return (cls.of(),)
        if not chunk_counts or any(isinstance(v, bool) or not isinstance(v, int) or v < 2 for v in chunk_counts):
            raise ScheduleError(f"{cls.name}: chunk counts {tuple(chunk_counts)!r}; expected integers >= 2")
        return tuple(cls.of(v) for v in dict.fromkeys(chunk_counts))

    # -- shapes ------------------------------------------------------------------------------

    def shape_error(self, num_stages: int, num_microbatches: int) -> str | None:
        """Why this schedule cannot run `num_stages` stages and `num_microbatches` microbatches
        (None: it can)."""
        if num_stages < 1 or num_microbatches < 1:
            return f"num_stages={num_stages}, num_microbatches={num_microbatches}; expected both >= 1"
        return None

    def runs(self, num_stages: int, num_microbatches: int, num_layers: int) -> bool:
        """Whether a pipeline of this shape runs under this schedule, a block per chunk."""
        return self.chunks * num_stages <= num_layers and self.shape_error(num_stages, num_microbatches) is None

    def bind(self, num_stages: int, num_microbatches: int) -> BoundSchedule:
        """The op lists of one pipeline shape; ScheduleError where the schedule cannot run it."""
        why = self.shape_error(num_stages, num_microbatches)
        if why is not None:
            raise ScheduleError(f"{self.label}: {why}")
        return BoundSchedule(self, num_stages, num_microbatches)

    # -- op lists ----------------------------------------------------------------------------

    def stage_ops(self, num_stages: int, num_microbatches: int, stage_idx: int) -> list[Task]:
        """The tasks of stage `stage_idx` in the order it runs them."""
        raise NotImplementedError

    def virtual_stage(self, num_stages: int, stage_idx: int, chunk: int) -> int:
        """The model position of chunk `chunk` of stage `stage_idx` (0: the embedding side)."""
        return stage_idx

    def positions(self, num_stages: int) -> tuple[tuple[int, int], ...]:
        """(stage_idx, chunk) at each model position 0 .. num_stages * chunks - 1."""
        at = {self.virtual_stage(num_stages, s, c): (s, c) for s in range(num_stages) for c in range(self.chunks)}
        return tuple(at[q] for q in range(len(at)))

    def head_stage(self, num_stages: int) -> int:
        """The stage holding the last model position (the head and the loss)."""
        return self.positions(num_stages)[-1][0]

    def wraps(self, num_stages: int) -> bool:
        """Whether a tensor crosses between the last stage and stage 0 where they are no plan
        boundary (interleaved's hand-over from one chunk round to the next, past 2 stages)."""
        pos = self.positions(num_stages)
        return any(abs(a - b) > 1 for (a, _), (b, _) in zip(pos, pos[1:]))

    def memory_counts(self, num_stages: int, num_microbatches: int) -> tuple[tuple[int, int], ...]:
        """Per stage, (most (chunk, microbatch) activations awaiting B at once, most awaiting W):
        :func:`backward_peaks` of its op list -- what the cost model charges a stage for
        (cached: the planner asks per stage)."""
        return _memory_counts(self, num_stages, num_microbatches)

    def _counts(self, num_stages: int, num_microbatches: int) -> tuple[tuple[int, int], ...]:
        """:meth:`memory_counts` uncached: the walk of every op list (a family with a closed
        form overrides it; the tests hold the two equal)."""
        return tuple(backward_peaks(self.stage_ops(num_stages, num_microbatches, s)) for s in range(num_stages))

    def max_in_flight(self, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
        """Per stage, the most (chunk, microbatch) activations held at once: from an F's start to
        the end of the last task that reads them (W in a split schedule, else B)."""
        freed = WEIGHT if self.split_backward else BACKWARD
        out = []
        for s in range(num_stages):
            started = ended = peak = 0
            for task in self.stage_ops(num_stages, num_microbatches, s):
                if task.kind == FORWARD:
                    started += 1
                    peak = max(peak, started - ended)
                elif task.kind == freed:
                    ended += 1
            out.append(peak)
        return tuple(out)

    # -- the cost model's terms --------------------------------------------------------------

    def pipeline_terms(self, *, t: Any, fwd: Any, b: Any, w: Any, hidden: Any, tail: Any) -> tuple[Any, Any]:
        """(fill, end) of one stage in ``T_pipe = (m - 1) P + sum_s fill_s + transfers + max_s
        end_s`` (``h2jax.plan._cost``), from its seconds per microbatch (floats, or numpy arrays
        over layer counts): t = fwd + b + w, b the input-gradient part of the backward, w the
        weight-gradient part, hidden the W that fills waits for B, tail the gradient sync and
        update. Unsplit one-chunk schedules: (t, tail)."""
        return t, tail

    def least_fill(self, *, fwd: float, bwd: float, w: float) -> float:
        """The least one part (a block, the embedding or the head) with these forward and
        backward seconds (w: the weight-gradient part of bwd) adds to sum_s fill_s: the search's
        lower bounds."""
        return fwd + bwd

    # -- the search's memory floors ----------------------------------------------------------

    def count_floors(self, *, k: Any, m: int, n_types: int, L: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The (awaiting B, awaiting W) counts that bound the memory of a chip type's k stages from
        below, per stage rank r = 1..L (its stages ranked by microbatches awaiting B, fewest
        first; a choice of k stages uses ranks 1..k), as points whose memory is the least the
        rank-r stage can need (the caps take the max over them: memory is linear in the counts,
        so over a polytope of counts it is least at one of its vertices). Every stage count p
        of the pipeline is at least r + n_types - 1 (every chip type has a stage)."""
        raise NotImplementedError

    def floor_key(self, k: Any, *, m: int, n_types: int) -> Any:
        """Where :attr:`floors_need_k`: a number per stage count k (an int or an array) that
        decides the floors -- choices with one key share their caps."""
        raise NotImplementedError


@functools.lru_cache(maxsize=8192)
def _memory_counts(schedule: Schedule, num_stages: int, num_microbatches: int) -> tuple[tuple[int, int], ...]:
    return schedule._counts(num_stages, num_microbatches)


@dataclass(frozen=True)
class BoundSchedule:
    """A schedule at one pipeline shape: the op list of every stage, its grid and counts."""

    schedule: Schedule
    num_stages: int
    num_microbatches: int

    @property
    def name(self) -> str:
        return self.schedule.name

    @property
    def num_chunks(self) -> int:
        return self.schedule.chunks

    @property
    def split_backward(self) -> bool:
        return self.schedule.split_backward

    def stage_ops(self, stage_idx: int) -> list[Task]:
        return self.schedule.stage_ops(self.num_stages, self.num_microbatches, stage_idx)

    def virtual_stage(self, stage_idx: int, chunk: int) -> int:
        return self.schedule.virtual_stage(self.num_stages, stage_idx, chunk)

    def positions(self) -> tuple[tuple[int, int], ...]:
        return self.schedule.positions(self.num_stages)

    def max_in_flight(self) -> tuple[int, ...]:
        return self.schedule.max_in_flight(self.num_stages, self.num_microbatches)

    def memory_counts(self) -> tuple[tuple[int, int], ...]:
        return self.schedule.memory_counts(self.num_stages, self.num_microbatches)

    def ops(self) -> list[list[Task]]:
        return [self.stage_ops(s) for s in range(self.num_stages)]

    def tasks(self) -> Grid:
        """The grid: each stage's ops placed as early as the dependencies allow, unit durations."""
        return grid_of(self.ops(), num_chunks=self.num_chunks, virtual_stage=self.virtual_stage)

    def events(
        self,
        *,
        forward: float | Sequence[float] = 1.0,
        backward: float | Sequence[float] = 1.0,
        weight: float | Sequence[float] = 1.0,
    ) -> list[Event]:
        """The op lists placed as early as dependencies allow with these durations (one number,
        or one per stage; input-gradient backward and weight gradient separately: an unsplit
        schedule's B takes backward + weight)."""
        n = self.num_stages

        def per_stage(x: float | Sequence[float]) -> list[float]:
            return [float(x)] * n if isinstance(x, float | int) else [float(v) for v in x]

        f, b, w = per_stage(forward), per_stage(backward), per_stage(weight)
        if not self.split_backward:
            b = [bi + wi for bi, wi in zip(b, w)]
        return place(
            self.ops(),
            {FORWARD: f, BACKWARD: b, WEIGHT: w},
            num_chunks=self.num_chunks,
            virtual_stage=self.virtual_stage,
        )


def timed_events(
    schedule: BoundSchedule,
    *,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 1.0,
    weight: float | Sequence[float] = 1.0,
) -> list[Event]:
    """:meth:`BoundSchedule.events`."""
    return schedule.events(forward=forward, backward=backward, weight=weight)


_REGISTRY: dict[str, type[Schedule]] = {}


def register(cls: type[Schedule]) -> type[Schedule]:
    """Register a schedule family under its ``name`` (a class decorator)."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ScheduleError(f"schedule name {cls.name!r} is taken by {_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def schedule_names() -> tuple[str, ...]:
    """Every registered schedule family, in registration order."""
    return tuple(_REGISTRY)


def schedule_family(name: str) -> type[Schedule]:
    """The family registered under `name`; ScheduleError naming the known ones."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ScheduleError(
            f"schedule={name!r} is not one of {', '.join(_REGISTRY)}, nor a schedule file (a path ending .csv)"
        )
    return cls
