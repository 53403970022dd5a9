"""``h2jax`` command line: train | admit | check-config | plan | simulate | profile | align | convert | tokenize | data.

``h2jax train`` resumes from the latest committed checkpoint of its run when there is one
(``--restore-step N`` picks another, ``--init-from DIR`` starts from another run's
weights); SIGTERM/SIGINT save at the next step boundary and exit 0. The same holds under
``mpirun``/``srun`` (one process per stage), where SIGUSR1 to ``mpirun`` is the signal
that reaches every rank without the launcher killing them (h2jax.launch.FailFast).

Configs are YAML files (``configs/*.yaml``) or nothing (the embedded default job),
followed by dotted ``key=value`` overrides. A bad config exits with code 2 and one line
naming the key, the value and what was expected -- before any device is touched.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml
from rich.markup import escape
from rich.table import Table

from h2jax._console import make_console
from h2jax._errors import debug, fail, say


def _split_args(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG] [key=value ...]`` -> (config path or None, overrides)."""
    from h2jax.config import ConfigError

    items = list(items)
    path = None
    if items and "=" not in items[0]:
        path = items.pop(0)
    for it in items:
        if "=" not in it:
            # a second file, or a missing '=': a config error (exit 2), like a bad override
            raise ConfigError(
                it, f"got {it!r} after the config file; expected key=value overrides (one config file at most)"
            )
    return path, items


def _plan_table(cfg) -> Table:
    t = Table(title=f"plan: {cfg.plan.num_stages} stages, {cfg.plan.describe()}")
    several = bool(cfg.plan.pipelines)
    for col in ("pipeline",) * several + ("stage", "chip", "data x tensor", "layers", "recompute", "chip memory"):
        t.add_column(col)
    for s, st in enumerate(cfg.plan.stages):
        chip = cfg.cluster.chips[st.chip]
        t.add_row(
            *((str(cfg.plan.pipeline_of_stage(s)),) if several else ()),
            str(s),
            st.chip + (" (emulated)" if chip.emulated else ""),
            f"{st.data} x {st.tensor}",
            ", ".join(f"{a}-{b - 1}" for a, b in st.layer_chunks),  # every chunk (interleaved, zb-v)
            "yes" if st.recompute else "no",
            f"{chip.memory_gib:g} GiB",
        )
    return t


def _load(args: argparse.Namespace):
    """The validated config of ``args.config``; a config error prints one line to stderr and exits 2."""
    from h2jax.config import ConfigError, check_inputs, load_config

    try:
        path, overrides = _split_args(args.config)
        run_dir = getattr(args, "run_dir", None)
        if run_dir is None:
            return load_config(path, overrides)
        return check_inputs(load_config(path, overrides, check_files=False), run_dir=run_dir)
    except ConfigError as e:
        raise SystemExit(_refuse("config error", str(e))) from None


def _refuse(what: str, message: str, *, console=None, rank: int | None = -1) -> int:
    """Print ``message`` as one bad-input line and return the exit code. Under a launcher every
    rank reads the same input and fails alike: rank 0 says it once for the job. Another rank
    waits a while for rank 0 to end the job (the launcher ends every rank when one exits
    non-zero, and a rank that exits first could end rank 0 before its line is out); a rank
    still running after the wait failed alone, and says so itself."""
    if rank == -1:
        from h2jax.launch import LauncherError, detect_launch

        try:
            launch = detect_launch()
        except LauncherError:
            launch = None
        rank = None if launch is None else launch.rank
    if rank:
        import time

        time.sleep(REFUSE_WAIT_S)
        message = f"rank {rank}: {message}"
    return fail(what, message, console=console)


# seconds a rank other than 0 waits for rank 0 to report a config error the job shares
REFUSE_WAIT_S = 20.0


def cmd_check_config(args: argparse.Namespace) -> int:
    cfg = _load(args)
    console = make_console()
    from h2jax.config import config_to_dict, format_count

    if args.print:
        console.print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), highlight=False)
    console.print(_plan_table(cfg))
    from h2jax.config import config_warnings

    for line in config_warnings(cfg):
        say("warning", line, style="bold yellow", console=make_console(stderr=True))
    from h2jax.config import ConfigError, model_factory

    try:  # a gin file may select the user's own model class: that is what trains
        user = model_factory(_split_args(args.config)[0], cfg)
    except ConfigError as e:
        return _refuse("config error", str(e))
    if user is not None:
        what = f"model {user.description} ({cfg.model.n_layers} blocks; the built-in model's other keys do not apply)"
    else:
        what = (
            f"model {cfg.model.n_layers} layers x d_model {cfg.model.d_model} "
            f"({format_count(cfg.model.num_params())} parameters)"
        )
    console.print(f"[green]config ok[/]: {cfg.name}, {escape(what)}")
    from h2jax._hostmem import host_memory_line

    console.print(host_memory_line(), highlight=False)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    console = make_console(stderr=True)
    from h2jax.launch import FailFast, LauncherError, detect_launch

    try:
        launch = detect_launch()
    except LauncherError as e:
        return fail("launcher error", str(e), console=console)
    if args.elastic:
        return _train_elastic(args, launch, console)
    if args.inject_fault or args.launcher:
        flag = "--inject-fault" if args.inject_fault else "--launcher"
        return fail("config error", f"{flag} belongs to --elastic (the supervisor); add --elastic", console=console)
    fail_fast = None
    if launch is not None and launch.size > 1:
        from h2jax.comm import preload_ucx

        preload_ucx()  # before MPI maps its own UCX: the ucx engine's (comm.engine)
        fail_fast = FailFast(launch)
        fail_fast.start()  # main() blocked the stop signals before any thread started; wait for them
    cfg = _load(args)
    from h2jax.config import ConfigError, config_to_dict, model_factory

    try:  # a gin file may select the user's own model class (experiment.model = @module.Class)
        model = model_factory(_split_args(args.config)[0], cfg)
    except ConfigError as e:
        return _refuse("config error", str(e), console=console)

    writer = launch is None or launch.rank == 0
    from h2jax.checkpoint import check_start

    run_dir = Path(args.run_dir) if args.run_dir else Path(cfg.train.out_dir) / cfg.name
    try:  # the checkpoint to start from, on the disk, before any device
        check_start(
            cfg.checkpoint.dir or run_dir / "checkpoints",
            restore_step=args.restore_step,
            init_from=args.init_from,
            model=config_to_dict(cfg)["model"] if model is None else None,  # a gin-selected class: its own shapes
        )
    except ConfigError as e:
        return _refuse("config error", str(e), console=console, rank=None if launch is None else launch.rank)
    if writer:
        console.rule(f"h2jax train: {cfg.name}")
        console.print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), highlight=False)
        console.print(_plan_table(cfg))
        from h2jax.config import config_warnings

        for line in config_warnings(cfg):
            say("warning", line, style="bold yellow", console=console)
        if cfg.data.sources:
            from h2jax.data import load_data

            console.print(load_data(cfg).describe(), highlight=False, soft_wrap=True)
        if launch is not None and launch.size > 1:
            console.print(f"{launch.size} processes ({launch.launcher}), transport {cfg.train.transport}")
        from h2jax import _compile_cache

        console.print(f"[dim]{escape(_compile_cache.describe())}[/]", highlight=False)
        if any(c.emulated for c in cfg.cluster.chips.values()):
            console.print(
                "[dim]emulated chip types: CPU PJRT clients sharing this host's cores; declared "
                "memory is enforced by the memory check, speed is not emulated.[/]"
            )
    from h2jax.runtime import run_job

    return run_job(
        cfg,
        run_dir=args.run_dir,
        restore_step=args.restore_step,
        init_from=args.init_from,
        console=console,
        fail_fast=fail_fast,
        launch=launch,
        model=model,
    )


def _train_elastic(args: argparse.Namespace, launch, console) -> int:
    """``h2jax train --elastic``: the supervisor (h2jax.elastic) runs the job and heals it."""
    from h2jax.config import ConfigError
    from h2jax.elastic import Options, parse_fault, supervise

    if launch is not None:
        return fail(
            "config error",
            f"--elastic: this process was started by {launch.launcher}; run `h2jax train --elastic` itself, "
            "with the launcher in --launcher (e.g. --launcher 'mpirun -np {stages}')",
            console=console,
        )
    if args.restore_step is not None:
        return fail(
            "config error", "--elastic resumes from the newest committed step; drop --restore-step", console=console
        )
    cfg = _load(args)
    try:
        faults = [parse_fault(spec, i) for i, spec in enumerate(args.inject_fault)]
        for key, v in (("--max-restarts", args.max_restarts), ("--backoff-s", args.backoff_s)):
            if v < 0:
                raise ConfigError(key, f"{v}; expected >= 0")
        if args.hang_timeout_s <= 0:
            raise ConfigError("--hang-timeout-s", f"{args.hang_timeout_s}; expected > 0")
        run_dir = Path(args.run_dir) if args.run_dir else Path(cfg.train.out_dir) / cfg.name
        opts = Options(
            config=list(args.config),
            run_dir=run_dir,
            launcher=args.launcher,
            max_restarts=args.max_restarts,
            backoff_s=args.backoff_s,
            hang_timeout_s=args.hang_timeout_s,
            faults=faults,
            init_from=args.init_from,
            replan_stragglers=args.replan_stragglers,
        )
        return supervise(cfg, opts, console)
    except ConfigError as e:
        return fail("config error", str(e), console=console)


def cmd_admit(args: argparse.Namespace) -> int:
    """``h2jax admit RUN CHIP``: the supervisor takes the nodes in at the job's next step
    boundary (a save, a re-plan, a relaunch; h2jax.elastic)."""
    from h2jax.elastic import request_admit

    try:
        where = request_admit(Path(args.run_dir), args.chip, args.nodes)
    except ValueError as e:
        return fail("admit", str(e))
    print(f"asked the supervisor of {args.run_dir} to admit {args.nodes} {args.chip} node(s): {where}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="h2jax", description="Train one model across chip types of different vendors.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train an experiment (default: the embedded default job)")
    t.add_argument("config", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    t.add_argument("--run-dir", default=None, help="run folder (default: <train.out_dir>/<name>)")
    t.add_argument(
        "--restore-step",
        type=int,
        default=None,
        metavar="N",
        help="resume from committed checkpoint step N instead of the latest (with --init-from: "
        "take that step's weights)",
    )
    t.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="start a new run (step 0, fresh optimizer) from the weights of the latest committed "
        "checkpoint in DIR, under this run's plan",
    )
    e = t.add_argument_group("elastic (h2jax.elastic: a node dies, the job goes on)")
    e.add_argument(
        "--elastic",
        action="store_true",
        help="run the job under a supervisor that re-plans onto the surviving chips and resumes from the "
        "newest committed checkpoint when a process or node dies (events in <run>/events.jsonl)",
    )
    e.add_argument(
        "--launcher",
        default=None,
        metavar="CMD",
        help="--elastic: the command that starts the job's processes, {stages} standing for the plan's stage "
        "count (e.g. 'mpirun --oversubscribe -np {stages}'); default: one process",
    )
    e.add_argument("--max-restarts", type=int, default=3, metavar="N", help="--elastic: restarts before it gives up")
    e.add_argument(
        "--backoff-s", type=float, default=5.0, metavar="S", help="--elastic: wait S before the first restart, doubling"
    )
    e.add_argument(
        "--hang-timeout-s",
        type=float,
        default=30.0,
        metavar="S",
        help="--elastic: a job with no finished step for S seconds (or 10x its slowest step) is ended as hung",
    )
    e.add_argument(
        "--inject-fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="--elastic, to rehearse: node:CHIP:NODE@STEP (that node dies), kill:RANK@STEP (kill -9 of one "
        "process), stop:RANK@STEP (it stops responding), slow:STAGE:SECONDS@STEP (each fwd/bwd of the stage "
        "takes SECONDS longer: a straggler); repeatable",
    )
    e.add_argument(
        "--replan-stragglers",
        action="store_true",
        help="--elastic: when the job names a straggler stage, save, re-plan with its chip type priced at the "
        "measured slowdown, and resume (default: the straggler is only reported)",
    )
    t.set_defaults(func=cmd_train)
    a = sub.add_parser("admit", help="tell the supervisor of an elastic run (train --elastic) that nodes are back")
    a.add_argument("run_dir", help="the run folder of the elastic run")
    a.add_argument("chip", help="the chip type whose nodes are back")
    a.add_argument("--nodes", type=int, default=1, help="how many nodes of it (default 1)")
    a.set_defaults(func=cmd_admit)
    c = sub.add_parser("check-config", help="validate a config without touching any device")
    c.add_argument("config", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    c.add_argument("--print", action="store_true", help="print the resolved config")
    c.set_defaults(func=cmd_check_config)
    from h2jax import cli_align, cli_models, cli_plan

    cli_plan.add_commands(sub)  # plan, simulate, profile
    cli_align.add_commands(sub)  # align
    cli_models.add_commands(sub)  # convert, tokenize
    return p


def _drop_unretrieved_task_errors(record) -> bool:
    """A logging filter: False for asyncio's "Task exception was never retrieved" records."""
    return not str(record.msg).startswith("Task exception was never retrieved")


def _quiet_libraries() -> None:
    """orbax logs through absl: every failed background write as an ERROR with a traceback, and
    routine notes as WARNINGs. When several of its concurrent writes fail (a full disk), the save
    raises the first and asyncio logs each other one, with a traceback, as "Task exception was
    never retrieved". h2jax reports the failed save once, as one line naming the path and step,
    so those logs show only with ``H2JAX_DEBUG=1``."""
    import logging

    if not debug():
        logging.getLogger("absl").setLevel(logging.CRITICAL)
        asyncio_log = logging.getLogger("asyncio")
        if _drop_unretrieved_task_errors not in asyncio_log.filters:
            asyncio_log.addFilter(_drop_unretrieved_task_errors)


def _block_stop_signals() -> bool:
    """Under a launcher with more than one process: block the stop signals before any import
    starts a thread (h2jax.launch.FailFast.block). Returns whether it did."""
    from h2jax.launch import FailFast, LauncherError, detect_launch

    try:
        launch = detect_launch()
    except LauncherError:  # reported by the command that needs the launcher
        return False
    if launch is None or launch.size < 2:
        return False
    FailFast.block()
    return True


def main(argv: Sequence[str] | None = None) -> int:
    blocked = _block_stop_signals()
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if blocked and args.func is not cmd_train:  # only `train` waits for the stop signals in a thread
        from h2jax.launch import FailFast

        FailFast.unblock()
    # `h2jax train exp.yaml --init-from DIR key=value`: overrides may also follow the options
    if rest and hasattr(args, "config") and not any(a.startswith("-") for a in rest):
        args.config = [*args.config, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    _quiet_libraries()
    from h2jax import _compile_cache

    _, note = _compile_cache.enable()
    if note:
        make_console(stderr=True).print(f"[dim]h2jax: {escape(note)}[/]", highlight=False, soft_wrap=True)
    return args.func(args)


def entry() -> int:
    """The ``h2jax`` console command: main(), in a process whose malloc gives XLA's host
    buffers transparent huge pages (re-executed once to set that; see h2jax._hostmem)."""
    from h2jax._hostmem import reexec_with_hugepages

    reexec_with_hugepages(["-m", "h2jax.cli", *sys.argv[1:]])
    try:
        code = main()
    except SystemExit as e:  # argparse and the config errors exit this way
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # Ctrl-C where a command does not stop on it itself (train saves, then exits 0)
        print("h2jax: interrupted", file=sys.stderr)
        code = 130
    # Every file is written and closed by now (metrics, TensorBoard, checkpoints, run outputs).
    # Leave without the interpreter's teardown: XLA's and orbax's worker threads can still be
    # inside C++ when Python finalizes, and a thread unwound there aborts the process
    # ("terminate called ... exception not rethrown", exit 134) after a run that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:  # under a launcher: finalize MPI as the interpreter's exit would
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    os._exit(code or 0)


if __name__ == "__main__":
    sys.exit(entry())
