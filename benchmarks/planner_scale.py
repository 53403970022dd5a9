"""HeteroAuto search time at scale: a 100B-class GPT on 1,024, 2,432 and 10,000 chips.

    python benchmarks/planner_scale.py

Prints one row per cluster (search time, estimated iteration time, lower bound and gap,
stages, whether the order is memory-descending) and, last, ``RESULT {json}``.
Exact search (every per-chip choice, every order) is proven on small instances by
tests/plan/test_search_optimal.py; at these sizes the search runs with chip grouping
(`group_size`), a beam of per-chip choices and an order neighbourhood, and the gap to
the (memory-aware) lower bound says how much could at most be left on the table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from h2jax.plan import Cluster, ModelShape, SearchOptions, search  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# cluster file, search options. Re-chosen when the roofline's activation count doubled
# (session 3; docs/LOG.md): the old ones (groups 128/128/256, beams 4/3/2) then took 0.15 /
# 1.2 / 27 s and found plans as fast as or slower than these.
RUNS = [
    ("hetero_1024", SearchOptions(group_size=64, max_options_per_chip=3, max_orders=6)),
    ("hetero_2432", SearchOptions(group_size=128, max_options_per_chip=2, max_orders=6)),
    ("hetero_10000", SearchOptions(group_size=512, max_options_per_chip=1, max_orders=6)),
]


def main() -> None:
    result: dict = {"search_s": {}, "iteration_s": {}, "lower_bound_s": {}, "gap": {}}
    print(
        f"{'cluster':<14} {'chips':>6} {'types':>5} {'tokens/step':>12} {'search s':>9} {'iter s':>8} "
        f"{'bound s':>8} {'gap':>7} {'stages':>6} {'mem-desc':>8}"
    )
    for name, opts in RUNS:
        raw = yaml.safe_load((ROOT / "configs" / "clusters" / f"{name}.yaml").read_text())
        cluster = Cluster.load(ROOT / "configs" / "clusters" / f"{name}.yaml")
        model = ModelShape.from_config(raw["model"])
        r = search(cluster, model, global_batch=raw["global_batch"], opts=opts)
        n = str(cluster.num_devices)
        result["search_s"][n] = round(r.search_s, 3)
        result["iteration_s"][n] = round(r.iteration_s, 3)
        result["lower_bound_s"][n] = round(r.lower_bound_s, 3)
        result["gap"][n] = round(r.gap, 3)
        print(
            f"{name:<14} {n:>6} {len(cluster.names):>5} {raw['global_batch'] * model.seq_len:>12,} "
            f"{r.search_s:>9.2f} {r.iteration_s:>8.2f} {r.lower_bound_s:>8.2f} {100 * r.gap:>6.1f}% "
            f"{r.plan.num_stages if r.plan else 0:>6} {str(r.memory_descending):>8}",
            flush=True,
        )
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
