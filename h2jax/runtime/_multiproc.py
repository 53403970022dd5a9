"""Multi-controller training: ``mpirun -np N h2jax train CONFIG``, one process per stage.

Every process belongs to exactly one stage and one chip type (its local backend; an
emulated chip is registered in the process as one node holding that stage's devices).
MPI ``COMM_WORLD`` (mpi4py) is the glue: rank s runs stage s, boundary tensors go
through a multi-process transport (``host``: numpy + mpi4py; ``ffi``: the XLA FFI
send/recv), the gradient norm and the loss are reduced over MPI, rank 0 prints progress
and writes the metrics and the merged timeline.

Fail fast: an exception on any rank prints one line naming the stage, rank and last
completed step, then aborts the whole job (``MPI_Abort``); a rank killed outright makes
the launcher SIGTERM the others, which print the same kind of line and exit non-zero;
a receive whose peer never sends times out inside the transport.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console

from h2jax.config import ConfigError, ExperimentConfig, save_config, validate
from h2jax.data import get_global_batch, load_dataset
from h2jax.plan import get_schedule, stage_tasks
from h2jax.launch import FailFast, LaunchInfo
from h2jax.runtime._layout import flatten
from h2jax.runtime._metrics import MetricsLogger
from h2jax.runtime._stage import StageProgram
from h2jax.runtime._timeline import Timeline, bubble_fraction, plot_gantt
from h2jax.runtime._trainer import StepStats, clip_scale, make_optimizer

FWD, BWD = 0, 1


def _tag(microbatch: int, direction: int) -> int:
    # MPI keeps messages of one (source, tag, communicator) in order, so tags can repeat
    # across steps; 32767 is the smallest tag bound MPI guarantees
    return (2 * microbatch + direction) % 32768


class MultiProcessTrainer:
    """The stage of this process, and the step loop that talks to the other stages."""

    def __init__(self, cfg: ExperimentConfig, launch: LaunchInfo, *, model: Any = None,
                 run_dir: str | Path | None = None, console: Console | None = None,
                 fail_fast: FailFast | None = None):
        from mpi4py import MPI

        self.cfg = cfg = validate(cfg)
        self.comm = MPI.COMM_WORLD
        self.launch = launch
        plan = cfg.plan
        n = plan.num_stages
        if self.comm.Get_size() != launch.size:
            raise RuntimeError(f"{launch.launcher} says {launch.size} processes, MPI COMM_WORLD has "
                               f"{self.comm.Get_size()}")
        if launch.size != n:
            raise ConfigError("plan.stages", f"the job has {launch.size} processes and the plan {n} stages; "
                                             "this version runs exactly one process per stage (mpirun -np "
                                             f"{n})")
        self.rank = launch.rank
        self.stage_idx = s = self.rank
        self.first, self.last = s == 0, s == n - 1
        self.console = console or Console(stderr=True)
        self.run_dir = Path(run_dir) if run_dir is not None else Path(cfg.train.out_dir) / cfg.name
        self.step = 0
        self.fail_fast = fail_fast
        spec = plan.stages[s]
        chip = cfg.cluster.chips[spec.chip]
        # this process is one node of its chip type, holding exactly this stage's devices
        if chip.emulated:
            from xla_plugins import register_emulated_chips

            backend = register_emulated_chips({spec.chip: (1, spec.num_devices)})[spec.chip][0]
        else:
            backend = chip.platform
        self.backend = backend
        devices = jax.devices(backend)[: spec.num_devices]
        if len(devices) < spec.num_devices:
            raise RuntimeError(f"stage {s} (rank {self.rank}) needs {spec.num_devices} devices of {backend}, "
                               f"this process has {len(devices)}")
        from jax.sharding import Mesh

        from h2jax.models import StageModule, build_model, check_stageable

        mesh = Mesh(np.array(devices, dtype=object).reshape(spec.data, spec.tensor), ("data", "tensor"))
        self.dataset = load_dataset(corpus=cfg.data.corpus, token_file=cfg.data.token_file,
                                    tokenizer=cfg.data.tokenizer, token_dtype=cfg.data.token_dtype)
        model = model if model is not None else build_model(cfg.model, seed=cfg.seed)
        check_stageable(model)
        module = StageModule(model, layers=spec.layers, first=self.first, last=self.last)
        self.tx, self.lr_schedule = make_optimizer(cfg)
        label = f"stage {s} · {spec.chip} ({spec.data}x{spec.tensor}) layers {spec.layers[0]}-{spec.layers[1] - 1}"
        self.stage = StageProgram(s, spec, mesh, module, self.tx, first=self.first, last=self.last, label=label)
        self.labels = [f"stage {i} · {st.chip} ({st.data}x{st.tensor}) layers {st.layers[0]}-{st.layers[1] - 1}"
                       for i, st in enumerate(plan.stages)]
        from h2jax.comm import make_peer_transport

        self.fused = None
        if cfg.train.transport == "ffi":
            from h2jax.runtime._fused import FusedStage, FusedUnsupported

            try:  # transfers inside the stage programs (collective: every rank reaches this)
                self.fused = FusedStage(self.stage, plan=plan, seq_len=cfg.model.seq_len, d_model=cfg.model.d_model,
                                        dtype=jnp.dtype(cfg.model.dtype), rank_of_stage=list(range(n)),
                                        comm=self.comm.Dup(), timeout_s=60.0)
            except FusedUnsupported as e:
                self.console.print(f"h2jax: stage {s}: transfers run as programs of their own ({e})")
        self.transport = None if self.fused is not None else make_peer_transport(cfg.train.transport, self.comm)
        self.tasks = stage_tasks(get_schedule(plan.schedule, n, plan.num_microbatches).tasks(), s)
        mb = plan.microbatch_size
        self.act_like = jax.ShapeDtypeStruct((mb, cfg.model.seq_len, cfg.model.d_model),
                                             jnp.dtype(cfg.model.dtype))
        self.dloss = jax.device_put(jnp.float32(1.0 / plan.num_microbatches), self.stage.scalar_sharding)
        self.tokens_per_step = plan.global_batch * cfg.model.seq_len
        # one time origin for every rank's events: time.perf_counter is the host's monotonic
        # clock, shared by the processes of one host (across hosts this is approximate)
        t0 = self.comm.bcast(time.perf_counter(), root=0)
        self.timeline = Timeline(stage_labels=self.labels, t0=t0) if cfg.train.timeline else None

    # -- one step ------------------------------------------------------------------------------
    def _record(self, kind: str, m: int | None, t0: float, t1: float, **extra: Any) -> None:
        if self.timeline is not None:
            self.timeline.add(kind, stage=self.stage_idx, step=self.step, microbatch=m, start=t0, end=t1,
                              chip=self.stage.spec.chip, **extra)

    def forward_backward(self) -> float | None:
        """This stage's forwards and backwards of the current step; the loss on the last stage."""
        cfg, st, s = self.cfg, self.stage, self.stage_idx
        timed = self.timeline is not None
        tokens = targets = None
        if self.first or self.last:
            tok, tgt = get_global_batch(self.dataset, seed=cfg.seed, step=self.step,
                                        num_microbatches=cfg.plan.num_microbatches,
                                        microbatch_size=cfg.plan.microbatch_size, seq_len=cfg.model.seq_len)
            tokens = [jax.device_put(t, st.act_sharding) for t in tok] if self.first else None
            targets = [jax.device_put(t, st.act_sharding) for t in tgt] if self.last else None
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
                    x = self.transport.recv(self.act_like, peer=self.rank - 1, tag=_tag(m, FWD),
                                            sharding=st.act_sharding)
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
                    self.transport.send(y, peer=self.rank + 1, tag=_tag(m, FWD))
                    self._record("send", m, t0, time.perf_counter(), peer=s + 1, phase="F")
            else:
                if self.last:
                    dy = self.dloss
                else:
                    t0 = time.perf_counter()
                    dy = self.transport.recv(self.act_like, peer=self.rank + 1, tag=_tag(m, BWD),
                                             sharding=st.act_sharding)
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
                    self.transport.send(dx, peer=self.rank - 1, tag=_tag(m, BWD))
                    self._record("send", m, t0, time.perf_counter(), peer=s - 1, phase="B")
        self.transport.flush()  # every send of this step has left
        return float(jnp.mean(jnp.stack(losses))) if self.last else None

    def _forward_backward_fused(self, tokens: Any, targets: Any) -> float | None:
        """The same walk with every transfer inside the stage programs (``ffi``)."""
        fused, timed = self.fused, self.timeline is not None
        saved: dict[int, Any] = {}
        losses, pending = [], []
        for task in self.tasks:
            m = task.microbatch
            t0 = time.perf_counter()
            if task.kind == "F":
                out, saved[m] = fused.forward(m, tokens[m] if self.first else None,
                                              targets[m] if self.last else None)
                (losses if self.last else pending).append(out)
            else:
                out = fused.backward(m, saved.pop(m), targets[m] if self.last else None, self.dloss)
                pending.append(out)
            if timed:  # the program's time includes its receive (waiting for the peer) and send
                jax.block_until_ready(out)
                self._record("fwd" if task.kind == "F" else "bwd", m, t0, time.perf_counter(),
                             transfers="in-program")
        jax.block_until_ready(pending)  # every send of this step has left
        return float(jnp.mean(jnp.stack(losses))) if self.last else None

    def train_step(self) -> StepStats:
        from mpi4py import MPI

        t0 = time.perf_counter()
        local_loss = self.forward_backward()
        sq = float(self.stage.grad_sqnorm())
        grad_norm = math.sqrt(self.comm.allreduce(sq, op=MPI.SUM))
        loss = self.comm.bcast(local_loss, root=self.cfg.plan.num_stages - 1)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise FloatingPointError(f"step {self.step}: loss={loss}, grad_norm={grad_norm}")
        self.stage.apply_update(clip_scale(grad_norm, self.cfg.optimizer.clip_norm))
        jax.block_until_ready(self.stage.params)
        dt = time.perf_counter() - t0
        stats = StepStats(step=self.step, loss=loss, grad_norm=grad_norm, lr=float(self.lr_schedule(self.step)),
                          step_time_s=dt, tokens_per_s=self.tokens_per_step / dt)
        if self.fail_fast is not None:
            self.fail_fast.last_completed_step = self.step
        self.step += 1
        return stats

    # -- the loop ------------------------------------------------------------------------------
    def run(self, steps: int | None = None) -> list[StepStats]:
        cfg = self.cfg
        steps = cfg.train.steps if steps is None else steps
        lead = self.rank == 0
        if lead:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
            cfg.plan.to_yaml(self.run_dir / "plan.yaml")
            (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        # who is where: operators (and the killed-rank test) find each stage's process here
        ranks = self.comm.gather({"rank": self.rank, "stage": self.stage_idx, "pid": os.getpid(),
                                  "host": os.uname().nodename, "backend": self.backend}, root=0)
        if lead:
            (self.run_dir / "ranks.json").write_text(json.dumps(ranks, indent=2))
        self.comm.Barrier()
        history: list[StepStats] = []
        t_start = time.perf_counter()
        log = MetricsLogger(self.run_dir, total_steps=steps, tensorboard=cfg.train.tensorboard,
                            progress=cfg.train.progress, console=self.console) if lead else None
        try:
            while self.step < steps:
                stats = self.train_step()
                history.append(stats)
                if log is not None and (stats.step % cfg.train.log_every == 0 or self.step == steps):
                    total = sum(st.num_devices for st in cfg.plan.stages)
                    log.log(stats.step, {"loss": stats.loss, "grad_norm": stats.grad_norm, "lr": stats.lr,
                                         "step_time_s": stats.step_time_s, "tokens_per_s": stats.tokens_per_s,
                                         "tgs": stats.tokens_per_s / total})
        finally:
            if log is not None:
                log.close()
        wall = time.perf_counter() - t_start
        self._write_outputs(history, wall)
        return history

    def _write_outputs(self, history: list[StepStats], wall_s: float) -> None:
        # every rank's parameters by model layer (the multi-process == single-process tests read them)
        params = {k: np.asarray(v) for k, v in flatten(self.stage.params).items()}
        start = self.cfg.plan.stages[self.stage_idx].layers[0]
        renamed = {}
        for k, v in params.items():
            parts = k.split("/")
            if parts[0] == "blocks":
                parts[1] = str(int(parts[1]) + start)
            renamed["/".join(parts)] = v
        self.comm.Barrier()
        np.savez(self.run_dir / f"params_stage{self.stage_idx}.npz", **renamed)
        events = self.timeline.events() if self.timeline is not None else []
        gathered = self.comm.gather(events, root=0)
        if self.rank != 0:
            return
        summary: dict[str, Any] = {
            "steps": len(history), "wall_s": wall_s, "processes": self.launch.size,
            "launcher": self.launch.launcher, "transport": self.cfg.train.transport,
            "losses": [h.loss for h in history],
            "median_step_time_s": float(np.median([h.step_time_s for h in history[1:] or history])) if history else None,
        }
        if self.timeline is not None and history:
            merged = Timeline(stage_labels=self.labels, t0=0.0)
            for evs in gathered:
                for e in evs:
                    merged.add(e.kind, stage=e.stage, step=e.step, microbatch=e.microbatch,
                               start=e.start_us / 1e6, end=(e.start_us + e.dur_us) / 1e6, chip=e.chip, **e.extra)
            merged.save(self.run_dir / "trace.json")
            gstep = history[-1].step
            ev = merged.events(gstep)
            plot_gantt(ev, self.run_dir / "gantt.png", stage_labels=self.labels,
                       title=f"{self.cfg.name}: step {gstep}, {self.launch.size} processes, {self.cfg.train.transport}")
            summary["bubble_fraction_last_step"] = bubble_fraction(
                [e for e in ev if e.kind in ("fwd", "bwd")], len(self.labels))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def run_multiprocess(cfg: ExperimentConfig, launch: LaunchInfo, *, fail_fast: FailFast | None = None,
                     run_dir: str | Path | None = None, console: Console | None = None) -> int:
    """Train on this rank; on any failure print one line and end the whole job promptly."""
    from mpi4py import MPI

    if fail_fast is None:  # the CLI starts it earlier, before JAX's threads exist
        fail_fast = FailFast(launch)
        fail_fast.start()
    if launch.rank == 0:
        (console or Console(stderr=True)).print(
            f"h2jax train: {cfg.name} on {launch.size} processes ({launch.launcher}), transport "
            f"{cfg.train.transport}; rank s runs stage s")
        if cfg.checkpoint.enabled:
            (console or Console(stderr=True)).print(
                "[yellow]h2jax: multi-process runs do not write checkpoints yet (checkpoint.* is ignored); "
                "SIGTERM ends the job without saving[/]")
    try:
        trainer = MultiProcessTrainer(cfg, launch, run_dir=run_dir, console=console, fail_fast=fail_fast)
        history = trainer.run()
    except BaseException as e:  # noqa: BLE001 -- any failure ends every process of the job
        sys.stderr.write(fail_fast.line(f"failed: {type(e).__name__}: {e}") + "\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(2 if isinstance(e, ConfigError) else 1)
        raise
    if launch.rank == 0 and history:
        (console or Console(stderr=True)).print(
            f"loss {history[0].loss:.4f} -> {history[-1].loss:.4f} over {len(history)} steps on "
            f"{launch.size} processes")
        print(trainer.run_dir)
    return 0
