"""A schedule written as a file: each stage's ordered tasks, no code.

The format follows torchtitan's ``pipeline_parallel_schedule_csv``: one row per stage (row i
is stage i), one cell per task in the order the stage runs them, each cell
``<position><kind><microbatch>``:

- position: the model position (virtual stage) the task computes, 0 .. p*v - 1 (position 0
  holds the embedding, the last the head); a stage holds the positions its row names, its
  chunk c being the c-th smallest of them (v per stage, the same v on every stage);
- kind: ``F`` forward, ``B`` the whole backward, or, split, ``I`` the input gradient and ``W``
  the weight gradient (a file writes either B, or I and W);
- microbatch: 0 .. m - 1.

``#`` starts a comment; blank cells and lines are skipped. Communication actions (torchtitan's
``SEND_F`` and the like) are refused: h2jax moves tensors where the tasks need them.

Loading checks what a schedule must be: every (position, microbatch) has one F and one B (and
one W when split) and nothing else, consecutive positions sit on one stage or on neighbours
(or the last stage and stage 0, in that order: interleaved's wrap), and the tasks run in these orders without a deadlock (every
dependency met: :func:`h2jax.plan.schedules._tasks.place`). The in-flight bound it implies is
its own (:meth:`Schedule.max_in_flight`): the runtime's memory check and the cost model use it.
A file fixes the pipeline shape (p stages, m microbatches): a plan of another shape is refused.
The cost model prices it by replaying its op lists (no closed form); the search bounds its
memory by its own per-stage counts.
"""

from __future__ import annotations

import csv
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from h2jax.plan.schedules._base import Schedule, ScheduleError
from h2jax.plan.schedules._tasks import BACKWARD, FORWARD, WEIGHT, Task, place

SUFFIXES = (".csv", ".txt")
_KINDS = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD, "W": WEIGHT}


def looks_like_file(label: str) -> bool:
    """Whether a schedule value names a file rather than a family: a path separator or a
    schedule-file suffix."""
    return os.sep in label or "/" in label or label.lower().endswith(SUFFIXES)


@dataclass(frozen=True)
class FileSchedule(Schedule):
    """A schedule read from a file (module docstring). Compares and hashes by its path and
    content digest."""

    source: str = ""
    """The path as the plan wrote it (what the plan's YAML writes back)."""
    digest: str = ""
    rows: tuple[tuple[Task, ...], ...] = field(default=(), compare=False, repr=False)
    split: bool = field(default=False, compare=False)
    holds: tuple[tuple[int, ...], ...] = field(default=(), compare=False, repr=False)
    """Per stage, its model positions in chunk order."""
    num_microbatches: int = field(default=0, compare=False)

    name: ClassVar[str] = "file"
    closed_form: ClassVar[bool] = False
    placement: ClassVar[str] = "chunk c of stage s at the c-th smallest position its row names"

    @classmethod
    def load(cls, path: str) -> FileSchedule:
        """Read and check the schedule file at `path`; ScheduleError naming the file, the row and
        the cell where it is wrong."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ScheduleError(f"schedule file {path}: {e.strerror or e}; expected a readable CSV file") from None
        except UnicodeDecodeError as e:
            raise ScheduleError(f"schedule file {path}: not UTF-8 ({e.reason} at byte {e.start})") from None
        return cls.parse(text, source=path)

    @classmethod
    def parse(cls, text: str, *, source: str = "<text>") -> FileSchedule:
        """The schedule of a file's text (see :meth:`load`)."""
        rows: list[list[tuple[int, str, str, int]]] = []  # (position, letter, kind, microbatch)
        for line_no, line in enumerate(text.splitlines(), start=1):
            (row,) = csv.reader([line.split("#", 1)[0]])
            cells = [_cell(c.strip(), f"{source}:{line_no}, cell {i}") for i, c in enumerate(row, 1) if c.strip()]
            if cells:
                rows.append(cells)
        if not rows:
            raise ScheduleError(f"schedule file {source}: no tasks; expected one row of tasks per stage")
        p = len(rows)
        letters = {c[1] for r in rows for c in r}
        split = bool(letters & {"I", "W"})
        if split and "B" in letters:
            raise ScheduleError(
                f"schedule file {source}: writes B (the whole backward) beside I / W (its two halves); "
                "expected either B, or I and W"
            )
        positions = sorted({c[0] for r in rows for c in r})
        holds = tuple(tuple(sorted({c[0] for c in r})) for r in rows)
        v = len(holds[0])
        for s, h in enumerate(holds):
            if len(h) != v:
                raise ScheduleError(
                    f"schedule file {source}: stage {s} computes positions {list(h)}, stage 0 {list(holds[0])}; "
                    "expected the same number of positions (layer chunks) on every stage"
                )
        owner: dict[int, int] = {}
        for s, h in enumerate(holds):
            for q in h:
                if q in owner:
                    raise ScheduleError(
                        f"schedule file {source}: position {q} is computed by stages {owner[q]} and {s}; "
                        "expected one stage per position"
                    )
                owner[q] = s
        if positions != list(range(p * v)):
            missing = sorted(set(range(p * v)) - set(positions))
            raise ScheduleError(
                f"schedule file {source}: {p} stages of {v} chunk(s) compute positions {positions}; expected "
                f"0 .. {p * v - 1}" + (f" (missing {missing})" if missing else "")
            )
        for q in range(p * v - 1):
            a, b = owner[q], owner[q + 1]
            if abs(a - b) > 1 and (a, b) != (p - 1, 0):
                raise ScheduleError(
                    f"schedule file {source}: position {q} is on stage {a}, position {q + 1} on stage {b}; "
                    "expected consecutive positions on one stage, on neighbouring stages, or from the last "
                    "stage to stage 0 (interleaved's wrap)"
                )
        m = 1 + max(c[3] for r in rows for c in r)
        want = ("F", "I", "W") if split else ("F", "B")
        seen: dict[tuple[int, str, int], int] = {}
        for s, r in enumerate(rows):
            for q, letter, _, j in r:
                if (q, letter, j) in seen:
                    raise ScheduleError(
                        f"schedule file {source}: {q}{letter}{j} appears twice (stages {seen[q, letter, j]} and {s}); "
                        "expected every task once"
                    )
                seen[q, letter, j] = s
        for q in range(p * v):
            for j in range(m):
                for letter in want:
                    if (q, letter, j) not in seen:
                        raise ScheduleError(
                            f"schedule file {source}: no {q}{letter}{j} (stage {owner[q]}); expected "
                            f"{', '.join(want)} of every position 0 .. {p * v - 1} and microbatch 0 .. {m - 1}"
                        )
        tasks = tuple(tuple(Task(kind, j, holds[s].index(q)) for q, _, kind, j in r) for s, r in enumerate(rows))
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        sched = cls(v, source=source, digest=digest, rows=tasks, split=split, holds=holds, num_microbatches=m)
        try:
            place(
                list(tasks),
                dict.fromkeys((FORWARD, BACKWARD, WEIGHT), 1.0),
                num_chunks=v,
                virtual_stage=lambda s, c: holds[s][c],
            )
        except RuntimeError as e:
            raise ScheduleError(f"schedule file {source}: {e} (a task waits for one its stage runs later)") from None
        return sched

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ScheduleError(f"schedule file {self.source}: {self.chunks} chunks per stage; expected >= 1")

    # -- identity ----------------------------------------------------------------------------

    @property
    def split_backward(self) -> bool:  # type: ignore[override]
        return self.split

    @property
    def label(self) -> str:
        return self.source

    def to_raw(self) -> str:
        return self.source

    def with_chunks(self, chunks: int) -> Schedule:
        if chunks != self.chunks:
            raise ScheduleError(f"schedule file {self.source}: its stages hold {self.chunks} chunk(s), not {chunks}")
        return self

    # -- shapes and op lists -----------------------------------------------------------------

    def shape_error(self, num_stages: int, num_microbatches: int) -> str | None:
        if (num_stages, num_microbatches) != (len(self.rows), self.num_microbatches):
            return (
                f"the file schedules {len(self.rows)} stages and {self.num_microbatches} microbatches; "
                f"the plan has {num_stages} stages and {num_microbatches} microbatches"
            )
        return None

    def stage_ops(self, num_stages: int, num_microbatches: int, stage_idx: int) -> list[Task]:
        return list(self.rows[stage_idx])

    def virtual_stage(self, num_stages: int, stage_idx: int, chunk: int) -> int:
        return self.holds[stage_idx][chunk]

    # -- the cost model and the search -------------------------------------------------------

    def least_fill(self, *, fwd: float, bwd: float, w: float) -> float:
        return 0.0  # no closed form: the least a replayed order adds is not known in advance

    def count_floors(self, *, k: Any, m: int, n_types: int, L: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The r-th fewest awaiting-B count over the file's stages (a chip type's stages are some
        of them), with the fewest awaiting W of any stage; past the file's stage count the most
        (no such choice runs)."""
        counts = self.memory_counts(len(self.rows), self.num_microbatches)
        j = sorted(c[0] for c in counts)
        j_r = np.array([j[min(r, len(j) - 1)] for r in range(L)], dtype=np.float64)
        return [(j_r, np.full(L, float(min(c[1] for c in counts))))]


def _cell(cell: str, where: str) -> tuple[int, str, str, int]:
    """(position, letter, kind, microbatch) of one cell such as ``0F3``."""
    i = 0
    while i < len(cell) and cell[i].isdigit():
        i += 1
    letter, rest = cell[i : i + 1], cell[i + 1 :]
    if not i or letter not in _KINDS or not rest.isdigit():
        hint = "; h2jax moves tensors itself (no SEND/RECV actions)" if "_" in cell or "SEND" in cell.upper() else ""
        raise ScheduleError(
            f"schedule file {where}: {cell!r}; expected <position><F|B|I|W><microbatch>, e.g. 0F3{hint}"
        )
    return int(cell[:i]), letter, _KINDS[letter], int(rest)
