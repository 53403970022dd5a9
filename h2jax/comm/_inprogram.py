"""Boundary transfers *inside* a jitted stage program (the ``ffi`` channel).

The forward program of stage s starts by receiving its input from stage s-1 and ends by
sending its output to stage s+1; the backward program likewise for gradients. Each
device of the stage mesh moves its own pieces, as :mod:`h2jax.comm._routing` says, then
the destination all-gathers over its own ``tensor`` axis; no transfer costs a dispatch.

The calls run per device under ``jax.shard_map`` (a side-effecting call in plain
multi-device jit crashes the partitioner); per-device peers/tags/offsets are int32 tables
indexed by the device's mesh coordinates, so one SPMD body serves every device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from h2jax.comm import _ffi
from h2jax.comm._routing import Boundary, RoutingUnsupported, lin, peer_table, tag


def _device_index(mesh_shape: tuple[int, int]) -> jax.Array:
    return jax.lax.axis_index("data") * mesh_shape[1] + jax.lax.axis_index("tensor")


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
        by_dev[lin(t.src, b.src)].append((t_idx, t))
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
    peers = peer_table(peer, b.dst, by_dev, slots, "dst")
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
                    tag=tag(tag_base, tags[i, k]),
                    comm=comm,
                    token=tok,
                    timeout_s=timeout_s,
                    buffered=True,  # the stage's program goes on while the next stage is busy
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
        by_dev[lin(t.dst, b.dst)].append((t_idx, t))
    counts = {len(v) for v in by_dev}
    if len(counts) != 1:
        raise RoutingUnsupported(f"destination devices receive unequal numbers of pieces {sorted(counts)} for {b}")
    slots = counts.pop()
    tags = np.zeros((ndev, slots), np.int32)
    row = np.zeros((ndev, slots), np.int32)
    for d, items in enumerate(by_dev):
        for k, (t_idx, t) in enumerate(items):
            tags[d, k] = t_idx
            row[d, k] = t.index[0][0] - t.dst[0] * rows_dst
    peers = peer_table(peer, b.src, by_dev, slots, "src")
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
                tag=tag(tag_base, tags[i, k]),
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
