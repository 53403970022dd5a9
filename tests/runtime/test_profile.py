"""The measured profiler: real stage programs timed on an emulated chip type, cached as JSON
that the planner reads instead of its roofline estimates."""

from __future__ import annotations

import pytest

from h2jax.config import load_config
from h2jax.models import GPTConfig
from h2jax.plan import ModelShape, ProfileTable, estimate, load_chip, roofline_costs
from h2jax.plan._profiles import EXCHANGE, EXCHANGE_CALL, PROGRAM, TRANSFER, local_cores
from h2jax.runtime import _profile
from h2jax.runtime._profile import BLOCK_COUNTS, ChipProfiler, ProfileNoiseError, fit_line, profile_chip

pytestmark = pytest.mark.slow  # profiles real programs (minutes on a loaded machine): the full suite, not the fast lane


def test_measured_profile_feeds_the_planner(tmp_path):
    chip = load_config(None).cluster.chips["sim_a"]
    # a block big enough that its time stands above a shared host's noise in the fitted slope
    # (at d_model 64, seq 32 a block's backward took microseconds and the fit could read <= 0)
    model = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4, d_ff=512)
    rows = profile_chip("sim_a", chip, model, tensor_degrees=[1, 2], microbatches=[2], repeats=3)
    assert set(rows) == {(1, 2), (2, 2)}
    for parts in rows.values():
        # sim_a has a second node in the tests' cluster: the contention probe and the
        # transfer and the exchange across pipelines between two clients of this host ran
        assert set(parts) == {"embed", "block", "head", PROGRAM, TRANSFER, EXCHANGE, EXCHANGE_CALL}
        assert parts[TRANSFER].fwd_s > 0
        # a one-block exchange (fitted per block + per call) takes time both ways; the per-block
        # part is the block's parameters
        x, call = parts[EXCHANGE], parts[EXCHANGE_CALL]
        assert x.fwd_s + call.fwd_s > 0 and x.bwd_s + call.bwd_s > 0
        assert x.param_bytes == parts["block"].param_bytes and call.param_bytes == 0
        for name, cost in parts.items():
            assert not cost.estimated
            assert cost.fwd_s >= 0 and cost.bwd_s >= 0
            # host cores busy while it runs: measured, within this machine's cores
            assert 0 <= cost.fwd_cores <= local_cores() and 0 <= cost.bwd_cores <= local_cores()
            if name not in (PROGRAM, TRANSFER, EXCHANGE, EXCHANGE_CALL):
                assert cost.param_bytes > 0 and cost.update_s > 0
        blk = parts["block"]
        assert blk.fwd_s > 0 and blk.bwd_s > 0 and blk.fwd_cores > 0 and blk.bwd_cores > 0
    # the roofline's activation count (what the forward keeps for the backward, array by
    # array) agrees with what XLA's compiled forward programs really output
    shape0 = ModelShape.from_config(model)
    for (t, b), parts in rows.items():
        est = roofline_costs(shape0, load_chip("sim_a")[0], tensor=t, microbatch=b)
        for part in ("block", "head"):
            got, want = parts[part].act_bytes, est[part].act_bytes
            assert abs(got - want) <= 0.01 * got, (t, part, got, want)
        assert parts[PROGRAM].param_bytes == 0  # the fixed cost of a call holds no parameters
    # tensor parallelism really shards a block's parameters: half of them per device at t=2
    # (the norm scales, replicated, are the small remainder)
    p1, p2 = rows[(1, 2)]["block"].param_bytes, rows[(2, 2)]["block"].param_bytes
    assert 0.49 * p1 < p2 < 0.52 * p1, (p1, p2)
    shape = ModelShape.from_config(model)
    table = ProfileTable()
    for (t, b), parts in rows.items():
        table.add("sim_a", shape.key(), t, b, parts)
    table.save(tmp_path / "prof.json")
    loaded = ProfileTable.load(tmp_path / "prof.json")
    assert loaded.measured("sim_a")
    profile, _ = load_chip("sim_a")
    got = loaded.costs(shape, profile, tensor=2, microbatch=2)
    assert got["block"] == rows[(2, 2)]["block"]
    # a shape that was not measured falls back to the roofline estimate, marked as such
    assert loaded.costs(shape, profile, tensor=1, microbatch=4)["block"].estimated
    # a one-stage plan priced from the measured parts pays one program call per forward and
    # backward, not one per part
    from h2jax.plan import Plan, StageSpec

    plan = Plan(stages=(StageSpec("sim_a", (0, 4), 1, 2),), global_batch=4, num_microbatches=2)
    st = estimate(plan, shape, {"sim_a": profile}, table=loaded).stages[0]
    p = rows[(2, 2)]
    assert abs(st.fwd_s - (p[PROGRAM].fwd_s + p["embed"].fwd_s + 4 * p["block"].fwd_s + p["head"].fwd_s)) < 1e-12


def test_driver_costs_are_measured_through_the_real_trainer():
    from h2jax.runtime._profile import profile_driver

    d = profile_driver("sim_a", steps=5)  # sim_a has two nodes in the tests' cluster
    # every figure is a measured, non-negative time, and the driver costs something
    figures = (d.step_s, d.step_cpu_s, d.op_cpu_s, d.transfer_cpu_s)
    assert min(figures) >= 0 and sum(figures) > 0
    assert max(figures) < 1.0  # a null model's driver: milliseconds, not seconds


def test_block_cost_is_the_least_squares_line_through_the_block_programs():
    exact = {f"b{k}/f": 0.3 + 2.0 * k for k in BLOCK_COUNTS}
    blk, fixed = fit_line(exact, "f")
    assert abs(blk - 2.0) < 1e-12 and abs(fixed - 0.3) < 1e-12
    # noise on one program moves the slope by a fraction of it (a two-point difference takes all of it)
    noisy = dict(exact, **{"b2/f": exact["b2/f"] + 0.7})
    blk, _ = fit_line(noisy, "f")
    assert abs(blk - 2.0) == pytest.approx(0.7 / 14)
    # a line through the origin or below it: no negative fixed cost
    assert fit_line({f"b{k}/u": 2.0 * k - 0.5 for k in BLOCK_COUNTS}, "u")[1] == 0.0


class _NoisyProfiler(ChipProfiler):
    """A profiler whose rounds are given, not timed: the 4-block backward took no longer than
    the 1-block one for the first `noisy` rounds (another job on the host in those rounds)."""

    def __init__(self, *args, noisy: int, **kw):
        self._rows = {(1, 2): {"walls": {}}}
        self.rounds, self.noisy = 0, noisy

    def round(self) -> None:
        walls = self._rows[(1, 2)]["walls"]
        for k in BLOCK_COUNTS:
            f = 1.0 + k
            b = 9.0 - k if self.rounds < self.noisy else 1.0 + 2 * k
            for kind, t in (("f", f), ("fb", f + b), ("u", 0.1 * k)):
                walls.setdefault(f"b{k}/{kind}", []).append(t)
        self.rounds += 1

    def rows(self, statistic="median"):
        return {(1, 2): {"rounds": self.rounds}}


@pytest.mark.parametrize("noisy", [3, 30], ids=["noise-passes", "noise-stays"])
def test_a_block_that_fits_to_no_cost_takes_more_rounds_then_is_refused(monkeypatch, noisy):
    made = []
    monkeypatch.setattr(_profile, "ChipProfiler", lambda *a, **kw: made.append(_NoisyProfiler(noisy=noisy)) or made[-1])
    chip = load_config(None).cluster.chips["sim_a"]
    model = GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
    if noisy == 3:  # the median of 3 noisy and 3 quiet rounds is the first to slope upwards
        rows = profile_chip("sim_a", chip, model, tensor_degrees=[1], microbatches=[2], repeats=3)
        assert rows == {(1, 2): {"rounds": 6}}
        assert made[0].unsure() == []
        return
    with pytest.raises(ProfileNoiseError) as e:
        profile_chip("sim_a", chip, model, tensor_degrees=[1], microbatches=[2], repeats=3)
    assert made[0].rounds == 3 * (1 + _profile.EXTRA_ROUNDS)
    msg = str(e.value)
    assert "profile sim_a: tensor 1, microbatch 2: a block's backward fits to -1e+03 ms" in msg, msg
    assert "(1, 2, 4 blocks took 8e+03, 7e+03, 5e+03 ms)" in msg and "after 9 rounds" in msg, msg
    assert "forward" not in msg.split("after")[0].replace("backward", ""), msg


def test_profiler_rounds_accumulate_and_the_statistic_is_chosen():
    chip = load_config(None).cluster.chips["sim_a"]
    model = GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
    with pytest.raises(ValueError, match=r"statistic='mean': expected one of median, lower-quartile"):
        profile_chip("sim_a", chip, model, tensor_degrees=[1], microbatches=[2], statistic="mean")
    prof = ChipProfiler("sim_a", chip, model, tensor_degrees=[1], microbatches=[1, 2])
    with pytest.raises(RuntimeError, match="no round timed yet"):
        prof.rows()
    for _ in range(5):  # rounds a caller may spread over a long run
        prof.round()
    assert prof.rounds == 5
    med, low = prof.rows("median"), prof.rows("lower-quartile")
    assert set(med) == set(low) == {(1, 1), (1, 2)}
    for key in med:
        # the transfer is one timed call (no fit): its lower quartile is at most its median,
        # and both come from the same five rounds
        assert 0 < low[key][TRANSFER].fwd_s <= med[key][TRANSFER].fwd_s
        assert not med[key]["block"].estimated
        # a tiny block on a loaded host may fit to no forward time at all; then the profiler
        # must say so (profile_chip adds rounds on it and refuses if it stays)
        t, b = key
        said = [u for u in prof.unsure("median") if u.startswith(f"tensor {t}, microbatch {b}: a block's forward")]
        assert (med[key]["block"].fwd_s > 0) != bool(said), (med[key]["block"], said)
    with pytest.raises(ValueError, match="statistic='p90'"):
        prof.rows("p90")


def test_cli_profile_measures_and_writes_a_table_the_planner_reads(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "prof.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "h2jax.cli",
            "profile",
            "--chip",
            "sim_a",
            "--model",
            "configs/tiny.yaml",
            "--tensor",
            "1",
            "--microbatch",
            "2",  # one row: the README's profile commands measure several through the same CLI
            "--measure",
            "--repeats",
            "3",
            "--statistic",
            "lower-quartile",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "sim_a tensor=1 microbatch=2" in r.stdout and "(measured)" in r.stdout
    assert "runtime driver on" in r.stdout
    table = ProfileTable.load(out)
    assert table.measured("sim_a") and table.driver
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "h2jax.cli",
            "profile",
            "--chip",
            "sim_a",
            "--model",
            "configs/tiny.yaml",
            "--measure",
            "--statistic",
            "mean",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--statistic" in bad.stderr and "'mean'" in bad.stderr
