"""What one training step needs from the other stages: the :class:`World`.

The trainer is the same in one process and under mpirun; what differs sits here:

- which stages this process runs (``local_stages``) and on which meshes;
- per-stage scalars in stage order on every process (:meth:`World.stage_values`: the
  squared gradient norms, so the global norm is the single-process one to the bit);
- one stage's value on every process (:meth:`World.from_stage`: the loss);
- point to point between processes (:meth:`World.post`, :meth:`World.take`: the slices of a
  parameter several stages hold, h2jax.runtime._tied), with every stage's ranks
  (:meth:`World.ranks_of`);
- the step boundary (:meth:`World.step_boundary`: whether any process got a stop signal,
  and the newest step every process has committed);
- decisions taken once (:meth:`World.lead`: rank 0 reads the checkpoint directory and tells
  the others) and actions that must succeed everywhere (:meth:`World.all`);
- who writes the run folder (``is_writer``).

:class:`LocalWorld` owns every stage (one process). :class:`MpiWorld` runs one stage per
process group over an mpi4py-like communicator; its agreement logic uses only
``allgather``, ``bcast``, ``gather``, ``barrier`` and point-to-point ``send``/``recv``, so
:class:`ThreadComm` (ranks as threads of one process) runs it without mpirun -- the tests check the stop agreement, the
non-finite policy and the resume decisions that way.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from h2jax.checkpoint import CheckpointCorruptError, CheckpointError
from h2jax.config import ConfigError, ExperimentConfig

if TYPE_CHECKING:
    from h2jax.launch import FailFast
    from h2jax.runtime._procgroup import StageGroup


class JobError(Exception):
    """A failure every process of the job met at the same point (they agreed on it): the
    writer reports it once and every process exits with ``code``."""

    def __init__(self, what: str, message: str, code: int = 1, *, corrupt: bool = False):
        super().__init__(message)
        self.what, self.code = what, code
        self.corrupt = corrupt  # a checkpoint's files could not be read (CheckpointCorruptError)


_AGREED = (CheckpointError, ConfigError, OSError, KeyError, ValueError)
EXCHANGE_TAG = 30_001  # World.post's messages on the world communicator (channels use their own)


class World:
    """The interface (see the module docstring); both worlds implement all of it."""

    rank: int = 0
    size: int = 1
    launcher: str | None = None
    num_stages: int
    local_stages: tuple[int, ...]
    is_writer: bool = True
    comm: Any = None  # the mpi4py-like communicator of every process (MpiWorld); None in one process
    group: StageGroup | None = None  # this process's stage group (jax.distributed cluster, mesh) under a launcher
    fail_fast: FailFast | None = None  # the launcher's watchdog and stop-signal catcher (h2jax.launch)

    @property
    def multiprocess(self) -> bool:
        return self.size > 1

    def stage_values(self, values: Mapping[int, float]) -> list[float]:
        raise NotImplementedError

    def from_stage(self, stage: int, value: Any) -> Any:
        raise NotImplementedError

    def ranks_of(self, stage: int) -> tuple[int, ...]:
        """The world ranks of ``stage``'s processes, in their order in its ``jax.distributed``
        cluster (a device's ``process_index`` picks one); this process alone in one process."""
        return (self.rank,)

    def post(self, rank: int, obj: Any) -> None:
        """Send ``obj`` (it must pickle: host arrays) to process ``rank`` without waiting for it
        to be received (pickled at once; :meth:`settle` waits): a process that sends to several
        is held by none of them. Messages between two processes arrive in the order posted."""
        raise NotImplementedError(f"{type(self).__name__} has no other process to post to")

    def take(self, rank: int) -> Any:
        """The next object process ``rank`` posted to this one (waits for it)."""
        raise NotImplementedError(f"{type(self).__name__} has no other process to take from")

    def settle(self) -> None:
        """Wait until every object :meth:`post` sent from this process was received."""

    def step_boundary(self, stop: str | None, committed: int | None) -> tuple[str | None, int]:
        raise NotImplementedError

    def lead(self, fn: Callable[[], Any], what: str) -> Any:
        raise NotImplementedError

    def all(self, fn: Callable[[], Any], what: str) -> Any:
        raise NotImplementedError

    def gather(self, obj: Any) -> list[Any] | None:
        raise NotImplementedError

    def allgather(self, obj: Any) -> list[Any]:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError


class LocalWorld(World):
    """One process runs every stage."""

    def __init__(self, num_stages: int):
        self.num_stages = num_stages
        self.local_stages = tuple(range(num_stages))

    def stage_values(self, values: Mapping[int, float]) -> list[float]:
        return [float(values[s]) for s in range(self.num_stages)]

    def from_stage(self, stage: int, value: Any) -> Any:
        return value

    def step_boundary(self, stop: str | None, committed: int | None) -> tuple[str | None, int]:
        return stop, -1 if committed is None else committed

    def lead(self, fn: Callable[[], Any], what: str) -> Any:
        return self.all(fn, what)

    def all(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return fn()
        except _AGREED as e:
            raise JobError(
                what, str(e), 2 if isinstance(e, ConfigError) else 1, corrupt=isinstance(e, CheckpointCorruptError)
            ) from e

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass


class MpiWorld(World):
    """One stage per process group; ``comm`` is mpi4py's COMM_WORLD (or a ThreadComm).

    ``stage_of_rank[r]`` is the stage of world rank r; the first rank of a stage speaks for
    it (``leader``). ``launcher`` names what started the job (for messages).
    """

    def __init__(self, comm: Any, stage_of_rank: Sequence[int], *, launcher: str | None = None):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stage_of_rank = tuple(int(s) for s in stage_of_rank)
        self.num_stages = max(self.stage_of_rank) + 1
        self.stage_idx = self.stage_of_rank[self.rank]
        self.local_stages = (self.stage_idx,)
        self.leaders = tuple(self.stage_of_rank.index(s) for s in range(self.num_stages))
        self.is_leader = self.leaders[self.stage_idx] == self.rank
        self.is_writer = self.rank == 0
        self.launcher = launcher
        self._posted: list[Any] = []  # post's sends not yet known received (settle)

    def stage_values(self, values: Mapping[int, float]) -> list[float]:
        mine = float(values[self.stage_idx]) if self.is_leader else None
        by_rank = self.comm.allgather(mine)
        return [float(by_rank[self.leaders[s]]) for s in range(self.num_stages)]

    def from_stage(self, stage: int, value: Any) -> Any:
        return self.comm.bcast(value, root=self.leaders[stage])

    def ranks_of(self, stage: int) -> tuple[int, ...]:
        return tuple(r for r, s in enumerate(self.stage_of_rank) if s == stage)

    def post(self, rank: int, obj: Any) -> None:
        self._posted.append(self.comm.isend(obj, dest=rank, tag=EXCHANGE_TAG))

    def take(self, rank: int) -> Any:
        return self.comm.recv(source=rank, tag=EXCHANGE_TAG)

    def settle(self) -> None:
        posted, self._posted = self._posted, []
        for req in posted:
            req.wait()

    def step_boundary(self, stop: str | None, committed: int | None) -> tuple[str | None, int]:
        got = self.comm.allgather((stop, -1 if committed is None else committed))
        stops = sorted({s for s, _ in got if s})
        return (stops[0] if stops else None), min(c for _, c in got)

    def lead(self, fn: Callable[[], Any], what: str) -> Any:
        result = err = None
        if self.rank == 0:
            try:
                result = fn()
            except _AGREED as e:
                err = (str(e), 2 if isinstance(e, ConfigError) else 1, isinstance(e, CheckpointCorruptError))
        result, err = self.comm.bcast((result, err), root=0)
        if err is not None:
            raise JobError(what, err[0], err[1], corrupt=err[2])
        return result

    def all(self, fn: Callable[[], Any], what: str) -> Any:
        result = err = None
        try:
            result = fn()
        except _AGREED as e:
            # a ConfigError names its key already (the same line as in one process)
            config = isinstance(e, ConfigError)
            err = (
                str(e) if config or self.num_stages == 1 else f"stage {self.stage_idx}: {e}",
                2 if config else 1,
                isinstance(e, CheckpointCorruptError),
            )
        errs = [e for e in self.comm.allgather(err) if e is not None]
        if errs:
            # the same message on every rank: stage order, one line each stage
            msgs = list(dict.fromkeys(m for m, _, _ in errs))
            raise JobError(what, "; ".join(msgs), max(c for _, c, _ in errs), corrupt=any(c for _, _, c in errs))
        return result

    def gather(self, obj: Any) -> list[Any] | None:
        return self.comm.gather(obj, root=0)

    def allgather(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def barrier(self) -> None:
        self.comm.barrier()


class ThreadComm:
    """An mpi4py-like communicator whose ranks are threads of this process (the object
    collectives :class:`MpiWorld` uses: allgather, bcast, gather, barrier; and send/recv). Make one
    :class:`ThreadGroup` and give each thread ``group.comm(rank)``."""

    def __init__(self, group: ThreadGroup, rank: int):
        self._g, self._rank = group, rank

    def Get_rank(self) -> int:  # noqa: N802 -- mpi4py's names
        return self._rank

    def Get_size(self) -> int:  # noqa: N802
        return self._g.size

    def allgather(self, obj: Any) -> list[Any]:
        return self._g.exchange(self._rank, obj)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self._g.exchange(self._rank, obj)[root]

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        got = self._g.exchange(self._rank, obj)
        return got if self._rank == root else None

    def barrier(self) -> None:
        self._g.exchange(self._rank, None)

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        self._g.mailbox(self._rank, dest, tag).put(obj)

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Any:
        """A posted send (mailboxes never block: it is done at once), with mpi4py's ``wait``."""
        self.send(obj, dest, tag)
        return _Done()

    def recv(self, source: int, tag: int = 0) -> Any:
        try:
            return self._g.mailbox(source, self._rank, tag).get(timeout=self._g.timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"rank {self._rank}: no message from rank {source} tag {tag} in {self._g.timeout_s:g} s"
            ) from None


class _Done:
    def wait(self) -> None:
        pass


class ThreadGroup:
    """The shared state of a :class:`ThreadComm` world of ``size`` ranks."""

    def __init__(self, size: int, *, timeout_s: float = 120.0):
        self.size, self.timeout_s = size, timeout_s
        self._barrier = threading.Barrier(size, timeout=timeout_s)
        self._slots: list[Any] = [None] * size
        self._lock = threading.Lock()
        self._mail: dict[tuple[int, int, int], queue.Queue] = {}  # (source, dest, tag): in send order, as MPI

    def mailbox(self, source: int, dest: int, tag: int) -> queue.Queue:
        with self._lock:
            return self._mail.setdefault((source, dest, tag), queue.Queue())

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)

    def exchange(self, rank: int, obj: Any) -> list[Any]:
        self._barrier.wait()  # everyone has read the previous exchange
        self._slots[rank] = obj
        self._barrier.wait()  # everyone has written
        return list(self._slots)


def make_world(cfg: ExperimentConfig, *, fail_fast: Any = None) -> World:
    """The world of this process, from the launcher's environment (h2jax.launch): a
    :class:`LocalWorld` without one, else an :class:`MpiWorld` over COMM_WORLD whose stage
    group (jax.distributed cluster, mesh) is built here, before JAX's backends start."""
    from h2jax.launch import FailFast, detect_launch

    launch = detect_launch()
    if launch is None or launch.size == 1:
        return LocalWorld(cfg.plan.num_stages)
    from mpi4py import MPI

    from h2jax.runtime._procgroup import StageGroup

    comm = MPI.COMM_WORLD
    if comm.Get_size() != launch.size:
        raise RuntimeError(f"{launch.launcher} says {launch.size} processes, MPI COMM_WORLD has {comm.Get_size()}")
    if fail_fast is None:  # the CLI starts it earlier, before JAX's threads exist
        fail_fast = FailFast(launch)
        fail_fast.start()
    group = StageGroup(cfg.plan, cfg.cluster.chips, comm)
    fail_fast.stage = group.stage_idx
    world = MpiWorld(comm, [group.layout.stage_of(r) for r in range(comm.Get_size())], launcher=launch.launcher)
    world.group, world.fail_fast = group, fail_fast
    import socket

    fail_fast.peers = world.allgather((world.rank, group.stage_idx, os.getpid(), socket.gethostname()))
    return world


_prepared: list[tuple[Any, World]] = []  # (the plan, the world) setup_backends built for train()


def setup_backends(target: ExperimentConfig | Any) -> dict[str, list[str]]:
    """Make the chip types available before anything starts JAX (a model built at a script's
    top level does); chip type -> backend name per node.

    Given the experiment config, it works in one process and under a launcher alike: in one
    process every chip type of the cluster is registered (emulated ones as CPU clients, one
    per node); under mpirun/srun this process's world is built now -- its stage's chip type
    with its stage's devices, and jax.distributed where a stage spans processes -- and
    :func:`h2jax.train` of the same plan takes it over. Given the cluster alone, one process
    only: under a launcher the plan decides which chip type each process holds."""
    from h2jax.config import ClusterConfig, validate
    from h2jax.launch import LauncherError, detect_launch
    from h2jax.runtime._cluster import register_backends

    try:
        launch = detect_launch()
    except LauncherError as e:
        raise ConfigError("launcher", str(e)) from None
    launched = launch is not None and launch.size > 1
    if isinstance(target, ClusterConfig):
        if launched:
            raise ConfigError(
                "setup_backends",
                f"under {launch.launcher} ({launch.size} processes) each process holds its stage's chip "
                "type only, which the plan decides: pass the experiment config (h2jax.setup_backends(cfg))",
            )
        return register_backends(target)
    if not isinstance(target, ExperimentConfig):
        raise TypeError(f"setup_backends: expected an ExperimentConfig or a ClusterConfig, got {type(target).__name__}")
    cfg = validate(target)
    if not launched:
        return register_backends(cfg.cluster)
    if _prepared and _prepared[0][0] != cfg.plan:
        raise ConfigError("setup_backends", "called twice with different plans; one process runs one plan's stage")
    if not _prepared:
        _prepared.append((cfg.plan, make_world(cfg)))
    group = _prepared[0][1].group
    return {group.spec.chip: [group.backend]}


def take_prepared_world(cfg: ExperimentConfig) -> World | None:
    """The world :func:`setup_backends` built for ``cfg``'s plan (handed over once), or None."""
    if not _prepared:
        return None
    plan, world = _prepared[0]
    if plan != cfg.plan:
        raise ConfigError(
            "plan",
            "h2jax.setup_backends(cfg) prepared this process for another plan than the one train() was "
            "given; pass the same config to both",
        )
    _prepared.clear()
    return world
