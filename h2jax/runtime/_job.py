"""``h2jax train`` as a job: build the trainer, resume, train, and say what happened -- once,
for one process and for mpirun alike -- with the exit status.

Exit status: 0 trained (or stopped by a signal after saving, or nothing left to train); 2 a
config error (before any device, or the memory check); 1 anything else. Failures every
process meets at the same point (a checkpoint that does not fit, the memory check, a
non-finite step under ``abort``) are agreed between the processes: the writer prints one
line and every process exits with the same status. Any other failure of one process under
a launcher prints ``h2jax: stage S (rank R/N, launcher) failed: ...; last completed step K``
and aborts the whole job (``MPI_Abort``); in one process it prints one line.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from h2jax._console import make_console
from h2jax._errors import EXIT_CONFIG, EXIT_FAIL, EXIT_INTERRUPTED, debug, say
from h2jax._units import MIB
from h2jax.checkpoint import CheckpointError, CheckpointSaveError, on_disk
from h2jax.config import ConfigError, ExperimentConfig
from h2jax.runtime._links import link_lines
from h2jax.runtime._outputs import RunFolderGone
from h2jax.runtime._runner import StageFailure
from h2jax.runtime._state import NonFiniteLossError
from h2jax.runtime._trainer import Trainer
from h2jax.runtime._world import JobError


def run_job(
    cfg: ExperimentConfig,
    *,
    run_dir: str | Path | None = None,
    restore_step: int | None = None,
    init_from: str | Path | None = None,
    console: Console | None = None,
    fail_fast: Any = None,
    launch: Any = None,
    model: Any = None,
) -> int:
    """Train ``cfg`` as ``h2jax train`` does; returns this process's exit status.

    ``model``: a user's stageable nnx model (e.g. the class a gin file selects); None: the built-in model.
    """
    console = console or make_console(stderr=True)
    multi = launch is not None and launch.size > 1
    trainer = None
    try:
        trainer = Trainer(cfg, model=model, run_dir=run_dir, console=console, fail_fast=fail_fast)
        w = trainer.world
        mem = {
            s: m
            for d in w.allgather({st.stage_idx: m.total for st, m in zip(trainer.stages, trainer.memory)})
            for s, m in d.items()
        }
        if w.is_writer:
            for s, spec in enumerate(cfg.plan.stages):
                if s in mem:
                    console.print(
                        f"stage {s} on {spec.chip}: {mem[s] / MIB:.1f} MiB per device "
                        f"(limit {cfg.cluster.chips[spec.chip].memory_gib:g} GiB)"
                    )
            for line in link_lines(trainer.links):
                console.print(line, highlight=False, soft_wrap=True)
        resumed = trainer.resume(restore_step=restore_step, init_from=init_from)
        if resumed and w.is_writer:
            console.print(f"[green]h2jax:[/] {escape(resumed)}", highlight=False, soft_wrap=True)
        start = trainer.step
        history = trainer.run()
        trainer.close()
        group = w.group
        w.barrier()
        if group is not None:
            group.close()  # leave the stage's jax.distributed cluster (collective over the stage)
    except (JobError, NonFiniteLossError) as e:  # every process is here, at the same point
        what, code = (e.what, e.code) if isinstance(e, JobError) else ("training failed", EXIT_FAIL)
        if launch is None or launch.rank == 0:
            say(what, str(e), console=console)
        if multi:  # nobody exits (and makes the launcher kill the others) before all are here
            from mpi4py import MPI

            MPI.COMM_WORLD.Barrier()
        if fail_fast is not None:
            fail_fast.finish()
        return code
    except BaseException as e:  # noqa: BLE001 -- one line, whatever failed
        if isinstance(e, ConfigError):
            what, code = "config error", EXIT_CONFIG
        elif isinstance(e, CheckpointSaveError):
            what, code = "checkpoint save failed", EXIT_FAIL
        elif isinstance(e, RunFolderGone):
            what, code = "run folder gone", EXIT_FAIL
        elif isinstance(e, CheckpointError):
            what, code = "checkpoint error", EXIT_FAIL
        elif isinstance(e, (StageFailure, NonFiniteLossError)):
            what, code = "training failed", EXIT_FAIL
        elif isinstance(e, KeyboardInterrupt):
            what, code = "interrupted", EXIT_INTERRUPTED
        else:
            what, code = f"failed: {type(e).__name__}", EXIT_FAIL
        message = str(e)
        if isinstance(e, CheckpointSaveError | RunFolderGone) and trainer is not None and cfg.checkpoint.enabled:
            message += f" ({on_disk(trainer.checkpoint_dir, steps_done=trainer.step)})"
        if not multi:
            say(what, message, console=console)
            if debug():
                raise
            return code
        from mpi4py import MPI

        # any failure of one process ends every process of the job promptly
        line = f"{what}: {message}"
        sys.stderr.write((fail_fast.line(line) if fail_fast is not None else f"h2jax: {line}") + "\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(code)
        raise
    if fail_fast is not None:
        fail_fast.finish()
    if not w.is_writer:
        return 0
    if trainer.preempted:
        if cfg.checkpoint.enabled:
            where = (
                f"saved step {trainer.step} to {trainer.checkpoint_dir}"
                f"{' on every process' if w.multiprocess else ''}; run the same command to resume"
            )
        else:
            where = "checkpoints are off (checkpoint.enabled=false): nothing saved"
        say(f"stopped by {trainer.preempted} after step {trainer.step}", where, console=console, style="yellow")
    elif not history:
        console.print(
            f"nothing to train: the run is at step {start} of train.steps={cfg.train.steps}; "
            "the run folder is left as it was"
        )
    else:
        first, last = history[0], history[-1]
        rest = history[1:] or history
        med = sorted(h.tokens_per_s for h in rest)[len(rest) // 2]
        skipped = sum(h.skipped for h in history)
        procs = f" on {w.size} processes" if w.multiprocess else ""
        console.print(
            f"loss {first.loss:.4f} -> {last.loss:.4f} over {len(history)} steps"
            f"{f' (from step {start})' if start else ''}{procs}; median {med:,.0f} tokens/s"
            f"{f'; {skipped} non-finite steps skipped' if skipped else ''}"
        )
        if trainer.eval_losses:
            evals = ", ".join(f"{v:.4f} after step {s}" for s, v in trainer.eval_losses[-3:])
            console.print(f"eval loss: {evals}{' (the last 3)' if len(trainer.eval_losses) > 3 else ''}")
        if cfg.checkpoint.enabled:
            console.print(f"checkpoints: {trainer.checkpoint_dir} (latest step {trainer.step})")
        console.print(
            f"run folder: [bold]{trainer.run_dir}[/] (metrics.jsonl, tb/, trace.json, gantt.png, summary.json)"
        )
    print(trainer.run_dir)
    return 0
