"""HeteroAuto as users run it: `h2jax plan`'s defaults on 512 to 10,000 chips, and how far its
plans are from the optimum.

    python benchmarks/planner_scale.py

No per-cluster option: every search runs with exactly the options `h2jax plan CLUSTER` uses
(``h2jax.cli_plan.search_options`` with its defaults: the search sets its own effort within
the default time budget). Per cluster one row: search time (wall and CPU: the machine may be
shared), estimated iteration time, the lower bound and the gap to it, stages, whether the
search was exhaustive, and the HeteroSpeedupRatio at the same global batch (each chip type's
baseline searched the same way).

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

Last line: ``RESULT {json}`` with search_s, found_s, cpu_s, iteration_s, lower_bound_s, gap,
ratio_same_batch (per cluster, by chip count), ratio_same_batch_512, the study's
max_default_over_optimum and optimum_gap_to_bound (min, median, max), and reference_ms (the
reference before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import timeit
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "plan"))

from h2jax.cli_plan import heteros_speedup, search_options  # noqa: E402
from h2jax.plan import Cluster, ModelShape, SearchOptions, search  # noqa: E402

CLUSTERS = ["mixed_gaudi2_h100", "hetero_1024", "hetero_2432", "hetero_10000"]


def reference_ms() -> float:
    """The machine's single-core speed: milliseconds of ``sum(i * i for i in range(100000))``,
    best of 5 x 20 (what ``python3 -m timeit -n 20`` reports)."""
    return 1e3 * min(timeit.repeat("sum(i * i for i in range(100000))", number=20, repeat=5)) / 20


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    keys = ("search_s", "found_s", "cpu_s", "iteration_s", "lower_bound_s", "gap", "ratio_same_batch")
    result: dict = {k: {} for k in keys}
    ref_before = reference_ms()
    print(f"load average before: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    print(f"reference before: {ref_before:.2f} ms (sum(i * i for i in range(100000)), best of 5 x 20)")
    print(
        f"{'cluster':<18} {'chips':>6} {'types':>5} {'search s':>8} {'found s':>7} {'cpu s':>6} {'iter s':>8} "
        f"{'bound s':>8} {'gap':>6} {'stages':>6} {'exhaustive':>10} {'ratio':>7}"
    )
    for name in CLUSTERS:
        path = ROOT / "configs" / "clusters" / f"{name}.yaml"
        raw = yaml.safe_load(path.read_text())
        cluster = Cluster.load(path)
        model = ModelShape.from_config(raw["model"])
        opts = search_options(cluster)  # the CLI's defaults, nothing per cluster
        c0 = time.process_time()
        r = search(cluster, model, global_batch=raw["global_batch"], opts=opts)
        cpu = time.process_time() - c0
        ratio = float("nan")
        if r.plan is not None:
            ratio, _ = heteros_speedup(
                cluster, model, global_batch=raw["global_batch"], hetero_tps=r.cost.tokens_per_s, table=None, opts=opts
            )
        n = str(cluster.num_devices)
        result["search_s"][n] = round(r.search_s, 3)
        result["found_s"][n] = round(r.found_s, 3)
        result["cpu_s"][n] = round(cpu, 3)
        result["iteration_s"][n] = round(r.iteration_s, 3)
        result["lower_bound_s"][n] = round(r.lower_bound_s, 3)
        result["gap"][n] = round(r.gap, 3)
        result["ratio_same_batch"][n] = round(ratio, 4)
        print(
            f"{name:<18} {n:>6} {len(cluster.names):>5} {r.search_s:>8.2f} {r.found_s:>7.2f} {cpu:>6.2f} "
            f"{r.iteration_s:>8.3f} "
            f"{r.lower_bound_s:>8.3f} {100 * r.gap:>5.1f}% {r.plan.num_stages if r.plan else 0:>6} "
            f"{str(r.exhaustive):>10} {100 * ratio:>6.1f}%",
            flush=True,
        )
        print(f"  {r.note}")
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
    result["reference_ms"] = {"before": round(ref_before, 2), "after": round(ref_after, 2)}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
