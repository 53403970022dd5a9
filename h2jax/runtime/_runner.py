"""The one walker of a stage's row of the schedule, and the timeline hooks.

A :class:`StageRunner` walks its stage's tasks (``plan.stage_tasks``) in order: for a
forward it takes the input from the channel (or the tokens), dispatches the stage's
forward program and hands the output to the channel; for a backward the same with
gradients. When the tasks hold W's (a split schedule), B dispatches the input-gradient
program and W the weight-gradient program; both are recorded as ``bwd`` events with
``part`` "B" or "W". Every dispatch names the step and the microbatch (the dropout keys derive from them). It
never waits for a device result it does not need: dispatch is
asynchronous, and only a receive blocks (for the peer's tensor). Optional watcher threads
wait for each program's output to record when the work ran; they never hold up dispatch.

In one process the trainer runs one runner per stage on threads (:func:`run_stages`);
under mpirun each rank runs its own stage's runner on its main thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax

from h2jax.comm import BWD, FWD, Channel, PipelineAborted, TransferFailure
from h2jax.plan import Task
from h2jax.plan._schedule import BACKWARD, FORWARD, WEIGHT
from h2jax.runtime._stage import StageProgram
from h2jax.runtime._timeline import Timeline


class StageFailure(RuntimeError):
    """A stage (or a transfer next to it) failed during a step."""

    def __init__(self, stage: int, step: int, what: str, cause: BaseException):
        super().__init__(f"stage {stage}, step {step}: {what} failed: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.step = step


class Watcher:
    """Records when each dispatched program of one stage ran: it ends when its output is
    ready, and starts at max(dispatch time, end of the stage's previous program) --
    programs of one stage run one after another on its devices."""

    def __init__(self, timeline: Timeline, stage: int, chip: str):
        self._q: queue.Queue = queue.Queue()
        self._timeline, self._stage, self._chip = timeline, stage, chip
        self._last_end = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"h2jax-watch-{stage}")
        self._thread.start()

    def watch(
        self, kind: str, step: int, microbatch: int | None, dispatched: float, out: Any, **extra: Any
    ) -> threading.Event:
        """Queue ``out`` to be timed; the returned event is set once its end is recorded, so a
        transfer that waits on it starts after the recorded end. ``extra`` lands in the event."""
        done = threading.Event()
        self._q.put((kind, step, microbatch, dispatched, out, done, extra))
        return done

    def drain(self) -> None:
        self._q.join()

    def close(self) -> None:
        """Stop the thread and wait for it: a thread left inside XLA when the interpreter exits
        can abort the process."""
        self._q.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._q.task_done()
                return
            kind, step, mb, dispatched, out, done, extra = item
            try:
                jax.block_until_ready(out)
                end = time.perf_counter()
                start = max(dispatched, self._last_end)
                self._last_end = end
                self._timeline.add(
                    kind, stage=self._stage, step=step, microbatch=mb, start=start, end=end, chip=self._chip, **extra
                )
            except Exception:  # noqa: BLE001 -- the failure itself surfaces on the dispatching thread
                pass
            finally:
                done.set()
                self._q.task_done()


class StageRunner:
    """Walks one stage's tasks of a step (module docstring)."""

    def __init__(
        self,
        program: StageProgram,
        channel: Channel,
        tasks: Sequence[Task],
        *,
        dloss: Any,
        timeline: Timeline | None = None,
        record: bool = True,
    ):
        self.program, self.channel, self.tasks = program, channel, list(tasks)
        self.dloss = dloss  # d(mean over microbatches)/d(one microbatch's loss), on the last stage
        self.timeline = timeline if record else None
        self.watcher = Watcher(timeline, program.stage_idx, program.spec.chip) if self.timeline is not None else None
        self.step = 0
        self.split = any(t.kind == WEIGHT for t in self.tasks)
        if self.timeline is not None:
            channel.record = self._record_transfer

    def _record_transfer(self, kind: str, microbatch: int, start: float, end: float, **extra: Any) -> None:
        self.timeline.add(
            kind,
            stage=self.program.stage_idx,
            step=self.step,
            microbatch=microbatch,
            start=start,
            end=end,
            chip=self.program.spec.chip,
            **extra,
        )

    def run_step(self, step: int, tokens: Sequence[Any] | None, targets: Sequence[Any] | None) -> list[Any]:
        """Dispatch every task of ``step``; returns the microbatch losses (last stage) as device
        scalars. ``tokens`` on the first stage, ``targets`` on the last, else None."""
        st, ch = self.program, self.channel
        self.step = step
        saved: dict[int, Any] = {}
        kept: dict[int, Any] = {}  # B's hand-over to W, split schedules
        part = {"part": BACKWARD} if self.split else {}
        losses: list[Any] = []
        task = None
        try:
            for task in self.tasks:
                m = task.microbatch
                if task.kind == "F":
                    x = tokens[m] if st.first else ch.recv(FWD, m)
                    t0 = time.perf_counter()
                    y, saved[m] = st.forward(m, x, targets[m] if st.last else None, split=self.split, step=step)
                    ready = self.watcher.watch("fwd", step, m, t0, y) if self.watcher else None
                    if st.last:
                        losses.append(y)
                    else:
                        ch.send(FWD, m, y, ready=ready)
                elif task.kind == BACKWARD:
                    dy = self.dloss if st.last else ch.recv(BWD, m)
                    t0 = time.perf_counter()
                    if self.split:
                        dx, kept[m] = st.input_backward(m, saved.pop(m), targets[m] if st.last else None, dy, step=step)
                    else:
                        dx = st.backward(m, saved.pop(m), targets[m] if st.last else None, dy, step=step)
                    ready = self.watcher.watch("bwd", step, m, t0, dx, **part) if self.watcher else None
                    if not st.first:
                        ch.send(BWD, m, dx, ready=ready)
                else:  # WEIGHT
                    t0 = time.perf_counter()
                    done = st.weight_backward(m, kept.pop(m))
                    if self.watcher:
                        self.watcher.watch("bwd", step, m, t0, done, part=WEIGHT)
            ch.flush()  # every send of this step has left
        except (PipelineAborted, StageFailure, TransferFailure):
            raise
        except BaseException as e:
            kind = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight gradient"}[task.kind if task else FORWARD]
            raise StageFailure(st.stage_idx, step, f"{kind} of microbatch {getattr(task, 'microbatch', '?')}", e) from e
        return losses

    def drain(self) -> None:
        if self.watcher is not None:
            self.watcher.drain()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self.channel.close()


def run_stages(runners: Sequence[StageRunner], step: int, tokens: Any, targets: Any, *, hub: Any = None) -> list[Any]:
    """One step of several local stages: one runner per stage on its own thread (a blocking
    receive must never hold up another stage's dispatch). A failure anywhere aborts the
    step everywhere and is re-raised naming the stage. Returns the last stage's losses."""
    if len(runners) == 1:
        return runners[0].run_step(step, tokens, targets)
    if hub is not None:
        hub.reset()
    results: dict[int, list[Any]] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(r: StageRunner) -> None:
        st = r.program
        try:
            results[st.stage_idx] = r.run_step(step, tokens if st.first else None, targets if st.last else None)
        except PipelineAborted:
            pass
        except BaseException as e:  # noqa: BLE001 -- re-raised below
            with lock:
                errors.append(e)
            if hub is not None:
                hub.abort()

    threads = [
        threading.Thread(target=work, args=(r,), name=f"h2jax-stage-{r.program.stage_idx}", daemon=True)
        for r in runners
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if hub is not None and hub.error is not None and not errors:
        errors.append(hub.error)
    if errors:
        e = errors[0]
        if isinstance(e, TransferFailure):
            raise StageFailure(e.stage, step, e.what, e.cause) from e
        raise e
    return results[runners[-1].program.stage_idx]
