"""With measured profiles, the planner searches only what was measured.

A chip type profiled at some (tensor degree, sequences per device) is planned only at those:
a roofline estimate of a row nobody timed, beside measured rows, ranks by another yardstick
(on emulated chips it reads the spec sheet, not the host) -- the plan that lost to the
hand-made one in benchmarks/plan_vs_hand.py was such a row. ``--allow-estimates`` opens
the other rows again and the output names every stage priced by the roofline.
"""

from __future__ import annotations

import dataclasses
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from h2jax.plan import Cluster, ModelShape, SearchOptions, exhaustive, load_chip, search
from tests._harness import measured_table as _measured

ROOT = Path(__file__).resolve().parents[2]
SIM_MIX = ROOT / "configs" / "clusters" / "sim_mix.yaml"


def _sim_mix() -> tuple[Cluster, ModelShape, int]:
    raw = yaml.safe_load(SIM_MIX.read_text())
    return Cluster.from_dict(raw, name="sim_mix"), ModelShape.from_config(raw["model"]), int(raw["global_batch"])


def _rows(plan) -> list[tuple[str, int, int]]:
    return [(s.chip, s.tensor, plan.microbatch_size // s.data) for s in plan.stages]


def test_table_lists_its_measured_rows():
    cluster, model, _ = _sim_mix()
    table = _measured(model, {"sim_a": [(1, 2), (2, 4)]})
    assert table.measured_rows("sim_a", model) == {(1, 2), (2, 4)}
    assert table.measured_rows("sim_b", model) == frozenset()
    other = dataclasses.replace(model, d_model=64)
    assert table.measured_rows("sim_a", other) == frozenset()  # another shape: nothing measured


def test_search_uses_only_measured_rows():
    # measured slower than the roofline (as emulated chips are: the spec sheet is not the
    # host), at tensor 1 and 2 or 4 sequences per device only: without the restriction the
    # roofline's rows win; with it every stage is a measured row
    cluster, model, gb = _sim_mix()
    rows = {n: [(1, 2), (1, 4)] for n in ("sim_a", "sim_b")}
    table = _measured(model, rows, slow=5.0)
    got = search(cluster, model, global_batch=gb, table=table)
    assert got.plan is not None, got.note
    assert all((t, b) in rows[c] for c, t, b in _rows(got.plan)), _rows(got.plan)
    assert not any(s.estimated for s in got.cost.stages)
    free = search(cluster, model, global_batch=gb, table=table, opts=SearchOptions(measured_only=False))
    assert any(s.estimated for s in free.cost.stages), _rows(free.plan)  # the cheaper spec-sheet rows
    assert free.iteration_s < got.iteration_s


def test_a_chip_type_without_measurements_keeps_the_roofline():
    cluster, model, gb = _sim_mix()
    table = _measured(model, {"sim_a": [(1, 4)]})
    got = search(cluster, model, global_batch=gb, table=table)
    assert got.plan is not None, got.note
    for (c, t, b), s in zip(_rows(got.plan), got.cost.stages):
        assert (c, t, b) == ("sim_a", 1, 4) if c == "sim_a" else s.estimated


def test_no_plan_within_the_measured_rows_says_so():
    cluster, model, gb = _sim_mix()
    # 3 sequences per device divide no microbatch size of a global batch of 32
    table = _measured(model, {n: [(1, 3)] for n in ("sim_a", "sim_b")})
    got = search(cluster, model, global_batch=gb, table=table)
    assert got.plan is None
    assert "measured rows of sim_a ((tensor, sequences per device) (1, 3))" in got.note, got.note


@pytest.mark.parametrize("seed", range(12))
def test_search_equals_exhaustive_within_measured_rows(seed):
    # random small instances of sim_a / sim_b, each type measured at a random subset of rows;
    # the brute force walks the same restricted space
    rng = random.Random(seed)
    model = ModelShape(
        n_layers=rng.randint(2, 6), d_model=64, n_heads=4, d_ff=128, vocab_size=256, seq_len=32, act_bytes=4
    )
    chips = []
    for name in ("sim_a", "sim_b"):
        chip = dataclasses.replace(load_chip(name)[0], host=None, memory_gib=rng.choice([0.05, 1.0]))
        chips.append((chip, 1))
    cluster = Cluster(tuple(chips), name=f"measured{seed}")
    all_rows = [(t, b) for t in (1, 2, 4) for b in (1, 2, 4, 8)]
    rows = {c.name: rng.sample(all_rows, rng.randint(1, 6)) for c, _ in chips}
    table = _measured(model, rows, slow=rng.choice([1.0, 3.0]))
    opts = SearchOptions(max_stages_per_chip=2, stage_in_node=True, max_microbatch=8)
    gb = rng.choice([4, 8])
    want_plan, want, _ = exhaustive(cluster, model, global_batch=gb, table=table, opts=opts)
    got = search(cluster, model, global_batch=gb, table=table, opts=opts)
    if want_plan is None:
        assert got.plan is None
        return
    assert got.plan is not None, got.note
    assert math.isclose(got.iteration_s, want, rel_tol=1e-9), (got.plan, want_plan)
    assert all((t, b) in rows[c] for c, t, b in _rows(got.plan))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "h2jax.cli", *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_cli_names_the_measured_space_and_the_estimated_stages(tmp_path):
    cluster, model, _ = _sim_mix()
    path = tmp_path / "prof.json"
    _measured(model, {n: [(1, 2), (1, 4)] for n in ("sim_a", "sim_b")}, slow=5.0).save(path)
    r = _cli("plan", str(SIM_MIX), "--profiles", str(path))
    out = " ".join(r.stdout.split())
    assert r.returncode == 0, r.stderr
    assert "searched only the measured configurations" in out and "sim_a tensor 1 at 2, 4 sequences per device" in out
    assert "(from measured profiles)" in out and "roofline" not in out, out
    r = _cli("plan", str(SIM_MIX), "--profiles", str(path), "--allow-estimates")
    out = " ".join(r.stdout.split())
    assert r.returncode == 0, r.stderr
    assert "partly a roofline estimate: stage 0 (" in out and "not measured for this model shape" in out, out
    _measured(model, {n: [(1, 3)] for n in ("sim_a", "sim_b")}).save(path)
    r = _cli("plan", str(SIM_MIX), "--profiles", str(path))
    err = " ".join(r.stderr.split())
    assert r.returncode == 2 and "--allow-estimates" in err and "measured rows of sim_a" in err, err
