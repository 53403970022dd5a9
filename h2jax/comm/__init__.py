"""Everything that crosses a stage boundary: the Transport protocols and their implementations.

One process (single controller), ``Transport``::

    transport = make_transport("local")
    y = transport.transfer(x, dst_sharding)          # jax.device_put, across backends

Several processes (``mpirun``; ranks of one MPI communicator), ``PeerTransport``::

    t = make_peer_transport("ffi" | "host", comm=None, timeout_s=60.0)   # collective over comm
    t.send(x, *, peer: int, tag: int) -> None                     # never waits for the receiver
    y = t.recv(like: jax.ShapeDtypeStruct, *, peer: int, tag: int,
               sharding: jax.sharding.Sharding | None = None) -> jax.Array
    t.flush() -> None                                             # every send delivered (or error)

  Messages of one (peer, tag) arrive in the order they were sent, so tags may repeat across
  steps; concurrent transfers between the same two ranks need distinct tags. A receive whose
  message never comes fails after ``timeout_s`` naming rank, peer, tag and tensor (``ffi``:
  the error surfaces when the result is used, as an XlaRuntimeError; ``host``: TimeoutError).
  ``ffi`` runs each call as a small jitted program (FfiTransport); ``host`` copies through
  numpy and mpi4py (HostTransport, the CPU-mediated baseline).

Inside a jitted stage program (the ~1 µs path; per device under ``jax.shard_map`` when the
mesh has several devices; tokens order the calls)::

    tok = new_token()
    tok = send(x, peer=1, tag=7, comm=comm, token=tok, timeout_s=60.0)          -> token
    y, tok = recv(shape, dtype, peer=1, tag=8, comm=comm, token=tok, timeout_s=60.0)
    y, tok = sendrecv(x, shape, dtype, dest=1, source=1, send_tag=7, recv_tag=8, comm=comm, token=tok)

  ``comm`` is an mpi4py communicator reserved for these calls (e.g. ``MPI.COMM_WORLD.Dup()``,
  or ``FfiTransport(...).comm``). See ``h2jax/comm/_ffi.py`` for ordering and deadlock freedom;
  ``stash_stats()`` counts the messages that took the deadlock-free detour (one more copy).
"""

from h2jax.comm._ffi import (
    DEFAULT_TIMEOUT_S,
    FfiUnavailableError,
    is_available,
    new_token,
    recv,
    register,
    send,
    sendrecv,
    stash_stats,
)
from h2jax.comm._host import HostTransport
from h2jax.comm._peer import FfiTransport, PeerTransport, make_peer_transport
from h2jax.comm._transport import LocalTransport, Transport, make_transport

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FfiTransport",
    "FfiUnavailableError",
    "HostTransport",
    "LocalTransport",
    "PeerTransport",
    "Transport",
    "is_available",
    "make_peer_transport",
    "make_transport",
    "new_token",
    "recv",
    "register",
    "send",
    "sendrecv",
    "stash_stats",
]
