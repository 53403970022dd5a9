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
"""

from __future__ import annotations

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
        n = 1
        for a, b in self.index:
            n *= b - a
        return n


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
