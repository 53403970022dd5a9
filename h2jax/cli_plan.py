"""``h2jax plan | simulate | profile``: the planner's commands (HeteroAuto).

None of them touches a device or imports JAX (``profile --estimate`` prints the roofline
table; measuring on devices is ``h2jax.runtime._profile``). Bad input exits 2 with one
line naming the key, like every config error of the CLI.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from h2jax._console import make_console
from h2jax._errors import EXIT_FAIL, fail, say
from h2jax._paths import keep_aside
from h2jax.cli_compare import compare, stages_table
from h2jax.cli_explain import explanation
from h2jax.cli_explain import fmt_s as _fmt_s
from h2jax.plan import DEFAULT_TIME_BUDGET_S, INTERLEAVED_CHUNKS, schedule_names


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register the planner's subcommands on the ``h2jax`` parser."""
    p = subparsers.add_parser("plan", help="search the fastest plan for a cluster (HeteroAuto)")
    p.add_argument("cluster", help="cluster YAML (configs/clusters/<name>.yaml or a name there)")
    p.add_argument(
        "--model",
        default=None,
        help="YAML with the model's fields (top level or under `model:`); default: the cluster file's `model:`",
    )
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: the cluster file's)")
    p.add_argument(
        "--other-global-batch",
        type=int,
        default=None,
        help="also report the ratio when the heterogeneous run uses this global batch",
    )
    p.add_argument(
        "--schedule",
        default=None,
        help="pin the pipeline schedule: a registered name (" + ", ".join(schedule_names()) + "), "
        "name:chunks (interleaved:3), or a schedule file (.csv: each stage's F/B/W tasks, "
        "examples/schedules/); default: the search chooses among --schedules, as one more dimension",
    )
    p.add_argument(
        "--schedules",
        default="all",
        help="comma-separated schedules a free search chooses among, or 'all' (the default; interleaved "
        "with each v of --interleaved-chunks). A subset searches faster; the schedules left out are "
        "priced on the chosen plan's stages and printed beside it",
    )
    p.add_argument(
        "--interleaved-chunks",
        default=",".join(map(str, INTERLEAVED_CHUNKS)),
        help="comma-separated chunk counts v (each >= 2) the search tries for interleaved (default %(default)s)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=DEFAULT_TIME_BUDGET_S,
        help="seconds each search may take (default %(default)s; 0: no limit); past it the best plan so far "
        "is printed, marked not exhaustive",
    )
    p.add_argument("--group-size", type=int, default=None, help="experts: handle chips of a type this many at a time")
    p.add_argument(
        "--beam", type=int, default=None, help="experts: keep only this many (stages, tensor) choices per chip type"
    )
    p.add_argument("--max-orders", type=int, default=120, help="all stage orders up to this many, else a neighbourhood")
    p.add_argument("--profiles", nargs="*", default=(), help="JSON caches written by `h2jax profile`")
    p.add_argument(
        "--allow-estimates",
        action="store_true",
        help="with --profiles: also consider the (tensor degree, sequences per device) a profiled chip type was "
        "not measured at, priced by the roofline (default: only its measured ones; the output names the stages "
        "priced by the roofline)",
    )
    p.add_argument("--grad-sync", default="step", choices=("step", "microbatch"))
    p.add_argument(
        "--out",
        default=None,
        help="folder for plan.yaml and experiment.yaml (an earlier plan there is kept aside, with a line)",
    )
    p.add_argument(
        "--max-pipelines",
        type=int,
        default=None,
        help="plans of at most this many pipelines, each on its own chip types and share of the batch (default: "
        "any number; 1: one pipeline through every chip type, no search over several)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes for the searches after the one pipeline's: the homogeneous baselines (each chip "
        "type's on one; they end exhaustive, marked (exact), so they do not depend on the count), the groups of "
        "the search over several pipelines and --prove's bounds (default: one per core, at most one per chip "
        "type; 1: all in this process)",
    )
    p.add_argument(
        "--prove",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="where the ratio at the matched total batch is below 100 %%: run the one-pipeline search on to its "
        "exact round within SECONDS, so its optimum bounds every plan of one pipeline (default 0: the search's "
        "lower bound is the bound printed)",
    )
    p.add_argument("--explain", action="store_true", help="after the plan, say what each word and number means")
    p.set_defaults(func=cmd_plan)
    s = subparsers.add_parser("simulate", help="discrete-event simulation of a plan's schedule")
    s.add_argument("plan", help="plan YAML (written by `h2jax plan`) or an experiment YAML with `plan:`")
    s.add_argument("--cluster", required=True, help="cluster YAML the plan runs on")
    s.add_argument("--model", default=None, help="model YAML (default: the cluster file's or the experiment's)")
    s.add_argument("--profiles", nargs="*", default=())
    s.add_argument("--grad-sync", default="step", choices=("step", "microbatch"))
    s.add_argument(
        "--out",
        default="runs/simulate",
        help="folder for trace.json and gantt.png (default: runs/simulate; an earlier one is kept aside, with a line)",
    )
    s.set_defaults(func=cmd_simulate)
    f = subparsers.add_parser(
        "profile", help="per-layer costs of a chip type: measured on its devices (--measure) or a roofline estimate"
    )
    f.add_argument("--chip", required=True, help="chip profile name (configs/chips/<name>.yaml)")
    f.add_argument("--model", required=True, help="model YAML")
    f.add_argument("--tensor", type=int, nargs="*", default=[1])
    f.add_argument("--microbatch", type=int, nargs="*", default=[1])
    f.add_argument("--out", default=None, help="JSON cache to write (merged with what is there)")
    f.add_argument(
        "--measure",
        action="store_true",
        help="time the real stage programs on this chip type's devices (emulated chips: this host's CPU)",
    )
    f.add_argument("--repeats", type=int, default=5, help="timed rounds per program, with --measure")
    f.add_argument(
        "--statistic",
        default="median",
        choices=("median", "lower-quartile"),
        help="what is kept of a program's timed rounds, with --measure: the median (what a "
        "training step sees on a machine that also runs other work; the default) or the "
        "lower quartile (the machine to itself)",
    )
    f.add_argument(
        "--no-driver",
        action="store_true",
        help="with --measure on an emulated chip: skip timing the runtime driver's own host CPU "
        "(a few seconds through the real trainer)",
    )
    f.set_defaults(func=cmd_profile)


# -- helpers -----------------------------------------------------------------------------------


def _fail(e: Exception) -> SystemExit:
    from h2jax.config import ConfigError

    err = e if isinstance(e, ConfigError) else ConfigError("plan", str(e))
    return SystemExit(fail("config error", str(err)))


def _read_yaml(path: str, key: str) -> Any:
    from h2jax._paths import find_config
    from h2jax._strict import read_yaml
    from h2jax.plan import ProfileError

    p = Path(path)
    if not p.is_file():
        p = find_config("clusters", path) or p
    if not p.is_file():
        raise ProfileError(f"file {path!r} not found")
    data = read_yaml(p, key=key) or {}  # not YAML: one line with its line and column
    if not isinstance(data, dict):
        raise ProfileError(f"{p}: holds a {type(data).__name__}; expected a mapping")
    return data


def _model(path: str | None, fallback: Any):
    from h2jax.plan import ModelShape, ProfileError

    raw = _read_yaml(path, "--model") if path else fallback
    if isinstance(raw, dict) and isinstance(raw.get("model"), dict):
        raw = raw["model"]
    need = ("n_layers", "d_model", "n_heads", "d_ff", "vocab_size", "seq_len")
    if not isinstance(raw, dict) or any(k not in raw for k in need):
        raise ProfileError(f"model: expected the fields {', '.join(need)} (from --model or the cluster's `model:`)")
    for k in need:
        if isinstance(raw[k], bool) or not isinstance(raw[k], int) or raw[k] < 1:
            raise ProfileError(f"model.{k}: expected a positive integer, got {raw[k]!r}")
    return ModelShape.from_config(raw), raw


def _table(paths) -> Any:
    from h2jax.plan import ProfileTable

    return ProfileTable.load(*paths)


def _stage_in_node(cluster) -> bool:
    return all(p.emulated for p, _ in cluster.chips)


def _schedule_arg(text: str | None, flag: str = "--schedule"):
    """The schedule `text` names (None: None); ProfileError naming the flag otherwise."""
    from h2jax.plan import ProfileError, ScheduleError, as_schedule

    if text is None:
        return None
    try:
        return as_schedule(text)
    except ScheduleError as e:
        raise ProfileError(f"{flag}: {e}") from None


def _schedules_arg(text: str) -> tuple:
    names = schedule_names() if text.strip() == "all" else tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        from h2jax.plan import ProfileError

        raise ProfileError(f"--schedules: expected 'all' or a comma-separated list of schedules, got {text!r}")
    return tuple(_schedule_arg(n, "--schedules") for n in names)


def _chunks_arg(text: str) -> tuple[int, ...]:
    from h2jax.plan import ProfileError

    try:
        vs = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        vs = ()
    if not vs or min(vs) < 2:
        raise ProfileError(f"--interleaved-chunks: expected a comma-separated list of integers >= 2, got {text!r}")
    return vs


def search_options(
    cluster,
    *,
    schedule=None,
    schedules: tuple = (),
    interleaved_chunks: tuple[int, ...] = INTERLEAVED_CHUNKS,
    group_size: int | None = None,
    beam: int | None = None,
    max_orders: int = 120,
    time_budget: float = DEFAULT_TIME_BUDGET_S,
    grad_sync: str = "step",
    measured_only: bool = True,
):
    """The SearchOptions `h2jax plan` searches with (its defaults are the CLI's defaults;
    benchmarks/planner_scale.py runs exactly these)."""
    from h2jax.plan import CostOptions, SearchOptions

    return SearchOptions(
        schedule=schedule,
        schedules=schedules or schedule_names(),
        interleaved_chunks=interleaved_chunks,
        group_size=group_size,
        max_options_per_chip=beam,
        max_orders=max_orders,
        measured_only=measured_only,
        time_budget_s=time_budget or None,
        stage_in_node=_stage_in_node(cluster),
        cost=CostOptions(grad_sync=grad_sync),
    )


def _schedules_line(res, model, cluster, table, opts) -> str:
    """The chosen schedule, and the same stages priced under the others."""
    from h2jax.plan import as_schedule, expand_chunks, schedule_estimates

    def shown(sched) -> str:
        return f"{sched.name} v={sched.chunks}" if sched.chunk_choice else sched.label

    how = "pinned by --schedule" if opts.schedule is not None else "chosen"
    chosen = res.plan.schedule
    scheds = expand_chunks(tuple(as_schedule(n) for n in schedule_names()), opts.interleaved_chunks)
    others = []
    for sched, c in schedule_estimates(res.plan, model, cluster, table=table, opts=opts.cost, schedules=scheds).items():
        if sched == chosen:
            continue
        label = shown(sched)
        if isinstance(c, str):
            others.append(f"{label} cannot run ({c})")
            continue
        fit = "" if c.fits else ", does not fit"
        others.append(f"{label} {_fmt_s(c.iteration_s)} ({100 * (c.iteration_s / res.iteration_s - 1):+.1f} %{fit})")
    return f"schedule {shown(chosen)} ({how}); the same stages under " + ", ".join(others)


def _rows_text(rows) -> str:
    """(tensor, sequences per device) pairs in words, tensor degrees with the same sizes together:
    "tensor 1, 2 at 2, 4 sequences per device"."""
    by_t: dict[int, tuple[int, ...]] = {}
    for t, b in sorted(rows):
        by_t[t] = (*by_t.get(t, ()), b)
    groups: dict[tuple[int, ...], list[int]] = {}
    for t, bs in by_t.items():
        groups.setdefault(bs, []).append(t)
    return ", ".join(
        f"tensor {', '.join(map(str, ts))} at {', '.join(map(str, bs))} sequences per device"
        for bs, ts in groups.items()
    )


def _search_line(res) -> str:
    how = (
        "exhaustive: every plan of the space priced or excluded by a lower bound"
        if res.exhaustive
        else f"not exhaustive: {res.note}"
    )
    found = f"plan found at {res.found_s:.3f} s; " if res.plan is not None else ""
    return (
        f"search: {res.search_s:.3f} s ({found}{res.configs_solved} configurations, {res.orders_solved} orders solved; "
        f"{how})"
    )


# -- commands ----------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    from h2jax.plan import Cluster, PlanError, ProfileError, idle_chips, search

    try:
        raw = _read_yaml(args.cluster, "cluster")
        cluster = Cluster.from_dict(raw, name=Path(args.cluster).stem)
        model, model_raw = _model(args.model, raw.get("model") if isinstance(raw, dict) else None)
        gb = args.global_batch or raw.get("global_batch")
        if not isinstance(gb, int) or gb < 1:
            raise ProfileError(
                f"global_batch: expected a positive integer (--global-batch or the cluster's "
                f"`global_batch:`), got {gb!r}"
            )
        table = _table(args.profiles)
        table.check_model(model)
        if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
            raise PlanError("--out", f"{args.out} is a file; expected a folder for plan.yaml and experiment.yaml")
        if args.max_pipelines is not None and args.max_pipelines < 1:
            raise PlanError("--max-pipelines", f"expected 1 or more, got {args.max_pipelines}")
        if args.workers is not None and args.workers < 1:
            raise PlanError("--workers", f"expected 1 or more, got {args.workers}")
        if args.time_budget < 0:
            raise ProfileError(f"--time-budget: expected seconds >= 0 (0: no limit), got {args.time_budget}")
        if not args.prove >= 0:
            raise PlanError("--prove", f"expected seconds >= 0 (0: no proof), got {args.prove}")
        opts = search_options(
            cluster,
            schedule=_schedule_arg(args.schedule),
            schedules=_schedules_arg(args.schedules),
            interleaved_chunks=_chunks_arg(args.interleaved_chunks),
            group_size=args.group_size,
            beam=args.beam,
            max_orders=args.max_orders,
            time_budget=args.time_budget,
            grad_sync=args.grad_sync,
            measured_only=not args.allow_estimates,
        )
    except (ProfileError, PlanError, ValueError) as e:
        raise _fail(e) from None
    from h2jax.config import format_count

    console = make_console()
    res = search(cluster, model, global_batch=gb, table=table, opts=opts)
    if res.plan is None:
        more = (
            "; profile more tensor degrees and microbatch sizes, or pass --allow-estimates"
            if opts.measured_only and table.entries
            else ""
        )
        raise _fail(
            ProfileError(f"plan: no plan fits ({res.note}); try more chips, a smaller model or microbatch{more}")
        )
    cost = res.cost
    tbl = stages_table(
        f"{cluster.name}: {cluster.num_devices} chips, model {format_count(model.num_params())} params, "
        f"global batch {gb} seq = {gb * model.seq_len:,} tokens, {res.plan.num_microbatches} x "
        f"{res.plan.microbatch_size}, {res.plan.schedule}",
        res.plan,
        cost,
    )
    console.print(tbl)
    for chip, (busy, cores) in table.loaded_chips(cluster.names).items():
        console.print(
            f"[bold yellow]note:[/] {chip}'s profile was measured while other work kept {busy:.1f} of its host's "
            f"{cores} cores busy: its costs are higher than the chip's alone, and this plan leans away from it; "
            f"measure it again on a quiet host (`h2jax profile --chip {chip} --measure`)"
        )
    missing = table.unprofiled(model, cluster.names) if table.entries else []
    if missing:
        console.print(
            f"[yellow]note:[/] --profiles has no entry of this model shape for {', '.join(missing)}: "
            "priced by the roofline"
        )
    rough = [
        f"stage {i} ({s.chip}, tensor {s.tensor}, {res.plan.microbatch_size // s.data} sequences per device)"
        for i, (s, c) in enumerate(zip(res.plan.stages, cost.stages))
        if c.estimated
    ]
    if not rough:
        est = " (from measured profiles)"
    elif table.entries:
        est = f" (partly a roofline estimate: {'; '.join(rough)} not measured for this model shape in --profiles)"
    else:
        est = " (roofline estimates: not a measurement)"
    if opts.measured_only and table.entries:
        held = {n: table.measured_rows(n, model) for n in cluster.names}
        held = {n: r for n, r in held.items() if r}
        if held:
            console.print(
                "searched only the measured configurations of profiled chip types (--allow-estimates adds the "
                "others, estimated): " + "; ".join(f"{n} {_rows_text(r)}" for n, r in held.items())
            )
    console.print(
        f"estimated iteration {_fmt_s(cost.iteration_s)}{est}, {cost.tokens_per_s:,.0f} tokens/s, "
        f"bubble {100 * cost.bubble_fraction:.1f} %; lower bound {_fmt_s(res.lower_bound_s)} "
        f"(gap {100 * res.gap:.1f} %)"
    )
    console.print(_search_line(res))
    console.print(_schedules_line(res, model, cluster, table, opts))
    console.print(f"stage order {'is' if res.memory_descending else 'is not'} memory-descending")
    for chip in cluster.names:
        n = cluster.devices(chip)
        console.print(
            f"  TGS {chip}: {cost.tokens_per_s / cluster.num_devices:,.1f} tokens/chip/s over all "
            f"{cluster.num_devices} chips ({cost.devices_by_chip.get(chip, 0)} of {n} {chip} used)"
        )
    idle = idle_chips(res, cluster)
    for chip, (n, why) in idle.items():
        console.print(f"  {n} {chip} chips left idle: {why}")
    chosen = compare(console, args, res, cluster, model, gb, table, opts, idle)
    if args.explain:
        console.print("\n[bold]what the output means[/]")
        several = len(cluster.names) > 1
        for line in explanation(
            res,
            cluster,
            gb,
            measured=bool(opts.measured_only and table.entries),
            several=several,
            other=several and bool(args.other_global_batch),
        ):
            console.print("  " + line)
    else:
        console.print("[dim](--explain says what each word and number above means)[/]")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        files = ("plan.yaml", "experiment.yaml", "comparison.json")
        for f in files:  # an earlier plan's files: kept, each beside its new one
            if (out / f).exists():
                say(
                    None,
                    f"the earlier {out / f} is kept as {keep_aside(out / f)}",
                    style="bold yellow",
                    prog="h2jax plan",
                )
        chosen.plan.to_yaml(out / "plan.yaml")
        exp = {
            "name": f"plan_{cluster.name}",
            "model": {k: model_raw[k] for k in model_raw},
            "cluster": {"chips": cluster.to_config_chips()},
            "plan": chosen.plan.to_dict(),
        }
        exp["plan"].pop("model", None)
        (out / "experiment.yaml").write_text(
            "# written by `h2jax plan`; run it with `h2jax train "
            + str(out / "experiment.yaml")
            + "`\n"
            + yaml.safe_dump(exp, sort_keys=False)
        )
        report = {
            "cluster": cluster.name,
            "global_batch": gb,
            "pipelines": chosen.plan.num_pipelines,
            "tokens_per_s": round(chosen.tokens_per_s, 1),
            "chips_used": {c: [chosen.devices_by_chip.get(c, 0), cluster.devices(c)] for c in cluster.names},
            "idle": {c: why for c, (_, why) in chosen.idle.items()},
            "heterospeedup": chosen.report,  # None with one chip type: nothing to compare
        }
        (out / "comparison.json").write_text(json.dumps(report, indent=1) + "\n")
        console.print(f"wrote {', '.join(str(out / f) for f in files)}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:

    from h2jax.plan import Cluster, CostOptions, Plan, PlanError, ProfileError, simulate_plan

    try:
        if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
            raise PlanError("--out", f"{args.out} is a file; expected a folder for trace.json and gantt.png")
        raw_plan = _read_yaml(args.plan, "plan")
        craw = _read_yaml(args.cluster, "--cluster")
        cluster = Cluster.from_dict(craw, name=Path(args.cluster).stem)
        fallback = raw_plan.get("model") if isinstance(raw_plan.get("model"), dict) else craw.get("model")
        model, _ = _model(args.model, fallback)
        pdata = raw_plan["plan"] if isinstance(raw_plan.get("plan"), dict) else raw_plan
        if not isinstance(pdata.get("model"), (str, type(None))):
            pdata = {k: v for k, v in pdata.items() if k != "model"}
        plan = Plan.from_dict(pdata)
        for i, s in enumerate(plan.stages):
            if s.chip not in cluster.names:
                raise PlanError(
                    f"plan.stages[{i}].chip", f"chip {s.chip!r} is not in the cluster ({', '.join(cluster.names)})"
                )
        table = _table(args.profiles)
        table.check_model(model)
        sim, cost = simulate_plan(plan, model, cluster, table=table, opts=CostOptions(grad_sync=args.grad_sync))
    except (ProfileError, PlanError, ValueError, KeyError) as e:
        raise _fail(e) from None
    console = make_console()
    console.print(
        f"simulated iteration {_fmt_s(sim.iteration_s)}; analytic estimate {_fmt_s(cost.iteration_s)} "
        f"({100 * (cost.iteration_s / sim.iteration_s - 1):+.1f} %); bubble {100 * sim.bubble_fraction:.1f} %; "
        f"{cost.tokens_per_step / sim.iteration_s:,.0f} tokens/s"
    )
    for s, u in enumerate(sim.utilisation()):
        console.print(f"  stage {s} ({plan.stages[s].chip}): utilisation {100 * u:.1f} %")
    if not cost.fits:
        console.print("[yellow]the plan does not fit:[/] " + "; ".join(cost.reasons))
    if args.out:
        out = Path(args.out)
        if out.is_dir() and any(out.iterdir()):  # an earlier simulation: kept whole, beside it
            say(
                None,
                f"the earlier output in {out} is kept in {keep_aside(out)}",
                style="bold yellow",
                prog="h2jax simulate",
            )
        sim.save_trace(out / "trace.json")
        sim.plot(out / "gantt.png", title=f"{Path(args.plan).name} on {cluster.name}")
        console.print(f"wrote {out / 'trace.json'} and {out / 'gantt.png'}")
    return 0


def _measure(args: argparse.Namespace, raw: dict) -> dict:
    """Time the stage programs on the chip's devices (imports JAX; registers emulated chips first)."""

    from h2jax._strict import build_dataclass
    from h2jax.config import ConfigError, resolve_chip
    from h2jax.models import GPTConfig

    try:
        chip = resolve_chip(args.chip, {"nodes": 1})
        # every model key (GQA, tying, RoPE scaling, dtype): the programs measured are the model's own
        cfg = build_dataclass(GPTConfig, dict(raw), "model")
    except (ConfigError, ValueError) as e:
        raise _fail(e) from None
    if not chip.emulated:
        import jax

        try:
            jax.devices(chip.platform)
        except RuntimeError:
            raise _fail(
                ConfigError(
                    "--chip",
                    f"{args.chip}: --measure times the chip's own devices ({chip.platform}), and this host has "
                    f"none (its backends: {', '.join(sorted({d.platform for d in jax.devices()}))}); "
                    f"drop --measure for a roofline estimate, or measure on a host with the chip",
                )
            ) from None
        print(f"measuring on the local {chip.platform} backend")
    from h2jax._hostload import OtherWork, loaded
    from h2jax.plan import local_cores
    from h2jax.runtime import ProfileNoiseError, profile_chip

    try:
        with OtherWork() as other:
            rows = profile_chip(
                args.chip,
                chip,
                cfg,
                tensor_degrees=args.tensor,
                microbatches=args.microbatch,
                repeats=args.repeats,
                statistic=args.statistic,
            )
    except ProfileNoiseError as e:  # nothing written: the table on disk is left as it was
        say("profile not measured", f"{e}; nothing written")
        raise SystemExit(EXIT_FAIL) from None
    if chip.emulated and loaded(other.cores, local_cores()):  # an emulated chip's times are this host's
        say(
            None,
            f"other work kept {other.cores:.1f} of this host's {local_cores()} cores busy while {args.chip} was "
            "measured: its times are slower than the chip alone, and a plan that compares it with other chip "
            "types leans away from it; measure again on a quiet host (`h2jax plan` names such profiles)",
            style="bold yellow",
            prog="h2jax profile",
        )
    if not chip.emulated:
        return {"rows": rows, "host_cores": None, "driver": None, "other_cores": None}
    # every emulated chip computes on this machine: what its figures are out of, and what the
    # runtime's own driver takes from it (a null model through the real trainer)
    driver = None
    if not args.no_driver:
        from h2jax.runtime import profile_driver

        try:
            driver = profile_driver(args.chip, statistic=args.statistic)
        except Exception as e:  # noqa: BLE001 - e.g. a 1-core host: only one emulated node could be made
            print(f"the driver's costs were not measured ({type(e).__name__}: {e}); the cost model leaves them out")
    return {"rows": rows, "host_cores": local_cores(), "driver": driver, "other_cores": other.cores}


def cmd_profile(args: argparse.Namespace) -> int:
    from h2jax._units import MIB
    from h2jax.plan import ProfileError, ProfileTable, load_chip, roofline_costs

    try:
        chip, _ = load_chip(args.chip)
        model, raw = _model(args.model, None)
    except (ProfileError, ValueError) as e:
        raise _fail(e) from None
    table = ProfileTable.load(args.out) if args.out else ProfileTable()
    got = _measure(args, raw) if args.measure else {"rows": {}, "host_cores": None, "driver": None, "other_cores": None}
    measured = got["rows"]
    for t in args.tensor:
        for b in args.microbatch:
            hit = measured.get((t, b))
            parts = hit or roofline_costs(model, chip, tensor=t, microbatch=b)
            table.add(
                chip.name,
                model.key(),
                t,
                b,
                parts,
                host_cores=got["host_cores"] if hit else None,
                other_cores=got["other_cores"] if hit else None,
            )
            blk = parts["block"]
            print(
                f"{chip.name} tensor={t} microbatch={b}: block fwd {blk.fwd_s * 1e3:.3f} ms, bwd "
                f"{blk.bwd_s * 1e3:.3f} ms, params {blk.param_bytes / MIB:.1f} MiB, activations "
                f"{blk.act_bytes / MIB:.1f} MiB ({'estimated: roofline' if blk.estimated else 'measured'})"
            )
    if got["host_cores"] is not None:
        print(f"host: {chip.host!r}, {got['host_cores']} cores (every emulated chip computes on this machine)")
    if got["driver"] is not None:
        d = got["driver"]
        table.driver[chip.host] = d
        print(
            f"runtime driver on {chip.host!r}: {1e3 * d.step_s:.2f} ms per step outside the programs, CPU "
            f"{1e3 * d.step_cpu_s:.2f} ms per step, {1e3 * d.op_cpu_s:.3f} ms per forward/backward beyond its "
            f"call, {1e3 * d.transfer_cpu_s:.3f} ms per boundary tensor"
        )
    if args.out:
        table.save(args.out)
        print(f"wrote {args.out}")
    return 0
