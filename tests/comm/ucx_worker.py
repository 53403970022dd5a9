"""One rank of a 2-process test of the ucx engine (run by test_ucx.py under mpirun).

usage: ucx_worker.py SCENARIO OUT_DIR   — writes OUT_DIR/rank<r>.json: {"checks": {name: ok}, "errors": {...}}
The ops are h2jax.comm._ffi's, on a UcxComm; what a rank receives must equal, bit for bit,
the array the other rank built from the same seed.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

from h2jax.comm import _ucx  # noqa: I001 -- before mpi4py: the wheel's UCX, not Open MPI's bundled one

_ucx._load()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402
from worker_common import DTYPES, make, same  # noqa: E402 -- this folder: the workers run as scripts

from h2jax.comm import _ffi as hc  # noqa: E402

SHAPES = [(), (1,), (7,), (0,), (3, 5), (2, 3, 4), (128, 257)]
RANK = MPI.COMM_WORLD.Get_rank()
OTHER = 1 - RANK
checks: dict[str, bool] = {}
errors: dict[str, str] = {}


def check(name: str, fn) -> None:
    try:
        checks[name] = bool(fn())
    except Exception as e:  # recorded, so one failure does not hide the others
        checks[name] = False
        errors[name] = "".join(traceback.format_exception_only(type(e), e))[-2000:]


def expect_error(name: str, fn, *needles: str) -> None:
    try:
        fn()
        errors[name] = "no error"
        checks[name] = False
    except Exception as e:
        checks[name] = all(n in str(e) for n in needles)
        errors[name] = str(e)[-600:]


def dtypes(comm) -> None:
    """Every (dtype, shape) case in one jitted program each way, tokens chained."""
    cases = [(s, d) for d in DTYPES for s in SHAPES]
    for sender in (0, 1):
        seeds = [1000 * sender + i for i in range(len(cases))]
        if RANK == sender:
            xs = [jnp.asarray(make(s, d, seed)) for (s, d), seed in zip(cases, seeds)]

            @jax.jit
            def send_all(*xs):
                tok = None
                for i, x in enumerate(xs):
                    tok = hc.send(x, peer=OTHER, tag=i, comm=comm, token=tok)
                return tok

            send_all(*xs).block_until_ready()
        else:

            @jax.jit
            def recv_all():
                tok, ys = None, []
                for i, (s, d) in enumerate(cases):
                    y, tok = hc.recv(s, d, peer=OTHER, tag=i, comm=comm, token=tok)
                    ys.append(y)
                return ys

            for (s, d), seed, y in zip(cases, seeds, recv_all()):
                check(
                    f"{sender}->{OTHER}/{np.dtype(d).name}{list(s)}",
                    lambda y=y, s=s, d=d, seed=seed: same(y, make(s, d, seed)),
                )
    # 0 bytes, and recv into a donated buffer
    z = jax.jit(
        lambda: hc.sendrecv(
            jnp.zeros((0, 3)), (0, 3), jnp.float32, dest=OTHER, source=OTHER, send_tag=1, recv_tag=1, comm=comm
        )[0]
    )()
    check("zero_bytes", lambda: z.shape == (0, 3))
    a = make((33, 9), jnp.float32, 7 + RANK)
    into = jax.jit(
        lambda x, buf: hc.recv(
            x.shape, x.dtype, peer=OTHER, tag=2, comm=comm, token=hc.send(x, peer=OTHER, tag=2, comm=comm), into=buf
        )[0],
        donate_argnums=1,
    )
    check("recv_into", lambda: same(into(jnp.asarray(a), jnp.zeros((33, 9))), make((33, 9), jnp.float32, 7 + OTHER)))


def shard_map(comm) -> None:
    """Per device under shard_map (two devices per process, so two threads in the engine at once),
    each device with its own traced tag, both directions at once, rendezvous-sized shards."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    tags = jnp.asarray([300, 301], jnp.int32)
    n = 1 << 20  # 4 MiB of float32 per device

    def body(x):
        tag = tags[jax.lax.axis_index("data")]
        y, _ = hc.sendrecv(x, x.shape, x.dtype, dest=OTHER, source=OTHER, send_tag=tag, recv_tag=tag, comm=comm)
        return y

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    mine, theirs = make((2 * n,), jnp.float32, 50 + RANK), make((2 * n,), jnp.float32, 50 + OTHER)
    for it in range(2):
        out = fn(jax.device_put(mine, NamedSharding(mesh, P("data"))))
        check(f"shard_map/iter{it}", lambda out=out: same(out, theirs))


def big(comm) -> None:
    """256 MiB each way at once (sendrecv), and 1F1B: both ranks send 64 MiB first, twice."""
    n = 64 * 1024 * 1024  # float32: 256 MiB
    x = jnp.full((n,), RANK + 1, jnp.float32)
    f = jax.jit(
        lambda x: hc.sendrecv(x, x.shape, x.dtype, dest=OTHER, source=OTHER, send_tag=3, recv_tag=3, comm=comm)[0]
    )
    y = f(x)
    ends = (float(y[0]), float(y[-1]))
    check("256MiB_sendrecv", lambda: ends == (OTHER + 1, OTHER + 1))
    del x, y
    m = 16 * 1024 * 1024
    mine = [jnp.full((m,), 10 * RANK + k, jnp.float32) for k in range(2)]

    @jax.jit
    def send_then_recv(a, b):  # both ranks send first: blocking sends would deadlock here
        tok = hc.send(a, peer=OTHER, tag=10 + RANK, comm=comm)
        tok = hc.send(b, peer=OTHER, tag=20 + RANK, comm=comm, token=tok)
        # the opposite order from the peer's sends: the first one waits in the stash
        y2, tok = hc.recv((m,), jnp.float32, peer=OTHER, tag=20 + OTHER, comm=comm, token=tok)
        y1, tok = hc.recv((m,), jnp.float32, peer=OTHER, tag=10 + OTHER, comm=comm, token=tok)
        return y1, y2

    before = _ucx.stash_stats()["messages"]
    for it in range(2):
        y1, y2 = send_then_recv(*mine)
        check(f"1f1b/iter{it}", lambda: float(y1[0]) == 10 * OTHER and float(y2[-1]) == 10 * OTHER + 1)
    check("1f1b/stashed", lambda: _ucx.stash_stats()["messages"] >= before + 2)


def buffered(comm) -> None:
    """Buffered sends: 1F1B's send-first exchange of 64 MiB with them; one returns while its receiver
    sleeps, where a plain one waits for it; one nobody receives fails the sender's next call."""
    import time

    m = 16 * 1024 * 1024
    mine = [jnp.full((m,), 10 * RANK + k, jnp.float32) for k in range(2)]

    @jax.jit
    def send_then_recv(a, b):
        tok = hc.send(a, peer=OTHER, tag=30 + RANK, comm=comm, buffered=True)
        tok = hc.send(b, peer=OTHER, tag=40 + RANK, comm=comm, token=tok, buffered=True)
        y2, tok = hc.recv((m,), jnp.float32, peer=OTHER, tag=40 + OTHER, comm=comm, token=tok)
        y1, tok = hc.recv((m,), jnp.float32, peer=OTHER, tag=30 + OTHER, comm=comm, token=tok)
        return y1, y2

    before = _ucx.stash_stats()
    for it in range(2):
        y1, y2 = send_then_recv(*mine)
        check(f"buffered_1f1b/iter{it}", lambda: float(y1[0]) == 10 * OTHER and float(y2[-1]) == 10 * OTHER + 1)
    hc.flush_sends(comm=comm)
    after = _ucx.stash_stats()
    check("buffered_1f1b/counted", lambda: after["buffered_sends"] == before["buffered_sends"] + 4)
    check("buffered_1f1b/flushed", lambda: after["sends_in_flight"] == 0)

    # rank 1 receives 4 MiB (a rendezvous) 2 s after rank 0 sends it: the buffered send returns at
    # once, the plain one when the receiver takes it
    n = 1 << 20
    x = jnp.asarray(make((n,), jnp.float32, 60))
    recv = jax.jit(lambda: hc.recv((n,), jnp.float32, peer=0, tag=61, comm=comm)[0])
    for buf in (True, False):
        MPI.COMM_WORLD.Barrier()
        if RANK == 0:
            send = jax.jit(lambda x, buf=buf: hc.send(x, peer=1, tag=61, comm=comm, buffered=buf))
            send(x + 0).block_until_ready()  # compiled and run once, received below
            MPI.COMM_WORLD.Barrier()
            t0 = time.perf_counter()
            send(x).block_until_ready()
            took = time.perf_counter() - t0
            errors[f"sender_waited_s/buffered={buf}"] = f"{took:.3f}"
            checks[f"sender_waited/buffered={buf}"] = took < 1.0 if buf else took > 1.5
            hc.flush_sends(comm=comm)
        else:
            y0 = recv()
            MPI.COMM_WORLD.Barrier()
            time.sleep(2.0)
            y = recv()
            check(
                f"received/buffered={buf}", lambda y=y, y0=y0: same(y, make((n,), jnp.float32, 60)) and same(y0, y + 0)
            )
    MPI.COMM_WORLD.Barrier()

    # a buffered send nobody receives: after its timeout the sender's next call fails, naming it,
    # once; its endpoint is closed (a comm of its own, so the other scenarios keep theirs)
    other = _ucx.UcxComm(MPI.COMM_WORLD)
    if RANK == 0:
        send = jax.jit(lambda x: hc.send(x, peer=1, tag=13, comm=other, timeout_s=0.5, buffered=True))
        send(x).block_until_ready()
        time.sleep(1.0)
        expect_error(
            "buffered_timeout",
            lambda: hc.flush_sends(comm=other),
            "timed out after 0.5 s: send of float32[1048576] (4194304 bytes) to peer 1 tag 13 was not received",
        )
        check("buffered_timeout/told_once", lambda: hc.flush_sends(comm=other) is None)
        expect_error(
            "buffered_after_close", lambda: send(x).block_until_ready(), "peer 1 is unreachable (endpoint closed"
        )
    MPI.COMM_WORLD.Barrier()


def errors_(comm) -> None:
    """A receive whose message never comes times out with a line; a wrong size fails at once."""
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    tok = jax.jit(lambda x: hc.send(x, peer=OTHER, tag=5, comm=comm, timeout_s=20.0))(x)
    recv = jax.jit(lambda: hc.recv((3, 4), jnp.float32, peer=OTHER, tag=6, comm=comm, timeout_s=1.5)[0])
    expect_error(
        "timeout",
        lambda: recv().block_until_ready(),
        "DEADLINE_EXCEEDED",
        "timed out after 1.5 s",
        f"peer {OTHER} with tag 6",
        "float32[3,4]",
        f"peer {OTHER} tag 5 (48 bytes)",
    )
    tok.block_until_ready()  # the peer's recv stashed our message: the send completed
    # take the stashed message, so the comm is clean for the next checks
    y = jax.jit(lambda: hc.recv((3, 4), jnp.float32, peer=OTHER, tag=5, comm=comm)[0])()
    check("stashed_then_received", lambda: same(y, x))

    tok = jax.jit(lambda x: hc.send(x, peer=OTHER, tag=8, comm=comm))(x)
    recv = jax.jit(lambda: hc.recv((5, 4), jnp.float32, peer=OTHER, tag=8, comm=comm, timeout_s=20.0)[0])
    expect_error(
        "size_smaller",
        lambda: recv().block_until_ready(),
        "has 48 bytes, expected 80",
        "float32[5,4]",
        f"peer {OTHER} tag 8",
    )
    tok.block_until_ready()
    tok = jax.jit(lambda x: hc.send(x, peer=OTHER, tag=9, comm=comm))(x)
    recv = jax.jit(lambda: hc.recv((2, 4), jnp.float32, peer=OTHER, tag=9, comm=comm, timeout_s=20.0)[0])
    expect_error("size_larger", lambda: recv().block_until_ready(), "larger than the expected 32 bytes", "float32[2,4]")
    tok.block_until_ready()
    # and a rendezvous-sized one (the stash path: the peer's send waits until we take it)
    n = 1 << 20
    tok = jax.jit(lambda: hc.send(jnp.ones((n,), jnp.float32), peer=OTHER, tag=11, comm=comm))()
    recv = jax.jit(lambda: hc.recv((n // 2,), jnp.float32, peer=OTHER, tag=11, comm=comm, timeout_s=20.0)[0])
    expect_error("size_large_message", lambda: recv().block_until_ready(), f"peer {OTHER} tag 11", "float32[524288]")
    tok.block_until_ready()
    # the engine still works after all that
    y = jax.jit(
        lambda x: hc.sendrecv(
            x + RANK, x.shape, x.dtype, dest=OTHER, source=OTHER, send_tag=12, recv_tag=12, comm=comm
        )[0]
    )(x)
    check("after_errors", lambda: same(y, x + OTHER))

    # a send nobody receives times out with a line; UCP cannot cancel a send, so the engine
    # closes that endpoint and later sends to it fail at once (whether the peer still sees the
    # message depends on whether its announcement had arrived: see ucx_engine.h)
    if RANK == 0:
        send = jax.jit(lambda: hc.send(jnp.ones(1 << 20), peer=1, tag=13, comm=comm, timeout_s=0.5))
        expect_error(
            "send_timeout",
            lambda: send().block_until_ready(),
            "DEADLINE_EXCEEDED",
            "timed out after 0.5 s",
            "to peer 1 tag 13 was not received",
        )
        expect_error(
            "send_after_close", lambda: send().block_until_ready(), "INTERNAL", "peer 1 is unreachable (endpoint closed"
        )
    else:
        import time

        time.sleep(1.5)


def peer_death(_comm) -> None:
    """Rank 1 dies; rank 0, waiting on it, fails at once with a line naming it (not a timeout)."""
    import time

    comm = _ucx.UcxComm(MPI.COMM_WORLD, peer_errors="all")  # over tcp here (UCX_TLS from the test)
    checks["detection_on"] = comm.peer_failure_detection[OTHER]
    y = jax.jit(
        lambda: hc.sendrecv(
            jnp.ones(4), (4,), jnp.float32, dest=OTHER, source=OTHER, send_tag=1, recv_tag=1, comm=comm
        )[0]
    )()
    checks["alive_first"] = float(y[0]) == 1.0
    if RANK == 0:  # a buffered send rank 1 will never take: in flight when it dies
        jax.jit(lambda: hc.send(jnp.ones(1 << 20), peer=1, tag=3, comm=comm, timeout_s=60.0, buffered=True))()
    MPI.COMM_WORLD.Barrier()
    if RANK == 1:
        with open(os.path.join(sys.argv[2], "rank1.json"), "w") as f:
            json.dump({"checks": checks, "errors": errors}, f)
        os._exit(0)  # no goodbye: the peer must notice on its own
    t0 = time.perf_counter()
    recv = jax.jit(lambda: hc.recv((4,), jnp.float32, peer=OTHER, tag=2, comm=comm, timeout_s=60.0)[0])
    # the wait fails at once, and so does the buffered send in flight to it (not after its 60 s):
    # the first call after the death tells one, the next the other, each naming the peer
    lines = []
    for _ in range(2):
        try:
            recv().block_until_ready()
            lines.append("no error")
        except Exception as e:
            lines.append(str(e))
    errors["dead_peer"] = " | ".join(lines)
    sent = [m for m in lines if "send of float32[1048576]" in m and f"peer {OTHER}" in m and "tag 3" in m]
    checks["dead_peer"] = any(f"peer {OTHER} is unreachable" in m for m in lines if m not in sent)
    checks["dead_peer_buffered"] = len(sent) == 1
    errors["dead_peer_s"] = f"{time.perf_counter() - t0:.1f}"
    checks["dead_peer_fast"] = time.perf_counter() - t0 < 30


def main() -> None:
    scenarios, out_dir = sys.argv[1].split(","), sys.argv[2]
    try:
        comm = _ucx.UcxComm(MPI.COMM_WORLD)
        for s in scenarios:
            {
                "dtypes": dtypes,
                "shard_map": shard_map,
                "big": big,
                "buffered": buffered,
                "errors": errors_,
                "peer_death": peer_death,
            }[s](comm)
            if s != "peer_death":
                MPI.COMM_WORLD.Barrier()
    except Exception as e:
        errors["<scenario>"] = traceback.format_exc()[-3000:]
        print(f"rank {RANK}: {e}", file=sys.stderr, flush=True)
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump({"checks": checks, "errors": errors}, f, indent=1)
    if "peer_death" not in scenarios:
        MPI.COMM_WORLD.Barrier()
    else:
        os._exit(0)  # the peer is gone: no MPI_Finalize


if __name__ == "__main__":
    main()
