"""CheckpointStore without a model: commits across parts, leftovers, retention, restore placement."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from h2jax.checkpoint import CheckpointError, CheckpointStore, nest, retained, unnest


def _state(v: float) -> dict[str, jax.Array]:
    return {"params/embed/table": jnp.full((4, 8), v), "params/blocks/0/w": jnp.full((8, 8), v + 1),
            "opt_state/0/count": jnp.int32(v)}


def _targets(state, sharding=None):
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in state.items()}


def test_nest_roundtrip():
    flat = {"a/b/c": 1, "a/d": 2, "e": 3}
    assert nest(flat) == {"a": {"b": {"c": 1}, "d": 2}, "e": 3}
    assert unnest(nest(flat)) == flat


def test_retention_policy():
    assert retained(range(1, 11), keep_last=2, keep_every=0) == {9, 10}
    assert retained(range(1, 11), keep_last=2, keep_every=4) == {4, 8, 9, 10}


@pytest.mark.parametrize("async_save", [True, False])
def test_save_commit_restore_and_retention(tmp_path, async_save):
    store = CheckpointStore(tmp_path, keep_last=2, keep_every=3, async_save=async_save)
    for step in range(1, 6):
        store.save(step, _state(step), {"step": step})
    store.close()
    assert store.committed_steps() == [3, 4, 5]  # last two, plus every 3rd
    got = store.restore(4, _targets(_state(0)))
    assert float(got["params/blocks/0/w"][0, 0]) == 5.0 and int(got["opt_state/0/count"]) == 4
    assert store.read_meta(5) == {"step": 5}


def test_restore_places_on_the_target_sharding(tmp_path):
    store = CheckpointStore(tmp_path, async_save=False)
    store.save(1, _state(1.0), {})
    devices = np.array(jax.devices("sim_b:0")[:4]).reshape(2, 2)
    sh = NamedSharding(Mesh(devices, ("data", "tensor")), P())
    got = store.restore(1, {"params/blocks/0/w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=sh)})
    assert set(got) == {"params/blocks/0/w"}  # a subset: only what is asked for is read
    assert got["params/blocks/0/w"].sharding == sh
    with pytest.raises(CheckpointError, match="lacks 1 arrays"):
        store.restore(1, {"params/head/w": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sh)})
    with pytest.raises(CheckpointError, match="has shape"):
        store.restore(1, {"params/blocks/0/w": jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=sh)})


def test_a_step_counts_only_when_every_part_committed(tmp_path):
    """Two writers (as two processes would be), each saving its own layers as its own part."""
    full = _state(7.0)
    a = CheckpointStore(tmp_path, part="p0", parts=("p0", "p1"), async_save=False)
    b = CheckpointStore(tmp_path, part="p1", parts=("p0", "p1"), async_save=False)
    a.save(1, {k: v for k, v in full.items() if "embed" in k}, {"step": 1})
    assert a.committed_steps() == []  # p1 has not committed step 1
    b.save(1, {k: v for k, v in full.items() if "embed" not in k}, {"step": 1})
    assert a.committed_steps() == b.committed_steps() == [1]
    # a reader with another partition (one part, say) collects every key from both parts
    reader = CheckpointStore(tmp_path)
    got = reader.restore(1, _targets(full))
    assert all(np.array_equal(got[k], full[k]) for k in full)
    # step 2: p0 commits, p1 dies before committing -> step 2 is never chosen
    a.save(2, {k: v for k, v in full.items() if "embed" in k}, {"step": 2})
    assert reader.latest_committed() == 1
    removed = a.cleanup()  # p0 restarts: its half of step 2 is a leftover
    assert removed and reader.latest_committed() == 1 and not (tmp_path / "parts" / "p0" / "2").exists()


def test_leftovers_of_a_killed_save_are_removed(tmp_path):
    store = CheckpointStore(tmp_path, async_save=False)
    store.save(1, _state(1.0), {})
    # a finalised but unmarked step, an orbax temporary directory, a marker whose data is gone
    store.save(2, _state(2.0), {})
    (tmp_path / "commits" / "2" / "main.json").unlink()
    (tmp_path / "parts" / "main" / "3.orbax-checkpoint-tmp-123").mkdir()
    (tmp_path / "commits" / "4").mkdir()
    (tmp_path / "commits" / "4" / "main.json").write_text('{"parts": ["main"]}')
    assert store.committed_steps() == [1]
    store.cleanup()
    assert sorted(p.name for p in (tmp_path / "parts" / "main").iterdir() if p.name[0].isdigit()) == ["1"]
    assert sorted(p.name for p in (tmp_path / "commits").iterdir()) == ["1"]
    store.save(2, _state(2.5), {})  # the step number is free again
    assert store.committed_steps() == [1, 2]
