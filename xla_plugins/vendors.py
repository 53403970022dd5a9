"""Real chip types: the one table of what h2jax knows about each vendor's platform.

A real chip type is written ``<platform>:<device kind>`` (``cuda:H100``, ``rocm:MI300X``,
``tpu:v5e``, ``cpu``). Its backend is the vendor's PJRT plugin, discovered by JAX through
the ``jax_plugins`` entry points. Every rule that depends on the vendor reads
:data:`VENDORS`: the platforms a chip profile may name (``h2jax.plan``), the device-kind
check of a placement (``h2jax.runtime``), the FFI handlers and the name XLA registers them
under (``h2jax.comm``), and whether the planner prices a fused attention kernel.

Pure data (no JAX import), so the planner may read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Vendor:
    """One PJRT platform and what h2jax does differently on it."""

    platform: str
    """PJRT platform name: ``jax.devices(platform)`` and the prefix of its chip types."""
    plugin: str
    """The pip package that provides its PJRT plugin."""
    ffi_module: str | None = None
    """The ``h2jax.comm`` extension holding this platform's FFI send/recv handlers; None: none built."""
    xla_platform: str | None = None
    """XLA's own name for the platform when FFI targets are registered (None: ``platform``)."""
    fused_attention: bool = False
    """Attention lowers to a fused kernel (cuDNN) in bf16/fp16, which the planner prices."""


VENDORS: dict[str, Vendor] = {
    v.platform: v
    for v in (
        Vendor("cpu", "jaxlib (built in)", ffi_module="_mpi_ffi_cpu"),
        # XLA's own platform name: jax 0.11 no longer maps "cuda" to "CUDA" for FFI targets, and
        # a target registered under "cuda" waits forever for a handler (seen on an H200)
        Vendor(
            "cuda",
            "jax-cuda12-plugin / jax-cuda13-plugin",
            ffi_module="_mpi_ffi_cuda",
            xla_platform="CUDA",
            fused_attention=True,
        ),
        Vendor("rocm", "jax-rocm7-plugin"),
        Vendor("tpu", "libtpu"),
        Vendor("xpu", "intel-extension-for-openxla"),
    )
}
"""platform name -> :class:`Vendor`, in the order error messages list them."""

PLATFORMS = tuple(VENDORS)
"""PJRT platforms a real chip type may name."""

# platform name -> the pip package that provides its PJRT plugin
VENDOR_PLATFORMS: dict[str, str] = {p: v.plugin for p, v in VENDORS.items()}


def platform_of(chip_type: str) -> str | None:
    """The PJRT platform of a real chip type (``cuda:H100`` -> ``cuda``), or None if emulated."""
    platform = chip_type.split(":", 1)[0]
    return platform if platform in VENDORS else None


def fused_attention(platform: str) -> bool:
    """Whether chips of ``platform`` run attention as a fused kernel (unknown platforms: no)."""
    vendor = VENDORS.get(platform)
    return vendor is not None and vendor.fused_attention


def device_kind_matches(chip_type: str, device_kinds: list[str] | set[str] | tuple[str, ...]) -> bool:
    """Whether devices of these kinds serve ``chip_type``: ``cuda:H100`` needs a kind that
    contains ``h100`` (case-insensitive); a chip type without ``:`` (``cpu``) takes any."""
    if ":" not in chip_type:
        return True
    want = chip_type.split(":", 1)[1].lower()
    return any(want in kind.lower() for kind in device_kinds)
