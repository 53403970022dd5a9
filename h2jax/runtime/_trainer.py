"""The trainer: config -> this process's stages on their meshes -> pipelined optimizer steps.

One trainer for one process and for mpirun. ``Trainer(cfg)`` validates, finds its
:class:`~h2jax.runtime._world.World` from the launcher (one process: every stage; under
mpirun/srun: the stage of this rank), registers the chip types, cuts the model into
stages, places each on its mesh, builds each stage's channel and runner (all in
h2jax.runtime._wiring), checks memory (h2jax.runtime._memory) and names and times each link
(h2jax.runtime._links); ``run()`` trains and writes the run folder (h2jax.runtime._outputs).
With checkpoints on, ``run()`` saves every ``checkpoint.every_steps`` steps
and at the end, and on a stop signal saves at the next step boundary (every process
agrees on it there) and returns (``preempted``); ``resume()`` continues from a
checkpoint, under this trainer's plan, whichever mode wrote it.

Non-finite steps follow ``train.nonfinite`` on every process alike: the loss and every
stage's gradient norm are known to all of them, so they all abort or all skip.

A parameter several stages hold (a head tied to the embedding table, on other chip types
or in other processes) trains as one parameter: its gradient is the sum of every holder's,
counted once by the global norm, and its copies stay bit-identical (h2jax.runtime._tied).
"""

from __future__ import annotations

import gc
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.console import Console

from h2jax._console import make_console
from h2jax.checkpoint import CheckpointError, CheckpointStore, failpoint, on_disk
from h2jax.comm import LocalHub, PipelineAborted
from h2jax.config import ConfigError, ExperimentConfig, check_inputs, check_launcher, save_config, validate
from h2jax.models import build_model, check_calls, check_stageable
from h2jax.runtime._faults import ElasticHooks, Stragglers
from h2jax.runtime._feed import DataFeed, place_ends, place_segments, place_weights, step_loss
from h2jax.runtime._layout import by_model_path, flatten, load_state_by_layer, restore_targets, stage_state_by_layer
from h2jax.runtime._links import link_table
from h2jax.runtime._memory import check_memory
from h2jax.runtime._metrics import MetricsLogger
from h2jax.runtime._outputs import RunLock, model_name, prepare_run_dir, step_metrics, write_outputs
from h2jax.runtime._pipelines import exchange, run_pipelines, total_loss
from h2jax.runtime._procgroup import fetch, local_value
from h2jax.runtime._runner import StageFailure, run_stages
from h2jax.runtime._stage import StageMemory, check_params_only
from h2jax.runtime._state import (
    StepStats,
    checkpoint_meta,
    checkpoint_writer,
    clip_scale,
    leftovers_line,
    make_optimizer,
    nonfinite_error,
    poison,
    read_plan,
    truncate_metrics,
)
from h2jax.runtime._wiring import wire
from h2jax.runtime._world import JobError, World, make_world, take_prepared_world


@dataclass
class TrainResult:
    """What :func:`train` gives back: the model with the trained parameters (gathered from
    every stage and process, on every process), the run's summary and per-step stats."""

    model: nnx.Module
    summary: dict[str, Any]
    history: list[StepStats]
    run_dir: Path


class Trainer:
    """Builds this process's stages of an experiment and trains them (module docstring)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        model: nnx.Module | Callable[[], nnx.Module] | None = None,
        run_dir: str | Path | None = None,
        console: Console | None = None,
        world: World | None = None,
        hub: LocalHub | None = None,
        fail_fast: Any = None,
    ):
        cfg = check_inputs(validate(cfg), run_dir=run_dir)  # what the run reads and writes, before devices
        if isinstance(model, nnx.Module):
            _check_model(model, cfg)
        self.cfg = cfg
        self.console = console or make_console(stderr=True)
        self.run_dir = Path(run_dir) if run_dir is not None else Path(cfg.train.out_dir) / cfg.name
        self.run_lock = RunLock(self.run_dir)  # taken by resume() or run(), the first to write there
        self._run_dir_held = False  # on every process alike (the lock itself is the writer's)
        if world is None:  # the world h2jax.setup_backends(cfg) built under a launcher, else a new one
            world = take_prepared_world(cfg) or make_world(cfg, fail_fast=fail_fast)
        self.world = w = world
        self.fail_fast = w.fail_fast if w.fail_fast is not None else fail_fast
        self._stop_signal: str | None = None
        self._restore_signals: Callable[[], None] = _nothing
        self._catch_signals()  # a stop asked during the set-up's compiles is kept for the first boundary
        try:
            self._set_up(model, hub)
        except BaseException:
            self._restore_signals()
            raise

    def _set_up(self, model: nnx.Module | Callable[[], nnx.Module] | None, hub: LocalHub | None) -> None:
        """The chip types, the data, the model's stages and their programs (the first compiles)."""
        cfg, w, plan = self.cfg, self.world, self.cfg.plan
        transport = cfg.train.transport
        group = w.group
        check_launcher(transport, plan.num_stages, launched=group is not None)
        if group is None:  # chip types first: emulated backends must exist before JAX starts any
            from h2jax.runtime._cluster import register_backends

            register_backends(cfg.cluster)
        self.feed = DataFeed(cfg)
        self.dataset = self.feed.dataset
        self.eval_losses: list[tuple[int, float]] = []  # (steps trained, eval loss) of every evaluation
        if self.dataset.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                "model.vocab_size",
                f"vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {self.dataset.vocab_size}",
            )
        self.builtin_model = model is None  # its FLOPs are cfg.model's: the metrics carry MFU
        # what the run folder says trains: a gin selection names itself, else the class
        self.model_note = None if model is None else getattr(model, "description", None) or model_name(model)
        if model is None:
            model = build_model(cfg.model, seed=cfg.seed)
        elif not isinstance(model, nnx.Module):  # a builder (e.g. a gin-selected class): the chip types exist now
            model = model()
            _check_model(model, cfg)
        if not cfg.data.packing and not getattr(getattr(model, "head", None), "masked_targets", False):
            raise ConfigError(
                "data.packing",
                f"false pads rows with targets of -1 (no loss there), and {model_name(model)}.head does not "
                "say it leaves them out; expected a head whose loss is the mean over targets >= 0 and that sets "
                "masked_targets = True (as h2jax's LLaMA head), or packing=true",
            )
        self.model = model
        self.tx, self.lr_schedule = make_optimizer(cfg)
        self.local = w.local_stages
        self.elastic = ElasticHooks(cfg, w.rank, list(w.local_stages))  # under --elastic: faults, records
        self.stragglers = Stragglers(cfg, self.elastic.dir)
        wiring = wire(cfg, model, w, tx=self.tx, hub=hub)
        self.pipes = wiring.pipes  # one, or the pipelines of plan.pipelines (h2jax.runtime._pipelines)
        self.schedule = self.pipes[0].schedule
        self.stages, self.runners, self.tied = wiring.stages, wiring.runners, wiring.tied
        self.labels, self.backends, self._lp, self.timeline = wiring.labels, wiring.backends, wiring.lp, wiring.timeline
        self.loss_stage, self.hub, self._own_hub = wiring.loss_stage, wiring.hub, wiring.own_hub
        self.tokens_per_step = plan.global_batch * cfg.model.seq_len
        self.step = 0
        self._first_step = 0  # run() sets it to the step it starts from; train_step() may run without it
        self.skipped_steps = 0
        self.preempted: str | None = None  # the stop signal that ended run(), if one did
        self._store: CheckpointStore | None = None
        self._saved_step: int | None = None  # the step of the state saved (or restored) last
        self._all_committed = -1
        self.memory: list[StageMemory] = []
        if cfg.train.memory_check:
            self.memory = w.all(self.check_memory, "config error")
        # each link's path and speed (h2jax.runtime._links); comm.require_device_direct refuses here
        self.links = w.all(lambda: link_table(cfg, w, self.stages, self.backends, engine=wiring.engine), "config error")

    # -- data (h2jax.runtime._feed) -------------------------------------------------------------
    def data_position(self, step: int) -> int:
        """Sequences consumed before ``step`` (h2jax.runtime._feed)."""
        return self.feed.position(step)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        return self.feed.batch(step)

    def segments(self, step: int) -> np.ndarray | None:
        """The document segment ids of ``step``'s inputs (packed data), else None."""
        return self.feed.segments(step)

    def device_batch(self, step: int) -> tuple[list[jax.Array] | None, list[jax.Array] | None, list | None]:
        """``step``'s tokens on the first stage, targets and (padded data) the microbatches' loss
        shares on the last; None where this process holds neither end."""
        if not any(st.first or st.last for st in self.stages):
            return None, None, None
        t0 = time.perf_counter()
        tokens, targets = self.batch(step)
        self.feed.wait_s = time.perf_counter() - t0  # what the step waited for (data.sources: read ahead)
        return *place_ends(self.stages, tokens, targets), place_weights(self.stages, targets)

    # -- memory --------------------------------------------------------------------------------
    def check_memory(self) -> list[StageMemory]:
        """Per-device memory of this process's stages (one per runner, in stage order) against
        their chips' declared memory (h2jax.runtime._memory)."""
        return [m for pipe in self.pipes for m in check_memory(self.cfg, pipe)]

    # -- one step ------------------------------------------------------------------------------
    def forward_backward(self, step: int) -> jax.Array | None:
        """Every forward and backward of ``step`` on this process's stages; gradients
        accumulate in the stages (a tied parameter's in its owner: h2jax.runtime._tied).
        Returns the step's loss (the mean over microbatches; padded data: over real targets)
        as a device scalar where the last stage runs, else None."""
        if len(self.pipes) > 1:
            tokens, targets = self.batch(step)
            losses = run_pipelines(self.pipes, step, tokens, targets, self.segments(step), own_hubs=self._own_hub)
            exchange(self.tied.sum_grads, "gradients summed", self.timeline, self.runners, step)
            return jnp.float32(total_loss(self.world, self.pipes, losses))  # on every process
        tokens, targets, weights = self.device_batch(step)
        segments = place_segments(self.runners, self.segments(step))  # every stage reads them: packed data
        try:
            hub = self.hub if self._own_hub else None
            losses = run_stages(self.runners, step, tokens, targets, hub=hub, segments=segments, weights=weights)
        except PipelineAborted:
            err = self.hub.error if self.hub is not None else None
            if err is None:
                raise
            raise StageFailure(err.stage, step, err.what, err.cause) from err
        self.tied.sum_grads()
        return step_loss(losses, weights) if losses else None

    def _grad_sqnorms(self) -> list[float]:
        """Every stage's squared gradient norm (the sum over its chunks, in chunk order), in stage order."""
        sq = [(st.stage_idx, st.grad_sqnorm()) for st in self.stages]  # dispatched on every program first
        per_stage: dict[int, float] = {}
        for s, x in sq:
            per_stage[s] = per_stage.get(s, 0.0) + float(local_value(x))
        return self.world.stage_values(per_stage)

    def finish_step(self) -> float:
        """Clip by the global gradient norm over all stages and update every stage; returns the
        norm. A non-finite norm updates nothing (the caller decides what that means)."""
        grad_norm = math.sqrt(sum(self._grad_sqnorms()))
        if math.isfinite(grad_norm):
            self._apply(grad_norm)
        return grad_norm

    def _apply(self, grad_norm: float) -> None:
        scale = clip_scale(grad_norm, self.cfg.optimizer.clip_norm)
        for runner in self.runners:
            for st in runner.programs:  # every chunk's parameters
                t0 = time.perf_counter()
                st.apply_update(scale)
                if runner.watcher is not None:  # the timeline's `update` event: when the optimizer step ran
                    chunk = {"chunk": st.chunk} if runner.chunked else {}
                    runner.watcher.watch("update", self.step, None, t0, st.params, **chunk)
        # every copy of a tied parameter (of every layer, with several pipelines) takes its owner's new value
        exchange(
            self.tied.sync, "parameters copied", self.timeline if len(self.pipes) > 1 else None, self.runners, self.step
        )

    def train_step(self) -> StepStats:
        cfg, step = self.cfg, self.step
        t0 = time.perf_counter()
        loss_dev = self.forward_backward(step)
        if step in cfg.train.inject_nonfinite_steps:
            for st in self.stages:
                st.acc = poison(st.acc)
            if loss_dev is not None:
                loss_dev = loss_dev * jnp.float32(jnp.nan)
        local_loss = float(local_value(loss_dev)) if loss_dev is not None else None
        sq = self._grad_sqnorms()
        grad_norm = math.sqrt(sum(sq))
        loss = float(self.world.from_stage(self.loss_stage, local_loss))
        skipped = False
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self._apply(grad_norm)
        elif cfg.train.nonfinite == "skip":
            for st in self.stages:
                st.zero_grads()
            self.skipped_steps += 1
            skipped = True
        else:
            raise nonfinite_error(step, loss, grad_norm, sq, loss_stage=self.loss_stage)
        dt = time.perf_counter() - t0
        if self.fail_fast is not None:
            self.fail_fast.last_completed_step = step
            # from the second step on (the first compiles), a job that stops making progress ends
            self._slowest = max(getattr(self, "_slowest", 0.0), dt) if step > self._first_step else 0.0
            if step > self._first_step:
                self.fail_fast.watch(cfg.train.transfer_timeout_s + 5 * self._slowest)
            self.fail_fast.heartbeat()
        self.step += 1
        return StepStats(
            step=step,
            loss=loss,
            grad_norm=grad_norm,
            lr=float(self.lr_schedule(step)),
            step_time_s=dt,
            tokens_per_s=self.tokens_per_step / dt,
            skipped=skipped,
        )

    def drain_timeline(self) -> None:
        """Wait until every program dispatched so far has its timeline event."""
        for r in self.runners:
            r.drain()

    def gather_events(self, step: int | None = None) -> list[Any] | None:
        """The timeline events of every stage, of ``step`` (None: every step recorded), on the
        writer; None on other processes and when no timeline is kept. Collective: every process
        calls it at the same point."""
        if self.timeline is None:
            return None
        self.drain_timeline()
        got = self.world.gather(self.timeline.events(step) if step is not None else self.timeline.events())
        return None if got is None else [e for evs in got for e in evs]

    def step_metrics(self, stats: StepStats) -> dict[str, Any]:
        """The metrics of one step (collective: every process calls it at the same steps;
        the writer's dict is the one that counts)."""
        events = self.gather_events(stats.step)
        m = step_metrics(self.cfg, stats, skipped_steps=self.skipped_steps, events=events, with_mfu=self.builtin_model)
        # the time this process spent reading the step's batch (0 where it holds neither end stage)
        m["data_wait_fraction"] = self.feed.wait_s / stats.step_time_s if stats.step_time_s > 0 else 0.0
        m.update(self.feed.metrics(stats.step))  # where the step's sequences start, and their epoch
        m.update(self.elastic.metrics())  # under --elastic: the goodput so far
        if events is not None:  # the writer: every stage's busy time, against its own baseline
            line = self.stragglers.observe(stats.step, events)
            if line:
                self.console.print(f"[bold yellow]h2jax: {line}[/]", highlight=False)
            m.update(self.stragglers.metrics())
        return m

    # -- the loop ------------------------------------------------------------------------------
    def _local_stop(self) -> str | None:
        if self.fail_fast is not None:
            return self.fail_fast.stop_signal
        return self._stop_signal

    def run(self, steps: int | None = None) -> list[StepStats]:
        """Train up to ``steps`` (default ``train.steps``) from ``self.step``; checkpoint as
        configured. Returns early, after saving, on a stop signal (see ``preempted``)."""
        cfg, w = self.cfg, self.world
        steps = cfg.train.steps if steps is None else steps
        self._hold_run_dir()
        prepare_run_dir(
            cfg,
            w,
            self.run_dir,
            backends=self.backends,
            step=self.step,
            console=self.console,
            model=self.model_note,
            links=self.links,
        )
        w.barrier()
        store = self.checkpoint_store() if cfg.checkpoint.enabled else None
        every = cfg.checkpoint.every_steps
        if store is not None and self.fail_fast is not None:
            from h2jax.launch import stop_grace_s

            self.fail_fast.allow_graceful_stop(stop_grace_s())
            self.fail_fast.saved = lambda: on_disk(self.checkpoint_dir, steps_done=self.step)
        history: list[StepStats] = []
        self._first_step = self.step
        t_start = time.perf_counter()
        log = None
        if w.is_writer and self.step < steps:
            log = MetricsLogger(
                self.run_dir,
                total_steps=steps,
                tensorboard=cfg.train.tensorboard,
                progress=cfg.train.progress,
                console=self.console,
            )
        self._catch_signals()
        frozen = False
        elastic = self.elastic
        elastic.mark_resume(self.timeline, self.step, self.runners)
        try:
            while self.step < steps:
                elastic.before_step(self.step, self.runners)
                stats = self.train_step()
                elastic.after_step(stats.step, stats.step_time_s)
                history.append(stats)
                if not frozen:
                    # the first step compiled; the model, its state and programs exist. Keep every
                    # object alive now out of the collector's full passes, which otherwise walk them
                    # all inside a step every so often (90-140 ms pauses in 0.5 s steps, docs/LOG.md)
                    gc.collect()
                    gc.freeze()
                    frozen = True
                n_eval = cfg.train.eval_every
                evaluated = n_eval > 0 and (self.step % n_eval == 0 or self.step == steps)
                if evaluated:
                    self.eval_losses.append((self.step, self.evaluate()))
                if stats.step % cfg.train.log_every == 0 or self.step == steps or stats.skipped or evaluated:
                    metrics = self.step_metrics(stats)
                    if evaluated:  # after the step's update: the model the next step starts from
                        metrics["eval_loss"] = self.eval_losses[-1][1]
                    if log is not None:
                        log.log(stats.step, metrics)
                if w.is_writer:
                    self.run_lock.check_present()  # a run folder deleted under the job ends it
                if store is not None:
                    store.poll()  # commit a finished background save
                    if every > 0 and self.step % every == 0 and self.step < steps:
                        self.save_checkpoint()
                if self._boundary(store):
                    break
            if self.fail_fast is not None:
                self.fail_fast.unwatch()
            if store is not None:
                if self.fail_fast is not None:
                    self.fail_fast.stopping()  # no more step boundaries: a stop signal now waits for the save
                if (self.step == steps or self.preempted) and self._saved_step != self.step:
                    if store.latest_committed() != self.step or w.multiprocess:
                        self.save_checkpoint()
                self.close_checkpoints()  # commits the last save
                w.barrier()  # every part has committed it
                store.apply_retention()  # judged once more, now that every part's last step counts
        except BaseException:
            self.close_checkpoints()  # the last committed checkpoint stays the restart point
            raise
        finally:
            if frozen:
                gc.unfreeze()
            self._restore_signals()
            if log is not None:
                log.close()
        self.summary = self._write_outputs(history, time.perf_counter() - t_start)
        return history

    def _boundary(self, store: CheckpointStore | None) -> bool:
        """The step boundary: every process learns whether any got a stop signal (then all stop
        here) and the newest step every process has committed."""
        mine = store.last_committed_here if store is not None else None
        stop, all_committed = self.world.step_boundary(self._local_stop(), mine)
        if all_committed != self._all_committed:
            self._all_committed = all_committed
            failpoint("committed_all", all_committed)
        if stop:
            self.preempted = stop
            return True
        return False

    def _catch_signals(self) -> None:
        """One process: SIGTERM/SIGINT ask run() to stop at the next step boundary (saving
        first when checkpoints are on); a second SIGINT interrupts at once. From the set-up on
        (the first compiles run there, and Python's own KeyboardInterrupt, raised inside JAX's
        gc callback, was swallowed: the job trained to the end) until run() ends or close().
        Under a launcher, h2jax.launch.FailFast catches them instead."""
        if self._restore_signals is not _nothing:
            return
        if self.fail_fast is not None or threading.current_thread() is not threading.main_thread():
            return
        old = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._stop_signal = name
            what = "saving and stopping" if self.cfg.checkpoint.enabled else "stopping (checkpoints are off)"
            self.console.print(f"[yellow]h2jax: {name} received: {what} after the step in progress[/]")

        for sig in old:
            signal.signal(sig, handler)

        def restore() -> None:
            for sig, h in old.items():
                signal.signal(sig, h)
            self._restore_signals = _nothing

        self._restore_signals = restore

    def _write_outputs(self, history: list[StepStats], wall_s: float) -> dict[str, Any]:
        events = self.gather_events()
        return write_outputs(
            self.cfg,
            self.world,
            self.run_dir,
            history,
            wall_s,
            events=events,
            memory={r.stage_idx: m for r, m in zip(self.runners, self.memory or [])},
            backends=self.backends,
            labels=self.labels,
            t0=self.timeline.t0 if self.timeline is not None else None,
            tokens_per_step=self.tokens_per_step,
            extra=self._summary_extra(),
        )

    def _summary_extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {"links": self.links}
        if self.cfg.data.sources:
            out["data"] = self.feed.summary(self.step)
        if self.eval_losses:
            out["eval_losses"] = [[s, v] for s, v in self.eval_losses]
            out["eval_loss"] = self.eval_losses[-1][1]
        return out

    # -- evaluation ----------------------------------------------------------------------------
    def val_data(self) -> Any:
        """The validation stream (h2jax.data.load_validation), opened on first use."""
        return self.feed.validation()

    def evaluate(self) -> float:
        """The mean loss over the validation sequences (train.eval_batches global batches of
        data.val_sources, the same at every call): the forwards alone, through this job's
        stages, schedule order and programs; no gradient, parameter or optimizer state changes.
        Collective: every process calls it at the same step."""
        total = count = 0.0
        for i in range(self.cfg.train.eval_batches):
            tok, tgt, seg = self.feed.validation_batch(i)  # every stage reads the segments
            real = float((tgt >= 0).sum())  # every batch weighs its real targets (all of them unless padded)
            if len(self.pipes) > 1:
                got = run_pipelines(self.pipes, self.step, tok, tgt, seg, own_hubs=self._own_hub, forward_only=True)
                loss = total_loss(self.world, self.pipes, got)
            else:
                tokens, targets = place_ends(self.stages, tok, tgt)
                segments, weights = place_segments(self.runners, seg), place_weights(self.stages, tgt)
                hub = self.hub if self._own_hub else None
                got = run_stages(
                    self.runners, self.step, tokens, targets, hub=hub, forward_only=True, segments=segments
                )
                local = float(local_value(step_loss(got, weights))) if got else None
                loss = float(self.world.from_stage(self.loss_stage, local))
            total, count = total + real * loss, count + real
            if self.fail_fast is not None:
                self.fail_fast.heartbeat()  # each batch is progress: many of them may outlast the watchdog
        return total / max(count, 1.0)

    # -- checkpoints ---------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        d = self.cfg.checkpoint.dir
        return Path(d) if d is not None else self.run_dir / "checkpoints"

    def checkpoint_store(self) -> CheckpointStore:
        """This process's writer: one part holding every stage in one process; under mpirun its
        stage's part of every step (module docstring of h2jax.checkpoint._store)."""
        if self._store is None:
            self._store = checkpoint_writer(self.cfg, self.world, self.checkpoint_dir)
        return self._store

    def close_checkpoints(self) -> None:
        """Commit the save in flight (if any) and release the store."""
        if self._store is not None:
            store, self._store = self._store, None
            store.close()

    def state_by_layer(self) -> dict[str, jax.Array]:
        """Parameters and optimizer state of this process's stages by model path (the
        optimizer leaves every stage holds alike, from stage 0 only)."""
        return stage_state_by_layer(self.stages, self._lp, stage_wide=0 in self.local, ties=self.tied)

    def save_checkpoint(self) -> None:
        """Start saving this process's part of checkpoint ``self.step`` (async if configured;
        every process calls it at the same step)."""
        store = self.checkpoint_store()
        if self._saved_step is None and self.world.is_writer:
            try:
                store.dir.mkdir(parents=True, exist_ok=True)
                save_config(self.cfg, store.dir / "config.yaml")
            except OSError:
                pass  # the save below reports an unwritable directory with the step
        store.clear(self.step)  # an older future of this run (--restore-step)
        self.world.barrier()  # no process's new share of this step may commit beside another's old one
        store.save(
            self.step,
            self.state_by_layer(),
            checkpoint_meta(self.cfg, self.step, self.skipped_steps, self.data_position(self.step)),
        )
        self._saved_step = self.step
        if self.fail_fast is not None:
            self.fail_fast.heartbeat()  # a synchronous save may take long; it is progress

    def restore(self, directory: str | Path, step: int | None = None, *, params_only: bool = False) -> int:
        """Load checkpoint ``step`` (default: the latest committed) of ``directory`` onto this
        process's stages. Full state: the run continues at that step; ``params_only``: the
        weights alone, for a new run from step 0. Returns the step read."""
        plan = self._lead_plan_read(directory, step, params_only=params_only)
        self._read(plan)
        return plan["step"]

    def _model_keys(self) -> list[str]:
        mine = sorted(restore_targets(self.stages, self._lp, params_only=False, ties=self.tied))
        return sorted(set().union(*self.world.allgather(mine)))

    def _lead_plan_read(self, directory: str | Path, step: int | None, *, params_only: bool) -> dict[str, Any]:
        model_keys = self._model_keys()

        return self.world.lead(
            lambda: read_plan(directory, step, self.cfg, model_keys, params_only=params_only), "checkpoint error"
        )

    def _read(self, plan: dict[str, Any]) -> None:
        lp = self._lp

        def read() -> None:
            store = CheckpointStore(plan["dir"])
            try:
                targets = restore_targets(self.stages, lp, params_only=plan["params_only"], ties=self.tied)
                state = store.restore(plan["step"], targets)
                load_state_by_layer(self.stages, lp, state, params_only=plan["params_only"], ties=self.tied)
            finally:
                store.close()

        self.world.all(read, "checkpoint error")
        if not plan["params_only"]:
            self.step, self.skipped_steps = plan["next_step"], plan["skipped_steps"]
            self.feed.base = (self.step, plan["sequences_consumed"])
            self._saved_step = self.step
            if plan.get("warning") and self.world.is_writer:
                self.console.print(f"[yellow]h2jax: {plan['warning']}[/]")

    def resume(self, *, restore_step: int | None = None, init_from: str | Path | None = None) -> str | None:
        """What ``h2jax train`` does before training: continue from this run's checkpoints (the
        latest committed step, or ``restore_step``), or start from the weights of another
        run's checkpoint (``init_from``), which either mode may have written. The writer
        decides; every process reads its own layers. Returns a line saying what happened
        (the same on every process), or None."""
        cfg, w = self.cfg, self.world
        self._hold_run_dir()
        if init_from is not None:
            plan = self._lead_plan_read(init_from, restore_step, params_only=True)
            if cfg.checkpoint.enabled:
                w.lead(self._refuse_init_over_checkpoints, "checkpoint error")
            self._read(plan)
            return (
                f"initialised the weights from {Path(init_from).absolute()} step {plan['step']}; training from step 0"
            )
        if not cfg.checkpoint.enabled:
            if restore_step is not None:
                raise JobError("checkpoint error", "--restore-step needs checkpoint.enabled=true")
            return None
        mine = w.all(lambda: self.checkpoint_store().cleanup(), "checkpoint error")
        removed = [r for part in w.allgather(mine) for r in part]
        store = self.checkpoint_store()
        aside = [a for part in w.allgather(store.kept_aside) for a in part]
        pruned = [a for part in w.allgather(store.pruned_aside) for a in part]
        if w.is_writer:
            for a in aside:
                self.console.print(f"[bold yellow]h2jax: kept aside {a}[/]", highlight=False, soft_wrap=True)
            for a in pruned:
                self.console.print(f"[bold yellow]h2jax: removed {a}[/]", highlight=False, soft_wrap=True)
        committed = w.lead(lambda: self.checkpoint_store().committed_steps(), "checkpoint error")
        store_dir = self.checkpoint_store().dir
        if not committed:
            if restore_step is not None:
                raise JobError(
                    "checkpoint error", f"--restore-step {restore_step}: {store_dir} holds no committed checkpoint"
                )
            return leftovers_line(removed) if removed else None
        latest = committed[-1]
        # the newest intact committed step: a damaged one is named and the one before it tried
        candidates = [restore_step] if restore_step is not None else committed[::-1]
        damaged: list[str] = []
        for step in candidates:
            try:
                plan = self._lead_plan_read(store_dir, step, params_only=False)
                self._read(plan)
                break
            except JobError as e:
                if not e.corrupt or restore_step is not None:
                    raise
                damaged.append(str(e))
                if w.is_writer:
                    self.console.print(
                        f"[bold yellow]h2jax: {e}; trying the committed step before it[/]",
                        highlight=False,
                        soft_wrap=True,
                    )
        else:
            raise JobError("checkpoint error", f"every committed step of {store_dir} is damaged: {'; '.join(damaged)}")
        step = plan["step"]
        msg = f"resumed from {store_dir} step {step}"
        if damaged:
            msg += " (the newest intact step; the damaged newer step(s) are replaced as this run reaches them)"
        if removed:
            msg += f" ({leftovers_line(removed)})"
        if aside:
            msg += f" ({len(aside)} uncommitted step(s) kept aside in {store_dir / 'aside'})"
        if step != latest and not damaged:
            msg += f"; committed steps after {step} (up to {latest}) are replaced as this run reaches them"
        if w.is_writer:
            moved, aside_file = truncate_metrics(self.run_dir, self.step)
            if moved:
                msg += f"; {moved} metric rows of steps >= {self.step} moved to {aside_file.name}"
        return msg

    def _refuse_init_over_checkpoints(self) -> None:
        if self.checkpoint_store().latest_committed() is not None:
            raise CheckpointError(
                f"{self.checkpoint_dir} already holds checkpoints of a run; --init-from starts a new one "
                "(use another name or checkpoint.dir)"
            )

    # -- what a user (and a test) reads back ------------------------------------------------------
    def params_by_layer(self) -> dict[str, Any]:
        """This process's parameters by model path (device arrays); a tied one from its owner's."""
        return by_model_path(self.stages, self._lp, [st.params for st in self.stages], self.tied)

    def grads_by_layer(self) -> dict[str, Any]:
        """The accumulated gradients, named so (a tied parameter's: every holder's, summed)."""
        return by_model_path(self.stages, self._lp, [st.grads() for st in self.stages], self.tied)

    def gathered_params(self) -> dict[str, np.ndarray]:
        """Every parameter of the model by model path, as numpy, on every process (collective)."""
        mine = fetch(self.params_by_layer())  # collective over a stage's processes
        group = self.world.group
        share = mine if group is None or group.is_leader else {}
        out: dict[str, np.ndarray] = {}
        for part in self.world.allgather(share):
            out.update(part)
        return out

    def trained_model(self) -> nnx.Module:
        """The model given (or built) with this run's current parameters in place (collective)."""
        params = self.gathered_params()
        state = nnx.state(self.model, nnx.Param)
        flat = flatten(state)
        missing = sorted(set(flat) - set(params))
        if missing:
            raise KeyError(f"parameters outside embed/blocks/head are not trained by h2jax: {missing[:3]}")
        leaves = [jnp.asarray(params[k]) for k in flat]
        nnx.update(self.model, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state), leaves))
        return self.model

    def _hold_run_dir(self) -> None:
        """The writer takes the run folder's lock (collective; one line and exit 2 on every
        process when another job holds it). Whether it is taken already is asked of a flag every
        process keeps alike, never of the lock, which only the writer holds: one process
        skipping the collective that another enters would hang the job."""
        if not self._run_dir_held:
            self.world.lead(self.run_lock.acquire, "run folder")
            self._run_dir_held = True

    def close(self) -> None:
        """Stop the runners' helper threads (and the local hub this trainer owns); release the
        run folder."""
        for r in self.runners:
            r.close()
        for pipe in self.pipes:
            if pipe.hub is not None and self._own_hub:
                pipe.hub.close()
        self.run_lock.release()
        self._run_dir_held = False
        self._restore_signals()


def _nothing() -> None:
    pass


def _check_model(model: nnx.Module, cfg: ExperimentConfig) -> None:
    check_stageable(model)
    check_params_only(nnx.split(model, nnx.Param, ...)[2], type(model).__name__)  # one line, naming the state
    if len(model.blocks) != cfg.model.n_layers:  # the plan was checked against model.n_layers
        raise ConfigError(
            "model.n_layers", f"n_layers={cfg.model.n_layers} but the model has {len(model.blocks)} blocks"
        )
    check_calls(model, cfg.model.seq_len)  # a dropout that cannot draw, a head that is not one loss


def train(
    cfg: ExperimentConfig,
    *,
    model: nnx.Module | Callable[[], nnx.Module] | None = None,
    run_dir: str | Path | None = None,
    restore_step: int | None = None,
    init_from: str | Path | None = None,
    console: Console | None = None,
) -> TrainResult:
    """Train ``model`` (default: the GPT of ``cfg.model``; a zero-argument builder of one is
    called once the chip types are registered) as ``cfg`` says, continuing from the
    run's latest checkpoint if there is one. Under mpirun/srun every process calls it (the
    launcher is detected; each process runs its stage). Returns the model with the trained
    parameters in place -- the same module object, on every process -- with the summary
    and the per-step stats of this call."""
    trainer = Trainer(cfg, model=model, run_dir=run_dir, console=console)
    try:
        trainer.resume(restore_step=restore_step, init_from=init_from)
        history = trainer.run()
        trained = trainer.trained_model()
    finally:
        trainer.close()
    group = trainer.world.group
    if group is not None:
        trainer.world.barrier()
        group.close()
    return TrainResult(model=trained, summary=trainer.summary, history=history, run_dir=trainer.run_dir)
