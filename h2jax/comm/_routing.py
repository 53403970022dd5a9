"""Where each piece of a boundary tensor goes: the tag scheme and the per-device routing.

A boundary tensor ``[batch, ..., hidden]`` leaves stage s laid out ``P("data")`` on its
(data, tensor) mesh and arrives on the next stage's mesh. :func:`h2jax.plan.reshard_pattern`
(pure) says which source device sends which piece to which destination device: every
element crosses the link once, in ``1/tp`` pieces of the hidden dim, and the destination
all-gathers them over its own ``tensor`` axis. This module turns that pattern into
per-device tables (the in-program FFI path) and per-shard sends (the staged paths).

Tags (one scheme for every multi-process channel): a (microbatch, direction, lane) owns
``TAGS_PER_TRANSFER`` consecutive tags, one per piece of the pattern, modulo the smallest
tag bound MPI guarantees. The lane tells apart the boundaries that join the same two
stages in the same direction when stages hold several layer chunks (interleaved: chunk 0's
boundary 0 -> 1 and chunk 1's boundary p -> p+1 both go stage 0 -> stage 1): it is the
chunk of the boundary's lower model position, one of ``lanes`` (the plan's chunks per
stage; 1 and lane 0 for one-chunk plans, whose tags are those of one lane). MPI keeps the
messages of one (source, tag, communicator) in order, so tags may repeat across steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from h2jax.plan import reshard_pattern

FWD, BWD = 0, 1  # activations travel s -> s+1, their gradients s+1 -> s
TAG_SPACE = 32768  # MPI guarantees at least this many tags
TAGS_PER_TRANSFER = 64  # tags reserved per (microbatch, direction): >= pieces of one boundary


def tag_base(microbatch: int, direction: int, lanes: int = 1) -> int:
    """The first tag of ``microbatch``'s transfer in ``direction`` on lane 0 of ``lanes``;
    lane l adds :func:`lane_offset` (l), piece k adds k."""
    return ((2 * microbatch + direction) * lanes * TAGS_PER_TRANSFER) % TAG_SPACE


def lane_offset(lane: int) -> int:
    """What lane ``lane`` adds to a :func:`tag_base` (module docstring)."""
    return lane * TAGS_PER_TRANSFER


def tag(base: Any, piece: Any) -> Any:
    return (base + piece) % TAG_SPACE


class RoutingUnsupported(ValueError):
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
            raise RoutingUnsupported(f"pieces of unequal shapes {sorted(shapes)} for {self}")
        return shapes.pop()

    def check(self) -> None:
        """Raise RoutingUnsupported unless every multi-process channel can carry this boundary."""
        if self.num_transfers > TAGS_PER_TRANSFER:
            raise RoutingUnsupported(
                f"{self.num_transfers} pieces cross one boundary ({self.src[0]}x{self.src[1]} -> "
                f"{self.dst[0]}x{self.dst[1]}); at most {TAGS_PER_TRANSFER} (tags per microbatch)"
            )


def lin(coord: tuple[int, int], mesh_shape: tuple[int, int]) -> int:
    """Row-major index of a (data, tensor) mesh coordinate."""
    return coord[0] * mesh_shape[1] + coord[1]


def peer_table(
    peer: int | Sequence[int], other: tuple[int, int], by_dev: list[list[tuple[int, Any]]], slots: int, side: str
) -> Any:
    """The rank each (device, slot) talks to: ``peer`` (one process holds the other stage) or
    ``peer[device index on the other mesh]`` (the other stage spans several processes)."""
    if isinstance(peer, (int, np.integer)):
        return int(peer)
    ranks = [int(r) for r in peer]
    if len(ranks) != other[0] * other[1]:
        raise ValueError(f"peer ranks: {len(ranks)} given for a {other[0]}x{other[1]} mesh ({ranks})")
    if len(set(ranks)) == 1:  # one process: a static rank
        return ranks[0]
    table = np.zeros((len(by_dev), slots), np.int32)
    for d, items in enumerate(by_dev):
        for k, (_, t) in enumerate(items):
            table[d, k] = ranks[lin(getattr(t, side), other)]
    return table


def device_ranks(ranks: Sequence[int]) -> int | list[int]:
    """A stage's owner ranks per device, as the routing functions take them: one rank when a
    single process holds the whole stage."""
    ranks = [int(r) for r in ranks]
    return ranks[0] if len(set(ranks)) == 1 else ranks
