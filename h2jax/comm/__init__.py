"""Everything that crosses a stage boundary: one channel per stage, and the byte movers under it.

The runtime uses one interface, the stage's :class:`Channel` (``recv``/``send`` per
direction and microbatch, ``flush`` at the end of a step), built once by
:func:`make_channel` from ``train.transport`` (see ``h2jax/comm/_channel.py``):
``local`` (one process: ``jax.device_put`` across backends), ``host`` (numpy + mpi4py, the
CPU-mediated baseline), ``ffi-call`` (FFI send/recv, a program per transfer) and ``ffi``
(FFI send/recv traced into the stage programs). The tag scheme and the per-device routing
live in ``_routing.py``; the resharding pattern itself is the pure
:func:`h2jax.plan.reshard_pattern`.

Below the channels, point-to-point movers between ranks of one MPI communicator (also
what ``benchmarks/transport.py`` measures)::

    t = FfiTransport(comm, timeout_s=60.0) | HostTransport(comm, ...)   # collective over comm
    t.send(x, *, peer: int, tag: int) -> None                     # never waits for the receiver
    y = t.recv(like, *, peer: int, tag: int, sharding=None) -> jax.Array
    t.flush() -> None                                             # every send delivered (or error)

and the FFI calls usable inside any jitted program (per device under ``jax.shard_map``;
tokens order the calls)::

    tok = send(x, peer=1, tag=7, comm=comm, token=new_token())
    y, tok = recv(shape, dtype, peer=1, tag=8, comm=comm, token=tok)
    y, tok = sendrecv(x, shape, dtype, dest=1, source=1, send_tag=7, recv_tag=8, comm=comm, token=tok)

Which path a link's bytes take -- ``direct``, ``staged`` (through host memory) or ``host`` --
is :func:`classify_link` (``_paths.py``, pure); the runtime's link table
(h2jax.runtime._links) names and times every link of a run.

A receive whose message never comes fails after ``timeout_s`` naming rank, peer, tag and
tensor. A buffered send (``send(..., buffered=True)``, either engine: what the stage programs'
boundaries use) returns once its bytes are copied; ``flush_sends(comm=...)`` waits until all
are received. ``stash_stats()`` counts the messages that took the deadlock-free detour, and the
buffered sends.

The transport registry (:data:`TRANSPORTS`, :class:`Transport`) is pure data and loads at
once, so that ``h2jax.config`` checks ``train.transport`` without importing JAX; every other
name loads with its module on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from h2jax.comm._transports import ENGINES, PROCESS_TRANSPORTS, REGISTRY, TRANSPORTS, Transport

_LAZY = {
    "Channel": "h2jax.comm._channel",
    "FfiChannel": "h2jax.comm._channel",
    "LocalHub": "h2jax.comm._channel",
    "PeerChannel": "h2jax.comm._channel",
    "PipelineAborted": "h2jax.comm._channel",
    "StageLink": "h2jax.comm._channel",
    "TransferFailure": "h2jax.comm._channel",
    "make_channel": "h2jax.comm._channel",
    "stage_links": "h2jax.comm._channel",
    "DEFAULT_TIMEOUT_S": "h2jax.comm._ffi",
    "FfiUnavailableError": "h2jax.comm._ffi",
    "is_available": "h2jax.comm._ffi",
    "mpi_device_aware": "h2jax.comm._ffi",
    "flush_sends": "h2jax.comm._ffi",
    "new_token": "h2jax.comm._ffi",
    "recv": "h2jax.comm._ffi",
    "register": "h2jax.comm._ffi",
    "send": "h2jax.comm._ffi",
    "sendrecv": "h2jax.comm._ffi",
    "stash_stats": "h2jax.comm._ffi",
    "HostTransport": "h2jax.comm._host",
    "LinkEnd": "h2jax.comm._paths",
    "MpiFacts": "h2jax.comm._paths",
    "classify_link": "h2jax.comm._paths",
    "library_name": "h2jax.comm._paths",
    "not_direct": "h2jax.comm._paths",
    "UcxFacts": "h2jax.comm._paths",
    "classify_proto": "h2jax.comm._paths",
    "parse_proto_info": "h2jax.comm._paths",
    "UcxComm": "h2jax.comm._ucx",
    "UcxUnavailableError": "h2jax.comm._ucx",
    "UcxVersionMismatch": "h2jax.comm._ucx",
    "preload_ucx": "h2jax.comm._ucx",
    "ucx_platforms": "h2jax.comm._ucx",
    "ucx_settings": "h2jax.comm._ucx",
    "FfiTransport": "h2jax.comm._peer",
    "PeerTransport": "h2jax.comm._peer",
    "BWD": "h2jax.comm._routing",
    "FWD": "h2jax.comm._routing",
    "Boundary": "h2jax.comm._routing",
    "RoutingUnsupported": "h2jax.comm._routing",
    "tag_base": "h2jax.comm._routing",
}

if TYPE_CHECKING:
    from h2jax.comm._channel import (
        Channel,
        FfiChannel,
        LocalHub,
        PeerChannel,
        PipelineAborted,
        StageLink,
        TransferFailure,
        make_channel,
        stage_links,
    )
    from h2jax.comm._ffi import (
        DEFAULT_TIMEOUT_S,
        FfiUnavailableError,
        flush_sends,
        is_available,
        mpi_device_aware,
        new_token,
        recv,
        register,
        send,
        sendrecv,
        stash_stats,
    )
    from h2jax.comm._host import HostTransport
    from h2jax.comm._paths import (
        LinkEnd,
        MpiFacts,
        UcxFacts,
        classify_link,
        classify_proto,
        library_name,
        not_direct,
        parse_proto_info,
    )
    from h2jax.comm._peer import FfiTransport, PeerTransport
    from h2jax.comm._routing import BWD, FWD, Boundary, RoutingUnsupported, tag_base
    from h2jax.comm._ucx import (
        UcxComm,
        UcxUnavailableError,
        UcxVersionMismatch,
        preload_ucx,
        ucx_platforms,
        ucx_settings,
    )

__all__ = ["ENGINES", "PROCESS_TRANSPORTS", "REGISTRY", "TRANSPORTS", "Transport", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'h2jax.comm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
