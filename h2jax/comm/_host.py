"""The CPU-mediated baseline: copy to host numpy, mpi4py point-to-point, copy back.

What the FFI transport is measured against (H2's "CPU-mediated" path). Sends are
``Isend`` from a private host copy, so a send never waits for its receiver and two
neighbours sending to each other at once cannot deadlock; ``flush()`` waits until every
send has left. A receive polls ``Iprobe`` until its message arrives or ``timeout_s`` runs
out, then checks the size before receiving.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from h2jax.comm._ffi import DEFAULT_TIMEOUT_S, desc


def _as_bytes(a: np.ndarray) -> np.ndarray:
    # mpi4py does not know bfloat16 & co: every transfer is raw bytes
    return a.reshape(-1).view(np.uint8)


def first_device(like: Any, sharding: jax.sharding.Sharding | None) -> jax.Device:
    s = sharding if sharding is not None else getattr(like, "sharding", None)
    if s is not None:
        return min(s.device_set, key=lambda d: d.id)
    return jax.devices()[0]


class HostTransport:
    """Boundary tensors as host bytes over mpi4py (see the module docstring)."""

    name = "host"

    def __init__(self, comm: Any = None, *, timeout_s: float = DEFAULT_TIMEOUT_S, dup: bool = True):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD if comm is None else comm
        # collective over comm: every rank constructs its transport at the same point
        self.comm = comm.Dup() if dup else comm
        self.timeout_s = float(timeout_s)
        self._pending: list[tuple[Any, np.ndarray, int, int]] = []  # (request, buffer, peer, tag)

    def send(self, x: jax.Array, *, peer: int, tag: int) -> None:
        from mpi4py import MPI

        buf = np.array(x, copy=True, order="C")  # waits for x; private, so the send may outlive x
        req = self.comm.Isend([_as_bytes(buf), MPI.BYTE], dest=peer, tag=tag)
        self._pending.append((req, buf, peer, tag))
        self._reap()

    def recv(
        self, like: jax.ShapeDtypeStruct, *, peer: int, tag: int, sharding: jax.sharding.Sharding | None = None
    ) -> jax.Array:
        from mpi4py import MPI

        expected = int(np.prod(like.shape, dtype=np.int64)) * np.dtype(like.dtype).itemsize
        status = MPI.Status()
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while not self.comm.Iprobe(source=peer, tag=tag, status=status):
            self._reap()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"h2jax host recv on rank {self.comm.Get_rank()}: timed out after "
                    f"{self.timeout_s:g} s: no message from peer {peer} with tag {tag} "
                    f"(expected {desc(like.shape, like.dtype)}, {expected} bytes)"
                )
            spins += 1
            if spins > 1000:
                time.sleep(20e-6)
        got = status.Get_count(MPI.BYTE)
        if got != expected:
            raise ValueError(
                f"h2jax host recv on rank {self.comm.Get_rank()}: message from peer {peer} tag {tag} "
                f"has {got} bytes, expected {expected} ({desc(like.shape, like.dtype)})"
            )
        out = np.empty(like.shape, like.dtype)
        self.comm.Recv([_as_bytes(out), MPI.BYTE], source=peer, tag=tag)
        return jax.device_put(out, sharding if sharding is not None else first_device(like, None))

    def _reap(self) -> None:
        self._pending = [p for p in self._pending if not p[0].Test()]

    def flush(self) -> None:
        """Wait until every send has left this process (or fail after ``timeout_s``)."""
        deadline = time.monotonic() + self.timeout_s
        while self._pending:
            self._reap()
            if self._pending and time.monotonic() > deadline:
                left = ", ".join(f"peer {p} tag {t} ({b.nbytes} bytes)" for _, b, p, t in self._pending)
                raise TimeoutError(
                    f"h2jax host flush on rank {self.comm.Get_rank()}: timed out after "
                    f"{self.timeout_s:g} s; sends not received: {left}"
                )
            time.sleep(20e-6)

    def close(self) -> None:
        self.flush()
