"""MPI send/recv as XLA FFI calls: transfers that live *inside* jitted programs.

The C++ handlers (``ffi/``, built by ``pip install``) move bytes over MPI point-to-point
on a communicator handed over from mpi4py; this module registers them with JAX and
decides everything else (shapes, dtypes, checks, error messages).

Ordering: every call takes a *token* (a 1-byte array) and returns a new one. Threading
the token from one call into the next makes each transfer depend on the previous one,
so XLA keeps them in program order (the mpi4jax pattern, with a plain array instead of an
XLA token). ``has_side_effect=True`` only keeps a call alive when its result is unused;
it does not order independent calls. Calls without a token are unordered among
themselves.

Deadlock freedom (1F1B: two neighbours send large tensors to each other at once): a
waiting handler receives every message that reaches its communicator, so a peer blocked
in its own send always completes; a message nobody asked for yet is stashed until its
recv comes (one extra copy in that case only). ``sendrecv`` pairs the two directions with
no copy at all. Because any message on the communicator may be stashed, give the handlers
a communicator of their own (``comm.Dup()``; FfiTransport does).

Multi-device meshes: call these per device inside ``jax.shard_map`` (a side-effecting
``ffi_call`` in plain multi-device jit crashes the SPMD partitioner). Ranks and tags may be
traced int32 scalars (e.g. ``table[jax.lax.axis_index("tensor")]``), so each device of one
program can address its own peer and tag; they travel as a small operand. Concurrent
transfers between the same two processes need distinct tags.

Buffered sends (``send(..., buffered=True)``; host buffers, either engine): the bytes are
copied into a buffer of the engine, the send of the copy is posted and the call returns, so
the program that sends goes on while the receiver is still busy (a rendezvous holds a plain
send until the receiver posts). Later calls on the process complete the sends in flight;
``flush_sends()`` waits for all of them, as MPI_Finalize does (the MPI engine) and process exit
does (the ucx engine) before the process ends. The pipeline's in-program boundaries send this
way; the copy costs a ping-pong (a receiver always waiting) its time, so the plain send stays
the default. Device buffers send plainly either way.

Failures: a receive waits at most ``timeout_s``; the error names the rank, peer, tag, the
tensor and what did arrive instead. A plain send fails the same way after ``timeout_s``; a
buffered one that nobody receives in time fails the next call on that process (or
``flush_sends``), naming the send. A message of the right (peer, tag) with the wrong size
fails at once.

Engines: ``comm`` is an mpi4py communicator (the MPI engine, targets ``h2jax_*``) or a
``h2jax.comm._ucx.UcxComm`` built over one (the UCX engine, targets ``h2jax_ucx_*``): one
op, the engine below it.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xla_plugins import VENDORS

DEFAULT_TIMEOUT_S = 60.0
_TOKEN = jax.ShapeDtypeStruct((1,), jnp.uint8)
_MODULES = {p: v.ffi_module for p, v in VENDORS.items() if v.ffi_module is not None}
_lock = threading.Lock()
_registered: set[str] = set()


class FfiUnavailableError(ImportError):
    """The compiled extension (``h2jax/comm/_mpi_ffi_*.so``) is missing or cannot load."""


def _extension(platform: str) -> Any:
    # libmpi first: the extension names libmpi by soname only and reuses mpi4py's copy
    import importlib

    from mpi4py import MPI  # noqa: F401

    name = _MODULES.get(platform)
    if name is None:
        raise FfiUnavailableError(f"h2jax ffi: no handlers for platform {platform!r}; built for {sorted(_MODULES)}")
    try:
        return importlib.import_module(f"h2jax.comm.{name}")
    except ImportError as e:
        hint = (
            "it is built only where a CUDA toolkit is found (H2JAX_FFI_CUDA=AUTO|ON)"
            if platform == "cuda"
            else "it is built by `python3 -m pip install -e .` (needs a C++17 compiler and CMake)"
        )
        raise FfiUnavailableError(
            f"h2jax ffi: the {platform} extension h2jax.comm.{name} is unavailable ({e}); {hint}"
        ) from e


def register(platform: str = "cpu") -> None:
    """Register the handlers for ``platform`` with JAX (idempotent, thread-safe)."""
    with _lock:
        if platform in _registered:
            return
        ext = _extension(platform)
        for target, capsule in ext.registrations().items():
            # under XLA's own platform name (the vendor table says why cuda's differs)
            jax.ffi.register_ffi_target(target, capsule, platform=VENDORS[platform].xla_platform or platform)
        _registered.add(platform)


def is_available(platform: str = "cpu") -> bool:
    try:
        register(platform)
    except FfiUnavailableError:
        return False
    return True


def stash_stats(platform: str = "cpu") -> dict[str, int]:
    """``{"messages": n, "bytes": b, ...}``: how many messages this process's handlers took in
    before their receive was posted (while waiting on something else, so that a peer blocked
    in a large send to us completes: the deadlock freedom of this module). Each costs an
    allocation and one more copy; a pipeline that pairs its sends and receives (``sendrecv``)
    should see few. Also ``buffered_sends`` / ``buffered_bytes`` (sends posted from the
    engine's buffers) and ``sends_in_flight`` (not yet completed)."""
    return {k: int(v) for k, v in _extension(platform).stash_stats().items()}


def flush_sends(platform: str = "cpu", *, comm: Any = None) -> None:
    """Wait until every buffered send of this process's engine (``comm``'s: the MPI engine where
    None) has been received (each at most its own timeout); raises ``TimeoutError`` naming the
    first send that was not, or ``RuntimeError`` for another failure of one."""
    if _is_ucx(comm):
        err = comm.flush_sends_line()
    else:
        err = _extension(platform).flush_sends()
    if err:
        raise (TimeoutError if "timed out" in err else RuntimeError)(err)


def mpi_device_aware(platform: str) -> bool:
    """The MPI library under the handlers takes ``platform``'s device pointers (asked by the
    compiled handlers: MPIX_Query_cuda_support for cuda); False where no handlers for it are
    built (they then cannot run there at all) or the library says no. CPU: False."""
    try:
        ext = _extension(platform)
    except FfiUnavailableError:
        return False
    query = getattr(ext, f"{platform}_aware_mpi", None)
    return bool(query()) if query is not None else False


def _register_all() -> None:
    register("cpu")
    try:  # a GPU stage needs it; a CPU-only build simply has no cuda handlers
        register("cuda")
    except FfiUnavailableError:
        pass


def new_token() -> jax.Array:
    """A fresh token: the start of an ordered chain of transfers."""
    return jnp.zeros(_TOKEN.shape, _TOKEN.dtype)


def _is_ucx(comm: Any) -> bool:
    return getattr(comm, "engine", None) == "ucx"  # a h2jax.comm._ucx.UcxComm


def _comm_handle(comm: Any) -> np.int64:
    if _is_ucx(comm):
        return np.int64(comm.handle)
    if not hasattr(comm, "py2f"):
        raise TypeError(f"comm must be an mpi4py communicator or a UcxComm, got {type(comm).__name__}")
    return np.int64(comm.py2f())


def _target(comm: Any, op: str) -> str:
    """The FFI target of ``op`` on ``comm``'s engine (registering the engine's handlers)."""
    if _is_ucx(comm):
        return f"h2jax_ucx_{op}"  # registered by UcxComm's constructor
    _register_all()
    return f"h2jax_{op}"


def desc(shape: tuple[int, ...], dtype: Any) -> str:
    return f"{jnp.dtype(dtype).name}[{','.join(str(d) for d in shape)}]"


def _is_static(v: Any) -> bool:
    return isinstance(v, (int, np.integer))


def _check(comm: Any, what: str, rank: Any, tag: Any, timeout_s: float) -> None:
    """Static ranks and tags are checked here; traced ones by the handler at run time."""
    from mpi4py import MPI

    _comm_handle(comm)  # a communicator at all?
    size = comm.Get_size()
    if _is_static(rank) and not 0 <= int(rank) < size:
        raise ValueError(f"h2jax ffi: {what} {rank} is not a rank of the communicator (size {size})")
    if _is_ucx(comm):
        tag_ub, ub_name = comm.tag_ub, "the ucx engine's tag bound"
    else:
        # MPI_TAG_UB is the same on every communicator; mpi4py shows it on COMM_WORLD only
        tag_ub, ub_name = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767, "MPI_TAG_UB"
    if _is_static(tag) and not 0 <= int(tag) <= tag_ub:
        raise ValueError(f"h2jax ffi: tag {tag} is outside 0..{tag_ub} ({ub_name})")
    if not timeout_s > 0:
        raise ValueError(f"h2jax ffi: timeout_s must be > 0, got {timeout_s}")


def _route(*values: Any) -> jax.Array:
    # an operand, not attributes: under shard_map each device may pass its own peer and tag
    if all(_is_static(v) for v in values):
        return jnp.asarray(np.array(values, np.int32))
    return jnp.stack([jnp.asarray(v, jnp.int32).reshape(()) for v in values])


def _token(token: jax.Array | None) -> jax.Array:
    if token is None:
        return new_token()
    if token.shape != _TOKEN.shape or token.dtype != _TOKEN.dtype:
        raise TypeError(f"h2jax ffi: token must come from new_token()/send/recv, got {token.dtype}{list(token.shape)}")
    return token


def send(
    x: jax.Array,
    *,
    peer: int | jax.Array,
    tag: int | jax.Array,
    comm: Any,
    token: jax.Array | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    buffered: bool = False,
) -> jax.Array:
    """Send ``x`` to rank ``peer`` of ``comm``; returns the next token.

    Returns once ``x`` has been delivered to the peer (received, or stashed by the peer while
    it waits on anything of its own); ``buffered`` (host buffers): once ``x`` is copied into the
    engine's send buffer (module docstring; ``flush_sends`` waits for it). Not received within
    ``timeout_s``: an error naming the send.
    """
    x = jnp.asarray(x)
    _check(comm, "peer", peer, tag, timeout_s)
    op = "bsend" if buffered else "send"
    call = jax.ffi.ffi_call(_target(comm, op), _TOKEN, has_side_effect=True)
    return call(
        _route(peer, tag),
        x,
        _token(token),
        comm=_comm_handle(comm),
        timeout_s=np.float64(timeout_s),
        desc=desc(x.shape, x.dtype),
    )


def recv(
    shape: tuple[int, ...],
    dtype: Any,
    *,
    peer: int | jax.Array,
    tag: int | jax.Array,
    comm: Any,
    token: jax.Array | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    into: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Receive a ``dtype[shape]`` array from rank ``peer`` of ``comm``; returns ``(array, token)``.

    ``into``: a ``dtype[shape]`` buffer the result may reuse (its contents are overwritten; XLA
    aliases it to the output, so a loop or a donated argument receives without allocating).
    """
    shape = tuple(int(d) for d in shape)
    _check(comm, "peer", peer, tag, timeout_s)
    out = (jax.ShapeDtypeStruct(shape, dtype), _TOKEN)
    attrs = dict(comm=_comm_handle(comm), timeout_s=np.float64(timeout_s), desc=desc(shape, dtype))
    if into is None:
        call = jax.ffi.ffi_call(_target(comm, "recv"), out, has_side_effect=True)
        return call(_route(peer, tag), _token(token), **attrs)
    if tuple(into.shape) != shape or into.dtype != jnp.dtype(dtype):
        raise TypeError(f"h2jax ffi: into is {desc(into.shape, into.dtype)}, expected {desc(shape, dtype)}")
    call = jax.ffi.ffi_call(_target(comm, "recv_into"), out, has_side_effect=True, input_output_aliases={2: 0})
    return call(_route(peer, tag), _token(token), into, **attrs)


def sendrecv(
    x: jax.Array,
    shape: tuple[int, ...],
    dtype: Any,
    *,
    dest: int,
    source: int,
    send_tag: int,
    recv_tag: int,
    comm: Any,
    token: jax.Array | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[jax.Array, jax.Array]:
    """Send ``x`` to ``dest`` and receive a ``dtype[shape]`` array from ``source`` at once.

    The paired exchange of 1F1B's steady state (send forward, receive backward): both
    directions are posted together, zero-copy, and cannot deadlock. Returns ``(array, token)``.
    """
    x = jnp.asarray(x)
    shape = tuple(int(d) for d in shape)
    _check(comm, "dest", dest, send_tag, timeout_s)
    _check(comm, "source", source, recv_tag, timeout_s)
    call = jax.ffi.ffi_call(
        _target(comm, "sendrecv"), (jax.ShapeDtypeStruct(shape, dtype), _TOKEN), has_side_effect=True
    )
    what = f"send {desc(x.shape, x.dtype)} / recv {desc(shape, dtype)}"
    return call(
        _route(dest, send_tag, source, recv_tag),
        x,
        _token(token),
        comm=_comm_handle(comm),
        timeout_s=np.float64(timeout_s),
        desc=what,
    )
