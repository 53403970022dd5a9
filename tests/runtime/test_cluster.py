"""Chip types -> backends -> stage devices, and the real-chip path on the host's own CPU backend."""

from __future__ import annotations

import pytest

from h2jax.config import load_config
from h2jax.runtime import place_stages


def test_stages_of_one_chip_type_land_on_separate_nodes():
    cfg = load_config(
        None,
        [
            "cluster.chips={sim_a: {nodes: 2}}",
            "model.n_layers=4",
            "plan.stages=[{chip: sim_a, data: 2, layers: [0, 2]}, {chip: sim_a, data: 2, layers: [2, 4]}]",
        ],
    )
    placements = place_stages(cfg.plan, cfg.cluster)
    assert [p.backend for p in placements] == ["sim_a:0", "sim_a:1"]
    assert all(len(p.devices) == 2 for p in placements)


def test_real_cpu_chip_type_beside_an_emulated_one(tmp_path):
    """A real chip type is named by platform (and device kind); here the host's own CPU backend."""
    cfg = load_config(
        None,
        [
            "cluster.chips={sim_a: {nodes: 1}, 'cpu:cpu': {emulated: false, platform: cpu, nodes: 1, devices_per_node: 8}}",
            "plan.stages=[{chip: sim_a, data: 2, tensor: 2, layers: [0, 4]}, {chip: 'cpu:cpu', data: 4, layers: [4, 6]}]",
        ],
    )
    placements = place_stages(cfg.plan, cfg.cluster)
    assert placements[1].backend == "cpu" and len(placements[1].devices) == 4


def test_wrong_device_kind_is_named():
    cfg = load_config(
        None,
        [
            "cluster.chips={sim_a: {nodes: 1}, 'cpu:H100': {emulated: false, platform: cpu, nodes: 1, devices_per_node: 8}}",
            "plan.stages=[{chip: sim_a, layers: [0, 4]}, {chip: 'cpu:H100', layers: [4, 6]}]",
        ],
    )
    with pytest.raises(RuntimeError, match=r"cpu:H100.*kind"):
        place_stages(cfg.plan, cfg.cluster)
