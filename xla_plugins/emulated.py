"""Emulated chip types: named CPU PJRT clients, one per emulated node.

What is emulated, plainly: an emulated chip type (e.g. ``sim_a``) is a CPU PJRT client
whose devices are slices of the *same* host CPU. Its declared memory (from its chip
profile) is enforced by the runtime's memory check before training starts; its speed is
**not** faked -- every emulated device computes at whatever the shared host CPU gives it.

Each emulated node is its own client, registered as backend ``"<chip>:<node>"``
(``sim_a:0``, ``sim_a:1``, ...), because XLA runs the programs of one CPU client one after
another while programs on different clients overlap -- as stages on different nodes of a
real cluster do. Devices of two clients never share one mesh or one jit.

Registration must happen before JAX initialises its backends (the first
``jax.devices()``); :func:`register_emulated_chips` is idempotent for names it already
registered and says clearly when it comes too late.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

_lock = threading.Lock()
# backend name -> number of devices, for every emulated backend this process registered
_registered: dict[str, int] = {}


class EmulatedBackendError(RuntimeError):
    """An emulated chip type cannot be (or was not) registered in this process."""


def backend_name(chip_type: str, node: int) -> str:
    """The JAX backend name of emulated node ``node`` of ``chip_type``."""
    return f"{chip_type}:{node}"


def emulated_backends() -> dict[str, int]:
    """Backends registered so far by this module: name -> devices."""
    with _lock:
        return dict(_registered)


def register_emulated_chips(chips: Mapping[str, tuple[int, int]]) -> dict[str, list[str]]:
    """Register emulated chip types; returns chip type -> its backend names (one per node).

    ``chips`` maps chip type to ``(nodes, devices_per_node)``. Backends already registered
    with the same device count are reused, so several experiments in one process (tests)
    may ask for overlapping clusters as long as the first call registered enough.
    """
    from jax.extend.backend import register_backend_factory

    from xla_plugins.jaxcompat import backends_are_initialized, make_cpu_client

    out: dict[str, list[str]] = {}
    with _lock:
        missing: list[tuple[str, int]] = []
        for chip, (nodes, per_node) in chips.items():
            if nodes < 1 or per_node < 1:
                raise EmulatedBackendError(
                    f"emulated chip {chip!r}: nodes={nodes}, devices_per_node={per_node}; both must be >= 1"
                )
            names = []
            for node in range(nodes):
                name = backend_name(chip, node)
                names.append(name)
                have = _registered.get(name)
                if have is None:
                    missing.append((name, per_node))
                elif have != per_node:
                    raise EmulatedBackendError(
                        f"emulated backend {name!r} already has {have} devices in this process, asked for {per_node}"
                    )
            out[chip] = names
        if missing and backends_are_initialized():
            raise EmulatedBackendError(
                "JAX backends were initialised before the emulated chip types "
                f"{[n for n, _ in missing]} could be registered; register them before the first "
                "jax.devices() call (e.g. call h2jax before touching JAX, or register a superset "
                "at start-up as tests/conftest.py does)"
            )
        for i, (name, per_node) in enumerate(missing):
            register_backend_factory(
                name,
                lambda n=per_node: make_cpu_client(n),
                # below the real "cpu" backend, so jax.devices() keeps its default
                priority=-100 - len(_registered) - i,
                fail_quietly=False,
            )
        for name, per_node in missing:
            _registered[name] = per_node
    return out
