"""The Transport protocol: how a boundary tensor crosses from one stage mesh to the next.

A transport moves one array, laid out on the source stage's mesh, to the destination
stage's sharding (possibly another backend, another data x tensor shape). The runtime
calls it from a transfer thread, never from the thread that dispatches stage programs,
because a transfer may have to wait for its source to be computed.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax


@runtime_checkable
class Transport(Protocol):
    """Moves boundary tensors between stage meshes."""

    name: str

    def transfer(self, x: jax.Array, dst: jax.sharding.Sharding) -> jax.Array:
        """``x`` laid out as ``dst`` (on the destination stage's devices). May block until ``x`` is ready."""
        ...


class LocalTransport:
    """Single process: ``jax.device_put`` to the destination sharding, across backends.

    PJRT copies between clients (on CPU the bytes may be shared, so its timing says nothing
    about a real link). Any data/tensor layout on either side is allowed: device_put
    reshards.
    """

    name = "local"

    def transfer(self, x: jax.Array, dst: jax.sharding.Sharding) -> jax.Array:
        return jax.device_put(x, dst)


def make_transport(name: str) -> Transport:
    if name == "local":
        return LocalTransport()
    raise ValueError(f"train.transport: {name!r} is not available in one process; expected 'local'")
