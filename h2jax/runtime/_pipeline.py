"""The pipeline driver: walks a schedule, dispatching each stage's programs asynchronously.

One thread per stage walks that stage's row of the schedule grid (``plan.get_schedule``)
in order and dispatches its forward/backward programs; it waits only for the boundary
tensor it consumes next, never for a device result it does not need. One thread per
boundary and direction moves tensors through the Transport: a cross-backend transfer
blocks until its source is computed, so it must not sit on a dispatching thread. Optional
watcher threads wait for each program's output to record when the work ran (the
timeline); they never hold up dispatch.

A failure anywhere aborts the step on every thread and is re-raised naming the stage.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from h2jax.comm import Transport
from h2jax.plan import Task, stage_tasks
from h2jax.runtime._stage import StageProgram
from h2jax.runtime._timeline import Timeline

_POLL_S = 0.05


class PipelineAborted(RuntimeError):
    """Raised on the threads of a step that another thread's failure aborted."""


class StageFailure(RuntimeError):
    """A stage (or a transfer next to it) failed during a step."""

    def __init__(self, stage: int, step: int, what: str, cause: BaseException):
        super().__init__(f"stage {stage}, step {step}: {what} failed: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.step = step


class _Mailbox:
    """Microbatch-indexed hand-over between a transfer thread and a stage thread."""

    def __init__(self, abort: threading.Event):
        self._items: dict[int, Any] = {}
        self._cv = threading.Condition()
        self._abort = abort

    def put(self, microbatch: int, value: Any) -> None:
        with self._cv:
            self._items[microbatch] = value
            self._cv.notify_all()

    def get(self, microbatch: int) -> Any:
        with self._cv:
            while microbatch not in self._items:
                if self._abort.is_set():
                    raise PipelineAborted()
                self._cv.wait(_POLL_S)
            return self._items.pop(microbatch)


@dataclass
class StepResult:
    losses: list[jax.Array]  # one scalar per microbatch, on the last stage
    dispatch_s: float  # wall time until every program of the step was dispatched


class _Watcher:
    """Records when each dispatched program ran: ends when its output is ready, starts at
    max(dispatch time, end of the previous program of the same stage) -- programs of one
    stage run one after another on its backend."""

    def __init__(self, timeline: Timeline, stage: int, chip: str):
        self._q: queue.Queue = queue.Queue()
        self._timeline, self._stage, self._chip = timeline, stage, chip
        self._last_end = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"h2jax-watch-{stage}")
        self._thread.start()

    def watch(self, kind: str, step: int, microbatch: int | None, dispatched: float, out: Any) -> threading.Event:
        """Queue ``out`` to be timed; the returned event is set once its end is recorded, so
        whoever consumes ``out`` after waiting on it starts after the recorded end."""
        done = threading.Event()
        self._q.put((kind, step, microbatch, dispatched, out, done))
        return done

    def drain(self) -> None:
        self._q.join()

    def close(self) -> None:
        self._q.put(None)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._q.task_done()
                return
            kind, step, mb, dispatched, out, done = item
            try:
                jax.block_until_ready(out)
                end = time.perf_counter()
                start = max(dispatched, self._last_end)
                self._last_end = end
                self._timeline.add(
                    kind, stage=self._stage, step=step, microbatch=mb, start=start, end=end, chip=self._chip
                )
            except Exception:  # noqa: BLE001 -- the failure itself surfaces on the dispatching thread
                pass
            finally:
                done.set()
                self._q.task_done()


class Pipeline:
    """Runs one optimizer step's forwards and backwards over the stages of a plan."""

    def __init__(
        self,
        stages: Sequence[StageProgram],
        transport: Transport,
        grid: Any,
        *,
        num_microbatches: int,
        timeline: Timeline | None = None,
    ):
        self.stages = list(stages)
        self.transport = transport
        self.num_microbatches = num_microbatches
        self.tasks: list[list[Task]] = [stage_tasks(grid, s) for s in range(len(self.stages))]
        self.timeline = timeline
        self._watchers = (
            [_Watcher(timeline, s.stage_idx, s.spec.chip) for s in self.stages] if timeline is not None else None
        )
        last = self.stages[-1]
        # d(mean over microbatches)/d(loss of one microbatch)
        self._dloss = jax.device_put(jnp.float32(1.0 / num_microbatches), last.scalar_sharding)

    def close(self) -> None:
        for w in self._watchers or ():
            w.close()

    def run_step(self, step: int, tokens: Sequence[jax.Array], targets: Sequence[jax.Array]) -> StepResult:
        """Dispatch every forward and backward of ``step``; returns without waiting for them.

        ``tokens[m]`` lives on stage 0's mesh, ``targets[m]`` on the last stage's.
        """
        n = len(self.stages)
        abort = threading.Event()
        fwd_in = [_Mailbox(abort) for _ in range(n)]  # activations arriving at stage s
        bwd_in = [_Mailbox(abort) for _ in range(n)]  # gradients arriving at stage s
        outq: dict[tuple[int, str], queue.Queue] = {}
        for b in range(n - 1):
            outq[(b, "fwd")] = queue.Queue()
            outq[(b, "bwd")] = queue.Queue()
        for m, tok in enumerate(tokens):
            fwd_in[0].put(m, tok)
        losses: list[Any] = [None] * self.num_microbatches
        errors: list[BaseException] = []
        err_lock = threading.Lock()

        def fail(exc: BaseException) -> None:
            with err_lock:
                if not isinstance(exc, PipelineAborted):
                    errors.append(exc)
            abort.set()

        def stage_worker(s: int) -> None:
            st = self.stages[s]
            saved: dict[int, Any] = {}
            task = None
            try:
                for task in self.tasks[s]:
                    m = task.microbatch
                    if task.kind == "F":
                        x = fwd_in[s].get(m)
                        t = time.perf_counter()
                        y, saved[m] = st.forward(x, targets[m] if st.last else None)
                        ready = None
                        if self._watchers is not None:
                            ready = self._watchers[s].watch("fwd", step, m, t, y)
                        if st.last:
                            losses[m] = y
                        else:
                            outq[(s, "fwd")].put((m, y, ready))
                    else:
                        dy = self._dloss if st.last else bwd_in[s].get(m)
                        t = time.perf_counter()
                        dx = st.backward(saved.pop(m), dy)
                        ready = None
                        if self._watchers is not None:
                            ready = self._watchers[s].watch("bwd", step, m, t, dx)
                        if s > 0:
                            outq[(s - 1, "bwd")].put((m, dx, ready))
            except BaseException as e:  # noqa: BLE001 -- re-raised by run_step
                what = (
                    f"{'forward' if task is None or task.kind == 'F' else 'backward'} of microbatch "
                    f"{getattr(task, 'microbatch', '?')}"
                )
                fail(e if isinstance(e, PipelineAborted) else StageFailure(s, step, what, e))

        def transfer_worker(b: int, direction: str) -> None:
            src, dst = (b, b + 1) if direction == "fwd" else (b + 1, b)
            dst_stage = self.stages[dst]
            q = outq[(b, direction)]
            inbox = fwd_in[dst] if direction == "fwd" else bwd_in[dst]
            m = None
            try:
                for _ in range(self.num_microbatches):
                    while True:
                        try:
                            m, x, ready = q.get(timeout=_POLL_S)
                            break
                        except queue.Empty:
                            if abort.is_set():
                                raise PipelineAborted() from None
                    # wait for the source outside the timed transfer; with a timeline, wait until
                    # the watcher recorded its end, so the trace never shows a transfer first
                    if ready is not None:
                        while not ready.wait(_POLL_S):
                            if abort.is_set():
                                raise PipelineAborted()
                    x.block_until_ready()
                    t0 = time.perf_counter()
                    y = self.transport.transfer(x, dst_stage.act_sharding)
                    y.block_until_ready()
                    t1 = time.perf_counter()
                    inbox.put(m, y)
                    if self.timeline is not None:
                        extra = {"bytes": int(x.nbytes), "transport": self.transport.name, "direction": direction}
                        self.timeline.add(
                            "send",
                            stage=src,
                            step=step,
                            microbatch=m,
                            start=t0,
                            end=t1,
                            chip=self.stages[src].spec.chip,
                            peer=dst,
                            **extra,
                        )
                        self.timeline.add(
                            "recv",
                            stage=dst,
                            step=step,
                            microbatch=m,
                            start=t0,
                            end=t1,
                            chip=dst_stage.spec.chip,
                            peer=src,
                            **extra,
                        )
            except BaseException as e:  # noqa: BLE001
                fail(
                    e
                    if isinstance(e, PipelineAborted)
                    else StageFailure(src, step, f"{direction} transfer of microbatch {m} to stage {dst}", e)
                )

        t_start = time.perf_counter()
        threads = [
            threading.Thread(target=stage_worker, args=(s,), name=f"h2jax-stage-{s}", daemon=True) for s in range(n)
        ]
        threads += [
            threading.Thread(target=transfer_worker, args=(b, d), name=f"h2jax-xfer-{b}-{d}", daemon=True)
            for b in range(n - 1)
            for d in ("fwd", "bwd")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return StepResult(losses=losses, dispatch_s=time.perf_counter() - t_start)

    def drain_timeline(self) -> None:
        """Wait until the watchers have recorded every program dispatched so far."""
        for w in self._watchers or ():
            w.drain()
