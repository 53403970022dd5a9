"""The measured profiler: real stage programs timed on an emulated chip type, cached as JSON
that the planner reads instead of its roofline estimates."""

from __future__ import annotations

from h2jax.config import load_config
from h2jax.models import GPTConfig
from h2jax.plan import ModelShape, ProfileTable, load_chip
from h2jax.runtime._profile import profile_chip


def test_measured_profile_feeds_the_planner(tmp_path):
    chip = load_config(None).cluster.chips["sim_a"]
    model = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=4, d_ff=128)
    rows = profile_chip("sim_a", chip, model, tensor_degrees=[1, 2], microbatches=[2], repeats=3)
    assert set(rows) == {(1, 2), (2, 2)}
    for parts in rows.values():
        assert set(parts) == {"embed", "block", "head"}
        for cost in parts.values():
            assert not cost.estimated
            assert cost.fwd_s > 0 and cost.bwd_s >= 0 and cost.param_bytes > 0
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
