"""Stages that span several processes: rank -> stage mapping, one ``jax.distributed`` cluster
per stage, the global stage mesh, and per-device boundary transfers.

Two ways to lay a plan over the processes of an ``mpirun`` / ``srun`` job (world size W):

- ``W == num_stages``: one process per stage; rank s runs stage s and holds all of its
  devices (an emulated chip type is registered in the process as one node).
- ``W == total devices of the plan``: one process per device, as on GPU nodes. Stage s gets
  ``data * tensor`` consecutive ranks, stages in plan order. A stage with more than one
  process is its own ``jax.distributed`` cluster: the processes of the stage
  (``COMM_WORLD.Split(color=stage)``) elect their first rank as coordinator, which picks a
  free port and broadcasts it; every process then sees the stage's *global* devices, and the
  stage mesh spans them. Stages never share a cluster (backends of different vendors never
  share one), so a cluster is as homogeneous as its stage.

Anything else is a :class:`~h2jax.config.ConfigError` naming both valid counts.

Emulated chips in a stage over several processes: ``jax.distributed`` wires only the
*default* backend of a process, so such a process does not register an emulated PJRT client
(``sim_a:0``); its chip is the plain ``cpu`` backend with ``jax_num_cpu_devices`` set to the
process's device count (cross-process collectives: gloo). It is still the emulated chip
type of the plan (memory checks, labels, profiles use the plan's name); only the backend
name differs (``cpu`` instead of ``sim_a:0``). A stage in one process keeps the emulated
backend, as before.

Device -> rank map: the stage mesh orders its devices by (process, local id), so device
``i`` (row-major over ``(data, tensor)``) belongs to group rank ``i // devices_per_process``.
:meth:`ProcessLayout.device_ranks` gives the world rank of every device of a stage; every
multi-process channel (h2jax.comm) addresses each piece of :func:`h2jax.plan.reshard_pattern`
to the rank that owns its peer device.

Reductions over the whole pipeline (loss, squared grad norm) go over MPI ``COMM_WORLD``;
every process of a stage holds the same (replicated) value, so only the stage's leader
(first rank) contributes: :meth:`StageGroup.stage_share`.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from h2jax.config import ConfigError


# -- where every rank sits (pure: no jax, no MPI) ------------------------------------------------
@dataclass(frozen=True)
class ProcessLayout:
    """The plan's stages over the job's processes (see the module docstring)."""

    world_size: int
    ranks_of_stage: tuple[tuple[int, ...], ...]  # world ranks of each stage, group-rank order
    devices_per_process: tuple[int, ...]  # per stage
    devices_of_stage: tuple[int, ...]  # data * tensor per stage

    @classmethod
    def from_plan(cls, plan: Any, world_size: int) -> ProcessLayout:
        n = plan.num_stages
        ndev = tuple(st.data * st.tensor for st in plan.stages)
        total = sum(ndev)
        if world_size == n:  # one process per stage (checked first: n == total is both)
            return cls(world_size, tuple((s,) for s in range(n)), ndev, ndev)
        if world_size == total:  # one process per device, stages in plan order
            ranks, start = [], 0
            for k in ndev:
                ranks.append(tuple(range(start, start + k)))
                start += k
            return cls(world_size, tuple(ranks), (1,) * n, ndev)
        shapes = ", ".join(f"stage {s}: {st.data}x{st.tensor}" for s, st in enumerate(plan.stages))
        raise ConfigError(
            "plan.stages",
            f"the job has {world_size} processes; the plan has {n} stages and {total} devices ({shapes}): "
            f"run one process per stage (-np {n}) or one process per device (-np {total})",
        )

    @property
    def num_stages(self) -> int:
        return len(self.ranks_of_stage)

    @property
    def mode(self) -> str:
        """'stage' (one process per stage) or 'device' (one process per device)."""
        return "stage" if self.world_size == self.num_stages else "device"

    def stage_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the job's 0..{self.world_size - 1}")
        for s, ranks in enumerate(self.ranks_of_stage):
            if rank in ranks:
                return s
        raise AssertionError(rank)  # unreachable: the stages' ranks cover the world

    def group_rank(self, rank: int) -> int:
        return self.ranks_of_stage[self.stage_of(rank)].index(rank)

    def leader(self, stage: int) -> int:
        """The world rank that speaks for ``stage`` (its first process)."""
        return self.ranks_of_stage[stage][0]

    def processes(self, stage: int) -> int:
        return len(self.ranks_of_stage[stage])

    @property
    def any_group(self) -> bool:
        """Whether some stage spans several processes."""
        return any(len(r) > 1 for r in self.ranks_of_stage)

    def device_ranks(self, stage: int) -> list[int]:
        """World rank owning each device of ``stage``'s mesh (row-major over (data, tensor))."""
        k = self.devices_per_process[stage]
        return [self.ranks_of_stage[stage][i // k] for i in range(self.devices_of_stage[stage])]


# jax releases whose CPU collectives (gloo) hang a stage that spans processes (docs/LOG.md,
# session 35: both processes of the stage wait in one all-reduce of its first programs)
GLOO_HANGS = ("0.12.1",)


def refuse_hanging_jax(plan: Any, chips: Mapping[str, Any], layout: ProcessLayout, version: str) -> None:
    """A :class:`~h2jax.config.ConfigError` where a stage on CPU devices spans several processes
    and jaxlib `version` is one of :data:`GLOO_HANGS`: such a job would wait for its first
    activations until the transport's timeout, and say nothing of why."""
    if version not in GLOO_HANGS:
        return
    for s, st in enumerate(plan.stages):
        chip = chips[st.chip]
        if layout.processes(s) > 1 and (chip.emulated or chip.platform == "cpu"):
            raise ConfigError(
                "plan.stages",
                f"stage {s} ({st.chip}, CPU devices) spans {layout.processes(s)} processes, and jaxlib {version}'s "
                f"CPU collectives hang such a stage: install another release (pip install 'jaxlib!={version}' "
                f"'jax!={version}'), or run one process per stage (-np {plan.num_stages})",
            )


# -- this process's stage ------------------------------------------------------------------------
def _node_index(comm: Any, chip: str) -> int:
    """This rank's index among the ranks of ``chip`` on its host (collective over ``comm``)."""
    from mpi4py import MPI

    host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        chips = host.allgather(chip)
        return chips[: host.Get_rank()].count(chip)
    finally:
        host.Free()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class StageGroup:
    """This process's stage: its process group, its backend, its (global) stage mesh.

    Collective over ``comm`` (every rank constructs one at the same point), and it must come
    before anything initialises JAX's backends in this process (``jax.distributed`` and the
    emulated chips register backends).
    """

    def __init__(self, plan: Any, chips: Mapping[str, Any], comm: Any = None, *, init_timeout_s: int = 120):
        from mpi4py import MPI

        self.comm = comm = MPI.COMM_WORLD if comm is None else comm
        self.plan = plan
        self.layout = layout = ProcessLayout.from_plan(plan, comm.Get_size())
        refuse_hanging_jax(plan, chips, layout, importlib.metadata.version("jaxlib"))
        self.rank = comm.Get_rank()
        self.stage_idx = s = layout.stage_of(self.rank)
        self.group = comm.Split(color=s, key=self.rank)  # collective over comm
        if self.group.Get_rank() != layout.group_rank(self.rank):
            raise AssertionError(
                f"rank {self.rank}: group rank {self.group.Get_rank()}, layout says {layout.group_rank(self.rank)}"
            )
        self.group_rank, self.group_size = self.group.Get_rank(), self.group.Get_size()
        self.is_leader = self.group_rank == 0
        self.spec = spec = plan.stages[s]
        self.chip = chip = chips[spec.chip]
        self.local_devices = k = layout.devices_per_process[s]
        # this process's index among the processes of its chip type on its host: which of the
        # host's devices it takes (real chips; e.g. one GPU per process)
        self.node_index = _node_index(comm, spec.chip)
        self.distributed = self.group_size > 1
        if self.distributed:
            self.backend = self._init_distributed(chip, k, init_timeout_s)
        elif chip.emulated:
            from xla_plugins import register_emulated_chips

            self.backend = register_emulated_chips({spec.chip: (1, k)})[spec.chip][0]
        else:
            self.backend = chip.platform
        self.mesh = self._mesh()

    # -- set-up ---------------------------------------------------------------------------------
    def _init_distributed(self, chip: Any, k: int, timeout_s: int) -> str:
        import jax

        from xla_plugins import backends_are_initialized

        if backends_are_initialized():
            raise RuntimeError(
                f"stage {self.stage_idx} (rank {self.rank}) spans {self.group_size} processes and "
                "needs its own jax.distributed cluster, but JAX's backends are already "
                "initialised in this process; build the StageGroup before touching JAX"
            )
        nodes = self.group.allgather(socket.gethostname())
        host = None
        if self.is_leader:  # the coordinator of this stage's cluster: a free port on the leader's host
            host = "127.0.0.1" if len(set(nodes)) == 1 else os.environ.get("H2JAX_COORDINATOR_HOST", socket.getfqdn())
            host = f"{host}:{_free_port()}"
        self.coordinator = self.group.bcast(host, root=0)
        if chip.emulated:
            # the emulated chip type as the default backend: jax.distributed wires only that one
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", k)
            local_ids = None
            backend = "cpu"
        else:  # one host's processes of this chip type take consecutive local devices
            local_ids = list(range(self.node_index * k, (self.node_index + 1) * k))
            backend = chip.platform
        # every parameter is given: no cluster detection. Under Open MPI 5, jax >= 0.12 detects the
        # local process id with a collective over MPI's COMM_WORLD (mpi4py), which only this
        # stage's processes would enter: a job whose stages span different process counts (one
        # stage alone on a process) would wait there forever
        jax.distributed.initialize(
            coordinator_address=self.coordinator,
            num_processes=self.group_size,
            process_id=self.group_rank,
            local_device_ids=local_ids,
            cluster_detection_method="deactivate",
            initialization_timeout=int(timeout_s),
        )
        return backend

    def _mesh(self) -> Any:
        import jax
        from jax.sharding import Mesh

        spec, k = self.spec, self.local_devices
        if self.distributed:  # the cluster's devices: process 0's, then process 1's, ...
            devices = sorted(jax.devices(self.backend), key=lambda d: (d.process_index, d.id))
        elif self.chip.emulated:  # a client of its own, holding exactly this stage's devices
            devices = jax.devices(self.backend)[:k]
        else:
            devices = jax.devices(self.backend)[self.node_index * k : (self.node_index + 1) * k]
        where = f"stage {self.stage_idx} (rank {self.rank}, {spec.chip} on backend {self.backend})"
        if len(devices) != spec.num_devices:
            raise RuntimeError(
                f"{where} needs {spec.num_devices} devices ({spec.data}x{spec.tensor}), "
                f"its {self.group_size} process(es) have {len(devices)}"
            )
        owners = [d.process_index for d in devices]
        want = [i // k for i in range(spec.num_devices)] if self.distributed else owners
        if owners != want:
            raise RuntimeError(f"{where}: devices belong to processes {owners}, expected {want} ({k} per process)")
        return Mesh(np.array(devices, dtype=object).reshape(spec.data, spec.tensor), ("data", "tensor"))

    def close(self) -> None:
        """Leave the stage's jax.distributed cluster (collective over the stage's processes)."""
        if self.distributed:
            import jax

            jax.distributed.shutdown()
            self.distributed = False

    # -- reductions over the pipeline -------------------------------------------------------------
    def stage_share(self, value: float) -> float:
        """``value`` from the stage's leader, 0 from its other processes: sum over COMM_WORLD counts
        each stage once."""
        return float(value) if self.is_leader else 0.0

    @property
    def label(self) -> str:
        sp = self.spec
        where = (
            f"{self.group_size} processes, backend {self.backend}" if self.group_size > 1 else f"backend {self.backend}"
        )
        return f"{stage_label(self.stage_idx, sp)} [{where}]"


def stage_label(stage_idx: int, spec: Any) -> str:
    """How the timeline, the Gantt chart and messages name a stage: its chip, mesh and layers
    (each chunk's range, for a stage of several)."""
    layers = ", ".join(f"{a}-{b - 1}" for a, b in spec.layer_chunks)
    return f"stage {stage_idx} · {spec.chip} ({spec.data}x{spec.tensor}) layers {layers}"


# -- arrays that span the stage's processes -------------------------------------------------------
def global_array(x: Any, sharding: Any) -> Any:
    """A global array laid out as ``sharding`` from ``x``, the whole value, present on every
    process of the stage (tokens, targets). Each process puts only its own devices' slices."""
    import jax

    x = np.asarray(x)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def local_value(x: Any) -> np.ndarray:
    """A fully replicated array (loss, squared norm) as numpy, on any process of its mesh."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if not x.is_fully_replicated:
        raise ValueError(
            f"local_value: {x.shape} {x.sharding} is neither fully addressable nor replicated; use fetch()"
        )
    return np.asarray(x.addressable_data(0))


def fetch(tree: Any) -> Any:
    """Every leaf as a whole numpy array on every process (collective over the stage's
    processes when a leaf is sharded across them: call it on all of them, same order)."""
    import jax
    from jax.experimental import multihost_utils

    def one(x: Any) -> np.ndarray:
        if x.is_fully_addressable or x.is_fully_replicated:
            return local_value(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)
