"""One channel per stage: every way a boundary tensor crosses between two stage meshes.

The stage runner talks to its stage's channel and to nothing else that moves bytes::

    x = channel.recv(FWD, m, after=last)   # stage input of microbatch m (None: received in-program)
    channel.send(FWD, m, y, ready=None)    # stage output; never waits for the receiver
    dy = channel.recv(BWD, m, after=last)  # gradient of the output
    channel.send(BWD, m, dx)               # gradient of the input
    channel.flush()                        # end of a step: every send has left

``make_channels(train.transport, ...)`` chooses the mechanism once:

- ``local`` (one process): ``jax.device_put`` to the next stage's sharding, across backends,
  on a transfer thread per boundary and direction (a cross-client copy blocks until its
  source is computed, so it never sits on a dispatching thread). :class:`LocalHub`.
- ``host`` (processes): each process copies the pieces its devices hold to host memory and
  sends them with mpi4py; the CPU-mediated baseline. :class:`PeerChannel` over HostTransport.
- ``ffi-call`` (processes): the same pieces through the FFI handlers, one small jitted
  program per transfer. :class:`PeerChannel` over FfiTransport.
- ``ffi`` (processes): the FFI send/recv traced *into* the stage programs (``in_program``):
  the runner's recv returns None and the programs call :meth:`FfiChannel.recv_in_program` /
  :meth:`FfiChannel.send_in_program` at trace time; the sends are buffered (the program goes
  on once its piece is copied: h2jax.comm._ffi), and ``flush`` waits until the receivers have
  taken them. If a boundary cannot be routed
  in-program (uneven pieces), building the channel fails naming the reason; there is no
  silent fallback.

Every multi-process channel routes per device (:mod:`h2jax.comm._routing`): each piece of
the resharding pattern goes straight to the rank that owns its destination device, and the
destination all-gathers over its ``tensor`` axis. A channel may be given ``record``, a
callback ``record(kind, microbatch, start, end, **extra)`` for the timeline.

Stages of several layer chunks (interleaved, zb-v): the pipeline is read as one of model
*positions* (a chunk each): a channel serves one position, its link names the plan stage
of every position (``StageLink.stages``), and a boundary to a position on the same stage
is no channel's business -- the runner hands that tensor over itself, without a transfer.
Boundaries joining the same two stages carry their chunk's lane in their tags
(:mod:`h2jax.comm._routing`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np

from h2jax.comm._routing import BWD, FWD, TAG_SPACE, Boundary, RoutingUnsupported, lane_offset, lin, tag, tag_base
from h2jax.comm._transports import PROCESS_TRANSPORTS, TRANSPORTS

_POLL_S = 0.05

Record = Callable[..., None]


class PipelineAborted(RuntimeError):
    """Raised on a thread waiting for a transfer of a step that another thread's failure aborted."""


class TransferFailure(RuntimeError):
    """A transfer of the ``local`` hub failed; ``stage`` is its source stage."""

    def __init__(self, stage: int, what: str, cause: BaseException):
        super().__init__(f"{what} failed: {type(cause).__name__}: {cause}")
        self.stage, self.what, self.cause = stage, what, cause


@dataclass(frozen=True)
class StageLink:
    """What a channel knows of its stage and its neighbours.

    ``boundaries[b]`` is the tensor between stage b and b+1 (shape and dtype; its gradient
    has the same). ``ranks[s]`` lists the world rank owning each device of stage s
    (row-major over (data, tensor)); None in one process.

    With layer chunks every index above is a model position (``stage_idx`` the one this
    channel serves), ``stages[q]`` the plan stage holding position q and ``chunks[q]`` its
    chunk there (None: one chunk per stage, positions are stages).
    """

    stage_idx: int
    mesh_shapes: tuple[tuple[int, int], ...]
    mesh: Any
    sharding: Any  # this stage's activation sharding, P("data") on its mesh
    boundaries: tuple[jax.ShapeDtypeStruct, ...]
    ranks: tuple[tuple[int, ...], ...] | None = None
    stages: tuple[int, ...] | None = None
    chunks: tuple[int, ...] | None = None

    def stage(self, position: int) -> int:
        """The plan stage holding ``position``."""
        return self.stages[position] if self.stages is not None else position

    def crosses(self, direction: int, sending: bool) -> bool:
        """Whether this boundary exists and leads to another stage (a transfer): False at
        either end of the model and between two chunks of one stage."""
        other = self.neighbour(direction, sending)
        return 0 <= other < self.num_stages and self.stage(other) != self.stage(self.stage_idx)

    @property
    def lanes(self) -> int:
        return max(self.chunks) + 1 if self.chunks else 1

    def lane(self, direction: int, sending: bool) -> int:
        """The tag lane of this boundary: the chunk of its lower position."""
        return self.chunks[min(self.stage_idx, self.neighbour(direction, sending))] if self.chunks else 0

    def tag_base(self, microbatch: int, direction: int, sending: bool) -> int:
        return (tag_base(microbatch, direction, self.lanes) + lane_offset(self.lane(direction, sending))) % TAG_SPACE

    @property
    def num_stages(self) -> int:
        return len(self.mesh_shapes)

    @property
    def first(self) -> bool:
        return self.stage_idx == 0

    @property
    def last(self) -> bool:
        return self.stage_idx == self.num_stages - 1

    def neighbour(self, direction: int, sending: bool) -> int:
        """The stage on the other end: activations go s -> s+1, gradients s+1 -> s."""
        downstream = (direction == FWD) == sending
        return self.stage_idx + (1 if downstream else -1)

    def boundary(self, direction: int, sending: bool) -> Boundary:
        other = self.neighbour(direction, sending)
        b = min(self.stage_idx, other)
        like = self.boundaries[b]
        me, them = self.mesh_shapes[self.stage_idx], self.mesh_shapes[other]
        src, dst = (me, them) if sending else (them, me)
        return Boundary(tuple(like.shape), src, dst)


class Channel(Protocol):
    """One stage's boundaries (module docstring)."""

    transport: str
    in_program: bool
    record: Record | None

    def recv(self, direction: int, microbatch: int, *, after: Any = None) -> jax.Array | None: ...

    def send(self, direction: int, microbatch: int, x: jax.Array, *, ready: threading.Event | None = None) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    # asked only of a channel whose transfers live inside the stage programs (``in_program``),
    # while the programs are traced; ``base`` is the microbatch's tag base, a program argument
    def recv_in_program(self, direction: int, base: Any) -> jax.Array: ...

    def send_in_program(self, direction: int, y: jax.Array, base: Any) -> jax.Array: ...


# -- one process ------------------------------------------------------------------------------------
class _Mailbox:
    """Microbatch-indexed hand-over between a transfer thread and a stage's runner."""

    def __init__(self, hub: LocalHub):
        self._items: dict[int, Any] = {}
        self._cv = threading.Condition()
        self._hub = hub

    def put(self, microbatch: int, value: Any) -> None:
        with self._cv:
            self._items[microbatch] = value
            self._cv.notify_all()

    def get(self, microbatch: int) -> Any:
        with self._cv:
            while microbatch not in self._items:
                if self._hub.aborted.is_set():
                    raise PipelineAborted()
                self._cv.wait(_POLL_S)
            return self._items.pop(microbatch)

    def clear(self) -> None:
        with self._cv:
            self._items.clear()


class LocalHub:
    """The ``local`` transport of one process: mailboxes per (stage, direction) and one
    transfer thread per (boundary, direction), shared by every stage's channel. Works
    whether one runner walks all stages (threads of one trainer) or several trainers of a
    simulated world each own one."""

    def __init__(self, num_stages: int):
        self.num_stages = num_stages
        self.aborted = threading.Event()
        self.error: BaseException | None = None
        self._shardings: dict[int, Any] = {}
        self._chips: dict[int, str] = {}
        self._stage_of: dict[int, int] = {}  # position -> plan stage, for the records
        self._inbox = {(s, d): _Mailbox(self) for s in range(num_stages) for d in (FWD, BWD)}
        self._queues = {(b, d): queue.Queue() for b in range(num_stages - 1) for d in (FWD, BWD)}
        self.channels: dict[int, LocalChannel] = {}
        self._threads = [
            threading.Thread(target=self._transfer, args=key, name=f"h2jax-xfer-{key[0]}-{key[1]}", daemon=True)
            for key in self._queues
        ]
        for t in self._threads:
            t.start()

    def channel(self, link: StageLink, *, chip: str = "") -> LocalChannel:
        s = link.stage_idx
        if s >= self.num_stages:
            raise ValueError(f"LocalHub({self.num_stages}) has no position {s} (one per model position)")
        self._shardings[s], self._chips[s] = link.sharding, chip
        self._stage_of[s] = link.stage(s)
        self.channels[s] = ch = LocalChannel(self, s)
        return ch

    def abort(self, exc: BaseException | None = None) -> None:
        if exc is not None and self.error is None:
            self.error = exc
        self.aborted.set()

    def reset(self) -> None:
        """A new step: forget an aborted one's leftovers."""
        self.aborted.clear()
        self.error = None
        for box in self._inbox.values():
            box.clear()

    def close(self) -> None:
        """Stop the transfer threads and wait for them (a thread left inside XLA when the
        interpreter exits can abort the process)."""
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=30)

    def _transfer(self, b: int, direction: int) -> None:
        src, dst = (b, b + 1) if direction == FWD else (b + 1, b)
        q = self._queues[(b, direction)]
        while True:
            item = q.get()
            if item is None:
                return
            m, x, ready = item
            try:
                # wait for the source outside the timed transfer; with a timeline, until its
                # end was recorded, so the trace never shows a transfer before its producer
                if ready is not None:
                    while not ready.wait(_POLL_S):
                        if self.aborted.is_set():
                            raise PipelineAborted()
                x.block_until_ready()
                t0 = time.perf_counter()
                y = jax.device_put(x, self._shardings[dst])
                y.block_until_ready()
                t1 = time.perf_counter()
                # recorded before the hand-over: once the receiver has it, the step may end
                extra = {"bytes": int(x.nbytes), "transport": "local", "phase": "FB"[direction]}
                for stage, kind, peer in ((src, "send", dst), (dst, "recv", src)):
                    ch = self.channels.get(stage)
                    if ch is not None and ch.record is not None:
                        ch.record(kind, m, t0, t1, peer=self._stage_of.get(peer, peer), **extra)
                self._inbox[(dst, direction)].put(m, y)
            except PipelineAborted:
                continue
            except BaseException as e:  # noqa: BLE001 -- handed to the runners, which re-raise it
                what = f"{'forward' if direction == FWD else 'backward'} transfer of microbatch {m} to stage {dst}"
                self.abort(TransferFailure(src, what, e))


class LocalChannel:
    transport = "local"
    in_program = False

    def __init__(self, hub: LocalHub, stage_idx: int):
        self.hub, self.stage_idx = hub, stage_idx
        self.record: Record | None = None

    def recv(self, direction: int, microbatch: int, *, after: Any = None) -> jax.Array:
        return self.hub._inbox[(self.stage_idx, direction)].get(microbatch)

    def send(self, direction: int, microbatch: int, x: jax.Array, *, ready: threading.Event | None = None) -> None:
        b = self.stage_idx if direction == FWD else self.stage_idx - 1
        self.hub._queues[(b, direction)].put((microbatch, x, ready))

    def flush(self) -> None:
        """Transfers complete when the receiving runner takes them: nothing to wait for here."""

    def close(self) -> None:
        pass


# -- several processes, pieces staged outside the programs -----------------------------------------
class PeerChannel:
    """``host`` / ``ffi-call``: this process's pieces of every boundary tensor, sent and received
    through a PeerTransport (HostTransport or FfiTransport) by rank and tag."""

    in_program = False

    def __init__(self, link: StageLink, transport: Any):
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        if link.ranks is None:
            raise ValueError("PeerChannel needs the ranks of every stage's devices")
        self.link, self.peer = link, transport
        self.transport = transport.name
        self.record: Record | None = None
        self.coord = {d: idx for idx, d in np.ndenumerate(link.mesh.devices)}  # device -> (data, tensor)
        local = set(link.mesh.local_devices)
        self._local = [d for d in link.mesh.devices.flat if d in local]  # this process's devices, mesh order
        self._routes: dict[tuple[int, bool], tuple[Boundary, list, tuple[int, ...]]] = {}
        s, n = link.stage_idx, link.num_stages
        for direction in (FWD, BWD):
            for sending in (True, False):
                if link.crosses(direction, sending):
                    other = link.neighbour(direction, sending)
                    b = link.boundary(direction, sending)
                    b.check()
                    self._routes[(direction, sending)] = (b, b.pattern(), link.ranks[other])
        nd = len(link.boundaries[0].shape) if link.boundaries else 3
        self._pieces_sharding = NamedSharding(link.mesh, P("data", *([None] * (nd - 2)), "tensor"))
        self._gather = jax.jit(lambda x: x, out_shardings=link.sharding)
        self._dtype = {
            d: link.boundaries[min(s, link.neighbour(d, False))].dtype
            for d in (FWD, BWD)
            if 0 <= link.neighbour(d, False) < n
        }

    def send(self, direction: int, microbatch: int, x: jax.Array, *, ready: threading.Event | None = None) -> None:
        b, pattern, peers = self._routes[(direction, True)]
        base = self.link.tag_base(microbatch, direction, True)
        t0 = time.perf_counter()
        shards = {self.coord[sh.device]: sh for sh in x.addressable_shards}
        for t_idx, t in enumerate(pattern):
            sh = shards.get(t.src)
            if sh is None:
                continue  # another process's device sends this one
            off = [sl.start or 0 for sl in sh.index]
            piece = sh.data[tuple(slice(a - o, z - o) for (a, z), o in zip(t.index, off))]
            self.peer.send(piece, peer=peers[lin(t.dst, b.dst)], tag=tag(base, t_idx))
        if self.record is not None:
            self.record(
                "send",
                microbatch,
                t0,
                time.perf_counter(),
                peer=self.link.stage(self.link.neighbour(direction, True)),
                phase="FB"[direction],
                transport=self.transport,
                bytes=int(x.nbytes),
            )

    def recv(self, direction: int, microbatch: int, *, after: Any = None) -> jax.Array:
        import jax.numpy as jnp

        if after is not None:
            jax.block_until_ready(after)  # never poll beside a running program (module docstring)
        b, pattern, peers = self._routes[(direction, False)]
        base = self.link.tag_base(microbatch, direction, False)
        t0 = time.perf_counter()
        full = tuple(b.shape)
        split = pattern[0].index[-1] != (0, full[-1])  # 1/tp pieces, all-gathered below
        arrays = []
        for dev in self._local:
            mine = sorted((t.index[0][0], t_idx, t) for t_idx, t in enumerate(pattern) if t.dst == self.coord[dev])
            parts = []
            for _, t_idx, t in mine:
                like = jax.ShapeDtypeStruct(tuple(z - a for a, z in t.index), self._dtype[direction])
                parts.append(
                    self.peer.recv(
                        like,
                        peer=peers[lin(t.src, b.src)],
                        tag=tag(base, t_idx),
                        sharding=jax.sharding.SingleDeviceSharding(dev),
                    )
                )
            arrays.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0))
        sharding = self._pieces_sharding if split else self.link.sharding
        y = jax.make_array_from_single_device_arrays(full, sharding, arrays)
        y = self._gather(y) if split else y
        if self.record is not None:
            y.block_until_ready()
            self.record(
                "recv",
                microbatch,
                t0,
                time.perf_counter(),
                peer=self.link.stage(self.link.neighbour(direction, False)),
                phase="FB"[direction],
                transport=self.transport,
                bytes=int(y.nbytes),
            )
        return y

    def flush(self) -> None:
        self.peer.flush()

    def close(self) -> None:
        self.peer.flush()


# -- several processes, transfers inside the stage programs ---------------------------------------
class FfiChannel:
    """``ffi``: the transfers are traced into the stage programs (module docstring)."""

    transport = "ffi"
    in_program = True

    def __init__(self, link: StageLink, comm: Any, *, timeout_s: float):
        from h2jax.comm import _ffi
        from h2jax.comm._routing import device_ranks

        _ffi.register()  # fail here, with the build hint, rather than inside a program
        if link.ranks is None:
            raise ValueError("FfiChannel needs the ranks of every stage's devices")
        self.link, self.comm, self.timeout_s = link, comm, float(timeout_s)
        self.record: Record | None = None
        self._pending: list[jax.Array] = []
        self._b: dict[tuple[int, bool], tuple[Boundary, Any]] = {}
        for direction in (FWD, BWD):
            for sending in (True, False):
                if link.crosses(direction, sending):
                    other = link.neighbour(direction, sending)
                    b = link.boundary(direction, sending)
                    b.check()
                    b.piece_shape()  # raises RoutingUnsupported for uneven pieces
                    self._b[(direction, sending)] = (b, device_ranks(link.ranks[other]))
        for (_, sending), (b, _) in self._b.items():
            counts = set(Counter(t.dst for t in b.pattern()).values())
            if not sending and len(counts) != 1:  # one SPMD body: every device receives as many pieces
                raise RoutingUnsupported(
                    f"destination devices receive unequal numbers of pieces {sorted(counts)} for {b}"
                )

    def recv_in_program(self, direction: int, base: Any) -> jax.Array:
        from h2jax.comm._inprogram import recv_boundary

        b, peer = self._b[(direction, False)]
        dtype = self.link.boundaries[min(self.link.stage_idx, self.link.neighbour(direction, False))].dtype
        base = base + lane_offset(self.link.lane(direction, False))  # the program's base is lane 0's
        return recv_boundary(
            self.link.mesh, b, dtype, peer=peer, tag_base=base, comm=self.comm, timeout_s=self.timeout_s
        )

    def send_in_program(self, direction: int, y: jax.Array, base: Any) -> jax.Array:
        from h2jax.comm._inprogram import send_boundary

        b, peer = self._b[(direction, True)]
        base = base + lane_offset(self.link.lane(direction, True))
        return send_boundary(y, self.link.mesh, b, peer=peer, tag_base=base, comm=self.comm, timeout_s=self.timeout_s)

    def recv(self, direction: int, microbatch: int, *, after: Any = None) -> None:
        return None  # the program receives it

    def send(self, direction: int, microbatch: int, x: jax.Array, *, ready: threading.Event | None = None) -> None:
        self._pending.append(x)  # the program's send token: ready once the piece is copied (buffered)

    def flush(self) -> None:
        from h2jax.comm import _ffi

        pending, self._pending = self._pending, []
        jax.block_until_ready(pending)
        _ffi.flush_sends(comm=self.comm)  # the engine's buffered sends received

    def close(self) -> None:
        self.flush()


def make_channel(
    transport: str,
    link: StageLink,
    *,
    comm: Any = None,
    hub: LocalHub | None = None,
    chip: str = "",
    timeout_s: float = 60.0,
    shared: dict | None = None,
    engine: str = "mpi",
) -> Channel:
    """The channel of one stage (or model position) for ``train.transport`` (collective over
    ``comm`` for the multi-process transports: every rank builds its channel at the same
    point). Each multi-process channel talks over a duplicate of ``comm``; the channels of
    one stage's chunks pass one ``shared`` dict and so share one duplicate (and transport),
    made by the first: a chunk's messages must meet its neighbour chunk's on the same
    communicator, whatever their chunk indices (their tags tell them apart). `engine`: what
    moves the bytes under ``ffi`` and ``ffi-call`` (``mpi`` or ``ucx``: the communicator is then
    a :class:`h2jax.comm._ucx.UcxComm` over the duplicate; ``comm.engine``, resolved)."""
    if transport == "local":
        if hub is None:
            raise ValueError("the local transport needs the process's LocalHub")
        return hub.channel(link, chip=chip)
    if transport not in PROCESS_TRANSPORTS:
        raise ValueError(f"train.transport: {transport!r}; expected one of {list(TRANSPORTS)}")
    if comm is None:
        raise ValueError(
            f"train.transport: {transport!r} moves tensors between processes; it needs a launcher "
            "(mpirun/srun) and an MPI communicator"
        )
    shared = {} if shared is None else shared
    if engine not in ("mpi", "ucx"):
        raise ValueError(f"comm.engine: {engine!r}; expected 'mpi' or 'ucx' (auto resolved before)")
    if transport == "ffi":
        if "comm" not in shared:
            if engine == "ucx":
                from h2jax.comm._ucx import UcxComm

                shared["comm"] = UcxComm(comm.Dup())
            else:
                shared["comm"] = comm.Dup()
        return FfiChannel(link, shared["comm"], timeout_s=timeout_s)
    from h2jax.comm._host import HostTransport
    from h2jax.comm._peer import FfiTransport

    if "peer" not in shared:
        if transport == "host":
            shared["peer"] = HostTransport(comm, timeout_s=timeout_s)
        else:
            shared["peer"] = FfiTransport(comm, timeout_s=timeout_s, engine=engine)
    return PeerChannel(link, shared["peer"])


def stage_links(
    mesh_shapes: Sequence[tuple[int, int]],
    boundaries: Sequence[jax.ShapeDtypeStruct],
    *,
    stage_idx: int,
    mesh: Any,
    sharding: Any,
    ranks: Sequence[Sequence[int]] | None = None,
    stages: Sequence[int] | None = None,
    chunks: Sequence[int] | None = None,
) -> StageLink:
    """The link of stage (or, with ``stages``/``chunks``, model position) ``stage_idx``
    (:class:`StageLink`)."""
    return StageLink(
        stage_idx,
        tuple(tuple(m) for m in mesh_shapes),
        mesh,
        sharding,
        tuple(boundaries),
        None if ranks is None else tuple(tuple(int(r) for r in rr) for rr in ranks),
        None if stages is None else tuple(int(s) for s in stages),
        None if chunks is None else tuple(int(c) for c in chunks),
    )
