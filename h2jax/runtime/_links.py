"""The link table of a run: every pair of neighbouring stages, the path its bytes take
(h2jax.comm._paths: ``direct``, ``staged`` or ``host``, and why), the transport's engine and
library, and -- with ``comm.probe`` -- one small and one large message timed at start-up.

The run header prints it (:func:`link_lines`), ranks.json and summary.json keep it, and
``comm.require_device_direct`` refuses a run whose device stages are not joined directly.

Timing: in one process a ``jax.device_put`` from the sending stage's first device to the
receiving stage's (what the ``local`` transport does; the median of SIZES' count); between
processes, round trips between the ranks holding each stage's first device, by the
transport's own path: ``ffi`` the handlers inside one jitted program per side (a loop of
round trips, as stage programs call them), ``ffi-call`` its ``FfiTransport`` (a program per
transfer: the small message's time includes its dispatch), ``host`` its ``HostTransport``.
One-way time = a round trip halved; the first round (which compiles) is not counted.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from h2jax._units import MIB
from h2jax.comm import LinkEnd, MpiFacts, UcxFacts, classify_link, library_name, not_direct, parse_proto_info
from h2jax.config import ConfigError

SIZES = ((8, 50), (4 * MIB, 5))  # (bytes, round trips timed at once): the small and the large message


def stage_pairs(plan: Any) -> list[tuple[int, int]]:
    """The (sending, receiving) stage of every boundary between two stages, in model order,
    each pair once (an interleaved plan's wrap-around pairs included)."""
    stage_of = [s for s, _ in plan.positions()]
    pipe_of = plan.position_pipelines()  # several pipelines: no boundary from one to the next
    out: list[tuple[int, int]] = []
    for (a, b), (pa, pb) in zip(zip(stage_of, stage_of[1:]), zip(pipe_of, pipe_of[1:])):
        if a != b and pa == pb and (a, b) not in out:
            out.append((a, b))
    return out


def _device_platforms(cfg: Any) -> list[str]:
    """The platforms of the plan's stages whose tensors sit in device memory."""
    chips = cfg.cluster.chips
    return sorted(
        {
            chips[s.chip].platform
            for s in cfg.plan.stages
            if not chips[s.chip].emulated and chips[s.chip].platform != "cpu"
        }
    )


UCX_AUTO = ("cpu",)
"""The platforms ``auto`` may give to the ucx engine: those its handlers have been run on (the CUDA
handlers are built where a CUDA toolkit is, but not yet run on a GPU: ``comm.engine: ucx`` asks
for them, and benchmarks/gpu_check.sh checks them)."""


def resolve_engine(cfg: Any, world: Any) -> str:
    """What moves the bytes under ``train.transport`` (``comm.engine``, ``auto`` resolved): "mpi" or
    "ucx" for the ``ffi`` and ``ffi-call`` transports, "" for the others (they have none to choose).
    ``auto``: mpi where every device stage's memory goes direct through the MPI library (no
    device stages: CPU and emulated chip types), else ucx where every rank has the ucx engine for
    those platforms and they are in :data:`UCX_AUTO`, else mpi (its links then say ``staged``).
    Collective in that last case (every rank decides alike). An engine asked for that cannot carry
    a stage's memory is refused."""
    if cfg.train.transport not in ("ffi", "ffi-call"):
        return ""
    want, platforms = cfg.comm.engine, _device_platforms(cfg)
    from h2jax.comm import ucx_platforms

    if want == "ucx" and platforms:
        built = ucx_platforms()
        missing = [p for p in platforms if p not in built]
        if missing:
            raise ConfigError(
                "comm.engine",
                f"engine='ucx' has no handlers for {'/'.join(missing)} stages here (built for "
                f"{', '.join(built) or 'nothing: UCX does not load'}); use engine 'mpi' or 'auto'",
            )
    if want != "auto":
        return want
    if not platforms:
        return "mpi"
    from h2jax.comm import mpi_device_aware

    mine = (all(mpi_device_aware(p) for p in platforms), set(platforms) <= set(ucx_platforms()) & set(UCX_AUTO))
    every = world.allgather(mine)
    if all(aware for aware, _ in every):
        return "mpi"
    return "ucx" if all(ucx for _, ucx in every) else "mpi"


def _engine(
    transport: str, ends: list[LinkEnd], engine: str = "mpi", version: str | None = None
) -> tuple[str, str, MpiFacts | None]:
    """(engine, library, the MPI facts) of ``transport`` over ``engine`` (ucx: its version)."""
    if transport == "local":
        import jax

        return "jax.device_put", f"jax {jax.__version__}", None
    if engine == "ucx":
        from h2jax.comm import ucx_settings

        return "ucx", f"UCX {version or '(not probed)'}, {ucx_settings()}", None
    from mpi4py import MPI

    lib = library_name(MPI.Get_library_version())
    if transport == "host":
        return "mpi4py", lib, MpiFacts(lib)
    from h2jax.comm import mpi_device_aware

    aware = {p: mpi_device_aware(p) for p in sorted({e.platform for e in ends if e.device_memory})}
    return "mpi", lib, MpiFacts(lib, aware)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _time_local(src: Any, dst: Any, nbytes: int, repeats: int) -> float:
    import jax

    x = jax.device_put(np.zeros(nbytes, np.uint8), src)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        jax.device_put(x, dst).block_until_ready()
        times.append(time.perf_counter() - t0)
    return _median(times[1:])


def _ping_pong(mover: Any, *, peer: int, lead: bool, device: Any, nbytes: int, repeats: int, tag: int) -> float:
    """Round trips of ``nbytes`` with ``peer`` (``lead``: this side sends first); the median
    one-way time on the leading side."""
    import jax

    like = jax.ShapeDtypeStruct((nbytes,), np.uint8)
    sharding = jax.sharding.SingleDeviceSharding(device)
    x = jax.device_put(np.zeros(nbytes, np.uint8), device)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        if lead:
            mover.send(x, peer=peer, tag=tag)
            mover.recv(like, peer=peer, tag=tag + 1, sharding=sharding).block_until_ready()
        else:
            y = mover.recv(like, peer=peer, tag=tag, sharding=sharding)
            mover.send(y, peer=peer, tag=tag + 1)
            mover.flush()
        times.append(time.perf_counter() - t0)
    mover.flush()
    return _median(times[1:]) / 2


def _ffi_loop(comm: Any, *, peer: int, lead: bool, device: Any, nbytes: int, repeats: int, tag: int) -> float:
    """``repeats`` round trips inside one jitted program per side (the ``ffi`` transport's
    in-program path); the one-way time, the better of two timed calls."""
    import jax
    import jax.numpy as jnp

    from h2jax.comm import new_token, recv, send

    n = max(nbytes // 4, 1)

    def body(i: Any, carry: Any) -> Any:
        buf, tok = carry
        if lead:
            tok = send(buf, peer=peer, tag=tag, comm=comm, token=tok)
            return recv((n,), jnp.float32, peer=peer, tag=tag + 1, comm=comm, token=tok, into=buf)
        buf, tok = recv((n,), jnp.float32, peer=peer, tag=tag, comm=comm, token=tok, into=buf)
        return buf, send(buf, peer=peer, tag=tag + 1, comm=comm, token=tok)

    prog = jax.jit(lambda b: jax.lax.fori_loop(0, repeats, body, (b, new_token()))[0], donate_argnums=0)
    buf = jax.device_put(np.zeros(n, np.float32), device)
    times = []
    for _ in range(3):  # the first compiles
        t0 = time.perf_counter()
        buf = prog(buf)
        buf.block_until_ready()
        times.append((time.perf_counter() - t0) / (2 * repeats))
    return min(times[1:])


def _probe(cfg: Any, world: Any, pairs: list[tuple[int, int]], stages: list[Any], engine: str = "mpi") -> tuple:
    """({(a, b): ((small s, large s), (rank a, rank b) or None)} (module docstring); under the ucx
    engine also {(a, b, leading side?): the protocol tables of that side's endpoint to the other}
    and the UCX version (else {} and None). Collective."""
    device = {st.stage_idx: st.mesh.local_devices[0] for st in stages}  # a stage's chunks share one mesh
    w = world
    if not w.multiprocess:
        timed = {(a, b): (tuple(_time_local(device[a], device[b], n, r) for n, r in SIZES), None) for a, b in pairs}
        return timed, {}, None
    if w.group is None or not hasattr(w.comm, "py2f"):
        return {}, {}, None  # threads standing in for processes (tests): no MPI link to time
    from h2jax.comm import FfiTransport, HostTransport

    transport = cfg.train.transport
    if transport == "host":
        mover = HostTransport(w.comm, timeout_s=cfg.train.transfer_timeout_s)
    else:  # collective: its own communicator
        mover = FfiTransport(w.comm, timeout_s=cfg.train.transfer_timeout_s, engine=engine)
    mine, protocols = {}, {}
    for i, (a, b) in enumerate(pairs):
        ra, rb = w.group.layout.device_ranks(a)[0], w.group.layout.device_ranks(b)[0]
        for k, (n, r) in enumerate(SIZES):
            kw = dict(nbytes=n, repeats=r, tag=4 * i + 2 * k)
            if w.rank not in (ra, rb):
                continue
            lead = w.rank == ra
            kw.update(peer=rb if lead else ra, lead=lead, device=device[a if lead else b])
            t = _ffi_loop(mover.comm, **kw) if transport == "ffi" else _ping_pong(mover, **kw)
            if lead:
                mine.setdefault((a, b), ([], (ra, rb)))[0].append(t)
        if engine == "ucx" and w.rank in (ra, rb):  # the protocols UCX chose for what was just sent, each way
            protocols[(a, b, w.rank == ra)] = mover.comm.protocols(rb if w.rank == ra else ra)
    mover.flush()
    w.barrier()
    (mover.comm if transport == "host" else mover.mpi_comm).Free()
    version = getattr(mover.comm, "version", None)
    timed = {k: (tuple(t), rr) for d in w.allgather(mine) for k, (t, rr) in d.items()}
    return timed, {k: v for d in w.allgather(protocols) for k, v in d.items()}, version


def _ucx_facts(texts: list[str], version: str | None) -> tuple[UcxFacts, str | None]:
    """UCX's facts of one link from its endpoints' protocol tables (both directions), and the
    protocols of the sending stage's buffers at the small and the large message, in words."""
    tables = [t for text in texts for t in parse_proto_info(text)]
    by_memory: dict[str, tuple] = {}
    for t in tables:
        by_memory[t.memory] = (*by_memory.get(t.memory, ()), t)
    facts = UcxFacts(version or "?", by_memory, large_bytes=SIZES[1][0])
    first = tables[0] if tables else None  # the sending stage's first: texts[0] is its endpoint's
    words = []
    for n, _ in SIZES:
        row = first.row(n) if first is not None else None
        if row is not None:
            words.append(f"{n} B {row.description} over {row.config}")
    return facts, "; ".join(words) or None


def link_table(
    cfg: Any, world: Any, stages: list[Any], backends: dict[int, str], engine: str = "mpi"
) -> list[dict[str, Any]]:
    """One dict per link (module docstring), the same on every process; raises ConfigError
    under ``comm.require_device_direct`` when a link between device stages is not direct.
    ``stages``, ``backends``: this process's stage programs and their backends; ``engine``: the
    resolved ``comm.engine`` (:func:`resolve_engine`). Collective."""
    plan, w, transport = cfg.plan, world, cfg.train.transport
    pairs = stage_pairs(plan)
    if not pairs:
        return []
    backend = {s: b for d in w.allgather(backends) for s, b in d.items()}
    chips = cfg.cluster.chips
    ends = [
        LinkEnd(s, st.chip, chips[st.chip].platform, chips[st.chip].emulated, backend.get(s, ""))
        for s, st in enumerate(plan.stages)
    ]
    # under ucx the path of a device link is what UCX chose for the probe's messages: probed anyway
    ucx_device = engine == "ucx" and any(e.device_memory for e in ends)
    timed, protocols, version = (
        _probe(cfg, w, pairs, stages, engine) if cfg.comm.probe or ucx_device else ({}, {}, None)
    )
    name, library, mpi = _engine(transport, ends, engine, version)
    links = []
    for a, b in pairs:
        words = None
        if engine == "ucx":
            texts = [protocols[k] for k in ((a, b, True), (a, b, False)) if k in protocols]
            facts, words = _ucx_facts(texts, version)
            path, why = classify_link(transport, ends[a], ends[b], ucx=facts)
        else:
            path, why = classify_link(transport, ends[a], ends[b], mpi=mpi)
        (small, large), ranks = timed.get((a, b), ((None, None), None))
        links.append(
            {
                "src": a,
                "dst": b,
                "src_chip": ends[a].chip,
                "dst_chip": ends[b].chip,
                "src_device": ends[a].device_memory,
                "dst_device": ends[b].device_memory,
                "path": path,
                "why": why,
                "transport": transport,
                "engine": name,
                "library": library,
                "protocols": words,
                "small_bytes": SIZES[0][0],
                "small_us": None if small is None else small * 1e6,
                "large_bytes": SIZES[1][0],
                "large_gbps": None if large is None else SIZES[1][0] / large / 1e9,
                "ranks": None if ranks is None else list(ranks),
            }
        )
    require_direct(cfg, links)
    return links


def require_direct(cfg: Any, links: list[dict[str, Any]]) -> None:
    """``comm.require_device_direct``: the first link between device stages that is not direct, in one line."""
    bad = not_direct(links) if cfg.comm.require_device_direct else []
    if bad:
        lk = bad[0]
        raise ConfigError(
            "comm.require_device_direct",
            f"the link stage {lk['src']} ({lk['src_chip']}) -> stage {lk['dst']} ({lk['dst_chip']}) is "
            f"{lk['path']} over {lk['transport']}: {lk['why']}"
            + (f" ({len(bad) - 1} more link(s) like it)" if len(bad) > 1 else ""),
        )


def link_lines(links: list[dict[str, Any]]) -> list[str]:
    """The run header's link table: one line per link."""
    out = []
    for lk in links:
        timed = (
            f": {lk['small_bytes']} B in {lk['small_us']:.0f} µs, {lk['large_bytes'] // MIB} MiB at "
            f"{lk['large_gbps']:.2f} GB/s"
            if lk["small_us"] is not None
            else ""
        )
        out.append(
            f"link stage {lk['src']} ({lk['src_chip']}) -> stage {lk['dst']} ({lk['dst_chip']}): {lk['path']} "
            f"via {lk['transport']} (engine {lk['engine']}, {lk['library']}){timed} -- {lk['why']}"
            + (f" [UCX: {lk['protocols']}]" if lk.get("protocols") else "")
        )
    return out
