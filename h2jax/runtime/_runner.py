"""The one walker of a stage's row of the schedule, and the timeline hooks.

A :class:`StageRunner` walks its stage's tasks (``plan.stage_tasks``) in order: for a
forward it takes the input from the channel (or the tokens), dispatches the stage's
forward program and hands the output to the channel; for a backward the same with
gradients. When the tasks hold W's (a split schedule), B dispatches the input-gradient
program and W the weight-gradient program; both are recorded as ``bwd`` events with
``part`` "B" or "W". Every dispatch names the step and the microbatch (the dropout keys
derive from them). On an accelerator it never waits for a device result it does not need:
dispatch is asynchronous, and only a receive blocks (for the peer's tensor; one that polls
from the host first for the stage's last program, see ``h2jax.comm._channel``). Optional
watcher threads wait for each program's output to record when the work ran; they never hold
up dispatch.

A stage's programs run in dispatch order, as on an accelerator's stream. The CPU client
does not keep that order: it runs programs that do not depend on each other side by side on
the process's cores, so a forward dispatched ahead slows the weight gradient before it and
both end late (under ``mpirun --bind-to core``, a 42 ms W took 88 ms beside a forward). On
CPU devices the runner therefore waits for the previous program before it dispatches the
next: the Python dispatch stops overlapping the compute (under a millisecond per program).

A stage of several layer chunks (interleaved, zb-v) has one program and one channel per
chunk; each task names its chunk. A boundary between two chunks of this stage (zb-v's turn
of the V) is handed over in a dict, without a transfer; the events of a chunked stage carry
``chunk``.

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
from h2jax.plan import BACKWARD, FORWARD, WEIGHT, Task
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
        program: StageProgram | Sequence[StageProgram],
        channel: Channel | Sequence[Channel],
        tasks: Sequence[Task],
        *,
        dloss: Any,
        timeline: Timeline | None = None,
        record: bool = True,
    ):
        # one program and one channel per chunk of the stage, in chunk order
        self.programs = [program] if isinstance(program, StageProgram) else list(program)
        self.channels = list(channel) if isinstance(channel, Sequence) else [channel]
        if len(self.channels) != len(self.programs):
            raise ValueError(f"{len(self.programs)} programs but {len(self.channels)} channels")
        self.program, self.channel, self.tasks = self.programs[0], self.channels[0], list(tasks)
        self.stage_idx = self.program.stage_idx
        self.chunked = len(self.programs) > 1
        bad = sorted({t.chunk for t in self.tasks} - set(range(len(self.programs))))
        if bad:
            raise ValueError(f"stage {self.stage_idx}: tasks of chunks {bad}, the stage has {len(self.programs)}")
        self.dloss = dloss  # d(mean over microbatches)/d(one microbatch's loss), on the last position's stage
        self.delay_s = 0.0  # an injected straggler (h2jax.runtime._faults): each fwd / bwd takes this much longer
        self.timeline = timeline if record else None
        self.watcher = Watcher(timeline, self.stage_idx, self.program.spec.chip) if self.timeline is not None else None
        self.step = 0
        self.split = any(t.kind == WEIGHT for t in self.tasks)
        self._evaluating = False  # run_step(forward_only=True) is walking the forwards
        # CPU devices run independent programs side by side, sharing the cores (module docstring)
        self.in_order = all(d.platform == "cpu" for st in self.programs for d in st.mesh.devices.flat)
        if self.timeline is not None:
            for c, ch in enumerate(self.channels):
                ch.record = self._recorder(c)

    def _recorder(self, chunk: int) -> Any:
        extra = {"chunk": chunk} if self.chunked else {}
        return lambda kind, microbatch, start, end, **kw: self._record_transfer(
            kind, microbatch, start, end, **extra, **kw
        )

    def _record_transfer(self, kind: str, microbatch: int, start: float, end: float, **extra: Any) -> None:
        self.timeline.add(
            kind,
            stage=self.stage_idx,
            step=self.step,
            microbatch=microbatch,
            start=start,
            end=end,
            chip=self.program.spec.chip,
            **extra,
        )

    def run_step(
        self,
        step: int,
        tokens: Sequence[Any] | None,
        targets: Sequence[Any] | None,
        *,
        forward_only: bool = False,
        segments: Sequence[Any] | None = None,
        weights: Sequence[Any] | None = None,
    ) -> list[Any]:
        """Dispatch every task of ``step``; returns the microbatch losses (last stage) as device
        scalars. ``tokens`` on the first stage, ``targets`` on the last, else None;
        ``segments``: each microbatch's document segment ids on this stage's mesh (packed
        data), else None; ``weights``: each microbatch's share of the step's loss on the last
        stage (h2jax.data.loss_weights: padded targets), else None (1 / microbatches each).
        ``forward_only`` (an evaluation): the forwards alone, in the
        schedule's order, nothing kept for a backward, nothing on the timeline; no gradient
        is touched."""
        if forward_only:
            return self._forwards(step, tokens, targets, segments)
        self.step = step
        saved: dict[tuple[int, int], Any] = {}  # (chunk, microbatch) -> what its backward needs
        kept: dict[tuple[int, int], Any] = {}  # B's hand-over to W, split schedules
        handed: dict[tuple[int, int, int], Any] = {}  # (direction, position, microbatch): same-stage boundary
        part = {"part": BACKWARD} if self.split else {}
        losses: list[Any] = []
        last: Any = None  # what this stage dispatched last (a polling receive waits for it)
        task = st = None
        try:
            for task in self.tasks:
                if self.in_order and last is not None:
                    jax.block_until_ready(last)  # one program after another, as on a device's stream
                m, c = task.microbatch, task.chunk
                st, ch = self.programs[c], self.channels[c]
                q = st.position
                tgt = targets[m] if st.last else None
                seg = {} if segments is None else {"segments": segments[m]}
                chunk = {"chunk": c} if self.chunked else {}
                if task.kind == FORWARD:
                    if st.first:
                        x = tokens[m]
                    elif st.local_in:
                        x = handed.pop((FWD, q, m))
                    else:
                        x = ch.recv(FWD, m, after=last)
                    t0 = time.perf_counter()
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    y, residuals = st.forward(m, x, tgt, split=self.split, step=step, **seg)
                    if not self._evaluating:  # an evaluation keeps nothing for a backward
                        saved[(c, m)] = residuals
                    last = y
                    ready = self.watcher.watch("fwd", step, m, t0, y, **chunk) if self.watcher else None
                    if st.last:
                        losses.append(y)
                    elif st.local_out:
                        handed[(FWD, q + 1, m)] = y
                    else:
                        ch.send(FWD, m, y, ready=ready)
                elif task.kind == BACKWARD:
                    if st.last:
                        dy = self.dloss if weights is None else weights[m]
                    elif st.local_out:
                        dy = handed.pop((BWD, q, m))
                    else:
                        dy = ch.recv(BWD, m, after=last)
                    t0 = time.perf_counter()
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    if self.split:
                        dx, kept[(c, m)] = st.input_backward(m, saved.pop((c, m)), tgt, dy, step=step, **seg)
                    else:
                        dx = st.backward(m, saved.pop((c, m)), tgt, dy, step=step, **seg)
                    last = dx
                    ready = self.watcher.watch("bwd", step, m, t0, dx, **part, **chunk) if self.watcher else None
                    if st.local_in:
                        handed[(BWD, q - 1, m)] = dx
                    elif not st.first:
                        ch.send(BWD, m, dx, ready=ready)
                else:  # WEIGHT
                    t0 = time.perf_counter()
                    done = last = st.weight_backward(m, kept.pop((c, m)))
                    if self.watcher:
                        self.watcher.watch("bwd", step, m, t0, done, part=WEIGHT, **chunk)
            for ch in self.channels:
                ch.flush()  # every send of this step has left
        except (PipelineAborted, StageFailure, TransferFailure):
            raise
        except BaseException as e:
            kind = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight gradient"}[task.kind if task else FORWARD]
            of = f" of chunk {task.chunk}" if task is not None and self.chunked else ""
            what = f"{kind}{of} of microbatch {getattr(task, 'microbatch', '?')}"
            raise StageFailure(self.stage_idx, step, what, e) from e
        return losses

    def _forwards(
        self, step: int, tokens: Sequence[Any] | None, targets: Sequence[Any] | None, segments: Sequence[Any] | None
    ) -> list[Any]:
        records = [ch.record for ch in self.channels]
        for ch in self.channels:
            ch.record = None  # an evaluation's transfers are not the training step's
        watcher, self.watcher = self.watcher, None
        tasks, self.tasks = self.tasks, [t for t in self.tasks if t.kind == FORWARD]
        self._evaluating = True
        try:
            return self.run_step(step, tokens, targets, segments=segments)  # the training step's forward programs
        finally:
            self.tasks, self.watcher, self._evaluating = tasks, watcher, False
            for ch, r in zip(self.channels, records):
                ch.record = r

    def drain(self) -> None:
        if self.watcher is not None:
            self.watcher.drain()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        for ch in self.channels:
            ch.close()


def run_stages(
    runners: Sequence[StageRunner],
    step: int,
    tokens: Any,
    targets: Any,
    *,
    hub: Any = None,
    forward_only: bool = False,
    segments: dict[int, Sequence[Any]] | None = None,
    weights: Sequence[Any] | None = None,
) -> list[Any]:
    """One step of several local stages: one runner per stage on its own thread (a blocking
    receive must never hold up another stage's dispatch). A failure anywhere aborts the
    step everywhere and is re-raised naming the stage. Returns the last stage's losses.
    ``forward_only``: an evaluation (:meth:`StageRunner.run_step`); ``segments``: stage ->
    each microbatch's segment ids on that stage's mesh (packed data); ``weights``: the loss
    shares of the microbatches on the last stage (padded data)."""
    segs = segments or {}
    if len(runners) == 1:
        r = runners[0]
        return r.run_step(
            step, tokens, targets, forward_only=forward_only, segments=segs.get(r.stage_idx), weights=weights
        )
    if hub is not None:
        hub.reset()
    # every runner is in the step before any thread starts: the hub records a transfer into a
    # stage with that stage's step, and the receiver's thread may start after the first send
    for r in runners:
        r.step = step
    results: dict[int, list[Any]] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(r: StageRunner) -> None:
        first, last = any(st.first for st in r.programs), any(st.last for st in r.programs)
        try:
            results[r.stage_idx] = r.run_step(
                step,
                tokens if first else None,
                targets if last else None,
                forward_only=forward_only,
                segments=segs.get(r.stage_idx),
                weights=weights if last else None,
            )
        except PipelineAborted:
            pass
        except BaseException as e:  # noqa: BLE001 -- re-raised below
            with lock:
                errors.append(e)
            if hub is not None:
                hub.abort()

    threads = [
        threading.Thread(target=work, args=(r,), name=f"h2jax-stage-{r.stage_idx}", daemon=True) for r in runners
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
    last = next(r for r in runners if any(st.last for st in r.programs))
    return results[last.stage_idx]
