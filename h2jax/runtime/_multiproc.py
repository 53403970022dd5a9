"""Multi-controller training: ``mpirun -np N h2jax train CONFIG``, one process per stage
(N = stages) or one process per device (N = the plan's devices; see h2jax.runtime._procgroup).

Every process belongs to exactly one stage and one chip type (its local backend; an
emulated chip is registered in the process as one node holding that stage's devices, or,
in a stage over several processes, is the default cpu backend of that stage's
``jax.distributed`` cluster). MPI ``COMM_WORLD`` (mpi4py) is the glue: boundary tensors go
through a multi-process transport (``host``: numpy + mpi4py; ``ffi``: the XLA FFI
send/recv), the gradient norm and the loss are reduced over MPI, rank 0 prints progress
and writes the metrics and the merged timeline.

Checkpoints work as in one process, in the same plan-independent layout: every stage saves
its parameters and optimizer state, keyed by model layer, as its own part (``stage<s>``) of
the step (stage 0 alone also saves the stage-wide optimizer leaves), and a step counts only
when every part has committed it. With one process per stage the part is that rank's;
with a stage over several processes it is one orbax multi-host save over the stage's
``jax.distributed`` cluster (each process writes the shards it holds; the stage's first
process finalises it and writes the commit marker: ``CheckpointStore(shared=True)``). A
checkpoint written by a run of one mode restores in a run of the other, under any plan:
every rank reads its own layers onto its own shardings, from whichever parts hold them.
Rank 0 decides what to resume from (it reads the directory, then tells the others), so the
ranks never disagree.

Stopping: with checkpoints on, a stop signal (SIGTERM, SIGINT, or SIGUSR1 -- what ``mpirun``
forwards without killing the ranks; see :class:`h2jax.launch.FailFast`) on any rank is
seen by every rank at the next step boundary, through one ``MPI_Allreduce`` of a stop flag
per step; every rank then saves that step and exits 0. Non-finite steps follow
``train.nonfinite`` on every rank alike: the loss and every stage's gradient norm are
known to all ranks, so they all abort (exit 1 after the last save is committed) or all
skip the update.

Fail fast: an exception on any rank prints one line naming the stage, rank and last
completed step, then aborts the whole job (``MPI_Abort``); a failed checkpoint save is
such an exception (the step never commits; earlier steps stay intact). A rank killed
outright makes the launcher SIGTERM the others, which print the same kind of line and
exit non-zero -- with checkpoints on, after at most the stop grace period if the launcher
does not kill them first; a receive whose peer never sends times out inside the transport.
Failures that every rank meets at the same point (a checkpoint that does not fit, a
non-finite step under ``abort``) end every rank with the same exit status and one message
from rank 0.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.markup import escape

from h2jax.checkpoint import CheckpointError, CheckpointSaveError, CheckpointStore
from h2jax.checkpoint._faults import failpoint
from h2jax.config import ConfigError, ExperimentConfig, save_config, validate
from h2jax.data import get_global_batch, load_dataset
from h2jax.launch import FailFast, LaunchInfo, stop_grace_s
from h2jax.plan import get_schedule, stage_tasks
from h2jax.runtime._layout import model_layout
from h2jax.runtime._metrics import MetricsLogger
from h2jax.runtime._procgroup import fetch, global_array, local_value
from h2jax.runtime._stage import StageProgram
from h2jax.runtime._timeline import Timeline, bubble_fraction, plot_gantt
from h2jax.runtime._trainer import (
    NonFiniteLossError,
    StepStats,
    check_checkpoint,
    checkpoint_meta,
    clip_scale,
    data_position,
    load_state_by_layer,
    make_optimizer,
    nonfinite_error,
    one_stage_plan,
    poison,
    restore_targets,
    stage_state_by_layer,
    truncate_metrics,
)

FWD, BWD = 0, 1


class JobError(Exception):
    """A failure every rank of the job met at the same point (the ranks agreed on it): rank 0
    reports it once and every rank exits with ``code``, without aborting the job."""

    def __init__(self, what: str, message: str, code: int = 1):
        super().__init__(message)
        self.what, self.code = what, code


def part_name(stage: int) -> str:
    """The checkpoint part a multi-process run's stage writes."""
    return f"stage{stage}"


def _tag(microbatch: int, direction: int) -> int:
    # MPI keeps messages of one (source, tag, communicator) in order, so tags can repeat
    # across steps; 32767 is the smallest tag bound MPI guarantees
    return (2 * microbatch + direction) % 32768


class MultiProcessTrainer:
    """The stage of this process, and the step loop that talks to the other stages."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        launch: LaunchInfo,
        *,
        model: Any = None,
        run_dir: str | Path | None = None,
        console: Console | None = None,
        fail_fast: FailFast | None = None,
    ):
        from mpi4py import MPI

        self.cfg = cfg = validate(cfg)
        self.comm = MPI.COMM_WORLD
        self.launch = launch
        plan = cfg.plan
        n = plan.num_stages
        if self.comm.Get_size() != launch.size:
            raise RuntimeError(
                f"{launch.launcher} says {launch.size} processes, MPI COMM_WORLD has {self.comm.Get_size()}"
            )
        from h2jax.runtime._procgroup import StageGroup

        # rank -> stage from the plan (one process per stage, or per device); a stage over several
        # processes becomes its own jax.distributed cluster here, before JAX's backends start
        self.group = StageGroup(plan, cfg.cluster.chips, self.comm)
        self.layout = self.group.layout
        self.rank = launch.rank
        self.stage_idx = s = self.group.stage_idx
        if fail_fast is not None:
            fail_fast.stage = s
        self.first, self.last = s == 0, s == n - 1
        self.console = console or Console(stderr=True)
        self.run_dir = Path(run_dir) if run_dir is not None else Path(cfg.train.out_dir) / cfg.name
        self.step = 0
        self.skipped_steps = 0
        self.preempted: str | None = None  # the stop signal the ranks agreed on, if one stopped run()
        self.fail_fast = fail_fast
        self._store: CheckpointStore | None = None
        self._saved_step: int | None = None  # the step of the state saved (or restored) last
        self._all_committed = -1  # the newest step every rank has committed in this run
        spec = plan.stages[s]
        self.plan1 = one_stage_plan(spec)  # this stage alone, for mapping its trees to model paths
        self.backend = self.group.backend
        mesh = self.group.mesh  # spans the stage's processes' devices
        from h2jax.models import StageModule, build_model, check_stageable

        self.dataset = load_dataset(
            corpus=cfg.data.corpus,
            token_file=cfg.data.token_file,
            tokenizer=cfg.data.tokenizer,
            token_dtype=cfg.data.token_dtype,
        )
        model = model if model is not None else build_model(cfg.model, seed=cfg.seed)
        check_stageable(model)
        module = StageModule(model, layers=spec.layers, first=self.first, last=self.last)
        self.tx, self.lr_schedule = make_optimizer(cfg)
        label = f"stage {s} · {spec.chip} ({spec.data}x{spec.tensor}) layers {spec.layers[0]}-{spec.layers[1] - 1}"
        self.stage = StageProgram(s, spec, mesh, module, self.tx, first=self.first, last=self.last, label=label)
        self.labels = [
            f"stage {i} · {st.chip} ({st.data}x{st.tensor}) layers {st.layers[0]}-{st.layers[1] - 1}"
            for i, st in enumerate(plan.stages)
        ]
        from h2jax.comm import make_peer_transport

        self.fused = None
        if cfg.train.transport == "ffi":
            from h2jax.runtime._fused import FusedStage, FusedUnsupported

            try:  # transfers inside the stage programs (collective: every rank reaches this)
                self.fused = FusedStage(
                    self.stage,
                    plan=plan,
                    seq_len=cfg.model.seq_len,
                    d_model=cfg.model.d_model,
                    dtype=jnp.dtype(cfg.model.dtype),
                    rank_of_device=[self.layout.device_ranks(i) for i in range(n)],
                    comm=self.comm.Dup(),
                    timeout_s=60.0,
                )
            except FusedUnsupported as e:
                if self.layout.any_group:
                    raise ConfigError(
                        "train.transport",
                        f"'ffi' across stages over several processes needs even per-device pieces: {e}",
                    ) from e
                self.console.print(f"h2jax: stage {s}: transfers run as programs of their own ({e})")
        self.boundary = None  # per-device host transfers, when some stage spans several processes
        if self.fused is None and self.layout.any_group:
            from h2jax.runtime._procgroup import HostBoundary

            self.boundary = HostBoundary(
                self.group,
                self.stage,
                shape=(plan.microbatch_size, cfg.model.seq_len, cfg.model.d_model),
                dtype=jnp.dtype(cfg.model.dtype),
                comm=self.comm,
            )
        self.transport = (
            None
            if self.fused is not None or self.boundary is not None
            else make_peer_transport(cfg.train.transport, self.comm)
        )
        self.tasks = stage_tasks(get_schedule(plan.schedule, n, plan.num_microbatches).tasks(), s)
        mb = plan.microbatch_size
        self.act_like = jax.ShapeDtypeStruct((mb, cfg.model.seq_len, cfg.model.d_model), jnp.dtype(cfg.model.dtype))
        self.dloss = global_array(np.float32(1.0 / plan.num_microbatches), self.stage.scalar_sharding)
        self.tokens_per_step = plan.global_batch * cfg.model.seq_len
        # one time origin for every rank's events: time.perf_counter is the host's monotonic
        # clock, shared by the processes of one host (across hosts this is approximate)
        t0 = self.comm.bcast(time.perf_counter(), root=0)
        self.timeline = Timeline(stage_labels=self.labels, t0=t0) if cfg.train.timeline else None

    # -- one step ------------------------------------------------------------------------------
    def _record(self, kind: str, m: int | None, t0: float, t1: float, **extra: Any) -> None:
        if self.timeline is not None and self.group.is_leader:
            self.timeline.add(
                kind,
                stage=self.stage_idx,
                step=self.step,
                microbatch=m,
                start=t0,
                end=t1,
                chip=self.stage.spec.chip,
                **extra,
            )

    def forward_backward(self) -> float | None:
        """This stage's forwards and backwards of the current step; the loss on the last stage."""
        cfg, st, s = self.cfg, self.stage, self.stage_idx
        timed = self.timeline is not None
        tokens = targets = None
        if self.first or self.last:
            tok, tgt = get_global_batch(
                self.dataset,
                seed=cfg.seed,
                step=self.step,
                num_microbatches=cfg.plan.num_microbatches,
                microbatch_size=cfg.plan.microbatch_size,
                seq_len=cfg.model.seq_len,
            )
            tokens = [global_array(t, st.act_sharding) for t in tok] if self.first else None
            targets = [global_array(t, st.act_sharding) for t in tgt] if self.last else None
        if self.fused is not None:
            return self._forward_backward_fused(tokens, targets)
        saved: dict[int, Any] = {}
        losses = []
        for task in self.tasks:
            m = task.microbatch
            if task.kind == "F":
                if self.first:
                    x = tokens[m]
                else:
                    t0 = time.perf_counter()
                    x = (
                        self.boundary.recv(m, FWD)
                        if self.boundary is not None
                        else self.transport.recv(
                            self.act_like, peer=self.rank - 1, tag=_tag(m, FWD), sharding=st.act_sharding
                        )
                    )
                    if timed:
                        x.block_until_ready()
                        self._record("recv", m, t0, time.perf_counter(), peer=s - 1, phase="F")
                t0 = time.perf_counter()
                y, saved[m] = st.forward(x, targets[m] if self.last else None)
                if timed:
                    jax.block_until_ready(y)
                    self._record("fwd", m, t0, time.perf_counter())
                if self.last:
                    losses.append(y)
                else:
                    t0 = time.perf_counter()
                    if self.boundary is not None:
                        self.boundary.send(y, m, FWD)
                    else:
                        self.transport.send(y, peer=self.rank + 1, tag=_tag(m, FWD))
                    self._record("send", m, t0, time.perf_counter(), peer=s + 1, phase="F")
            else:
                if self.last:
                    dy = self.dloss
                else:
                    t0 = time.perf_counter()
                    dy = (
                        self.boundary.recv(m, BWD)
                        if self.boundary is not None
                        else self.transport.recv(
                            self.act_like, peer=self.rank + 1, tag=_tag(m, BWD), sharding=st.act_sharding
                        )
                    )
                    if timed:
                        dy.block_until_ready()
                        self._record("recv", m, t0, time.perf_counter(), peer=s + 1, phase="B")
                t0 = time.perf_counter()
                dx = st.backward(saved.pop(m), dy)
                if timed:
                    jax.block_until_ready(dx)
                    self._record("bwd", m, t0, time.perf_counter())
                if not self.first:
                    t0 = time.perf_counter()
                    if self.boundary is not None:
                        self.boundary.send(dx, m, BWD)
                    else:
                        self.transport.send(dx, peer=self.rank - 1, tag=_tag(m, BWD))
                    self._record("send", m, t0, time.perf_counter(), peer=s - 1, phase="B")
        (self.boundary or self.transport).flush()  # every send of this step has left
        return float(local_value(jnp.mean(jnp.stack(losses)))) if self.last else None

    def _forward_backward_fused(self, tokens: Any, targets: Any) -> float | None:
        """The same walk with every transfer inside the stage programs (``ffi``)."""
        fused, timed = self.fused, self.timeline is not None
        saved: dict[int, Any] = {}
        losses, pending = [], []
        for task in self.tasks:
            m = task.microbatch
            t0 = time.perf_counter()
            if task.kind == "F":
                out, saved[m] = fused.forward(m, tokens[m] if self.first else None, targets[m] if self.last else None)
                (losses if self.last else pending).append(out)
            else:
                out = fused.backward(m, saved.pop(m), targets[m] if self.last else None, self.dloss)
                pending.append(out)
            if timed:  # the program's time includes its receive (waiting for the peer) and send
                jax.block_until_ready(out)
                self._record("fwd" if task.kind == "F" else "bwd", m, t0, time.perf_counter(), transfers="in-program")
        jax.block_until_ready(pending)  # every send of this step has left
        return float(local_value(jnp.mean(jnp.stack(losses)))) if self.last else None

    def train_step(self) -> StepStats:
        """One optimizer step of this stage. Every rank learns the loss and every stage's
        squared gradient norm (in stage order, so the norm is the single-process one to the
        bit) and applies ``train.nonfinite`` alike."""
        cfg, step = self.cfg, self.step
        t0 = time.perf_counter()
        local_loss = self.forward_backward()
        if step in cfg.train.inject_nonfinite_steps:
            self.stage.acc = poison(self.stage.acc)
            if self.last:
                local_loss = float("nan")
        sq = float(local_value(self.stage.grad_sqnorm()))
        # one value per stage, in stage order (a stage's other processes hold the same value)
        by_rank = self.comm.allgather(sq)
        sqs = [by_rank[self.layout.leader(i)] for i in range(cfg.plan.num_stages)]
        grad_norm = math.sqrt(sum(sqs))
        loss = self.comm.bcast(local_loss, root=self.layout.leader(cfg.plan.num_stages - 1))
        skipped = False
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.stage.apply_update(clip_scale(grad_norm, cfg.optimizer.clip_norm))
        elif cfg.train.nonfinite == "skip":
            self.stage.zero_grads()
            self.skipped_steps += 1
            skipped = True
        else:
            raise nonfinite_error(step, loss, grad_norm, sqs)
        jax.block_until_ready((self.stage.params, self.stage.acc))
        dt = time.perf_counter() - t0
        stats = StepStats(
            step=step,
            loss=loss,
            grad_norm=grad_norm,
            lr=float(self.lr_schedule(step)),
            step_time_s=dt,
            tokens_per_s=self.tokens_per_step / dt,
            skipped=skipped,
        )
        if self.fail_fast is not None:
            self.fail_fast.last_completed_step = step
        self.step += 1
        return stats

    def step_metrics(self, stats: StepStats) -> dict[str, Any]:
        total = sum(st.num_devices for st in self.cfg.plan.stages)
        return {
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "lr": stats.lr,
            "step_time_s": stats.step_time_s,
            "tokens_per_s": stats.tokens_per_s,
            "tgs": stats.tokens_per_s / total,
            "skipped": int(stats.skipped),
            "skipped_steps": self.skipped_steps,
        }

    # -- agreement between the ranks -----------------------------------------------------------
    def _lead(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` on rank 0, its result (or its failure, as a JobError) on every rank."""
        result = err = None
        if self.rank == 0:
            try:
                result = fn()
            except (CheckpointError, ConfigError, OSError) as e:
                err = str(e)
        result, err = self.comm.bcast((result, err), root=0)
        if err is not None:
            raise JobError(what, err)
        return result

    def _all(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` on every rank (no collectives inside); if it fails anywhere, a JobError
        naming the stage on every rank."""
        result = err = None
        try:
            result = fn()
        except (CheckpointError, ConfigError, OSError, KeyError, ValueError) as e:
            err = f"stage {self.stage_idx}: {e}"
        errs = [e for e in self.comm.allgather(err) if e is not None]
        if errs:
            raise JobError(what, "; ".join(errs))
        return result

    def _boundary(self, store: CheckpointStore | None) -> bool:
        """The step boundary: one allreduce tells every rank whether any rank got a stop
        signal (then all stop here) and the newest step every rank has committed."""
        if store is None:
            return False
        from mpi4py import MPI

        sig = self.fail_fast.stop_signal if self.fail_fast is not None else None
        mine = store.last_committed_here
        buf = np.array([signal.Signals[sig].value if sig else 0, -(mine if mine is not None else -1)], np.int64)
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
        all_committed = -int(buf[1])
        if all_committed != self._all_committed:
            self._all_committed = all_committed
            failpoint("committed_all", all_committed)
        if buf[0]:
            self.preempted = signal.Signals(int(buf[0])).name
            return True
        return False

    # -- checkpoints ---------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        d = self.cfg.checkpoint.dir
        return Path(d) if d is not None else self.run_dir / "checkpoints"

    def checkpoint_store(self) -> CheckpointStore:
        """This rank's writer: its stage's part of every step; rank 0 leads (module docstring of
        h2jax.checkpoint._store)."""
        if self._store is None:
            c, n = self.cfg.checkpoint, self.cfg.plan.num_stages
            self._store = CheckpointStore(
                self.checkpoint_dir,
                part=part_name(self.stage_idx),
                parts=[part_name(i) for i in range(n)],
                keep_last=c.keep_last,
                keep_every=c.keep_every,
                async_save=c.async_save,
                lead=self.rank == 0,
                shared=self.group.distributed,
            )
        return self._store

    def state_by_layer(self) -> dict[str, jax.Array]:
        """This stage's parameters and optimizer state by model path (stage-wide optimizer
        leaves, the same on every stage, from stage 0 only)."""
        return stage_state_by_layer([self.stage], self.plan1, stage_wide=self.first)

    def save_checkpoint(self) -> None:
        """Start saving this stage's part of checkpoint ``self.step`` (every rank calls it at
        the same step)."""
        store = self.checkpoint_store()
        if self._saved_step is None and self.rank == 0:
            try:
                store.dir.mkdir(parents=True, exist_ok=True)
                save_config(self.cfg, store.dir / "config.yaml")
            except OSError:
                pass  # the save below reports an unwritable directory with the step
        store.clear(self.step)  # an older future of this run (--restore-step)
        # no rank's new share of this step number may commit next to another rank's old one
        self.comm.Barrier()
        store.save(self.step, self.state_by_layer(), checkpoint_meta(self.cfg, self.step, self.skipped_steps))
        self._saved_step = self.step

    def close_checkpoints(self) -> None:
        """Commit the save in flight (if any) and release the store."""
        if self._store is not None:
            store, self._store = self._store, None
            store.close()

    def resume(self, *, restore_step: int | None = None, init_from: str | Path | None = None) -> str | None:
        """``Trainer.resume`` for this job: continue from the run's latest committed step (or
        ``restore_step``), or start from the weights of another run's checkpoint
        (``init_from``), which either mode may have written. Rank 0 decides; every rank reads
        its own layers. Returns the line saying what happened (the same on every rank)."""
        cfg = self.cfg
        if init_from is None and not cfg.checkpoint.enabled:
            if restore_step is not None:
                raise JobError("checkpoint error", "--restore-step needs checkpoint.enabled=true")
            return None
        # what the whole model reads: the union of every rank's restore targets
        mine = sorted(restore_targets([self.stage], self.plan1, params_only=False))
        model_keys = sorted(set().union(*self.comm.allgather(mine)))
        removed = 0
        if init_from is None:  # each rank removes its own leftovers; the allreduce orders it before the reads
            removed = self.comm.allreduce(len(self._all(lambda: self.checkpoint_store().cleanup(), "checkpoint error")))
        plan = self._lead(lambda: self._resume_plan(restore_step, init_from, model_keys, removed), "checkpoint error")
        if plan["step"] is None:
            return plan["message"]

        def read() -> None:
            store = CheckpointStore(plan["dir"])
            try:
                targets = restore_targets([self.stage], self.plan1, params_only=plan["params_only"])
                load_state_by_layer(
                    [self.stage], self.plan1, store.restore(plan["step"], targets), params_only=plan["params_only"]
                )
            finally:
                store.close()

        self._all(read, "checkpoint error")
        if not plan["params_only"]:
            self.step, self.skipped_steps = plan["next_step"], plan["skipped_steps"]
            self._saved_step = self.step
            if self.rank == 0:
                truncate_metrics(self.run_dir, self.step)
                if plan["warning"]:
                    self.console.print(f"[yellow]h2jax: {escape(plan['warning'])}[/]")
        return plan["message"]

    def _resume_plan(
        self, restore_step: int | None, init_from: str | Path | None, model_keys: list[str], removed: int
    ) -> dict[str, Any]:
        """Rank 0: what to read (the same decisions and messages as ``Trainer.resume``)."""
        cfg = self.cfg
        if init_from is not None:
            src = CheckpointStore(init_from)
            step = restore_step if restore_step is not None else src.latest_committed()
            if step is None:
                raise CheckpointError(f"{src.dir} holds no committed checkpoint")
            check_checkpoint(src, step, cfg, model_keys, params_only=True)
            if cfg.checkpoint.enabled and self.checkpoint_store().latest_committed() is not None:
                raise CheckpointError(
                    f"{self.checkpoint_dir} already holds checkpoints of a run; --init-from "
                    "starts a new one (use another name or checkpoint.dir)"
                )
            return {
                "dir": str(src.dir),
                "step": step,
                "params_only": True,
                "message": f"initialised the weights from {Path(init_from).absolute()} step {step}; "
                "training from step 0",
            }
        store = self.checkpoint_store()
        latest = store.latest_committed()
        if latest is None:
            if restore_step is not None:
                raise CheckpointError(f"--restore-step {restore_step}: {store.dir} holds no committed checkpoint")
            return {
                "step": None,
                "message": f"cleaned up {removed} leftovers of an interrupted save" if removed else None,
            }
        step = restore_step if restore_step is not None else latest
        meta = check_checkpoint(store, step, cfg, model_keys, params_only=False)
        next_step, skipped, warning = data_position(meta, cfg, f"{store.dir} step {step}")
        msg = f"resumed from {store.dir} step {step}"
        if removed:
            msg += f" (cleaned up {removed} leftovers of an interrupted save)"
        if step != latest:
            msg += f"; committed steps after {step} (up to {latest}) are replaced as this run reaches them"
        return {
            "dir": str(store.dir),
            "step": step,
            "params_only": False,
            "message": msg,
            "warning": warning,
            "next_step": next_step,
            "skipped_steps": skipped,
        }

    # -- the loop ------------------------------------------------------------------------------
    def run(self, steps: int | None = None) -> list[StepStats]:
        """Train up to ``steps`` (default ``train.steps``) from ``self.step``; checkpoint as
        configured. Returns early, after saving, when a rank got a stop signal (``preempted``)."""
        cfg = self.cfg
        steps = cfg.train.steps if steps is None else steps
        lead = self.rank == 0
        if lead:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
            cfg.plan.to_yaml(self.run_dir / "plan.yaml")
            if self.step == 0:  # a fresh run; a resumed run keeps appending
                (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        # who is where: operators (and the killed-rank test) find each stage's process here
        ranks = self.comm.gather(
            {
                "rank": self.rank,
                "stage": self.stage_idx,
                "pid": os.getpid(),
                "host": os.uname().nodename,
                "backend": self.backend,
                "group_rank": self.group.group_rank,
            },
            root=0,
        )
        if lead:
            (self.run_dir / "ranks.json").write_text(json.dumps(ranks, indent=2))
        self.comm.Barrier()
        store = self.checkpoint_store() if cfg.checkpoint.enabled else None
        every = cfg.checkpoint.every_steps
        if store is not None and self.fail_fast is not None:
            self.fail_fast.allow_graceful_stop(stop_grace_s())
        history: list[StepStats] = []
        t_start = time.perf_counter()
        log = (
            MetricsLogger(
                self.run_dir,
                total_steps=steps,
                tensorboard=cfg.train.tensorboard,
                progress=cfg.train.progress,
                console=self.console,
            )
            if lead
            else None
        )
        try:
            while self.step < steps:
                stats = self.train_step()
                history.append(stats)
                if log is not None and (stats.step % cfg.train.log_every == 0 or self.step == steps or stats.skipped):
                    log.log(stats.step, self.step_metrics(stats))
                if store is not None:
                    store.poll()  # commit a finished background save
                    if every > 0 and self.step % every == 0 and self.step < steps:
                        self.save_checkpoint()
                if self._boundary(store):
                    break
            if store is not None:
                if self.fail_fast is not None:
                    self.fail_fast.stopping()  # no more step boundaries: a stop signal now waits for the save
                if (self.step == steps or self.preempted) and self._saved_step != self.step:
                    self.save_checkpoint()
                self.close_checkpoints()  # commits the last save
                self.comm.Barrier()  # every part has committed it
                store.apply_retention()  # judged once more, now that every part's last step counts
        except NonFiniteLossError:
            self.close_checkpoints()  # the last committed checkpoint stays the restart point
            raise
        finally:
            if log is not None:
                log.close()
        wall = time.perf_counter() - t_start
        self._write_outputs(history, wall)
        return history

    def _write_outputs(self, history: list[StepStats], wall_s: float) -> None:
        # every rank's parameters by model layer (the multi-process == single-process tests read them)
        params = fetch(model_layout([self.stage.params], self.plan1))  # collective over the stage's processes
        self.comm.Barrier()
        if self.group.is_leader:
            np.savez(self.run_dir / f"params_stage{self.stage_idx}.npz", **params)
        events = self.timeline.events() if self.timeline is not None else []
        gathered = self.comm.gather(events, root=0)
        if self.rank != 0:
            return
        summary: dict[str, Any] = {
            "steps": len(history),
            "wall_s": wall_s,
            "processes": self.launch.size,
            "launcher": self.launch.launcher,
            "transport": self.cfg.train.transport,
            "losses": [h.loss for h in history],
            "median_step_time_s": float(np.median([h.step_time_s for h in history[1:] or history]))
            if history
            else None,
        }
        if self.timeline is not None and history:
            merged = Timeline(stage_labels=self.labels, t0=0.0)
            for evs in gathered:
                for e in evs:
                    merged.add(
                        e.kind,
                        stage=e.stage,
                        step=e.step,
                        microbatch=e.microbatch,
                        start=e.start_us / 1e6,
                        end=(e.start_us + e.dur_us) / 1e6,
                        chip=e.chip,
                        **e.extra,
                    )
            merged.save(self.run_dir / "trace.json")
            gstep = history[-1].step
            ev = merged.events(gstep)
            plot_gantt(
                ev,
                self.run_dir / "gantt.png",
                stage_labels=self.labels,
                title=f"{self.cfg.name}: step {gstep}, {self.launch.size} processes, {self.cfg.train.transport}",
            )
            summary["bubble_fraction_last_step"] = bubble_fraction(
                [e for e in ev if e.kind in ("fwd", "bwd")], len(self.labels)
            )
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def run_multiprocess(
    cfg: ExperimentConfig,
    launch: LaunchInfo,
    *,
    fail_fast: FailFast | None = None,
    run_dir: str | Path | None = None,
    console: Console | None = None,
    restore_step: int | None = None,
    init_from: str | Path | None = None,
) -> int:
    """Train on this rank (resuming as ``Trainer.resume`` does); on any failure print one line
    and end the whole job promptly. Returns this process's exit status."""
    from mpi4py import MPI

    if fail_fast is None:  # the CLI starts it earlier, before JAX's threads exist
        fail_fast = FailFast(launch)
        fail_fast.start()
    console = console or Console(stderr=True)
    lead = launch.rank == 0
    if lead:
        console.print(
            f"h2jax train: {cfg.name} on {launch.size} processes ({launch.launcher}), transport {cfg.train.transport}"
        )
    try:
        trainer = MultiProcessTrainer(cfg, launch, run_dir=run_dir, console=console, fail_fast=fail_fast)
        resumed = trainer.resume(restore_step=restore_step, init_from=init_from)
        if lead and resumed:
            console.print(f"[green]h2jax:[/] {escape(resumed)}", highlight=False, soft_wrap=True)
        start = trainer.step
        history = trainer.run()
        trainer.group.close()  # leave the stage's jax.distributed cluster (collective over the stage)
    except (JobError, NonFiniteLossError) as e:  # every rank is here, at the same point
        what, code = (e.what, e.code) if isinstance(e, JobError) else ("training failed", 1)
        if lead:
            console.print(f"[bold red]h2jax: {what}:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        MPI.COMM_WORLD.Barrier()  # nobody exits (and makes the launcher kill the others) before all are done
        fail_fast.finish()
        return code
    except BaseException as e:  # noqa: BLE001 -- any failure ends every process of the job
        why = (
            f"checkpoint save failed (earlier checkpoints are intact): {e}"
            if isinstance(e, CheckpointSaveError)
            else f"failed: {type(e).__name__}: {e}"
        )
        sys.stderr.write(fail_fast.line(why) + "\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(2 if isinstance(e, ConfigError) else 1)
        raise
    MPI.COMM_WORLD.Barrier()
    fail_fast.finish()
    if lead:
        if trainer.preempted:
            console.print(
                f"[yellow]h2jax: stopped by {trainer.preempted} after step {trainer.step}:[/] saved step "
                f"{trainer.step} to {escape(str(trainer.checkpoint_dir))} on every rank; run the same "
                "command to resume",
                highlight=False,
                soft_wrap=True,
            )
        elif history:
            console.print(
                f"loss {history[0].loss:.4f} -> {history[-1].loss:.4f} over {len(history)} steps"
                f"{f' (from step {start})' if start else ''} on {launch.size} processes"
            )
        else:
            console.print(f"nothing to train: the run is at step {start} of train.steps={cfg.train.steps}")
        if cfg.checkpoint.enabled and not trainer.preempted:
            console.print(f"checkpoints: {trainer.checkpoint_dir} (latest step {trainer.step})")
        print(trainer.run_dir)
    return 0
