"""Chip types -> JAX backends -> per-stage device lists and stage meshes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from h2jax.config import ClusterConfig
from h2jax.plan import Plan, assign_devices
from xla_plugins import device_kind_matches


@dataclass(frozen=True)
class StagePlacement:
    """Where one stage runs: its chip type, backend (one client = one node) and devices."""

    stage_idx: int
    chip: str
    backend: str
    node: int
    devices: tuple  # jax Devices, data-major: devices[d * tensor + t]

    @property
    def label(self) -> str:
        return f"{self.chip} node {self.node}"


def register_backends(cluster: ClusterConfig) -> dict[str, list[str]]:
    """Make every chip type of the cluster available in this one process; chip type -> backend
    name per node (the public entry is :func:`h2jax.setup_backends`).

    Emulated chips are registered as CPU clients (one per node). A real chip type uses
    its vendor's backend, which JAX discovers by itself; in one process it is one node.
    """
    from xla_plugins import register_emulated_chips

    emulated = {n: (c.nodes, c.devices_per_node) for n, c in cluster.chips.items() if c.emulated}
    backends = register_emulated_chips(emulated) if emulated else {}
    for name, chip in cluster.chips.items():
        if not chip.emulated:
            backends[name] = [chip.platform]
    return backends


def place_stages(plan: Plan, cluster: ClusterConfig) -> list[StagePlacement]:
    """Devices of every stage (touches JAX backends: call after validation)."""
    import jax

    backends = register_backends(cluster)
    assignment = assign_devices(
        plan,
        nodes={n: (c.nodes if c.emulated else 1) for n, c in cluster.chips.items()},
        devices_per_node={n: c.devices_per_node for n, c in cluster.chips.items()},
    )
    out = []
    for s, (spec, (node, idxs)) in enumerate(zip(plan.stages, assignment)):
        backend = backends[spec.chip][node]
        try:
            devs = jax.devices(backend)
        except RuntimeError as e:
            raise RuntimeError(
                f"stage {s} needs chip type {spec.chip!r} (backend {backend!r}), which JAX cannot "
                f"find in this process: {e}"
            ) from e
        if max(idxs) >= len(devs):
            raise RuntimeError(f"stage {s} needs devices {list(idxs)} of backend {backend!r}, which has {len(devs)}")
        chip = cluster.chips[spec.chip]
        if not chip.emulated:  # cuda:H100 -> the device kind must say H100
            kinds = sorted({d.device_kind for d in devs})
            if not device_kind_matches(spec.chip, kinds):
                raise RuntimeError(
                    f"stage {s} wants chip type {spec.chip!r}, but backend {backend!r} has devices of kind {kinds}"
                )
        out.append(StagePlacement(s, spec.chip, backend, node, tuple(devs[i] for i in idxs)))
    return out


def stage_mesh(placement: StagePlacement, *, data: int, tensor: int):
    """The stage's Mesh, axes ("data", "tensor")."""
    from jax.sharding import Mesh

    devs = np.array(placement.devices, dtype=object).reshape(data, tensor)
    return Mesh(devs, ("data", "tensor"))
