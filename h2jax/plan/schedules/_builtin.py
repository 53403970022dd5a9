"""The built-in schedules: gpipe, 1f1b, zb-h1, interleaved and zb-v.

Each is a frozen value (:class:`h2jax.plan.schedules.Schedule`) whose ``stage_ops`` writes
out a stage's ordered tasks (warm-up, steady state, cool-down) and which carries its own
closed forms: what a stage holds (``_counts``, held equal to the walk of the op lists by the
tests), its (fill, end) terms of the iteration time and its least fill (the cost model,
``h2jax.plan._cost``), and the memory floors by stage rank (the search,
``h2jax.plan.search``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from h2jax.plan.schedules._base import Schedule, register
from h2jax.plan.schedules._tasks import BACKWARD, FORWARD, WEIGHT, Task


def _one_f_one_b_warmup(num_stages: int, num_microbatches: int, stage_idx: int) -> int:
    return min(num_stages - stage_idx - 1, num_microbatches)


@register
@dataclass(frozen=True)
class GPipe(Schedule):
    """All forwards, then all backwards: simple, but every microbatch's activations stay
    alive on every stage until its backward (num_microbatches in flight). Bubble (F, B
    durations): (p - 1) / (m + p - 1) of the makespan -- 1F1B's, with more memory, so a
    search that offers 1F1B skips it."""

    name: ClassVar[str] = "gpipe"
    dominated_by: ClassVar[str | None] = "1f1b"

    def stage_ops(self, num_stages: int, num_microbatches: int, stage_idx: int) -> list[Task]:
        m = num_microbatches
        ops = [Task(FORWARD, i) for i in range(m)]  # warmup
        # steady state: none
        ops += [Task(BACKWARD, i) for i in range(m)]  # cooldown
        return ops

    def max_in_flight(self, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
        return (num_microbatches,) * num_stages

    def _counts(self, num_stages: int, num_microbatches: int) -> tuple[tuple[int, int], ...]:
        return ((num_microbatches, 0),) * num_stages

    def count_floors(self, *, k: Any, m: int, n_types: int, L: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every stage holds all m microbatches: (m, 0)."""
        return [(np.full(L, float(m)), np.zeros(L))]


@register
@dataclass(frozen=True)
class OneFOneB(Schedule):
    """1F1B: after a short warm-up each stage alternates one forward, one backward, so stage
    s holds at most num_stages - s microbatches; same bubble as GPipe, (p - 1) / (m + p - 1)
    of the makespan, with less memory."""

    name: ClassVar[str] = "1f1b"

    def stage_ops(self, num_stages: int, num_microbatches: int, stage_idx: int) -> list[Task]:
        m = num_microbatches
        warmup = _one_f_one_b_warmup(num_stages, m, stage_idx)
        # warmup
        ops = [Task(FORWARD, i) for i in range(warmup)]
        # steady state: one forward, one backward
        for i in range(m - warmup):
            ops += [Task(FORWARD, warmup + i), Task(BACKWARD, i)]
        # cooldown
        ops += [Task(BACKWARD, i) for i in range(m - warmup, m)]
        return ops

    def max_in_flight(self, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
        return tuple(min(num_stages - s, num_microbatches) for s in range(num_stages))

    def _counts(self, num_stages: int, num_microbatches: int) -> tuple[tuple[int, int], ...]:
        return tuple((n, 0) for n in self.max_in_flight(num_stages, num_microbatches))

    def count_floors(self, *, k: Any, m: int, n_types: int, L: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Stage s of p holds min(p - s, m): k stages have k distinct counts, the r-th fewest at
        least min(r, m) -- capped at m, which holds fewer than k stages when m < k."""
        r = np.arange(1, L + 1, dtype=np.float64)
        return [(np.minimum(r, m), np.zeros(L))]


@register
@dataclass(frozen=True)
class ZeroBubbleH1(Schedule):
    """ZB-H1 (arXiv 2401.10241, "handcrafted 1"): the backward split into B (input gradient,
    on the critical path) and W (weight gradient, needed only at the step end). Stage s runs
    1F1B's warm-up of p - s - 1 forwards, then F, B, W cycles in which its W's lag its B's by
    s, and a cool-down of B's, each followed by W's down to that lag, then the remaining W's --
    the deferred W's fill the tail where 1F1B idles.

    In flight (F started, W not ended): at most min(p, m) microbatches on every stage --
    1F1B's peak (its stage 0), so per-device memory never exceeds 1F1B's worst stage; later
    stages hold more than under 1F1B (the last stage must defer p - 1 W's for its B chain to
    finish in time). Bubble with unit F = B = W: (p - 1) idle slots per stage against 1F1B's
    3(p - 1), i.e. (p - 1) / (3m + p - 1) of the makespan (the paper's bubble rate
    (p - 1) / 3m counts idle per compute)."""

    name: ClassVar[str] = "zb-h1"
    split_backward: ClassVar[bool] = True
    caps_within: ClassVar[tuple[str, ...]] = ("1f1b",)
    floors_need_k: ClassVar[bool] = True

    def stage_ops(self, num_stages: int, num_microbatches: int, stage_idx: int) -> list[Task]:
        m = num_microbatches
        warmup = _one_f_one_b_warmup(num_stages, m, stage_idx)
        lag = stage_idx  # W's this stage holds back behind its B's
        # warmup
        ops = [Task(FORWARD, i) for i in range(warmup)]
        done_b = done_w = 0
        # steady state: F, B, and a W once more than `lag` B's wait for theirs
        for i in range(m - warmup):
            ops += [Task(FORWARD, warmup + i), Task(BACKWARD, i)]
            done_b += 1
            if done_b - done_w > lag:
                ops.append(Task(WEIGHT, done_w))
                done_w += 1
        # cooldown: B's as they arrive, W's down to the lag, then the deferred W's
        for i in range(m - warmup, m):
            ops.append(Task(BACKWARD, i))
            done_b += 1
            while done_b - done_w > lag:
                ops.append(Task(WEIGHT, done_w))
                done_w += 1
        ops += [Task(WEIGHT, i) for i in range(done_w, m)]
        return ops

    def max_in_flight(self, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
        return (min(num_stages, num_microbatches),) * num_stages

    def _counts(self, num_stages: int, num_microbatches: int) -> tuple[tuple[int, int], ...]:
        """1F1B's min(p - s, m) awaiting B, and min(s + 1, m) awaiting W (the lag of s, and the B
        that just ran)."""
        p, m = num_stages, num_microbatches
        return tuple((min(p - s, m), min(s + 1, m)) for s in range(p))

    def pipeline_terms(self, *, t: Any, fwd: Any, b: Any, w: Any, hidden: Any, tail: Any) -> tuple[Any, Any]:
        """(t - 2h, tail + 2h) with h the W work that fills the waits for B: the paper's
        (p - 1)(F + B - W) bubble on equal stages."""
        return t - 2 * hidden, tail + 2 * hidden

    def least_fill(self, *, fwd: float, bwd: float, w: float) -> float:
        """fwd + bwd less twice the W it hides (at most the forward it stands in for)."""
        return fwd + bwd - 2 * min(w, fwd)

    def floor_key(self, k: Any, *, m: int, n_types: int) -> Any:
        """The least awaiting-B plus awaiting-W count of any stage of a chip type with k stages:
        min(p, m) + 1 with p >= k + n_types - 1."""
        return np.minimum(np.asarray(k, dtype=np.float64) + n_types - 1, m) + 1

    def count_floors(self, *, k: Any, m: int, n_types: int, L: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(min(p - s, m), min(s + 1, m)) (:meth:`_counts`): j at least min(r, m), q at least 1,
        both at most m, and j + q >= T = min(p + 1, m + 1) with p >= k + n_types - 1: the
        vertices of that polytope nearest the origin, the two ends of its edge j + q = T."""
        r = np.arange(1, L + 1, dtype=np.float64)
        j_lo = np.minimum(r, m)
        T = self.floor_key(k, m=m, n_types=n_types)
        j1 = np.maximum(j_lo, T - m)
        j2 = np.maximum(j1, np.minimum(m, T - 1))
        return [(j1, np.maximum(1.0, T - j1)), (j2, np.maximum(1.0, T - j2))]


@register
@dataclass(frozen=True)
class Interleaved(Schedule):
    """Interleaved 1F1B (Megatron-LM, arXiv 2104.04473): each stage holds `chunks` (v) layer
    chunks, chunk c of stage s at model position c * p + s, so a microbatch passes every
    stage v times. Forwards go in groups of p microbatches, chunk by chunk; stage s warms up
    with 2(p - s - 1) + (v - 1)p chunk forwards, then alternates one forward, one backward
    (backwards visit the chunks in reverse).

    Needs num_microbatches divisible by num_stages (the grouping). In flight: stage s holds
    at most 2(p - s - 1) + (v - 1)p + 1 (chunk, microbatch) activations, each 1/v of a
    stage's. Bubble with unit F and B per chunk: p - 1 idle (F + B) per stage against v·m of
    work, i.e. (p - 1) / (v·m + p - 1) of the makespan (Megatron's (p - 1) / (v·m) counts idle
    per compute): 1F1B's bubble divided by about v, for v times the transfers."""

    chunks: int = 2
    name: ClassVar[str] = "interleaved"
    chunk_choice: ClassVar[bool] = True
    default_chunks: ClassVar[int] = 2
    placement: ClassVar[str] = "chunk c of stage s at model position c * num_stages + s"

    def shape_error(self, num_stages: int, num_microbatches: int) -> str | None:
        why = super().shape_error(num_stages, num_microbatches)
        if why is None and num_microbatches % num_stages:
            why = (
                f"num_microbatches={num_microbatches} is not a multiple of num_stages={num_stages} "
                "(forwards go in groups of num_stages microbatches)"
            )
        return why

    def virtual_stage(self, num_stages: int, stage_idx: int, chunk: int) -> int:
        return chunk * num_stages + stage_idx

    def _order(self, p: int, m: int, backward: bool) -> list[tuple[int, int]]:
        """(chunk, microbatch) in the order a stage runs them: groups of p microbatches, chunk
        by chunk (reversed for backwards)."""
        v = self.chunks
        return [(v - 1 - c if backward else c, i) for g in range(0, m, p) for c in range(v) for i in range(g, g + p)]

    def _warmup(self, p: int, m: int, stage_idx: int) -> int:
        return min(2 * (p - stage_idx - 1) + (self.chunks - 1) * p, self.chunks * m)

    def stage_ops(self, num_stages: int, num_microbatches: int, stage_idx: int) -> list[Task]:
        p, m = num_stages, num_microbatches
        fw = [Task(FORWARD, i, c) for c, i in self._order(p, m, False)]
        bw = [Task(BACKWARD, i, c) for c, i in self._order(p, m, True)]
        warmup, total = self._warmup(p, m, stage_idx), len(fw)
        # warmup
        ops = fw[:warmup]
        # steady state: one forward, one backward
        for i in range(total - warmup):
            ops += [fw[warmup + i], bw[i]]
        # cooldown
        ops += bw[total - warmup :]
        return ops

    def max_in_flight(self, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
        """(chunk, microbatch) activations per stage (each 1/v of a stage's)."""
        total = self.chunks * num_microbatches
        return tuple(min(self._warmup(num_stages, num_microbatches, s) + 1, total) for s in range(num_stages))

    def _counts(self, num_stages: int, num_microbatches: int) -> tuple[tuple[int, int], ...]:
        return tuple((n, 0) for n in self.max_in_flight(num_stages, num_microbatches))

    def pipeline_terms(self, *, t: Any, fwd: Any, b: Any, w: Any, hidden: Any, tail: Any) -> tuple[Any, Any]:
        """(t / v, t - t / v + tail): Megatron's m t + (p - 1) t / v on equal stages."""
        fill = t / self.chunks
        return fill, t - fill + tail

    def least_fill(self, *, fwd: float, bwd: float, w: float) -> float:
        return (fwd + bwd) / self.chunks

    def count_floors(self, *, k: Any, m: int, n_types: int, L: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """In (chunk, microbatch) counts stage s holds min(2(p - s - 1) + (v - 1)p + 1, vm), so the
        r-th fewest at least min(2(r - 1) + (v - 1)p + 1, vm) with p >= r + n_types - 1 (no k
        in it)."""
        r = np.arange(1, L + 1, dtype=np.float64)
        v = self.chunks
        return [(np.minimum(2 * (r - 1) + (v - 1) * (r + n_types - 1) + 1, v * m), np.zeros(L))]


@register
@dataclass(frozen=True)
class ZeroBubbleV(Schedule):
    """ZB-V (arXiv 2401.10241): two chunks per stage in a V -- chunk 0 of stage s at model
    position s, chunk 1 at 2p - 1 - s, so stage 0 holds the first and the last layers -- with
    the B/W split. Stage s warms up with 2(p - s) - 1 chunk-0 forwards, then s pairs (chunk-1
    F, chunk-0 F), then p - s rounds of chunk-1 F, B, W; the steady state runs chunk-0 F, B, W
    and chunk-1 F, B, W; the cool-down runs the remaining B's with W's deferred into the gaps
    (PyTorch's ScheduleZBVZeroBubble builds the same lists).

    Needs num_microbatches >= 2p - 1 (the warm-up's forwards). In flight: at most 2p (chunk,
    microbatch) activations on every stage, each half a stage's: 1F1B's peak of p
    microbatches. Bubble with unit F = B = W per chunk: p - 1 idle chunk slots per stage, only
    the fill of the first forward (no order of these ops can start the last stage earlier),
    i.e. (p - 1) / (6m + p - 1) of the makespan; the paper's bubble term (p - 1)(T_F + T_B -
    2T_W) of a stage's times is zero there."""

    chunks: int = 2
    name: ClassVar[str] = "zb-v"
    split_backward: ClassVar[bool] = True
    default_chunks: ClassVar[int] = 2
    placement: ClassVar[str] = "chunk 0 of stage s at model position s, chunk 1 at 2 * num_stages - 1 - s"

    def shape_error(self, num_stages: int, num_microbatches: int) -> str | None:
        why = super().shape_error(num_stages, num_microbatches)
        if why is None and num_microbatches < 2 * num_stages - 1:
            why = (
                f"num_microbatches={num_microbatches} < 2 * num_stages - 1 = {2 * num_stages - 1} "
                "(the V's warm-up needs that many)"
            )
        return why

    def virtual_stage(self, num_stages: int, stage_idx: int, chunk: int) -> int:
        return stage_idx if chunk == 0 else 2 * num_stages - 1 - stage_idx

    def stage_ops(self, num_stages: int, num_microbatches: int, stage_idx: int) -> list[Task]:
        p, m, s = num_stages, num_microbatches, stage_idx
        ops: list[Task] = []
        nf, nb, nw = [0, 0], [0, 0], [0, 0]  # per chunk: forwards, B's, W's issued

        def add(kind: str, chunk: int) -> None:
            count = {FORWARD: nf, BACKWARD: nb, WEIGHT: nw}[kind]
            ops.append(Task(kind, count[chunk], chunk))
            count[chunk] += 1

        # warmup: down the V's first arm, then both arms, then the turn at the last stage
        for _ in range(2 * (p - s) - 1):
            add(FORWARD, 0)
        for _ in range(s):
            add(FORWARD, 1)
            add(FORWARD, 0)
        for _ in range(p - s):
            add(FORWARD, 1)
            add(BACKWARD, 1)
            add(WEIGHT, 1)
        # steady state: F, B, W on each chunk in turn
        while nf[1] < nf[0] or nf[0] < m:
            if nf[0] < m:
                add(FORWARD, 0)
            add(BACKWARD, 0)
            add(WEIGHT, 0)
            add(FORWARD, 1)
            add(BACKWARD, 1)
            add(WEIGHT, 1)
        # cooldown: the remaining B's, W's deferred into the gaps and to the end
        for _ in range(s):
            add(BACKWARD, 0)
            add(BACKWARD, 1)
        for _ in range(p - s):
            add(BACKWARD, 0)
            add(WEIGHT, 0)
        while nw[1] < nb[1]:
            add(WEIGHT, 1)
        while nw[0] < nb[0]:
            add(WEIGHT, 0)
        return ops

    def max_in_flight(self, num_stages: int, num_microbatches: int) -> tuple[int, ...]:
        """(chunk, microbatch) activations per stage (each half a stage's)."""
        return (2 * num_stages,) * num_stages

    def _counts(self, num_stages: int, num_microbatches: int) -> tuple[tuple[int, int], ...]:
        """2p chunks awaiting B, and 2s + 1 awaiting W (the cool-down defers the W's of stage s's
        s B-pairs and one more)."""
        return tuple((2 * num_stages, 2 * s + 1) for s in range(num_stages))

    def pipeline_terms(self, *, t: Any, fwd: Any, b: Any, w: Any, hidden: Any, tail: Any) -> tuple[Any, Any]:
        """(g, t - g + tail), g = max(f, b, f + b - 2w, 2(b - w)) of one chunk's F, B, W (half the
        stage's): on equal stages m t + (p - 1) g, which the replay gives for any F, B, W with
        B >= F (p - 1 idle forwards when F = B = W)."""
        f, bc, wc = fwd / 2, b / 2, w / 2
        g = np.maximum(np.maximum(f, bc), np.maximum(f + bc - 2 * wc, 2 * (bc - wc)))
        return g, t - g + tail

    def least_fill(self, *, fwd: float, bwd: float, w: float) -> float:
        """A stage's fill is at least its chunk forward, half the stage's."""
        return fwd / 2

    def count_floors(self, *, k: Any, m: int, n_types: int, L: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(2p, 2s + 1) in chunk counts: j at least 2(r + n_types - 1), q at least 2r - 1 (no k
        or m in it)."""
        r = np.arange(1, L + 1, dtype=np.float64)
        return [(2 * (r + n_types - 1), 2 * r - 1)]
