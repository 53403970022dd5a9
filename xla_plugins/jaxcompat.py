"""What h2jax needs of JAX that has no public name in every supported release.

h2jax supports jax 0.10.2 through 0.12 (pyproject.toml). Everything else it uses is public
API in that whole range; the few things below are not, so they live here, each with the
releases it was checked against, and nowhere else reaches into ``jax._src``. When a public
name appears, the shim becomes an import of it for the releases that have it.
"""

from __future__ import annotations

from typing import Any


def backends_are_initialized() -> bool:
    """Whether JAX has created its backends (the first ``jax.devices()``): emulated chip types
    and a stage's own ``jax.distributed`` cluster must be set up before that.

    No public name in jax 0.10.2-0.12 (``jax.extend.backend`` has none; ``backends()``
    would initialise them): ``jax._src.xla_bridge.backends_are_initialized``."""
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def make_cpu_client(num_devices: int) -> Any:
    """A new CPU PJRT client of ``num_devices`` devices (an emulated node's backend).

    jaxlib's own module in jax 0.10.2-0.12 (``jax.extend.backend`` registers a factory but
    makes no client)."""
    from jaxlib import xla_client

    return xla_client.make_cpu_client(num_devices=num_devices)


def cudnn_fused_attention_available() -> bool:
    """Whether cuDNN's fused attention can be traced in this process (cuDNN found, of a
    version JAX accepts). No public check in jax 0.10.2-0.12 (``jax.nn.dot_product_attention``
    raises only when lowered): ``jax._src.cudnn.fused_attention_stablehlo.check_cudnn_version``.
    False where the check itself is missing (another JAX layout) or fails."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        check_cudnn_version()
    except Exception:  # noqa: BLE001 -- no cuDNN, no CUDA backend, or another JAX layout
        return False
    return True
