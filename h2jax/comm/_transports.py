"""The transports ``train.transport`` may name: the one registry, read by the config's checks.

Pure data (no JAX import): ``h2jax.config`` validates a config against it before any device
is touched, and :func:`h2jax.comm.make_channel` builds the channel each name stands for.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Transport:
    """One way a boundary tensor crosses from one stage mesh to the next."""

    name: str
    between_processes: bool
    """Moves tensors between processes: needs a launcher (mpirun, srun) and one process per stage."""
    summary: str


REGISTRY: dict[str, Transport] = {
    t.name: t
    for t in (
        Transport("local", False, "one process: jax.device_put across backends"),
        Transport("host", True, "numpy + mpi4py through host memory (the CPU-mediated baseline)"),
        Transport("ffi", True, "FFI send/recv traced into the stage programs"),
        Transport("ffi-call", True, "FFI send/recv, one program per transfer"),
    )
}
"""transport name -> :class:`Transport`, in the order error messages list them."""

TRANSPORTS: tuple[str, ...] = tuple(REGISTRY)
PROCESS_TRANSPORTS: tuple[str, ...] = tuple(n for n, t in REGISTRY.items() if t.between_processes)

ENGINES: tuple[str, ...] = ("auto", "mpi", "ucx")
"""``comm.engine``: what moves the bytes under the ``ffi`` and ``ffi-call`` transports (``auto``
resolves to one of the others per run: h2jax.runtime._links)."""
