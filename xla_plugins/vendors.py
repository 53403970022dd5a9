"""Real chip types: which PJRT platform (and plugin package) serves each vendor.

A real chip type is written ``<platform>:<device kind>`` (``cuda:H100``, ``rocm:MI300X``,
``tpu:v5e``, ``cpu``). Its backend is the vendor's PJRT plugin, discovered by JAX through
the ``jax_plugins`` entry points; h2jax only needs to know the platform name.
"""

from __future__ import annotations

# platform name -> the pip package that provides its PJRT plugin
VENDOR_PLATFORMS: dict[str, str] = {
    "cpu": "jaxlib (built in)",
    "cuda": "jax-cuda12-plugin / jax-cuda13-plugin",
    "rocm": "jax-rocm7-plugin",
    "tpu": "libtpu",
    "xpu": "intel-extension-for-openxla",
}


def platform_of(chip_type: str) -> str | None:
    """The PJRT platform of a real chip type (``cuda:H100`` -> ``cuda``), or None if emulated."""
    platform = chip_type.split(":", 1)[0]
    return platform if platform in VENDOR_PLATFORMS else None
