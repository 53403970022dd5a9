"""What a run writes to its folder besides checkpoints, on the writer: ``config.yaml``,
``plan.yaml`` and ``ranks.json`` before training (:func:`prepare_run_dir`), one row of
metrics per logged step (:func:`step_metrics`), and ``summary.json``, ``trace.json`` and
``gantt.png`` after it (:func:`write_outputs`). Each function is collective where it says
so: every process calls it at the same point, and the writer's result is the one that counts.
The writer holds the folder's :class:`RunLock` while it writes there.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from h2jax._paths import keep_aside
from h2jax.config import ConfigError, ExperimentConfig, save_config
from h2jax.runtime._memory import GIB
from h2jax.runtime._metrics import METRICS_FILENAME, read_metrics
from h2jax.runtime._stage import StageMemory
from h2jax.runtime._state import StepStats
from h2jax.runtime._timeline import Timeline, bubble_fraction, plot_gantt
from h2jax.runtime._world import World

LOCK_FILENAME = ".h2jax-run.lock"


class RunFolderGone(RuntimeError):
    """The run folder was deleted (or replaced) while the job wrote it."""


class RunLock:
    """One job writes a run folder at a time: the writer holds ``<run folder>/.h2jax-run.lock``
    (an advisory ``flock``) from the first thing it writes there until the trainer closes.

    The kernel drops the lock when its process ends, however it ends, so a lock file left
    behind by a killed job is not a lock: the next job takes it (the file only names the last
    holder, and may be deleted by hand). A second job finds the lock held and stops with one
    line naming the holder (pid, host, start time, command), before it writes anything."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILENAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (a no-op when held); ConfigError naming the holder when another job has it."""
        import fcntl
        import sys

        if self._fd is not None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(
                "train.out_dir", f"run folder {self.path.parent} cannot be written ({e.strerror or e})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = json.loads(os.read(fd, 1 << 16) or b"{}")
            except ValueError:
                holder = {}
            os.close(fd)
            who = (
                f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')}"
                f" ({holder.get('command', '?')})"
            )
            raise ConfigError(
                "name",
                f"run folder {self.path.parent} is in use by another h2jax job: {who}; wait for it to end, "
                f"or give this run another name= (or --run-dir)",
            ) from None
        os.ftruncate(fd, 0)
        holder = {
            "pid": os.getpid(),
            "host": os.uname().nodename,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv)[:200],
        }
        os.write(fd, (json.dumps(holder) + "\n").encode())
        self._fd = fd

    def check_present(self) -> None:
        """RunFolderGone when the lock file this job holds is no longer the one at its path:
        the run folder was deleted or replaced under the job (whose files would otherwise go
        on into unlinked files, or into a new empty folder, without a word)."""
        if self._fd is None:
            return
        try:
            same = os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except OSError:
            same = False
        if not same:
            raise RunFolderGone(
                f"run folder {self.path.parent} was deleted or replaced while this job wrote it; its "
                f"metrics.jsonl and tb/ went with it. Stopping rather than writing into a folder that is gone"
            )

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race with a job taking it)."""
        import fcntl

        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def prepare_run_dir(
    cfg: ExperimentConfig,
    world: World,
    run_dir: Path,
    *,
    backends: dict[int, str],
    step: int,
    console: Console,
    model: str | None = None,
    links: list[dict[str, Any]] | None = None,
) -> None:
    """The run folder, its config, plan and ranks (each with the links it timed,
    h2jax.runtime._links), and the metrics of an earlier run that this one would restart over
    (moved aside, said loudly; never deleted). ``model``: a user's model class that trains
    instead of the built-in one (``save_config``). Collective; the writer writes."""
    w = world
    ranks = w.allgather(
        {
            "rank": w.rank,
            "stages": list(w.local_stages),
            "pid": os.getpid(),
            "host": os.uname().nodename,
            "backend": [backends[s] for s in w.local_stages],
            "group_rank": w.group.group_rank if w.group is not None else 0,
        }
    )
    if not w.is_writer:
        return
    for r in ranks:  # one process: every link; else the links whose ends this rank timed
        r["links"] = [lk for lk in links or [] if lk["ranks"] is None or r["rank"] in lk["ranks"]]
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml", model=model)
    cfg.plan.to_yaml(run_dir / "plan.yaml")
    (run_dir / "ranks.json").write_text(json.dumps(ranks, indent=2))
    metrics = run_dir / METRICS_FILENAME
    if step == 0 and metrics.exists() and metrics.stat().st_size > 0:
        rows = read_metrics(metrics)
        aside = keep_aside(metrics)
        console.print(
            f"[bold yellow]h2jax: starting from step 0 in {run_dir}, which holds {len(rows)} metric rows "
            f"of an earlier run (no checkpoint to resume from): they are kept in {aside.name}[/]"
        )


def mfu(cfg: ExperimentConfig, tokens_per_s: float) -> dict[str, float]:
    """Model FLOPs utilisation at ``tokens_per_s``: ``mfu`` (the model's FLOPs per second over
    the summed peak of every device of the plan) and ``mfu/<chip>`` (the FLOPs of the layers
    that chip type's stages hold over its devices' peak). Peaks are the chip profiles'
    ``peak_tflops``; an emulated chip's is the profile's declared number, not a property of
    this host, so its MFU says how the run compares with that declaration only."""
    from h2jax.plan import ModelShape

    plan = cfg.plan
    per_token = ModelShape.from_config(cfg.model).train_flops_per_token()
    done: dict[str, float] = {}
    peak: dict[str, float] = {}
    for pipe in plan.pipeline_plans():  # each pipeline computes its share of the tokens
        head = pipe.schedule.head_stage(pipe.num_stages)
        tps = tokens_per_s * pipe.global_batch / plan.global_batch
        for s, spec in enumerate(pipe.stages):
            flops = spec.num_layers * per_token["block"] + (per_token["head"] if s == head else 0.0)
            done[spec.chip] = done.get(spec.chip, 0.0) + flops * tps
            chip_peak = spec.num_devices * cfg.cluster.chips[spec.chip].peak_tflops * 1e12
            peak[spec.chip] = peak.get(spec.chip, 0.0) + chip_peak
    out = {"mfu": sum(done.values()) / sum(peak.values())}
    out.update({f"mfu/{chip}": done[chip] / peak[chip] for chip in done})
    return out


def step_metrics(
    cfg: ExperimentConfig,
    stats: StepStats,
    *,
    skipped_steps: int,
    events: list[Any] | None,
    with_mfu: bool = True,
) -> dict[str, Any]:
    """The metrics of one step: loss, norm, learning rate, times, throughput per chip type,
    and the bubble fraction of ``events`` (every stage's timeline events of the step);
    ``with_mfu``: the model is ``cfg.model``'s (a user's own model's FLOPs are not known here,
    so its rows carry no MFU rather than a wrong one)."""
    devices_by_chip: dict[str, int] = {}
    for spec in cfg.plan.stages:
        devices_by_chip[spec.chip] = devices_by_chip.get(spec.chip, 0) + spec.num_devices
    total = sum(devices_by_chip.values())
    m: dict[str, Any] = {
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
        "lr": stats.lr,
        "step_time_s": stats.step_time_s,
        "tokens_per_s": stats.tokens_per_s,
        "tgs": stats.tokens_per_s / total,
        "skipped": int(stats.skipped),
        "skipped_steps": skipped_steps,
    }
    for chip, ndev in devices_by_chip.items():
        m[f"tgs/{chip}"] = stats.tokens_per_s / ndev
    if with_mfu:
        m.update(mfu(cfg, stats.tokens_per_s))
    if events is not None:
        m["bubble_fraction"] = bubble_fraction([e for e in events if e.kind in ("fwd", "bwd")], cfg.plan.num_stages)
    return m


def write_outputs(
    cfg: ExperimentConfig,
    world: World,
    run_dir: Path,
    history: list[StepStats],
    wall_s: float,
    *,
    events: list[Any] | None,
    memory: dict[int, StageMemory],
    backends: dict[int, str],
    labels: list[str],
    t0: float | None,
    tokens_per_step: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The summary (``extra``'s keys added: the data and evaluation), and, when this call
    trained, trace.json, gantt.png and summary.json on
    the writer). A call that trained nothing writes nothing: an earlier run's files stay.
    ``events``: every stage's timeline events (on the writer); ``memory``, ``backends``: this
    process's stages'. Collective."""
    w = world
    gstep = None
    if history:
        gstep = cfg.train.gantt_step if cfg.train.gantt_step >= 0 else history[-1].step
    mem = w.allgather({s: m.total / GIB for s, m in memory.items()})
    memory_gib = {s: g for d in mem for s, g in d.items()}
    backends = {s: b for d in w.allgather(backends) for s, b in d.items()}
    summary: dict[str, Any] = {
        "steps": len(history),
        "wall_s": wall_s,
        "first_loss": history[0].loss if history else None,
        "last_loss": history[-1].loss if history else None,
        "losses": [h.loss for h in history],
        # the first steps include compilation; the median excludes it
        "median_step_time_s": float(np.median([h.step_time_s for h in history[1:] or history])) if history else None,
        "tokens_per_step": tokens_per_step,
        "processes": w.size,
        "launcher": w.launcher,
        "transport": cfg.train.transport,
        "stages": [
            {"label": labels[s], "backend": backends.get(s), "memory_gib": memory_gib.get(s)}
            for s in range(cfg.plan.num_stages)
        ],
        **(extra or {}),
    }
    if not w.is_writer or not history:
        return summary
    if events is not None:
        merged = Timeline(stage_labels=labels, t0=t0)
        merged.extend(events)
        merged.save(run_dir / "trace.json")
        # an elastic launch that resumed (h2jax.runtime._faults.ElasticHooks.mark_resume): the
        # trace holds its boundary; the Gantt says it under its title
        mark = next((e for e in merged.events() if e.extra.get("recovery")), None)
        if mark is not None:
            summary["resumed"] = {"step": mark.step, "after": mark.name.removeprefix("resumed after ")}
        ev = [e for e in merged.events(gstep) if not e.extra.get("recovery")]
        if ev:
            plot_gantt(
                ev,
                run_dir / "gantt.png",
                stage_labels=labels,
                title=f"{cfg.name}: step {gstep}, {_plan_words(cfg.plan)}, {w.size} process{'es' if w.size > 1 else ''}, "
                f"{cfg.train.transport}"
                + (
                    ""
                    if mark is None
                    else f"\nthis launch resumed at step {mark.step} after {summary['resumed']['after']}"
                ),
            )
            summary["gantt_step"] = gstep
            summary["bubble_fraction_gantt_step"] = bubble_fraction(
                [e for e in ev if e.kind in ("fwd", "bwd")], cfg.plan.num_stages
            )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _plan_words(plan: Any) -> str:
    """The Gantt title's schedule and microbatches: "1f1b, 8 microbatches", "1 microbatch"; several
    pipelines: :meth:`Plan.describe`."""
    if plan.pipelines:
        return plan.describe()
    m = plan.num_microbatches
    return f"{plan.schedule}, {m} microbatch{'es' if m != 1 else ''}"


def model_name(model: Any) -> str:
    """``module.Class`` of a user's model, or of what a builder is (a lambda: "a model builder")."""
    from flax import nnx

    if isinstance(model, nnx.Module):
        cls = type(model)
        return f"{cls.__module__}.{cls.__qualname__}"
    name = getattr(model, "__qualname__", "")
    return (
        f"the model {getattr(model, '__module__', '?')}.{name} builds"
        if name and "<lambda>" not in name
        else "a model builder"
    )
