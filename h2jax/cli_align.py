"""``h2jax align``: numerical alignment of chip types against a float64 host reference.

Exit codes: 0 every gate passes, 1 some gate fails, 2 bad input (one line on stderr).
See docs/ALIGN.md for the commands and how to read the report.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from h2jax._errors import EXIT_FAIL, EXIT_OK, fail, say
from h2jax._paths import keep_aside


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``align`` on the ``h2jax`` parser."""
    a = subparsers.add_parser(
        "align", help="compare chip types' numerics against a float64 reference: op, layer and run level"
    )
    a.add_argument("config", nargs="*", help="[CONFIG.yaml] [key=value ...] (the experiment: model, data, plan)")
    a.add_argument(
        "--chips", nargs="+", default=None, help="chip types to compare (default: the cluster's); `cpu` is the host"
    )
    a.add_argument(
        "--levels",
        nargs="+",
        default=["op", "layer"],
        choices=("op", "layer", "run"),
        help="which levels (default: op layer)",
    )
    a.add_argument("--steps", type=int, default=300, help="training steps of the run level (default 300)")
    a.add_argument(
        "--numerics",
        nargs="*",
        default=[],
        metavar="CHIP.KEY=VALUE",
        help="policy of a chip type, e.g. sim_b.matmul_input_rounding=bf16 sim_b.matmul_precision=highest",
    )
    a.add_argument("--tol", nargs="*", default=[], metavar="PRIMITIVE=RTOL", help="per-primitive op tolerance (rel L2)")
    a.add_argument("--layer-gate", type=float, default=2e-3, help="layer level: max rel L2 of outputs and gradients")
    a.add_argument("--mre-gate", type=float, default=0.015, help="run level: max loss mean relative error")
    a.add_argument("--op-microbatches", type=int, default=1, help="microbatches of step 0 the op level traces")
    a.add_argument(
        "--all-ops",
        action="store_true",
        help="op level: also compare ops that only move elements (reshape, gather, ...)",
    )
    a.add_argument(
        "--trainer",
        action="store_true",
        help="run level: also train the plan with the real pipeline trainer (fp32 for now)",
    )
    a.add_argument("--no-plan", action="store_true", help="run level: skip the heterogeneous plan's run")
    a.add_argument("--out", default=None, help="report folder (default: <train.out_dir>/<name>/align)")
    a.add_argument("--top", type=int, default=12, help="ops shown in the terminal table")
    a.add_argument("--replay", default=None, metavar="FILE", help="re-run the op dumped in FILE (needs --chip)")
    a.add_argument("--chip", default=None, help="with --replay: the chip type to run the op on")
    # TEST-ONLY: perturb one primitive on a chip type, to prove the tool finds real faults
    a.add_argument("--inject-fault", nargs="*", default=[], help=argparse.SUPPRESS)
    a.set_defaults(func=cmd_align)


def _pairs(items: Sequence[str], what: str) -> dict[str, float]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            out[key] = float(value)
        except ValueError:
            sep = ""
        if not sep or not key:
            raise ValueError(f"{what} {item!r}: expected NAME=NUMBER")
    return out


def cmd_align(args: argparse.Namespace) -> int:
    from h2jax.align import AlignInputError, Fault, NumericsError, PolicyError
    from h2jax.config import ConfigError, load_config

    try:
        if args.replay is not None:
            return _replay(args)
        items = list(args.config)
        path = items.pop(0) if items and "=" not in items[0] else None
        if any("=" not in it for it in items):
            raise ConfigError(items[0], "expected key=value overrides after the config file (one config file at most)")
        cfg = load_config(path, items)
        tolerances = _pairs(args.tol, "--tol")
        faults = {}
        for spec in args.inject_fault:
            chip, _, rest = spec.partition("=")
            faults[chip] = Fault.parse(rest)
        from pathlib import Path

        out = Path(args.out) if args.out else Path(cfg.train.out_dir) / cfg.name / "align"
        if out.exists() and not out.is_dir():
            raise ConfigError("--out", f"{out} is a file; expected a folder for the report")
        if out.is_dir() and any(out.iterdir()):  # an earlier report: kept whole, beside it
            kept = keep_aside(out)
            say(None, f"the earlier report in {out} is kept in {kept}", style="bold yellow", prog="h2jax align")
        from h2jax.align import align

        report = align(
            cfg,
            chips=args.chips,
            levels=args.levels,
            numerics=args.numerics,
            steps=args.steps,
            layer_gate=args.layer_gate,
            mre_gate=args.mre_gate,
            tolerances=tolerances,
            microbatches=args.op_microbatches,
            plan=not args.no_plan,
            out_dir=out,
            faults=faults,
            all_ops=args.all_ops,
            trainer=args.trainer,
        )
    except (ConfigError, AlignInputError, NumericsError, PolicyError, ValueError) as e:
        return fail(None, str(e), prog="h2jax align")
    report.print(top=args.top)
    return EXIT_OK if report.passed() else EXIT_FAIL


def _replay(args: argparse.Namespace) -> int:
    from h2jax.align import replay

    if args.chip is None:
        raise ValueError("--replay needs --chip CHIP (the chip type to run the op on)")
    result = replay(args.replay, args.chip, numerics=args.numerics, tolerances=_pairs(args.tol, "--tol"))
    json.dump(result, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")
    return EXIT_FAIL if result["status"] == "fail" else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m h2jax.cli_align ...``: the align command on its own (until ``h2jax`` wires it)."""
    parser = argparse.ArgumentParser(prog="h2jax")
    sub = parser.add_subparsers(dest="command", required=True)
    add_commands(sub)
    args = parser.parse_args(["align", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
