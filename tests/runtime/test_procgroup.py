"""Stages over several processes: the rank -> stage layout and the per-device peer tables
(the mpirun runs themselves are in test_multiproc.py)."""

from __future__ import annotations

import pytest

from h2jax.config import ConfigError
from h2jax.plan import Plan, StageSpec
from h2jax.runtime._procgroup import ProcessLayout, refuse_hanging_jax


def _plan(*meshes: tuple[int, int]) -> Plan:
    stages = [
        StageSpec(chip=f"sim_{'abcd'[i]}", layers=(i, i + 1), data=d, tensor=t) for i, (d, t) in enumerate(meshes)
    ]
    return Plan(stages=stages, global_batch=8, num_microbatches=2)


# -- layout (pure) ------------------------------------------------------------------------------
def test_one_process_per_stage():
    lay = ProcessLayout.from_plan(_plan((2, 2), (4, 1)), 2)
    assert lay.mode == "stage" and not lay.any_group
    assert [lay.stage_of(r) for r in range(2)] == [0, 1]
    assert lay.device_ranks(0) == [0, 0, 0, 0] and lay.device_ranks(1) == [1, 1, 1, 1]
    assert lay.devices_per_process == (4, 4)


def test_one_process_per_device():
    lay = ProcessLayout.from_plan(_plan((1, 2), (1, 1), (2, 2)), 7)
    assert lay.mode == "device" and lay.any_group
    assert lay.ranks_of_stage == ((0, 1), (2,), (3, 4, 5, 6))
    assert [lay.stage_of(r) for r in range(7)] == [0, 0, 1, 2, 2, 2, 2]
    assert [lay.group_rank(r) for r in range(7)] == [0, 1, 0, 0, 1, 2, 3]
    assert [lay.leader(s) for s in range(3)] == [0, 2, 3]
    assert lay.device_ranks(2) == [3, 4, 5, 6]  # row-major over (data, tensor)
    assert lay.devices_per_process == (1, 1, 1)


def test_wrong_process_count_names_both_valid_counts():
    with pytest.raises(ConfigError) as e:
        ProcessLayout.from_plan(_plan((1, 2), (2, 2)), 4)
    msg = str(e.value)
    assert e.value.key == "plan.stages"
    assert "4 processes" in msg and "-np 2" in msg and "-np 6" in msg, msg
    assert "stage 0: 1x2" in msg and "stage 1: 2x2" in msg, msg


def test_stages_of_one_device_are_both_layouts():
    lay = ProcessLayout.from_plan(_plan((1, 1), (1, 1)), 2)
    assert lay.ranks_of_stage == ((0,), (1,)) and not lay.any_group


def test_a_jax_whose_cpu_collectives_hang_is_refused_for_cpu_stages_over_processes():
    """jaxlib 0.12.1 hangs a CPU stage that spans processes: refused in one line naming the stage,
    the release and the ways out; other releases, one process per stage, and a GPU stage pass."""
    from types import SimpleNamespace

    plan = _plan((1, 2), (1, 1))
    cpu, gpu = SimpleNamespace(emulated=True, platform="cpu"), SimpleNamespace(emulated=False, platform="cuda")
    chips = {"sim_a": cpu, "sim_b": cpu}
    per_device, per_stage = ProcessLayout.from_plan(plan, 3), ProcessLayout.from_plan(plan, 2)
    with pytest.raises(ConfigError) as e:
        refuse_hanging_jax(plan, chips, per_device, "0.12.1")
    assert e.value.key == "plan.stages"
    msg = str(e.value)
    assert "stage 0 (sim_a, CPU devices) spans 2 processes" in msg and "jaxlib 0.12.1" in msg, msg
    assert "jaxlib!=0.12.1" in msg and "-np 2" in msg, msg
    refuse_hanging_jax(plan, chips, per_device, "0.12.0.1")
    refuse_hanging_jax(plan, chips, per_stage, "0.12.1")
    refuse_hanging_jax(plan, {"sim_a": gpu, "sim_b": cpu}, per_device, "0.12.1")


def test_peer_table_per_device():
    from h2jax.comm._routing import Boundary
    from h2jax.comm._routing import lin as _lin
    from h2jax.comm._routing import peer_table as _peer_table

    b = Boundary((4, 3, 8), (1, 1), (2, 2))  # one source device, four destination devices
    by_dev: list[list] = [[]]
    for t_idx, t in enumerate(b.pattern()):
        by_dev[_lin(t.src, b.src)].append((t_idx, t))
    table = _peer_table([10, 11, 12, 13], b.dst, by_dev, 4, "dst")
    assert table.tolist() == [[10 + _lin(t.dst, b.dst) for _, t in by_dev[0]]]
    assert sorted(table[0].tolist()) == [10, 11, 12, 13]  # each destination device once
    assert _peer_table(5, b.dst, by_dev, 4, "dst") == 5
    assert _peer_table([7, 7, 7, 7], b.dst, by_dev, 4, "dst") == 7  # one process: a static rank
    with pytest.raises(ValueError, match="3 given for a 2x2 mesh"):
        _peer_table([1, 2, 3], b.dst, by_dev, 4, "dst")


# The mpirun runs (one process per device, ffi and host, == single process) are in
# tests/runtime/test_multiproc.py, through the real `h2jax train`.
