"""``h2jax plan``'s second half: the chip types alone, the plans of several pipelines, the ratios.

After the one-pipeline search (``h2jax.cli_plan``), with more than one chip type: each chip type
trained alone (h2jax.plan._baselines: at the same global batch, and on shares that add up to
it, the split searched), the search over plans of several pipelines (h2jax.plan._pipeline_search,
whose one-type pipelines are those same searches), the faster of the two plans chosen, and the
HeteroSpeedupRatios of the chosen plan, each naming its batches, with what bounds them.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from h2jax.cli_explain import fmt_s as _fmt_s


def ratio_line(base, hetero_tps: float, what: str) -> str:
    """One HeteroSpeedupRatio, named by `what` (which global batch each side trained at)."""
    if base.tokens_per_s <= 0:
        return f"HeteroSpeedupRatio {what}: not defined, no chip type has a plan of its own"
    missing = base.without_plan()
    over = f" (no plan alone: {', '.join(missing)})" if missing else ""
    return f"HeteroSpeedupRatio {what}{over}: {100 * base.ratio(hetero_tps):.1f} %"


def _job_text(r) -> str:
    """One homogeneous job's tokens/s and whether its search was exhaustive, or why it has no plan."""
    if r.plan is None:
        return f"no plan: {r.note}"
    return f"{r.cost.tokens_per_s:,.0f} tokens/s ({'exact' if r.exhaustive else 'not exhaustive: ' + r.note})"


def stages_table(title: str, plan, cost) -> Any:
    """A rich table of one pipeline's stages with their costs."""
    from rich.table import Table

    from h2jax._units import GIB

    tbl = Table(title=title)
    for col in ("stage", "chip", "data x tensor", "layers", "recompute", "fwd+bwd / mb", "costs", "memory / device"):
        tbl.add_column(col)
    for i, (s, c) in enumerate(zip(plan.stages, cost.stages)):
        tbl.add_row(
            str(i),
            s.chip,
            f"{s.data} x {s.tensor}",
            ", ".join(f"{a}-{b - 1}" for a, b in s.layer_chunks),  # a chunked stage: each chunk
            "yes" if s.recompute else "no",
            _fmt_s(c.t),
            f"roofline ({s.tensor}, {plan.microbatch_size // s.data})" if c.estimated else "measured",
            f"{c.memory.total / GIB:.1f} / {c.memory_limit / GIB:.0f} GiB",
        )
    return tbl


def _several_idle(several, cluster) -> dict[str, tuple[int, str]]:
    """Chips a plan of several pipelines leaves idle, by chip type, with why (each pipeline's own
    reasons, h2jax.plan.idle_chips on its chip types)."""
    from h2jax.plan import idle_chips

    out: dict[str, tuple[int, str]] = {}
    for group, pipe, c in zip(several.groups, several.plan.pipeline_plans(), several.cost.pipelines):
        for chip, (n, why) in idle_chips(SimpleNamespace(plan=pipe, cost=c), cluster.only(*group)).items():
            out[chip] = (n, f"pipeline {'+'.join(group)}: {why}")
    for chip in cluster.names:
        if not any(chip in g for g in several.groups):
            out[chip] = (
                cluster.devices(chip),
                "no pipeline: any share of the batch given to them made the step slower",
            )
    return out


def compare(console, args, res, cluster, model, gb: int, table, opts, idle: dict) -> SimpleNamespace:
    """The second half of ``h2jax plan`` (module docstring). The chosen plan: ``plan``,
    ``tokens_per_s``, ``devices_by_chip``, ``idle`` ({chip type: (chips, why)}) and ``report``
    (comparison.json's ``heterospeedup``; None with one chip type). `idle`: the one pipeline's."""
    from h2jax.plan import (
        Searcher,
        default_workers,
        matched_total,
        pipelines_bound,
        prove,
        same_batch,
        search,
        search_pipelines,
    )

    cost = res.cost
    chosen = SimpleNamespace(
        plan=res.plan, tokens_per_s=cost.tokens_per_s, devices_by_chip=cost.devices_by_chip, idle=idle, report=None
    )
    if len(cluster.names) == 1:
        return chosen
    workers = args.workers or default_workers(len(cluster.names))
    searcher = Searcher(cluster, model, table=table, opts=opts, workers=workers)
    same, matched = same_batch(searcher, gb), matched_total(searcher, gb)
    for name, r in same.results.items():
        console.print(f"  homogeneous {name} ({cluster.devices(name)} chips) at global batch {gb}: {_job_text(r)}")
    for name, r in matched.results.items():
        if r is not None:
            console.print(f"  homogeneous {name} at global batch {matched.shares[name]}: {_job_text(r)}")
    tps = cost.tokens_per_s
    several = None
    if args.max_pipelines != 1:
        order = list(dict.fromkeys(s.chip for s in res.plan.stages))
        several = search_pipelines(  # shares on the matched-total baseline's grid
            searcher,
            gb,
            order=order,
            time_budget_s=opts.time_budget_s,
            max_pipelines=args.max_pipelines,
            grid=gb // matched.unit,
        )
        space = "every partition" if several.every_partition else "partitions into runs of the stage order's chip types"
        step = f"shares in steps of {several.unit}" + (", then balanced to the sequence" if several.balanced else "")
        console.print(
            f"several pipelines: searched {several.priced} of {several.partitions} partitions of the chip types "
            f"({space}; {step}) in {several.search_s:.3f} s"
        )
        if several.plan is None:
            console.print("  no plan of several pipelines fits")
        else:
            c = several.cost
            faster = c.iteration_s < cost.iteration_s
            console.print(
                f"  best: {several.describe()}: estimated iteration {_fmt_s(c.iteration_s)}, "
                f"{c.exchange_words(_fmt_s)}, {c.tokens_per_s:,.0f} tokens/s: "
                + (
                    f"[bold]{cost.iteration_s / c.iteration_s:.3f}x the one pipeline's: chosen[/]"
                    if faster
                    else f"slower than the one pipeline ({cost.iteration_s / c.iteration_s:.3f}x): not chosen"
                )
            )
            if faster:
                tps = c.tokens_per_s
                chosen = SimpleNamespace(
                    plan=several.plan,
                    tokens_per_s=tps,
                    devices_by_chip=c.devices_by_chip,
                    idle=_several_idle(several, cluster),
                    report=None,
                )
                for group, pipe, pc in zip(several.groups, several.plan.pipeline_plans(), c.pipelines):
                    console.print(
                        stages_table(
                            f"pipeline {'+'.join(group)}: global batch {pipe.global_batch} = {pipe.num_microbatches}"
                            f" x {pipe.microbatch_size}, {pipe.schedule}, iteration {_fmt_s(pc.iteration_s)}",
                            pipe,
                            pc,
                        )
                    )
                for chip in cluster.names:
                    console.print(f"  {c.devices_by_chip.get(chip, 0)} of {cluster.devices(chip)} {chip} used")
                for chip, (n, why) in chosen.idle.items():
                    console.print(f"  {n} {chip} chips left idle: {why}")
                if c.exchange_note:
                    console.print(f"  note: {c.exchange_note}")
    console.print(f"[bold]{ratio_line(same, tps, f'at the same global batch ({gb} hetero, {gb} homogeneous)')}[/]")
    console.print(
        "[bold]"
        + ratio_line(
            matched, tps, f"at the matched total batch ({gb} hetero; homogeneous {matched.describe()}, split searched)"
        )
        + "[/]"
    )
    if chosen.plan is not res.plan:
        console.print(f"  (the one pipeline: {ratio_line(matched, cost.tokens_per_s, 'at the matched total batch')})")
    proof = space = None
    if args.prove and matched.tokens_per_s > 0 and matched.ratio(tps) < 1.0:
        if not res.exhaustive:
            proof = prove(cluster, model, global_batch=gb, table=table, opts=opts, budget_s=args.prove)
        if several is not None:
            space = pipelines_bound(
                searcher,
                gb,
                order=order,
                max_pipelines=args.max_pipelines,
                grid=gb // matched.unit,
                budget_s=args.prove,
            )
    bound = bounds(res, proof, several, matched, cluster, gb, model, tps, space, args.prove or 0.0)
    limits = bound["lines"] if bound else []
    for line in limits:
        console.print(f"  {line}")
    report = {
        "same_batch": same.to_dict(tps),
        "matched_total": matched.to_dict(tps),
        "one_pipeline": {
            "tokens_per_s": round(cost.tokens_per_s, 1),
            "ratio_matched_total": round(matched.ratio(cost.tokens_per_s), 4),
        },
        "several_pipelines": several.to_dict(matched) if several is not None else None,
        "chosen": "several pipelines" if chosen.plan is not res.plan else "one pipeline",
        "limits": limits,
        "bound": {k: v for k, v in bound.items() if k != "lines"} if bound else None,
    }
    if args.other_global_batch:
        ogb = args.other_global_batch
        other = search(cluster, model, global_batch=ogb, table=table, opts=opts)
        if other.plan is None:
            console.print(f"heterogeneous at global batch {ogb}: no plan ({other.note})")
        else:
            console.print(
                ratio_line(
                    same,
                    other.cost.tokens_per_s,
                    f"with hetero at global batch {ogb}, homogeneous at {gb} (the mismatched ratio)",
                )
            )
            console.print(
                ratio_line(same_batch(searcher, ogb), other.cost.tokens_per_s, f"at the same global batch ({ogb} both)")
            )
    chosen.report = report
    searcher.close()
    return chosen


def bounds(
    res, proof, several, matched, cluster, gb: int, model, tps: float, space=None, budget_s: float = 0.0
) -> dict[str, Any] | None:
    """What bounds the matched-total ratio where it is below 100 % (None where it is not): the
    one-pipeline space's optimum where a search of it was exhaustive (the default search's, or
    `proof`'s: :func:`h2jax.plan.prove`, ``h2jax plan --prove``), else that search's lower bound;
    and the plan of one pipeline per chip type, which cannot beat the chip types alone on the
    same shares (each alone runs at its own pace; together all wait for the slowest, then
    exchange). With two chip types the plans of several pipelines are only those, so an exact
    one-pipeline optimum below 100 % proves no plan of the space reaches it (``space_below``).
    `space`: :func:`h2jax.plan.pipelines_bound` (``--prove``, within `budget_s`), the lower bound
    over the plans of one and of several pipelines; where it covers every partition and stays
    below 100 %, that proves it too. ``lines``: the same in words."""
    if matched.tokens_per_s <= 0 or matched.ratio(tps) >= 1.0:
        return None
    one = proof if proof is not None and (proof.exhaustive or not res.exhaustive) else res
    lines = []
    exact = one.exhaustive and one.plan is not None
    how = f"--prove's exact search, {proof.search_s:.1f} s" if one is proof else "the exact search"
    if exact:
        ratio = matched.ratio(one.cost.tokens_per_s)
        lines.append(
            f"no plan of one pipeline exceeds {100 * ratio:.1f} % (the optimum of its space, "
            f"{_fmt_s(one.iteration_s)}: {how}; {100 * one.cost.bubble_fraction:.1f} % of its step is the bubble "
            f"of its {one.plan.num_stages} stages)"
        )
        if one.iteration_s < res.iteration_s * (1 - 1e-9):
            lines.append(
                f"  --prove's exact search found a faster one-pipeline plan than the default search's "
                f"({_fmt_s(one.iteration_s)}); --time-budget 0 searches to it"
            )
    elif one.lower_bound_s > 0:
        ratio = matched.ratio(gb * model.seq_len / one.lower_bound_s)
        unproven = f"; --prove's exact search did not end within {proof.search_s:.1f} s" if proof is not None else ""
        lines.append(
            f"no plan of one pipeline exceeds {100 * ratio:.1f} % (the search's lower bound, "
            f"{_fmt_s(one.lower_bound_s)}{unproven})"
        )
    else:
        ratio = None
    if several is not None and several.per_chip is not None:
        pc = several.per_chip
        lines.append(
            f"one pipeline per chip type: {100 * matched.ratio(pc.tokens_per_s):.1f} % "
            f"({_fmt_s(pc.iteration_s)}, {pc.exchange_words(_fmt_s)} over {several.per_chip_link}); "
            "at a split the baseline tried it cannot exceed 100 %: alone each chip type runs at its own pace, "
            "together every pipeline waits for the slowest, then exchanges"
        )
    # splits balanced to the sequence (h2jax.plan._balance) lie off the baseline's and the bound's grid:
    # neither argument below covers them
    off_grid = several is not None and several.balanced
    below = exact and ratio < 1.0 and len(cluster.names) == 2 and not off_grid
    if below:
        lines.append(
            "so no plan of the space reaches 100 %: with two chip types its plans of several pipelines are one "
            "pipeline per chip type"
        )
    space_ratio = None
    if space is not None and not space.complete:
        lines.append(
            f"the lower bound over the plans of several pipelines did not end within {budget_s:g} s (a bound per "
            "group of chip types and share of the batch; more --prove seconds give it time)"
        )
    elif space is not None and math.isfinite(space.bound_s):
        space_ratio = matched.ratio(gb * model.seq_len / space.bound_s)
        n = space.partitions - 1
        grid = " on its share grid" if off_grid else ""
        lines.append(
            f"no plan of the space{grid} ({n} partition{'s' if n > 1 else ''} into several pipelines, and one "
            f"pipeline) exceeds {100 * space_ratio:.1f} % (at least {_fmt_s(space.bound_s)}: the least of each "
            f"pipeline's lower bound at its share, reached at {space.describe()}; the exchange left out; "
            f"{space.seconds:.1f} s)"
        )
        if space_ratio < 1.0 and off_grid:
            lines.append(
                "so no plan on the share grid reaches 100 %; the splits balanced to the sequence lie off it, "
                "where the bound does not reach"
            )
        elif space_ratio < 1.0 and not below:
            below = True
            lines.append("so no plan of the space reaches 100 %")
        elif not below:
            lines.append(
                "that bound leaves room above 100 %, so it does not decide whether a plan of the space reaches it: "
                "each pipeline's bound lies below its best plan, as the one pipeline's does"
            )
    return {
        "one_pipeline_max_ratio": None if ratio is None else round(ratio, 4),
        "one_pipeline_exact": exact,
        "space_below": below,
        "space_max_ratio": None if space_ratio is None else round(space_ratio, 4),
        "space_bound": space.to_dict() if space is not None else None,
        "lines": lines,
    }
