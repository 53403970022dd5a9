"""Multi-process transports: one array to or from a peer process, by MPI rank and tag.

``FfiTransport`` runs each transfer as a small jitted program around the FFI handlers
(dispatch included: ~tens of µs); stage programs that want the ~1 µs path call
``h2jax.comm.send`` / ``recv`` inside their own jit instead. ``HostTransport`` is the
CPU-mediated baseline. Both take the same calls, so the runtime picks one by name.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from h2jax.comm import _ffi
from h2jax.comm._host import first_device


@runtime_checkable
class PeerTransport(Protocol):
    """Moves boundary tensors between processes (ranks of one MPI communicator)."""

    name: str

    def send(self, x: jax.Array, *, peer: int, tag: int) -> None:
        """Start sending ``x`` to ``peer``; returns without waiting for the receiver."""
        ...

    def recv(
        self, like: jax.ShapeDtypeStruct, *, peer: int, tag: int, sharding: jax.sharding.Sharding | None = None
    ) -> jax.Array:
        """The array that ``peer`` sent with ``tag``, laid out as ``sharding``."""
        ...

    def flush(self) -> None:
        """Wait until every send of this transport has been delivered."""
        ...


class FfiTransport:
    """Transfers as standalone jitted programs around the FFI send/recv handlers.

    A sharded ``x`` is first gathered onto one of its devices (a copy inside the source
    stage), and a received array lands on the first device of ``sharding`` and is then
    laid out as ``sharding`` (inside the destination stage). Programs are compiled once
    per (peer, tag, shape, dtype).
    """

    name = "ffi"

    def __init__(
        self, comm: Any = None, *, timeout_s: float = _ffi.DEFAULT_TIMEOUT_S, dup: bool = True, engine: str = "mpi"
    ):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD if comm is None else comm
        # collective over comm: every rank constructs its transport at the same point
        self.mpi_comm = comm.Dup() if dup else comm
        self.engine = engine
        if engine == "ucx":  # the same ops over UCX (h2jax.comm._ucx), bootstrapped over the duplicate
            from h2jax.comm._ucx import UcxComm

            self.comm = UcxComm(self.mpi_comm)
        else:
            _ffi.register()  # fail here, with the build hint, rather than at the first transfer
            self.comm = self.mpi_comm
        self.timeout_s = float(timeout_s)
        self._programs: dict[tuple, Any] = {}
        self._pending: list[jax.Array] = []  # tokens of sends in flight

    def _program(self, kind: str, peer: int, tag: int, like: Any = None, device: Any = None) -> Any:
        key = (kind, peer, tag) if like is None else (kind, peer, tag, like.shape, str(like.dtype), device)
        fn = self._programs.get(key)
        if fn is None:
            comm, timeout_s = self.comm, self.timeout_s
            if kind == "send":
                fn = jax.jit(lambda x: _ffi.send(x, peer=peer, tag=tag, comm=comm, timeout_s=timeout_s))
            else:
                sharding = jax.sharding.SingleDeviceSharding(device)
                fn = jax.jit(
                    lambda: _ffi.recv(like.shape, like.dtype, peer=peer, tag=tag, comm=comm, timeout_s=timeout_s)[0],
                    out_shardings=sharding,
                )
            self._programs[key] = fn
        return fn

    def send(self, x: jax.Array, *, peer: int, tag: int) -> None:
        if len(x.sharding.device_set) > 1:
            x = jax.device_put(x, jax.sharding.SingleDeviceSharding(first_device(x, None)))
        self._pending = [t for t in self._pending if not t.is_ready()]
        self._pending.append(self._program("send", peer, tag)(x))

    def recv(
        self, like: jax.ShapeDtypeStruct, *, peer: int, tag: int, sharding: jax.sharding.Sharding | None = None
    ) -> jax.Array:
        device = first_device(like, sharding)
        like = jax.ShapeDtypeStruct(tuple(like.shape), like.dtype)
        y = self._program("recv", peer, tag, like, device)()
        if sharding is not None and len(sharding.device_set) > 1:
            y = jax.device_put(y, sharding)
        return y

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        jax.block_until_ready(pending)

    def close(self) -> None:
        self.flush()
