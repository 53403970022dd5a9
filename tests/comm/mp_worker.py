"""One rank of a 2-process transport test (run by test_transports.py under mpirun).

usage: mp_worker.py SCENARIO OUT_DIR   — writes OUT_DIR/rank<r>.json: {"checks": {name: ok}, "errors": {...}}
Rank 0 and rank 1 both build the same arrays from seeds; what one rank receives must equal,
bit for bit, what ``jax.device_put`` (the local channel) makes of the array the other rank sent.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

if sys.argv[1:2] == ["cuda_ucx"]:  # the wheel's UCX (with CUDA transports) before MPI maps its own
    from h2jax.comm import _ucx

    _ucx.preload_ucx()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
from mpi4py import MPI  # noqa: E402
from worker_common import DTYPES, make, same  # noqa: E402 -- this folder: the workers run as scripts

from h2jax import comm as hc  # noqa: E402

SHAPES = [(), (1,), (7,), (0,), (3, 5), (2, 3, 4), (4, 1, 3, 1), (128, 257)]
RANK = MPI.COMM_WORLD.Get_rank()
OTHER = 1 - RANK
checks: dict[str, bool] = {}
errors: dict[str, str] = {}


def local(a: np.ndarray, dst) -> np.ndarray:
    return np.asarray(jax.device_put(jax.device_put(a, jax.devices()[0]), dst))


def check(name: str, fn) -> None:
    try:
        checks[name] = bool(fn())
    except Exception as e:  # recorded, so one failure does not hide the others
        checks[name] = False
        errors[name] = "".join(traceback.format_exception_only(type(e), e))[-2000:]


def cases():
    return [(s, d) for d in DTYPES for s in SHAPES]


# -- scenarios ----------------------------------------------------------------------------------
def equivalence(comm) -> None:
    dev0 = SingleDeviceSharding(jax.devices()[0])
    all_cases = cases()
    subset = [((5, 6), d) for d in DTYPES] + [(s, jnp.bfloat16) for s in SHAPES]

    # (a) ffi inside ONE jitted program per side, many transfers chained by tokens; both directions
    for sender in (0, 1):
        base = 1000 * sender
        if RANK == sender:
            xs = [jnp.asarray(make(s, d, base + i)) for i, (s, d) in enumerate(all_cases)]

            @jax.jit
            def send_all(*xs):
                tok = hc.new_token()
                for i, x in enumerate(xs):
                    tok = hc.send(x, peer=OTHER, tag=base + i, comm=comm, token=tok)
                return tok

            send_all(*xs).block_until_ready()
        else:

            @jax.jit
            def recv_all():
                tok, out = hc.new_token(), []
                for i, (s, d) in enumerate(all_cases):
                    y, tok = hc.recv(s, d, peer=OTHER, tag=base + i, comm=comm, token=tok)
                    out.append(y)
                return out

            got = recv_all()
            for i, (s, d) in enumerate(all_cases):
                check(
                    f"ffi_jit/{sender}->{OTHER}/{np.dtype(d).name}{list(s)}",
                    lambda g=got[i], i=i, s=s, d=d: same(g, local(make(s, d, base + i), dev0)),
                )

    # (b) FfiTransport and (c) HostTransport, standalone transfers, both directions
    for t, cs in ((hc.FfiTransport(comm), subset), (hc.HostTransport(comm), all_cases)):
        for sender in (0, 1):
            base = 5000 + 1000 * sender
            for i, (s, d) in enumerate(cs):
                if RANK == sender:
                    t.send(jnp.asarray(make(s, d, base + i)), peer=OTHER, tag=base + i)
                else:
                    y = t.recv(jax.ShapeDtypeStruct(s, d), peer=OTHER, tag=base + i, sharding=dev0)
                    check(
                        f"{t.name}/{sender}->{OTHER}/{np.dtype(d).name}{list(s)}",
                        lambda y=y, i=i, s=s, d=d: same(y, local(make(s, d, base + i), dev0)),
                    )
            t.flush()

    # (d) sharded source and destination (2 devices per process, different layouts)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    src_sh, dst_sh = NamedSharding(mesh, P("data")), NamedSharding(mesh, P(None, "data"))
    for t in (hc.FfiTransport(comm), hc.HostTransport(comm)):
        for d in (jnp.float32, jnp.bfloat16, jnp.int32):
            a = make((8, 6), d, 77)
            if RANK == 0:
                t.send(jax.device_put(a, src_sh), peer=1, tag=77)
            else:
                y = t.recv(jax.ShapeDtypeStruct((8, 6), d), peer=0, tag=77, sharding=dst_sh)
                check(
                    f"{t.name}/sharded/{np.dtype(d).name}",
                    lambda y=y, a=a: y.sharding == dst_sh and same(y, local(a, dst_sh)),
                )
            t.flush()

    # (e) per device under shard_map, each device with its own (traced) tag
    a = make((4, 6), jnp.float32, 99)
    tags = jnp.asarray([300, 301], jnp.int32)

    def body(x):
        tag = tags[jax.lax.axis_index("data")]
        if RANK == 0:
            return hc.send(x, peer=1, tag=tag, comm=comm)
        y, _ = hc.recv(x.shape, x.dtype, peer=0, tag=tag, comm=comm)
        return y

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    out = fn(jax.device_put(a if RANK == 0 else np.zeros_like(a), src_sh))
    if RANK == 1:
        check("ffi/shard_map", lambda: same(out, a))
    jax.block_until_ready(out)

    # (f) sendrecv: both ranks exchange in one call
    mine, theirs = make((33, 17), jnp.bfloat16, 40 + RANK), make((33, 17), jnp.bfloat16, 40 + OTHER)
    y, _ = jax.jit(
        lambda x: hc.sendrecv(
            x, x.shape, x.dtype, dest=OTHER, source=OTHER, send_tag=40 + RANK, recv_tag=40 + OTHER, comm=comm
        )
    )(jnp.asarray(mine))
    check("ffi/sendrecv", lambda: same(y, theirs))


def deadlock(comm) -> None:
    """1F1B: both neighbours send 64 MiB to each other at the same time, repeatedly, in both orders."""
    n = 16 * 1024 * 1024  # float32: 64 MiB, far above any eager limit
    mine = [jnp.full((n,), 10 * RANK + k, jnp.float32) for k in range(2)]

    def send_then_recv(buffered):
        @jax.jit
        def fn(a, b):  # both ranks send first: blocking sends would deadlock here
            tok = hc.send(a, peer=OTHER, tag=10 + RANK, comm=comm, buffered=buffered)
            tok = hc.send(b, peer=OTHER, tag=20 + RANK, comm=comm, token=tok, buffered=buffered)
            # receive in the opposite order from the peer's sends: the first one waits in the stash
            y2, tok = hc.recv((n,), jnp.float32, peer=OTHER, tag=20 + OTHER, comm=comm, token=tok)
            y1, tok = hc.recv((n,), jnp.float32, peer=OTHER, tag=10 + OTHER, comm=comm, token=tok)
            return y1, y2

        return fn

    before = hc.stash_stats()
    for buffered in (False, True):
        fn = send_then_recv(buffered)
        for it in range(3):
            y1, y2 = fn(*mine)
            check(
                f"ffi_jit/buffered={buffered}/iter{it}",
                lambda: float(y1[0]) == 10 * OTHER and float(y2[-1]) == 10 * OTHER + 1,
            )
        if not buffered:
            # each rank's first send completes only because the peer, blocked in its own send, took
            # the message into its stash: the mechanism did the work, not luck or an eager limit
            check("ffi_jit/stashed", lambda: hc.stash_stats()["messages"] >= before["messages"] + 3)
    # the buffered sends returned before the peer received: posted from the engine's own buffers
    check("ffi_jit/buffered", lambda: hc.stash_stats()["buffered_sends"] == before["buffered_sends"] + 6)
    hc.flush_sends()
    check("ffi_jit/flushed", lambda: hc.stash_stats()["sends_in_flight"] == 0)

    for t in (hc.FfiTransport(comm), hc.HostTransport(comm)):
        like = jax.ShapeDtypeStruct((n,), jnp.float32)
        for it in range(2):
            order = (0, 1) if it % 2 == 0 else (1, 0)  # sends in one order, receives in the other
            for k in order:
                t.send(mine[k], peer=OTHER, tag=100 + 10 * k + RANK)
            ys = {k: t.recv(like, peer=OTHER, tag=100 + 10 * k + OTHER) for k in reversed(order)}
            t.flush()
            check(f"{t.name}/iter{it}", lambda ys=ys: all(float(ys[k][n // 2]) == 10 * OTHER + k for k in (0, 1)))

    fn = jax.jit(
        lambda x: hc.sendrecv(x, x.shape, x.dtype, dest=OTHER, source=OTHER, send_tag=7, recv_tag=7, comm=comm)[0]
    )
    for it in range(2):
        y = fn(mine[0])
        check(f"ffi_sendrecv/iter{it}", lambda: float(y[1]) == 10 * OTHER)


def mismatch(comm) -> None:
    """A receive whose message never comes must fail with the timeout message, never hang."""
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    send = jax.jit(lambda x: hc.send(x, peer=OTHER, tag=5, comm=comm, timeout_s=20.0))
    recv = jax.jit(lambda: hc.recv((3, 4), jnp.float32, peer=OTHER, tag=6, comm=comm, timeout_s=1.5)[0])
    tok = send(x)
    try:
        recv().block_until_ready()
        errors["ffi_tag"] = "no error"
    except Exception as e:
        msg = str(e)
        checks["ffi_tag"] = (
            "timed out after 1.5 s" in msg
            and f"peer {OTHER} with tag 6" in msg
            and "float32[3,4]" in msg
            and f"peer {OTHER} tag 5 (48 bytes)" in msg
        )
        errors["ffi_tag"] = msg[-600:]
    tok.block_until_ready()  # the peer's recv stashed our message: the send itself completed

    # a message with the right tag and the wrong size fails at once, naming both sizes
    send = jax.jit(lambda x: hc.send(x, peer=OTHER, tag=8, comm=comm))
    recv = jax.jit(lambda: hc.recv((5, 4), jnp.float32, peer=OTHER, tag=8, comm=comm, timeout_s=20.0)[0])
    tok = send(x)
    try:
        recv().block_until_ready()
        errors["ffi_size"] = "no error"
    except Exception as e:
        checks["ffi_size"] = "has 48 bytes, expected 80" in str(e) and "float32[5,4]" in str(e)
        errors["ffi_size"] = str(e)[-600:]
    tok.block_until_ready()

    # ... and a larger one (MPI would truncate it) too, without aborting the job
    recv = jax.jit(lambda: hc.recv((2, 4), jnp.float32, peer=OTHER, tag=9, comm=comm, timeout_s=20.0)[0])
    tok = jax.jit(lambda x: hc.send(x, peer=OTHER, tag=9, comm=comm))(x)
    try:
        recv().block_until_ready()
        errors["ffi_size_larger"] = "no error"
    except Exception as e:
        checks["ffi_size_larger"] = "larger than the expected 32 bytes" in str(e) and "float32[2,4]" in str(e)
        errors["ffi_size_larger"] = str(e)[-600:]
    tok.block_until_ready()

    # a buffered send nobody receives (4 MiB: above any eager limit, it waits for a receive)
    # returns at once; after its timeout the sender's next call fails, naming the send
    if RANK == 0:
        import time

        big = jnp.zeros((1 << 20,), jnp.float32)
        send = jax.jit(lambda x: hc.send(x, peer=OTHER, tag=13, comm=comm, timeout_s=0.5, buffered=True))
        send(big).block_until_ready()
        time.sleep(1.0)
        try:
            hc.flush_sends()
            errors["ffi_send_timeout"] = "no error"
        except TimeoutError as e:
            checks["ffi_send_timeout"] = (
                f"timed out after 0.5 s: send of float32[1048576] (4194304 bytes) to peer {OTHER} tag 13 "
                "was not received" in str(e)
            )
            errors["ffi_send_timeout"] = str(e)
        hc.flush_sends()  # told once: nothing left in flight
    else:
        checks["ffi_send_timeout"] = True  # the receiving side has nothing to check
    comm.Barrier()

    t = hc.HostTransport(comm, timeout_s=1.5)
    t.send(x, peer=OTHER, tag=5)
    try:
        t.recv(jax.ShapeDtypeStruct((3, 4), jnp.float32), peer=OTHER, tag=6)
        errors["host_tag"] = "no error"
    except TimeoutError as e:
        checks["host_tag"] = "timed out after 1.5 s" in str(e) and f"peer {OTHER} with tag 6" in str(e)
        errors["host_tag"] = str(e)
    comm.Barrier()  # both are past their recv; drain the unmatched sends before leaving
    t.recv(jax.ShapeDtypeStruct((3, 4), jnp.float32), peer=OTHER, tag=5)
    t.flush()


def cuda(comm, barrier=None) -> None:
    """The CUDA handlers: device buffers on either side (run only where a GPU is present), over
    the MPI engine (`comm` an mpi4py communicator) or the ucx engine (a UcxComm; `barrier` the
    MPI communicator's)."""
    import time

    from h2jax.comm import _ffi

    dev = jax.devices("cuda")[0]
    if barrier is None:
        barrier = comm.Barrier
        ext = _ffi._extension("cuda")
        checks["cuda_extension"] = True
        errors["cuda_aware_mpi"] = str(ext.cuda_aware_mpi())  # informative: staged through host if False
    n = 0
    for dtype in (jnp.float32, jnp.bfloat16, jnp.int32):
        for shape in ((), (7,), (128, 257)):
            n += 1
            name = f"cuda_{jnp.dtype(dtype).name}{list(shape)}"
            want = make(shape, dtype, seed=1000 + n)
            if RANK == 0:
                x = jax.device_put(want, dev)
                jax.jit(lambda x: hc.send(x, peer=OTHER, tag=n, comm=comm))(x).block_until_ready()
                checks[name] = True
            else:
                with jax.default_device(dev):
                    y = jax.jit(lambda: hc.recv(shape, dtype, peer=OTHER, tag=n, comm=comm)[0])()
                checks[name] = y.devices() == {dev} and np.array_equal(np.asarray(y), want)
                if not checks[name]:
                    errors[name] = f"got {np.asarray(y)!r:.200} on {y.devices()}"
    # both directions at once (1F1B's send-forward/receive-backward), device to device
    mine = jax.device_put(make((256, 1024), jnp.float32, seed=RANK), dev)
    y, _ = jax.jit(
        lambda x: hc.sendrecv(
            x, (256, 1024), jnp.float32, dest=OTHER, source=OTHER, send_tag=50, recv_tag=50, comm=comm
        )
    )(mine)
    checks["cuda_sendrecv"] = np.array_equal(np.asarray(y), make((256, 1024), jnp.float32, seed=OTHER))
    # bandwidth of 64 MiB ping-pongs inside one program (informative)
    nel = (64 << 20) // 4

    def body(i, c):
        buf, tok = c
        if RANK == 0:
            tok = hc.send(buf, peer=OTHER, tag=60, comm=comm, token=tok)
            return hc.recv((nel,), jnp.float32, peer=OTHER, tag=61, comm=comm, token=tok, into=buf)
        buf, tok = hc.recv((nel,), jnp.float32, peer=OTHER, tag=60, comm=comm, token=tok, into=buf)
        return buf, hc.send(buf, peer=OTHER, tag=61, comm=comm, token=tok)

    prog = jax.jit(lambda b: jax.lax.fori_loop(0, 4, body, (b, hc.new_token()))[0], donate_argnums=0)
    buf = jax.device_put(jnp.zeros((nel,), jnp.float32), dev)
    buf = prog(buf).block_until_ready()
    barrier()
    t0 = time.perf_counter()
    buf = prog(buf).block_until_ready()
    one_way = (time.perf_counter() - t0) / 8
    errors["cuda_64MiB_one_way_ms"] = f"{one_way * 1e3:.2f} ({(64 << 20) / one_way / 1e9:.2f} GB/s)"
    checks["cuda_pingpong"] = bool(np.isfinite(np.asarray(buf[:4])).all())


def cuda_ucx(comm) -> None:
    """The ucx engine's CUDA handlers (the same checks), and the path UCX took for 64 MiB of CUDA
    memory (from its protocol table: direct over cuda_ipc expected between two processes)."""
    from h2jax.comm._paths import classify_proto, parse_proto_info
    from h2jax.comm._ucx import UcxComm, ucx_platforms

    checks["ucx_cuda_handlers"] = "cuda" in ucx_platforms()
    ucx = UcxComm(comm)
    cuda(ucx, barrier=comm.Barrier)
    text = ucx.protocols(OTHER)
    errors["ucx_64MiB_path"] = str(classify_proto(parse_proto_info(text), "cuda", 64 << 20))
    errors["ucx_protocols"] = text[-1500:]


def main() -> None:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD.Dup()
    try:
        scenarios = {"equivalence": equivalence, "deadlock": deadlock, "mismatch": mismatch, "cuda": cuda}
        {**scenarios, "cuda_ucx": cuda_ucx}[scenario](comm)
    except Exception as e:
        errors["<scenario>"] = traceback.format_exc()[-3000:]
        print(f"rank {RANK}: {e}", file=sys.stderr, flush=True)
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump({"checks": checks, "errors": errors}, f, indent=1)
    comm.Barrier()


if __name__ == "__main__":
    main()
