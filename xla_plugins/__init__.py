"""Chip types as PJRT backends.

Every chip type h2jax trains on is a PJRT backend registered with JAX under a name.
Real accelerators come from their vendors' plugins (see :mod:`xla_plugins.vendors`);
on a machine without accelerators, :mod:`xla_plugins.emulated` registers *emulated*
chip types: separate CPU PJRT clients that share the host's CPU cores.
"""

from xla_plugins.emulated import (
    EmulatedBackendError,
    backend_name,
    emulated_backends,
    register_emulated_chips,
)
from xla_plugins.jaxcompat import backends_are_initialized, cudnn_fused_attention_available
from xla_plugins.vendors import (
    PLATFORMS,
    VENDOR_PLATFORMS,
    VENDORS,
    Vendor,
    device_kind_matches,
    fused_attention,
    platform_of,
)

__all__ = [
    "PLATFORMS",
    "VENDORS",
    "EmulatedBackendError",
    "VENDOR_PLATFORMS",
    "Vendor",
    "backend_name",
    "backends_are_initialized",
    "cudnn_fused_attention_available",
    "device_kind_matches",
    "emulated_backends",
    "fused_attention",
    "platform_of",
    "register_emulated_chips",
]
