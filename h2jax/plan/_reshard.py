"""Topology-aware resharding between neighbouring stage meshes (pure; no jax).

A boundary tensor (activations ``[batch, ...]`` or their gradients) is sharded over the
source stage's ``data`` axis on the batch dim and replicated over its ``tensor`` axis; the
destination wants it sharded over *its* ``data`` axis and replicated over *its* ``tensor``
axis. Sending every destination device its whole data slice would push each element
across the slow inter-stage link ``tp_dst`` times. H2's pattern instead sends each of the
``tp_dst`` devices of a destination data slice a distinct ``1/tp_dst`` piece (split along
``split_dim``), so every element crosses exactly once, from source devices chosen to
spread the load, and the destination all-gathers the pieces over its own fast ``tensor``
axis.

Devices are named by mesh coordinates ``(data_idx, tensor_idx)``; slices are half-open
``(start, stop)`` per array dim, in global coordinates.

:func:`slice_routes` is the general case at the granularity of processes, for arrays of any
layout (a parameter several stages hold, h2jax.runtime._tied): which process sends which region
to which, each element of a receiver's blocks sent once, from a process that holds it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

Slice = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Transfer:
    """One piece crossing the boundary: ``src`` device sends ``index`` of the global array to ``dst``."""

    src: tuple[int, int]
    dst: tuple[int, int]
    index: Slice

    @property
    def num_elements(self) -> int:
        return _size(self.index)


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    if n % parts:
        raise ValueError(f"size {n} is not divisible into {parts} equal parts")
    step = n // parts
    return [(i * step, (i + 1) * step) for i in range(parts)]


def reshard_pattern(
    shape: tuple[int, ...],
    *,
    src: tuple[int, int],
    dst: tuple[int, int],
    batch_dim: int = 0,
    split_dim: int = -1,
    topology_aware: bool = True,
) -> list[Transfer]:
    """Which source device sends which slice to which destination device.

    ``src`` and ``dst`` are the (data, tensor) mesh shapes. With ``topology_aware`` each
    element crosses once and destination tensor groups all-gather along ``split_dim``
    afterwards; without it every destination device receives its whole data slice (the
    naive pattern, ``tp_dst`` times the bytes) -- kept for comparison.
    If ``shape[split_dim]`` is not divisible by ``tp_dst`` the topology-aware pattern
    is impossible and the naive one is returned.
    """
    ndim = len(shape)
    batch_dim %= ndim
    split_dim %= ndim
    if split_dim == batch_dim:
        raise ValueError("split_dim must differ from batch_dim")
    dp_s, tp_s = src
    dp_t, tp_t = dst
    src_rows = _split(shape[batch_dim], dp_s)
    dst_rows = _split(shape[batch_dim], dp_t)
    pieces = tp_t if topology_aware and shape[split_dim] % tp_t == 0 else 1
    cols = _split(shape[split_dim], pieces)
    sent = [[0] * tp_s for _ in range(dp_s)]  # elements sent per source device, for balancing
    out: list[Transfer] = []
    for j, (r0, r1) in enumerate(dst_rows):
        for l in range(tp_t):
            col_range = cols[l] if pieces > 1 else (0, shape[split_dim])
            # the source data slices overlapping this destination's rows
            for i, (s0, s1) in enumerate(src_rows):
                a, b = max(r0, s0), min(r1, s1)
                if a >= b:
                    continue
                index = [(0, n) for n in shape]
                index[batch_dim] = (a, b)
                index[split_dim] = col_range
                t = Transfer(src=(i, 0), dst=(j, l), index=tuple(index))
                # every tensor replica of source slice i holds these rows: pick the least loaded
                k = min(range(tp_s), key=lambda k_: (sent[i][k_], (k_ - l) % tp_s))
                sent[i][k] += t.num_elements
                out.append(Transfer(src=(i, k), dst=(j, l), index=t.index))
    return out


def bytes_crossing(pattern: list[Transfer], itemsize: int) -> int:
    """Bytes that cross the inter-stage link for a pattern."""
    return sum(t.num_elements for t in pattern) * itemsize


Route = tuple[Slice, Slice, Slice]  # (region, the sender's block it is cut from, the receiver's block it fills)


def _size(index: Slice) -> int:
    n = 1
    for a, b in index:
        n *= b - a
    return n


def _overlap(a: Slice, b: Slice) -> Slice | None:
    region = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return region if all(lo < hi for lo, hi in region) else None


def _cut(region: Slice, parts: int) -> list[Slice]:
    """``region`` cut into up to ``parts`` near-equal boxes along its longest dimension (fewer
    where that dimension is shorter; a scalar's whole), in order."""
    if not region:
        return [region]
    dim = max(range(len(region)), key=lambda k: region[k][1] - region[k][0])
    lo, hi = region[dim]
    n = min(parts, hi - lo)
    return [
        tuple((lo + (hi - lo) * t // n, lo + (hi - lo) * (t + 1) // n) if k == dim else r for k, r in enumerate(region))
        for t in range(n)
    ]


def slice_routes(
    src: Sequence[tuple[int, Slice]], dst: Sequence[tuple[int, Slice]]
) -> dict[tuple[int, int], list[Route]]:
    """How an array laid out over some processes' devices (``src``) reaches another layout
    (``dst``): {(sender, receiver): [(region, sender's block, receiver's block), ...]}, in an order
    that every process computes alike from the same two layouts.

    A layout lists (process, block) for each of its devices, a block being the slice of the global
    array that device holds (a sharding's ``devices_indices_map``); replicas repeat a block, and
    the distinct blocks of a layout tile the array. Each receiver gets every element of its
    distinct blocks exactly once: from itself where it holds the sender's block, else from that
    block's holders, who share the load: where the regions asked of a block are at least as many
    as its holders, each region comes whole from the holder that has sent the fewest elements so
    far (the receivers taken in order); where they are fewer (e.g. one receiver of a block that
    two processes hold), each region is cut along its longest dimension among the holders, so
    every holder sends a part. A receiver's block that the sender's blocks do not cover is an
    error (not a sharding's layout)."""
    holders: dict[Slice, list[int]] = {}
    for p, block in src:
        hs = holders.setdefault(tuple(block), [])
        if p not in hs:
            hs.append(p)
    for hs in holders.values():
        hs.sort()
    needs: dict[int, set[Slice]] = {}
    for p, block in dst:
        needs.setdefault(p, set()).add(tuple(block))
    asks: list[tuple[int, int, Slice, Slice, Slice]] = []  # (receiver index, receiver, its block, sender block, region)
    for i, r in enumerate(sorted(needs)):
        for d in sorted(needs[r]):
            covered = 0
            for e in sorted(holders):
                region = _overlap(d, e)
                if region is not None:
                    asks.append((i, r, d, e, region))
                    covered += _size(region)
            if covered != _size(d):
                raise ValueError(f"the sending layout covers {covered} of the {_size(d)} elements of block {d}")
    asked = Counter(e for _, r, _, e, _ in asks if r not in holders[e])  # regions asked of each block from afar
    done: Counter = Counter()  # ... of them routed so far
    sent = dict.fromkeys(sorted({p for hs in holders.values() for p in hs}), 0)
    out: dict[tuple[int, int], list[Route]] = {}
    for i, r, d, e, region in asks:
        hs = holders[e]
        if r in hs:
            out.setdefault((r, r), []).append((region, e, d))
        elif asked[e] >= len(hs):
            s = min(hs, key=lambda h: (sent[h], (hs.index(h) - i) % len(hs)))
            sent[s] += _size(region)
            out.setdefault((s, r), []).append((region, e, d))
        else:
            per = len(hs) // asked[e]  # holders for each region asked (>= 2)
            for t, part in enumerate(_cut(region, per)):
                s = hs[(done[e] * per + t) % len(hs)]
                sent[s] += _size(part)
                out.setdefault((s, r), []).append((part, e, d))
            done[e] += 1
    return out
