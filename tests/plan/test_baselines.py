"""The homogeneous jobs a heterogeneous plan is compared with (h2jax.plan._baselines): the
matched-total split is the best of every split on its grid, the shares add up to the global
batch, and chips a plan leaves idle are named with the reason."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from h2jax.plan import Cluster, ModelShape, Plan, Searcher, StageSpec, estimate, idle_chips, matched_total, same_batch
from h2jax.plan._baselines import GRID, MAX_GRID, REFINE_GAIN, share_unit

ROOT = Path(__file__).resolve().parents[2]


class TableSearcher:
    """A stand-in Searcher with a fixed tokens/s per (chip type, batch); None: no plan fits."""

    def __init__(self, table: dict[str, dict[int, float | None]]):
        self.cluster = SimpleNamespace(names=list(table))
        self.table = table

    def tokens_per_s(self, chip: str, b: int) -> float | None:
        return 0.0 if b == 0 else self.table[chip][b]

    def prefetch(self, requests) -> None:
        """Nothing to run ahead: the table is every search's result."""

    def __call__(self, chip: str, b: int):
        tps = self.table[chip][b]
        return SimpleNamespace(plan=None if tps is None else object(), cost=SimpleNamespace(tokens_per_s=tps))


def _brute(s: TableSearcher, gb: int, unit: int) -> float:
    """The most tokens/s over every split of gb into multiples of unit (a chip type without a
    plan at its share cannot take it)."""
    best = 0.0
    names = s.cluster.names
    for units in itertools.product(range(gb // unit + 1), repeat=len(names)):
        if sum(units) * unit != gb:
            continue
        tps = [s.tokens_per_s(n, j * unit) for n, j in zip(names, units)]
        if None not in tps:
            best = max(best, sum(tps))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_matched_total_split_is_the_best_split_on_its_grid(seed):
    import random

    rng = random.Random(seed)
    gb = rng.choice([8, 16, 24, 32, 40])
    unit = share_unit(gb)
    names = [f"c{i}" for i in range(rng.choice([2, 3, 4]))]
    table = {
        n: {b: (None if rng.random() < 0.2 else rng.uniform(1, 100)) for b in range(unit, gb + 1, unit)} for n in names
    }
    s = TableSearcher(table)
    got = matched_total(s, gb, refine=False, balance=False)
    assert sum(got.shares.values()) == gb or got.tokens_per_s == 0
    assert all(b % unit == 0 for b in got.shares.values())
    assert got.tokens_per_s == pytest.approx(_brute(s, gb, unit), rel=1e-12)
    assert got.ratio(2 * got.tokens_per_s) == pytest.approx(2.0) or got.tokens_per_s == 0


@pytest.mark.parametrize("seed", range(6))
def test_the_grid_is_doubled_while_the_best_split_gains(seed):
    """matched_total's refinement, replayed with brute force: from GRID steps the grid doubles
    while the best split gains at least REFINE_GAIN, up to MAX_GRID or the finest step that
    divides the batch; the best split of every grid tried is kept, the others named with theirs."""
    import random

    rng = random.Random(seed)
    gb = rng.choice([32, 48])
    names = [f"c{i}" for i in range(rng.choice([2, 3]))]
    table = {n: {b: (None if rng.random() < 0.1 else rng.uniform(1, 100)) for b in range(1, gb + 1)} for n in names}
    s = TableSearcher(table)
    got = matched_total(s, gb, balance=False)
    grid, unit = GRID, share_unit(gb, GRID)
    best, tried = (_brute(s, gb, unit), unit), []
    while grid < MAX_GRID:
        grid *= 2
        u = share_unit(gb, grid)
        if u == best[1] or u in [t[1] for t in tried]:
            break
        fine = _brute(s, gb, u)
        tried.append(best if fine > best[0] else (fine, u))
        gain, best = fine / best[0] - 1, max(best, (fine, u))
        if gain < REFINE_GAIN:
            break
    assert (got.tokens_per_s, got.unit) == (pytest.approx(best[0], rel=1e-12), best[1])
    assert [u for u, _ in got.coarser] == [u for _, u in tried] and len(tried) >= 1
    assert all(t == pytest.approx(b, rel=1e-12) for (_, t), (b, _) in zip(got.coarser, tried))
    assert got.tokens_per_s >= matched_total(s, gb, refine=False, balance=False).tokens_per_s
    assert f"shares in steps of {got.unit} (steps of {got.coarser[0][0]}: " in got.describe()


def test_a_split_that_gains_nothing_on_a_finer_grid_keeps_its_grid():
    # tokens/s proportional to the share: every split adds up to the same, no finer grid gains
    s = TableSearcher({n: {b: 10.0 * b for b in range(1, 65)} for n in ("a", "b")})
    got = matched_total(s, 64, balance=False)
    assert got.unit == share_unit(64, GRID) == 8 and got.coarser == ((4, pytest.approx(640.0)),)


def test_share_steps_divide_the_global_batch():
    assert [share_unit(b) for b in (512, 2048, 32, 24, 15, 7, 1)] == [64, 256, 4, 3, 3, 1, 1]


def test_on_a_real_cluster_the_split_is_searched_and_the_same_batch_baseline_is_the_whole_batch():
    cluster = Cluster.load(ROOT / "configs" / "clusters" / "sim_mix.yaml")
    import yaml

    raw = yaml.safe_load((ROOT / "configs" / "clusters" / "sim_mix.yaml").read_text())
    model, gb = ModelShape.from_config(raw["model"]), raw["global_batch"]
    searcher = Searcher(cluster, model)
    same, matched = same_batch(searcher, gb), matched_total(searcher, gb)
    assert same.shares == {n: gb for n in cluster.names}
    assert sum(matched.shares.values()) == gb
    # every split on the grid, each job searched alone: none adds up to more
    unit = matched.unit
    a, b = cluster.names
    splits = [(j * unit, gb - j * unit) for j in range(gb // unit + 1)]
    totals = [
        sum(searcher.tokens_per_s(n, x) or 0.0 for n, x in zip((a, b), split))
        for split in splits
        if all(searcher.tokens_per_s(n, x) is not None for n, x in zip((a, b), split))
    ]
    assert matched.tokens_per_s == pytest.approx(max(totals))
    d = matched.to_dict(matched.tokens_per_s)
    assert d["ratio"] == 1.0 and d["share_step"] == unit and sum(d["shares"].values()) == gb


def test_idle_chips_are_named_with_the_reason():
    cluster = Cluster.load(ROOT / "configs" / "clusters" / "sim_mix.yaml")
    model = ModelShape(n_layers=4, d_model=128, n_heads=4, d_ff=512, vocab_size=256, seq_len=128)
    a, b = cluster.names
    # a microbatch of 2 sequences: stage 0 on 2 of sim_a's 4 chips (data 2 is the whole microbatch)
    plan = Plan(
        (StageSpec(a, (0, 2), data=2, tensor=1), StageSpec(b, (2, 4), data=2, tensor=2)),
        global_batch=8,
        num_microbatches=4,
    )
    res = SimpleNamespace(plan=plan, cost=estimate(plan, model, cluster))
    idle = idle_chips(res, cluster)
    assert set(idle) == {a}
    n, why = idle[a]
    assert n == cluster.devices(a) - 2
    assert "data x tensor 2 x 1" in why and "the whole microbatch (2 sequences)" in why


def test_worker_processes_find_the_plans_this_process_finds(monkeypatch):
    """Searcher(workers=2) runs each chip type's baseline searches in a process of its own
    (spawned, kept until closed) where they would take more than WORTH_S here, and not below it;
    the plans are those of the searches run here."""
    import yaml

    from h2jax.plan import _baselines

    path = ROOT / "configs" / "clusters" / "sim_mix.yaml"
    cluster, model = Cluster.load(path), ModelShape.from_config(yaml.safe_load(path.read_text())["model"])
    small = Searcher(cluster, model, workers=2)
    same_batch(small, 8), matched_total(small, 8)  # tens of milliseconds each: not worth spawning for
    assert small._pool is None and sum(r.search_s for r in small._done.values()) < _baselines.WORTH_S
    monkeypatch.setattr(_baselines, "WORTH_S", 0.0)
    here, there = Searcher(cluster, model, workers=1), Searcher(cluster, model, workers=2)
    try:
        got = [(same_batch(s, 8), matched_total(s, 8)) for s in (here, there)]
        assert there._pool is not None  # the searches ran in the workers
    finally:
        there.close()
    assert there._pool is None
    assert set(there._done) == set(here._done) and len(here._done) >= 8
    for key, r in here._done.items():
        assert (there._done[key].plan, there._done[key].iteration_s) == (r.plan, r.iteration_s), key
    assert got[0][1].shares == got[1][1].shares and got[0][1].tokens_per_s == got[1][1].tokens_per_s


def test_ctrl_c_while_the_workers_search_ends_h2jax_plan_with_one_line():
    """SIGINT to `h2jax plan`'s process group (what Ctrl-C sends) while its workers search the
    baselines: one line, exit 130, and no process of the job left behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests._harness import cli_env

    proc = subprocess.Popen(
        [sys.executable, "-m", "h2jax.cli", "plan", "configs/clusters/hetero_2432.yaml", "--workers", "2"],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a shell's foreground job has it
    )
    try:
        for line in proc.stdout:  # the one-pipeline plan is printed; the baselines' searches follow
            if line.lstrip().startswith("TGS"):
                break
        for _ in range(100):  # the workers started: the job's process group holds more than the CLI
            group = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
            if len(group) >= 4:  # the CLI, spawn's resource tracker, two workers
                break
            time.sleep(0.1)
        time.sleep(0.2)  # past the milliseconds the CLI ignores Ctrl-C to start them (h2jax.plan._baselines)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "h2jax: interrupted" and "Traceback" not in err, err
    assert "homogeneous" not in out  # it stopped inside the baselines' searches
    for _ in range(50):  # the workers end with their parent
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("a process of the interrupted job is still running")
