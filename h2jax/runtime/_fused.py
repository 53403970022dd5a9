"""Boundary transfers *inside* the jitted stage programs (multi-process, ``ffi`` transport).

The forward program of stage s starts by receiving its input from stage s-1 and ends by
sending its output to stage s+1; the backward program likewise for gradients. Each
device of the stage mesh moves its own pieces, as the topology-aware pattern of
:func:`h2jax.plan.reshard_pattern` says: destination device (j, l) receives the rows of
its data slice j, columns piece l (1/tp of the hidden dim), from the source devices
holding them, then the destination all-gathers over its own ``tensor`` axis. Every
element crosses the inter-stage link once, and no transfer costs a dispatch of its own.

The calls run per device under ``jax.shard_map`` (a side-effecting call in plain
multi-device jit crashes the partitioner); per-device peers/tags/offsets are int32 tables
indexed by the device's mesh coordinates, so one SPMD body serves every device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from h2jax.comm import _ffi
from h2jax.plan import reshard_pattern

TAG_SPACE = 32768  # MPI guarantees at least this many tags


class FusedUnsupported(ValueError):
    """This pair of mesh shapes and tensor shape has no uniform per-device pattern."""


@dataclass(frozen=True)
class Boundary:
    """The pattern of one boundary tensor between a source and a destination mesh shape."""

    shape: tuple[int, ...]  # global, [batch, ..., hidden]
    src: tuple[int, int]
    dst: tuple[int, int]

    def pattern(self):
        return reshard_pattern(self.shape, src=self.src, dst=self.dst, batch_dim=0, split_dim=-1)

    @property
    def num_transfers(self) -> int:
        return len(self.pattern())

    def piece_shape(self) -> tuple[int, ...]:
        shapes = {tuple(b - a for a, b in t.index) for t in self.pattern()}
        if len(shapes) != 1:
            raise FusedUnsupported(f"pieces of unequal shapes {sorted(shapes)} for {self}")
        return shapes.pop()


def _lin(coord: tuple[int, int], mesh_shape: tuple[int, int]) -> int:
    return coord[0] * mesh_shape[1] + coord[1]


def _device_index(mesh_shape: tuple[int, int]) -> jax.Array:
    return jax.lax.axis_index("data") * mesh_shape[1] + jax.lax.axis_index("tensor")


def _peer_table(
    peer: int | Sequence[int], other: tuple[int, int], by_dev: list[list[tuple[int, Any]]], slots: int, side: str
) -> Any:
    """The rank each (device, slot) talks to: ``peer`` (one process holds the other stage) or
    ``peer[device index on the other mesh]`` (the other stage spans several processes)."""
    if isinstance(peer, (int, np.integer)):
        return int(peer)
    ranks = [int(r) for r in peer]
    if len(ranks) != other[0] * other[1]:
        raise ValueError(f"peer ranks: {len(ranks)} given for a {other[0]}x{other[1]} mesh ({ranks})")
    if len(set(ranks)) == 1:  # one process: a static rank, as before
        return ranks[0]
    table = np.zeros((len(by_dev), slots), np.int32)
    for d, items in enumerate(by_dev):
        for k, (_, t) in enumerate(items):
            table[d, k] = ranks[_lin(getattr(t, side), other)]
    return table


def send_boundary(
    y: jax.Array, mesh: Mesh, b: Boundary, *, peer: int | Sequence[int], tag_base: Any, comm: Any, timeout_s: float
) -> jax.Array:
    """Inside a jit: send ``y`` (sharded P("data") on ``mesh``, shape ``b.shape``) to the
    destination stage: ``peer`` is its rank, or the rank of each of its devices (row-major
    over its (data, tensor) mesh) when it spans several processes.
    Returns a per-device token array (keep it alive as a program output)."""
    pattern = b.pattern()
    piece = b.piece_shape()
    ndev = b.src[0] * b.src[1]
    rows_src = b.shape[0] // b.src[0]
    by_dev: list[list[tuple[int, Any]]] = [[] for _ in range(ndev)]
    for t_idx, t in enumerate(pattern):
        by_dev[_lin(t.src, b.src)].append((t_idx, t))
    slots = max(len(v) for v in by_dev)
    has = np.zeros((ndev, slots), np.bool_)
    tags = np.zeros((ndev, slots), np.int32)
    row = np.zeros((ndev, slots), np.int32)
    col = np.zeros((ndev, slots), np.int32)
    for d, items in enumerate(by_dev):
        for k, (t_idx, t) in enumerate(items):
            has[d, k] = True
            tags[d, k] = t_idx
            row[d, k] = t.index[0][0] - t.src[0] * rows_src
            col[d, k] = t.index[-1][0]
    peers = _peer_table(peer, b.dst, by_dev, slots, "dst")
    has, tags, row, col = (jnp.asarray(a) for a in (has, tags, row, col))

    def body(local):
        i = _device_index(b.src)
        token = _ffi.new_token()
        for k in range(slots):
            start = [row[i, k]] + [0] * (local.ndim - 2) + [col[i, k]]
            x = jax.lax.dynamic_slice(local, start, piece)
            token = jax.lax.cond(
                has[i, k],
                lambda x_, tok: _ffi.send(
                    x_,
                    peer=peers if isinstance(peers, int) else jnp.asarray(peers)[i, k],
                    tag=(tag_base + tags[i, k]) % TAG_SPACE,
                    comm=comm,
                    token=tok,
                    timeout_s=timeout_s,
                ),
                lambda x_, tok: tok,
                x,
                token,
            )
        return token[None]

    spec = P("data", *([None] * (y.ndim - 1)))
    return jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=P(("data", "tensor")))(y)


def recv_boundary(
    mesh: Mesh, b: Boundary, dtype: Any, *, peer: int | Sequence[int], tag_base: Any, comm: Any, timeout_s: float
) -> jax.Array:
    """Inside a jit: receive the boundary tensor from the source stage, laid out P("data") on
    ``mesh``; ``peer`` as in :func:`send_boundary` (ranks of the source stage's devices)."""
    pattern = b.pattern()
    piece = b.piece_shape()
    ndev = b.dst[0] * b.dst[1]
    rows_dst = b.shape[0] // b.dst[0]
    by_dev: list[list[tuple[int, Any]]] = [[] for _ in range(ndev)]
    for t_idx, t in enumerate(pattern):
        by_dev[_lin(t.dst, b.dst)].append((t_idx, t))
    counts = {len(v) for v in by_dev}
    if len(counts) != 1:
        raise FusedUnsupported(f"destination devices receive unequal numbers of pieces {sorted(counts)} for {b}")
    slots = counts.pop()
    tags = np.zeros((ndev, slots), np.int32)
    row = np.zeros((ndev, slots), np.int32)
    for d, items in enumerate(by_dev):
        for k, (t_idx, t) in enumerate(items):
            tags[d, k] = t_idx
            row[d, k] = t.index[0][0] - t.dst[0] * rows_dst
    peers = _peer_table(peer, b.src, by_dev, slots, "src")
    tags, row = jnp.asarray(tags), jnp.asarray(row)
    block = (rows_dst, *b.shape[1:-1], piece[-1])
    split_whole = piece[-1] == b.shape[-1]

    def body():
        i = _device_index(b.dst)
        token = _ffi.new_token()
        local = jnp.zeros(block, dtype)
        for k in range(slots):
            src = peers if isinstance(peers, int) else jnp.asarray(peers)[i, k]
            x, token = _ffi.recv(
                piece,
                dtype,
                peer=src,
                tag=(tag_base + tags[i, k]) % TAG_SPACE,
                comm=comm,
                token=token,
                timeout_s=timeout_s,
            )
            local = jax.lax.dynamic_update_slice(local, x, [row[i, k]] + [0] * (len(block) - 1))
        if not split_whole:  # the 1/tp pieces of this data slice, gathered over the fast axis
            local = jax.lax.all_gather(local, "tensor", axis=len(block) - 1, tiled=True)
        return local

    spec = P("data", *([None] * (len(b.shape) - 1)))
    return jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=spec, check_vma=False)()


TAGS_PER_TRANSFER = 64  # tags reserved per (microbatch, direction): >= transfers of one boundary


class FusedStage:
    """The stage programs of one process with their boundary transfers inside.

    ``forward(m, tokens, targets)`` / ``backward(m, saved, targets)`` dispatch one
    program each; nothing crosses the boundary outside them.

    Where the neighbours live: ``rank_of_stage[s]`` (one process per stage), or
    ``rank_of_device[s][i]``, the rank owning device ``i`` (row-major over (data, tensor))
    of stage ``s`` -- for stages that span several processes (see ``_procgroup``). Each
    piece of the resharding pattern then goes to (comes from) the rank of its peer device.
    The stage's own mesh may span several processes (a ``jax.distributed`` cluster): the
    programs are SPMD over it and each process moves only its own devices' pieces.
    """

    def __init__(
        self,
        st: Any,
        *,
        plan: Any,
        seq_len: int,
        d_model: int,
        dtype: Any,
        rank_of_stage: Sequence[int] | None = None,
        comm: Any,
        timeout_s: float,
        rank_of_device: Sequence[Sequence[int]] | None = None,
    ):
        self.st = st
        s = st.stage_idx
        n = plan.num_stages
        shape = (plan.microbatch_size, seq_len, d_model)
        mesh_of = [(x.data, x.tensor) for x in plan.stages]
        me = mesh_of[s]
        self.dtype = dtype
        if (rank_of_stage is None) == (rank_of_device is None):
            raise TypeError("FusedStage: pass exactly one of rank_of_stage and rank_of_device")
        if rank_of_device is None:
            ranks: list[Any] = [int(r) for r in rank_of_stage]
        else:  # a stage in one process keeps a plain rank (the same programs as rank_of_stage)
            ranks = [int(r[0]) if len(set(r)) == 1 else [int(x) for x in r] for r in rank_of_device]
            for i, (r, (dp, tp)) in enumerate(zip(rank_of_device, mesh_of)):
                if len(r) != dp * tp:
                    raise ValueError(f"rank_of_device[{i}]: {len(r)} ranks for stage {i}'s {dp}x{tp} mesh")
        if len(ranks) != n:
            raise ValueError(f"FusedStage: ranks for {len(ranks)} stages, the plan has {n}")
        self.prev = ranks[s - 1] if s > 0 else None
        self.next = ranks[s + 1] if s < n - 1 else None
        # activations go s -> s+1, their gradients s+1 -> s
        self.recv_fwd = Boundary(shape, mesh_of[s - 1], me) if s > 0 else None
        self.send_fwd = Boundary(shape, me, mesh_of[s + 1]) if s < n - 1 else None
        self.recv_bwd = Boundary(shape, mesh_of[s + 1], me) if s < n - 1 else None
        self.send_bwd = Boundary(shape, me, mesh_of[s - 1]) if s > 0 else None
        for b in (self.recv_fwd, self.send_fwd, self.recv_bwd, self.send_bwd):
            if b is not None:
                if b.num_transfers > TAGS_PER_TRANSFER:
                    raise FusedUnsupported(f"{b.num_transfers} transfers per boundary; at most {TAGS_PER_TRANSFER}")
                b.piece_shape()  # raises FusedUnsupported for uneven pieces
        self.comm, self.timeout_s = comm, float(timeout_s)
        self._fwd = jax.jit(self._forward_program)
        self._bwd = jax.jit(self._backward_program, donate_argnums=(3,))

    @staticmethod
    def tag_base(microbatch: int, direction: int) -> int:
        return ((2 * microbatch + direction) * TAGS_PER_TRANSFER) % TAG_SPACE

    def _forward_program(self, params, tokens, targets, base):
        st = self.st
        kw = dict(comm=self.comm, timeout_s=self.timeout_s, tag_base=base)
        x = tokens if st.first else recv_boundary(st.mesh, self.recv_fwd, self.dtype, peer=self.prev, **kw)
        if st.recompute:
            y, saved = st._apply(params, x, targets), x
        else:
            y, saved = st._vjp(params, x, targets)
        if st.last:
            return y, saved
        return send_boundary(y, st.mesh, self.send_fwd, peer=self.next, **kw), saved

    def _backward_program(self, params, saved, targets, acc, dloss, base):
        st = self.st
        kw = dict(comm=self.comm, timeout_s=self.timeout_s, tag_base=base)
        dy = dloss if st.last else recv_boundary(st.mesh, self.recv_bwd, self.dtype, peer=self.next, **kw)
        vjp = st._vjp(params, saved, targets)[1] if st.recompute else saved
        acc, dx = st._accumulate(vjp, dy, acc)
        if st.first:
            return acc, dx
        return acc, send_boundary(dx, st.mesh, self.send_bwd, peer=self.prev, **kw)

    def forward(self, microbatch: int, tokens: Any, targets: Any) -> tuple[Any, Any]:
        """(loss on the last stage / send token elsewhere, what backward needs)."""
        base = jnp.int32(self.tag_base(microbatch, 0))
        return self._fwd(self.st.params, tokens, targets, base)

    def backward(self, microbatch: int, saved: Any, targets: Any, dloss: Any) -> Any:
        base = jnp.int32(self.tag_base(microbatch, 1))
        self.st.acc, done = self._bwd(self.st.params, saved, targets, self.st.acc, dloss, base)
        return done
