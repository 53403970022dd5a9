"""HeteroAuto as users run it: `h2jax plan`'s defaults on 512 to 10,000 chips, and how far its
plans are from the optimum.

    python benchmarks/planner_scale.py

No per-cluster option: every search runs with exactly the options `h2jax plan CLUSTER` uses
(``h2jax.cli_plan.search_options`` with its defaults: the search sets its own effort within
the default time budget). Each search runs as `h2jax plan` runs it: once in a fresh process
(nothing cached from an earlier search), `--repeats` times (default 3) per cluster, since one
run on a shared machine can take up to half as long again as the next. Per cluster one row: the
median search time (wall and CPU) with the range over the runs, when the plan was found,
estimated iteration time, the lower bound and the gap to it, stages, whether the search was
exhaustive (of the run with the median time), the HeteroSpeedupRatio at the matched total batch
(the homogeneous jobs' batches sum to the global batch, the split searched) and at the same global
batch (each homogeneous job at the whole batch), each chip type's jobs searched the same way
(h2jax.plan._baselines), and the share of the cluster's chips the plan uses.

Then the enumeration study: on mid-size instances (64-256 chips; the generator of
tests/plan/test_search_effort.py) the exact search covers the whole space, so the defaults'
plan is compared with the true optimum, and the optimum's own distance from the lower bound
says how much of the gap at scale is the bound's looseness rather than the search's.

The search is anytime: "found s" is when the returned plan was found, the rest of the search
time looked for a better one (convergence needs two beam rounds without improvement).

Search times scale with the machine's single-core speed, which differs 2-2.5x between the
machines this was run on (docs/LOG.md). So the run first and last times a fixed pure-Python
reference, ``sum(i * i for i in range(100000))`` (best of 5 x 20, the same as
``python3 -m timeit -n 20 "sum(i*i for i in range(100000))"``), and reports it beside the
search times: runs on different machines compare through it.

After the one-pipeline search, as `h2jax plan` does: the search over plans of several pipelines
(h2jax.plan.search_pipelines, within the same time budget, its one-type pipelines the baselines'
searches) and the faster of the two plans chosen; the ratios are the chosen plan's. Where the
matched-total ratio is below 100 %, what bounds it, as `h2jax plan --prove 30` prints it (not part
of the search's time): the one-pipeline search run on to its exact round within 30 s (its optimum,
or where it does not end, its lower bound), the plan of one pipeline per chip type, and with two
chip types whether that proves no plan of the space reaches 100 %.

Last line: ``RESULT {json}`` with search_s, found_s, cpu_s (medians of the one-pipeline search),
search_s_runs (every run), pipelines_search_s (the search over several pipelines), iteration_s,
lower_bound_s, gap (the one pipeline's), ratio_matched_total and ratio_same_batch (the chosen
plan's), ratio_matched_total_one_pipeline, chosen (per cluster: "one pipeline" or the plan of
several), chips_used (the chosen plan's), pipelines (the search over several pipelines: its best
plan, one pipeline per chip type, partitions priced; per cluster, by chip count), ratio_bound
(per cluster below 100 %: one_pipeline_max_ratio, one_pipeline_exact, space_below, space_max_ratio,
space_bound), pipelines_bound (per cluster: h2jax.plan.pipelines_bound over every partition, no
budget -- bound_s, where it is reached, its seconds, max_ratio_matched_total), baselines_s (the
same-batch and matched-total baselines' searches, the matched total's grid refined, on the
worker processes `h2jax plan` starts by default: h2jax.plan.default_workers),
ratio_same_batch_512, the study's max_default_over_optimum and optimum_gap_to_bound (min,
median, max), and reference_ms (the reference before and after the whole run, and timed in
each search's process right before it: per cluster, the median).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path
from types import SimpleNamespace

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "plan"))

from h2jax.cli_compare import bounds  # noqa: E402
from h2jax.cli_plan import search_options  # noqa: E402
from h2jax.plan import (  # noqa: E402
    Cluster,
    ModelShape,
    Searcher,
    SearchOptions,
    default_workers,
    matched_total,
    pipelines_bound,
    prove,
    same_batch,
    search,
    search_pipelines,
)

CLUSTERS = ["mixed_gaudi2_h100", "hetero_1024", "hetero_2432", "hetero_10000"]
PROVE_S = 30.0  # `h2jax plan --prove`'s seconds where the matched-total ratio is below 100 %


def reference_ms() -> float:
    """The machine's single-core speed: milliseconds of ``sum(i * i for i in range(100000))``,
    best of 5 x 20 (what ``python3 -m timeit -n 20`` reports)."""
    return 1e3 * min(timeit.repeat("sum(i * i for i in range(100000))", number=20, repeat=5)) / 20


def load(name: str):
    path = ROOT / "configs" / "clusters" / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    return Cluster.load(path), ModelShape.from_config(raw["model"]), raw["global_batch"]


def one(name: str) -> None:
    """One cold search of cluster `name` (this process has searched nothing before): a JSON line."""
    cluster, model, gb = load(name)
    ref = reference_ms()
    c0 = time.process_time()
    r = search(cluster, model, global_batch=gb, opts=search_options(cluster))
    cpu = time.process_time() - c0
    print(
        json.dumps(
            {
                "reference_ms": ref,
                "search_s": r.search_s,
                "found_s": r.found_s,
                "cpu_s": cpu,
                "iteration_s": r.iteration_s,
                "lower_bound_s": r.lower_bound_s,
                "gap": r.gap,
                "stages": r.plan.num_stages if r.plan else 0,
                "tokens_per_s": r.cost.tokens_per_s if r.plan else 0.0,
                "chips_used": sum(r.cost.devices_by_chip.values()) / cluster.num_devices if r.plan else 0.0,
                "order": list(dict.fromkeys(s.chip for s in r.plan.stages)) if r.plan else [],
                "exhaustive": r.exhaustive,
                "note": r.note,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="cold searches per cluster, each in a fresh process")
    ap.add_argument("--one", metavar="CLUSTER", help=argparse.SUPPRESS)  # a child: one search, one JSON line
    args = ap.parse_args()
    if args.one:
        one(args.one)
        return
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: expected 1 or more")
    keys = (
        "search_s",
        "found_s",
        "cpu_s",
        "search_s_runs",
        "iteration_s",
        "lower_bound_s",
        "gap",
        "ratio_matched_total",
        "ratio_same_batch",
        "chips_used",
    )
    result: dict = {k: {} for k in keys}
    result["reference_ms"] = {}
    result["pipelines"] = {}
    result["pipelines_search_s"] = {}
    result["ratio_matched_total_one_pipeline"] = {}
    result["chosen"] = {}
    result["ratio_bound"] = {}
    result["pipelines_bound"] = {}
    result["baselines_s"] = {}
    ref_before = reference_ms()
    print(f"load average before: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    print(f"reference before: {ref_before:.2f} ms (sum(i * i for i in range(100000)), best of 5 x 20)")
    print(f"each search: {args.repeats} cold runs in fresh processes; medians, the range in brackets")
    print(
        f"{'cluster':<18} {'chips':>6} {'types':>5} {'search s':>8} {'(range)':>13} {'found s':>7} {'cpu s':>6} "
        f"{'iter s':>8} {'bound s':>8} {'gap':>6} {'stages':>6} {'exhaustive':>10} {'matched':>7} {'same':>7} "
        f"{'used':>5} {'ref ms':>6}"
    )
    for name in CLUSTERS:
        cluster, model, gb = load(name)
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--one", name], capture_output=True, text=True
            )
            if out.returncode != 0:
                sys.stderr.write(out.stderr[-4000:])
                sys.exit(f"planner_scale: the search of {name} failed (exit {out.returncode}; its output above)")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        times = [r["search_s"] for r in runs]
        mid = sorted(runs, key=lambda r: r["search_s"])[len(runs) // 2]  # the run with the median time
        ratio = matched = one_matched = float("nan")
        split = per_line = space_line = ""
        bound_lines: list[str] = []
        chips_used, chosen = mid["chips_used"], "one pipeline"
        if mid["stages"]:  # each chip type alone, searched as `h2jax plan` does (h2jax.plan._baselines)
            opts = search_options(cluster)
            searcher = Searcher(cluster, model, opts=opts, workers=default_workers(len(cluster.names)))
            t_base = time.perf_counter()
            same, base = same_batch(searcher, gb), matched_total(searcher, gb)
            searcher.close()  # as `h2jax plan` does: the search over several pipelines runs in this process
            result["baselines_s"][str(cluster.num_devices)] = round(time.perf_counter() - t_base, 1)
            split = f"{base.describe()}; both baselines searched in {time.perf_counter() - t_base:.1f} s"
            tps = one_matched_tps = mid["tokens_per_s"]
            # then, as `h2jax plan` does, the plans of several pipelines, and the faster plan chosen
            grid = gb // base.unit  # the several pipelines' shares on the baseline's grid, as `h2jax plan` puts them
            several = search_pipelines(searcher, gb, order=mid["order"], time_budget_s=opts.time_budget_s, grid=grid)
            result["pipelines"][str(cluster.num_devices)] = several.to_dict(base)
            result["pipelines_search_s"][str(cluster.num_devices)] = round(several.search_s, 3)
            if several.cost is not None and several.cost.iteration_s < mid["iteration_s"]:
                tps, chosen = several.cost.tokens_per_s, several.describe()
                chips_used = sum(several.cost.devices_by_chip.values()) / cluster.num_devices
            ratio, matched, one_matched = same.ratio(tps), base.ratio(tps), base.ratio(one_matched_tps)
            # the lower bound over the plans of one and of several pipelines, every partition (no budget)
            space = pipelines_bound(searcher, gb, order=mid["order"], grid=grid)
            result["pipelines_bound"][str(cluster.num_devices)] = {
                **space.to_dict(),
                "max_ratio_matched_total": round(base.ratio(gb * model.seq_len / space.bound_s), 4),
            }
            space_line = (
                f"  lower bound over the space of one and several pipelines ({space.partitions} partitions, "
                f"{space.seconds:.1f} s): {space.bound_s:.3f} s at {space.describe()}: matched-total ratio at most "
                f"{100 * base.ratio(gb * model.seq_len / space.bound_s):.1f} %"
            )
            if matched < 1.0:  # what bounds it: `h2jax plan --prove PROVE_S`, as a user asks for it
                # the bound is the proof's (exact, or its lower bound where its budget ends first)
                res = SimpleNamespace(
                    exhaustive=False, iteration_s=mid["iteration_s"], lower_bound_s=mid["lower_bound_s"]
                )
                proof = prove(cluster, model, global_batch=gb, opts=opts, budget_s=PROVE_S)
                bound = bounds(res, proof, several, base, cluster, gb, model, tps, space)
                result["ratio_bound"][str(cluster.num_devices)] = {k: v for k, v in bound.items() if k != "lines"}
                bound_lines = bound["lines"]
            per_line = (
                f"  several pipelines ({several.priced} of {several.partitions} partitions priced in "
                f"{several.search_s:.2f} s): best {several.describe()}"
                + (f", {several.cost.iteration_s:.3f} s ({several.cost.exchange_words()})" if several.cost else "")
                + f"; chosen: {chosen}"
            )
            if several.per_chip is not None:
                pc = several.per_chip
                per_line += (
                    f"\n  one pipeline per chip type: {pc.iteration_s:.3f} s, {pc.exchange_words()}; "
                    f"matched-total ratio {100 * base.ratio(pc.tokens_per_s):.1f} %"
                )
        n = str(cluster.num_devices)
        result["search_s"][n] = round(statistics.median(times), 3)
        result["found_s"][n] = round(statistics.median(r["found_s"] for r in runs), 3)
        result["cpu_s"][n] = round(statistics.median(r["cpu_s"] for r in runs), 3)
        result["search_s_runs"][n] = [round(t, 3) for t in times]
        result["iteration_s"][n] = round(mid["iteration_s"], 3)
        result["lower_bound_s"][n] = round(mid["lower_bound_s"], 3)
        result["gap"][n] = round(mid["gap"], 3)
        result["ratio_same_batch"][n] = round(ratio, 4)
        result["ratio_matched_total"][n] = round(matched, 4)
        result["ratio_matched_total_one_pipeline"][n] = round(one_matched, 4)
        result["chosen"][n] = chosen
        result["chips_used"][n] = round(chips_used, 4)
        result["reference_ms"][n] = round(statistics.median(r["reference_ms"] for r in runs), 2)
        spread = f"({min(times):.2f}-{max(times):.2f})"
        print(
            f"{name:<18} {n:>6} {len(cluster.names):>5} {result['search_s'][n]:>8.2f} {spread:>13} "
            f"{result['found_s'][n]:>7.2f} {result['cpu_s'][n]:>6.2f} {mid['iteration_s']:>8.3f} "
            f"{mid['lower_bound_s']:>8.3f} {100 * mid['gap']:>5.1f}% {mid['stages']:>6} "
            f"{str(mid['exhaustive']):>10} {100 * matched:>6.1f}% {100 * ratio:>6.1f}% {100 * chips_used:>4.0f}% "
            f"{result['reference_ms'][n]:>6.2f}",
            flush=True,
        )
        print(f"  {mid['note']}")
        if split:
            print(f"  matched total: homogeneous {split}")
        if per_line:
            print(per_line)
        if space_line:
            print(space_line)
        for line in bound_lines:
            print(f"  bound: {line}")
        if len({round(r["iteration_s"], 9) for r in runs}) > 1:
            print(
                f"  the runs' plans differ (the budget bought more or fewer rounds): {[r['iteration_s'] for r in runs]}"
            )
    result["ratio_same_batch_512"] = result["ratio_same_batch"]["512"]

    from test_search_effort import MID_SIZE_SEEDS, mid_size_instance

    print("\nenumeration study (defaults vs the exact optimum; 64-256 chips)")
    print(f"{'seed':>4} {'chips':>5} {'exact s':>7} {'default s':>9} {'default/opt':>11} {'opt gap to bound':>16}")
    over, opt_gap = [], []
    for seed in MID_SIZE_SEEDS:
        cluster, model, gb = mid_size_instance(seed)
        exact = search(cluster, model, global_batch=gb, opts=SearchOptions(auto=False, time_budget_s=None))
        got = search(cluster, model, global_batch=gb, opts=search_options(cluster))
        over.append(got.iteration_s / exact.iteration_s - 1)
        opt_gap.append(exact.gap)
        print(
            f"{seed:>4} {cluster.num_devices:>5} {exact.search_s:>7.2f} {got.search_s:>9.2f} "
            f"{100 * over[-1]:>+10.2f}% {100 * exact.gap:>15.1f}%",
            flush=True,
        )
    result["max_default_over_optimum"] = round(max(over), 4)
    result["optimum_gap_to_bound"] = {
        "min": round(min(opt_gap), 3),
        "median": round(statistics.median(opt_gap), 3),
        "max": round(max(opt_gap), 3),
    }
    print(f"load average after: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    ref_after = reference_ms()
    print(f"reference after: {ref_after:.2f} ms")
    result["reference_ms"].update({"before": round(ref_before, 2), "after": round(ref_after, 2)})
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
