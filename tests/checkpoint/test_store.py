"""CheckpointStore without a model: commits across parts, leftovers, retention, restore placement."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from h2jax.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStore,
    leftover_steps,
    nest,
    on_disk,
    retained,
    unnest,
)


def _state(v: float) -> dict[str, jax.Array]:
    return {
        "params/embed/table": jnp.full((4, 8), v),
        "params/blocks/0/w": jnp.full((8, 8), v + 1),
        "opt_state/0/count": jnp.int32(v),
    }


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


def test_a_run_resumed_from_an_older_step_saves_over_its_later_steps_while_a_save_is_in_flight(tmp_path):
    """--restore-step 2 of a run that went to step 6, async saves: each later step is cleared
    and saved again, also while the previous save is still in flight (orbax's cached step
    list must not keep the cleared step)."""
    first = CheckpointStore(tmp_path, keep_last=10, async_save=True)
    for step in (2, 4, 6):
        first.save(step, _state(step), {"step": step})
    first.close()
    again = CheckpointStore(tmp_path, keep_last=10, async_save=True)
    for step in (4, 6):
        again.clear(step)
        again.save(step, _state(10.0 * step), {"step": step})
    again.close()
    assert again.committed_steps() == [2, 4, 6]
    assert float(again.restore(6, _targets(_state(0)))["params/embed/table"][0, 0]) == 60.0


def test_what_a_failure_line_says_was_saved_names_the_steps_a_rerun_trains_again(tmp_path):
    """Read from the disk when printed: the committed steps, and which steps the job had
    trained past the newest of them (a stuck-rank timeout after step index 12 with step 5 the
    newest commit used to say only "last completed step 12")."""
    assert on_disk(tmp_path / "none", steps_done=3) == f"no checkpoint is left: {tmp_path / 'none'} is gone"
    assert on_disk(tmp_path, steps_done=2) == f"no committed step in {tmp_path} (a rerun resumes from step 0: " + (
        "steps 0-1 of this run are trained again)"
    )
    store = CheckpointStore(tmp_path, async_save=False)
    for step in (3, 5):
        store.save(step, _state(step), {"step": step})
    store.close()
    assert on_disk(tmp_path, steps_done=13) == (
        f"committed steps on disk: 3, 5 in {tmp_path} (a rerun resumes from step 5: steps 5-12 of this run are "
        "trained again)"
    )
    assert on_disk(tmp_path, steps_done=6).endswith(
        "(a rerun resumes from step 5: step 5 of this run is trained again)"
    )
    assert on_disk(tmp_path, steps_done=5) == on_disk(tmp_path) == f"committed steps on disk: 3, 5 in {tmp_path}"


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
    removed = store.cleanup()
    # what the resume line names (it used to say "3 leftovers"); step 2, newer than anything
    # committed, is kept aside rather than removed
    assert leftover_steps(removed) == [3, 4]
    assert [line.split()[1] for line in store.kept_aside] == ["2"]
    assert sorted(p.name for p in (tmp_path / "parts" / "main").iterdir() if p.name[0].isdigit()) == ["1"]
    assert sorted(p.name for p in (tmp_path / "commits").iterdir()) == ["1"]
    store.save(2, _state(2.5), {})  # the step number is free again
    assert store.committed_steps() == [1, 2]


def _share(state: dict, part: str) -> dict:
    """What one of two writers saves: p0 the embedding and the stage-wide count, p1 the rest."""
    return {k: v for k, v in state.items() if ("embed" in k or "count" in k) == (part == "p0")}


def _on_disk(tmp_path, part: str) -> list[int]:
    d = tmp_path / "parts" / part
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def test_retention_with_two_writers_never_leaves_nothing_and_leaves_no_orphans(tmp_path):
    """keep_last=1 with two writers committing at different times: whenever a writer judges, the
    newest step that counts survives; a share whose peer deleted its own first goes next time."""
    kw = dict(parts=("p0", "p1"), keep_last=1, async_save=False)
    a, b = CheckpointStore(tmp_path, part="p0", lead=True, **kw), CheckpointStore(tmp_path, part="p1", lead=False, **kw)
    for step in (1, 2, 3):
        a.save(step, _share(_state(step), "p0"), {"step": step})
        # a has committed `step`, b not yet: the previous step is still the one that counts
        assert a.committed_steps() == ([step - 1] if step > 1 else [])
        b.save(step, _share(_state(step), "p1"), {"step": step})
        assert a.committed_steps() == [step]
    # b's retention deleted its share of step 2 after step 3 counted; a's share is an orphan until a judges again
    assert _on_disk(tmp_path, "p1") == [3] and _on_disk(tmp_path, "p0") == [2, 3]
    assert a.apply_retention() == [2]
    assert _on_disk(tmp_path, "p0") == [3] and sorted(p.name for p in (tmp_path / "commits").iterdir()) == ["3"]
    got = CheckpointStore(tmp_path).restore(3, _targets(_state(0)))
    assert all(np.array_equal(got[k], v) for k, v in _state(3).items())


def test_the_lead_replaces_what_another_writer_set_left(tmp_path):
    """A directory a single-process run wrote (part main), continued by a two-writer run: a step
    number both wrote counts as the newest complete set; the lead removes the other set's share
    when it saves that step again and when retention drops its steps; cleanup removes its leftovers."""
    single = CheckpointStore(tmp_path, async_save=False, keep_last=5)
    for step in (1, 2, 3):
        single.save(step, _state(step), {"step": step})
    (tmp_path / "parts" / "main" / "4").mkdir()  # a finalised, never committed step of the single run
    kw = dict(parts=("p0", "p1"), keep_last=2, async_save=False)
    a, b = CheckpointStore(tmp_path, part="p0", lead=True, **kw), CheckpointStore(tmp_path, part="p1", lead=False, **kw)
    # newer than every committed step: kept aside (it may be all that is left of a run), not deleted
    assert a.cleanup() == [] and b.cleanup() == []
    assert len(a.kept_aside) == 1 and "step 4 of part main" in a.kept_aside[0]
    assert not (tmp_path / "parts" / "main" / "4").exists()
    assert [p.name.split("-")[1] for p in (tmp_path / "aside").iterdir()] == ["step4"]
    # step 3 again, without clearing first: both sets complete, the newer counts
    a.save(3, _share(_state(30.0), "p0"), {"step": 3})
    b.save(3, _share(_state(30.0), "p1"), {"step": 3})
    assert a.step_parts(3) == ("p0", "p1")
    assert float(CheckpointStore(tmp_path).restore(3, _targets(_state(0)))["params/embed/table"][0, 0]) == 30.0
    # step 2 again, as a run resumed from step 1 does: the lead's clear removes main's share
    assert a.clear(2) and not b.clear(2)
    assert a.committed_steps() == [1, 3] and _on_disk(tmp_path, "main") == [1, 3]
    a.save(2, _share(_state(20.0), "p0"), {"step": 2})
    b.save(2, _share(_state(20.0), "p1"), {"step": 2})
    assert a.committed_steps() == [1, 2, 3]
    # retention (keep 2) drops steps 1 and 2 when step 4 counts: the lead deletes main's step 1 as well
    for w in (a, b):
        w.save(4, _share(_state(4.0), w.part), {"step": 4})
    a.apply_retention()
    assert a.committed_steps() == [3, 4] and _on_disk(tmp_path, "main") == [3]
    assert _on_disk(tmp_path, "p0") == [3, 4] and _on_disk(tmp_path, "p1") == [3, 4]


def test_steps_kept_aside_are_under_the_retention_of_committed_steps(tmp_path):
    """aside/ was never emptied (5 full stage parts after 8 kills): it keeps the keep_last newest
    uncommitted steps, and each one it deletes is named."""
    store = CheckpointStore(tmp_path, async_save=False, keep_last=2)
    store.save(1, _state(1.0), {})
    for step in (2, 3, 4):  # three kills, each after a save finished and before its commit
        (tmp_path / "parts" / "main" / str(step)).mkdir()
        store.cleanup()
    kept = sorted(p.name.split("-")[1] for p in (tmp_path / "aside").iterdir())
    assert kept == ["step3", "step4"]
    assert len(store.pruned_aside) == 1 and "uncommitted step 2" in store.pruned_aside[0]


def test_a_damaged_step_is_named_without_python_reprs(tmp_path):
    cause = ValueError("DATA_LOSS: reading <bound method Reader.read of <ts.Reader object at 0x7f12>>: truncated")
    text = str(CheckpointCorruptError(tmp_path, 3, cause))
    assert "<bound method" not in text and "0x7f12" not in text
    assert (
        text
        == f"{tmp_path} step 3 is damaged: its files cannot be read (ValueError: DATA_LOSS: reading ...: truncated)"
    )
