"""Resharding patterns: every element crosses once, each destination gets exactly its data,
the load is spread over source devices."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from h2jax.plan import bytes_crossing, reshard_pattern, slice_routes

MESHES = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (4, 2), (2, 4), (8, 1), (1, 8)]


def _cover(shape, pattern):
    hits = np.zeros(shape, np.int32)
    for t in pattern:
        hits[tuple(slice(a, b) for a, b in t.index)] += 1
    return hits


@pytest.mark.parametrize("src,dst", list(itertools.product(MESHES, MESHES)))
def test_every_element_crosses_exactly_once(src, dst):
    shape = (8, 3, 8)  # batch divisible by every data degree, hidden by every tensor degree
    pattern = reshard_pattern(shape, src=src, dst=dst)
    assert (_cover(shape, pattern) == 1).all()
    assert bytes_crossing(pattern, 4) == int(np.prod(shape)) * 4
    # each destination device receives exactly rows of its data slice and its own 1/tp piece
    rows = shape[0] // dst[0]
    cols = shape[2] // dst[1]
    for t in pattern:
        j, l = t.dst
        (a, b), _, (c, d) = t.index
        assert j * rows <= a < b <= (j + 1) * rows
        assert (c, d) == (l * cols, (l + 1) * cols)
        i, k = t.src
        src_rows = shape[0] // src[0]
        assert i * src_rows <= a < b <= (i + 1) * src_rows  # the source really holds these rows
        assert 0 <= k < src[1]
    # after an all-gather over the destination's tensor axis, each device has its whole slice
    for j in range(dst[0]):
        got = np.zeros(shape, np.int32)
        for t in pattern:
            if t.dst[0] == j:
                got[tuple(slice(a, b) for a, b in t.index)] += 1
        assert (got[j * rows : (j + 1) * rows] == 1).all() and got.sum() == rows * shape[1] * shape[2]


@pytest.mark.parametrize("src,dst", list(itertools.product(MESHES, MESHES)))
def test_load_is_balanced_over_source_devices(src, dst):
    shape = (8, 3, 8)
    pattern = reshard_pattern(shape, src=src, dst=dst)
    sent = np.zeros(src, np.int64)
    for t in pattern:
        sent[t.src] += t.num_elements
    total = int(np.prod(shape))
    # every source device carries at most its fair share rounded up to one piece
    piece = max(t.num_elements for t in pattern)
    assert sent.max() <= total / sent.size + piece
    if len(pattern) >= sent.size:  # enough pieces for every source device: all of them send
        assert (sent > 0).all()


def test_naive_pattern_sends_tp_times_the_bytes():
    shape = (8, 16)
    smart = reshard_pattern(shape, src=(2, 2), dst=(2, 4))
    naive = reshard_pattern(shape, src=(2, 2), dst=(2, 4), topology_aware=False)
    assert bytes_crossing(naive, 2) == 4 * bytes_crossing(smart, 2)
    assert (_cover(shape, naive) == 4).all()


def test_indivisible_hidden_falls_back_to_whole_slices():
    pattern = reshard_pattern((4, 6), src=(1, 1), dst=(2, 4))
    assert (_cover((4, 6), pattern) == 4).all()


def test_indivisible_batch_is_refused():
    with pytest.raises(ValueError, match="divisible"):
        reshard_pattern((6, 8), src=(4, 1), dst=(1, 1))


# -- slice_routes: any layout to any other, at the granularity of processes -----------------------
def _layout(shape, grid, procs, replicas, first_rank):
    """(rank, block) per device: ``shape`` cut into ``grid`` blocks (per dim), each held by
    ``replicas`` devices, the devices dealt to ``procs`` processes in order (a stage's mesh)."""
    blocks = list(itertools.product(*[[(i * n // g, (i + 1) * n // g) for i in range(g)] for n, g in zip(shape, grid)]))
    devices = [b for b in blocks for _ in range(replicas)]
    per = len(devices) // procs
    return [(first_rank + i // per, b) for i, b in enumerate(devices)]


LAYOUTS = [  # (grid, replicas, processes)
    ((1, 1), 1, 1),
    ((1, 1), 2, 2),  # replicated over two processes (a data axis)
    ((2, 1), 1, 2),  # split on dim 0 (vocab) over two processes
    ((1, 2), 2, 2),  # split on dim 1, each half on one process twice
    ((1, 2), 2, 4),  # split on dim 1, each half on two processes
    ((4, 1), 1, 1),  # four blocks in one process
    ((2, 2), 2, 4),
]


@pytest.mark.parametrize("src,dst", list(itertools.product(LAYOUTS, LAYOUTS)))
def test_slice_routes_give_every_receiver_its_blocks_once_from_their_holders(src, dst):
    shape = (8, 12)
    a, b = _layout(shape, *src, first_rank=0), _layout(shape, *dst, first_rank=10)
    routes = slice_routes(a, b)
    held = {}
    for p, blk in a:
        held.setdefault(p, set()).add(blk)
    for r in sorted({p for p, _ in b}):
        for d in {blk for p, blk in b if p == r}:
            hits = np.zeros(shape, np.int32)
            for (s, rr), rt in routes.items():
                for region, e, dd in rt:
                    if rr == r and dd == d:
                        assert e in held[s]  # a sender sends only what it holds
                        assert all(e0 <= x0 < x1 <= e1 for (x0, x1), (e0, e1) in zip(region, e))
                        hits[tuple(slice(x0, x1) for x0, x1 in region)] += 1
            box = tuple(slice(x0, x1) for x0, x1 in d)
            assert (hits[box] == 1).all() and hits.sum() == hits[box].sum()  # its block, each element once


def test_slice_routes_share_a_replicated_block_among_its_holders():
    whole = ((0, 8), (0, 4))
    two = [(0, whole), (1, whole)]  # replicated over two processes
    four = [(r, whole) for r in range(10, 14)]  # four processes each needing it whole
    assert sorted(slice_routes(two, four)) == [(0, 10), (0, 12), (1, 11), (1, 13)]
    assert sorted(slice_routes(two, two + four)) == [
        (0, 0),
        (0, 10),
        (0, 12),
        (1, 1),
        (1, 11),
        (1, 13),
    ]  # own from itself


def test_slice_routes_cut_a_region_among_holders_that_outnumber_its_receivers():
    """One receiver of a block two processes hold (a mirror of data 2 sending to an owner of data
    1): each holder sends half, on every call (not the first holder every time); three holders of
    a block two rows long: two of them send a row each."""
    whole = ((0, 8), (0, 4))
    routes = slice_routes([(2, whole), (3, whole)], [(0, whole)])
    assert routes == {
        (2, 0): [(((0, 4), (0, 4)), whole, whole)],
        (3, 0): [(((4, 8), (0, 4)), whole, whole)],
    }
    short = ((0, 2), (0, 1))
    assert slice_routes([(1, short), (2, short), (3, short)], [(0, short)]) == {
        (1, 0): [(((0, 1), (0, 1)), short, short)],
        (2, 0): [(((1, 2), (0, 1)), short, short)],
    }
    assert slice_routes([(1, ()), (2, ())], [(0, ())]) == {(1, 0): [((), (), ())]}  # a scalar: whole
    # two receivers of four holders: each receiver's region from two of them, all four sending
    four = [(r, whole) for r in range(4)]
    sent = slice_routes(four, [(10, whole), (11, whole)])
    assert sorted(sent) == [(0, 10), (1, 10), (2, 11), (3, 11)]
    assert all(_elements(rt) == 16 for rt in sent.values())


def _elements(routes) -> int:
    return sum(int(np.prod([b - a for a, b in region])) for region, _, _ in routes)


def test_slice_routes_the_tied_table_of_two_stages_over_two_processes_each():
    """The owner's table split on vocab over ranks 0 and 1, the mirror's whole on ranks 2 and 3
    (data 2): the gradient goes half from each mirror process, the values back a half from each
    owner process to each mirror process."""
    owner = [(0, ((0, 4), (0, 4))), (1, ((4, 8), (0, 4)))]
    mirror = [(2, ((0, 8), (0, 4))), (3, ((0, 8), (0, 4)))]
    assert slice_routes(mirror, owner) == {
        (2, 0): [(((0, 4), (0, 4)), ((0, 8), (0, 4)), ((0, 4), (0, 4)))],
        (3, 1): [(((4, 8), (0, 4)), ((0, 8), (0, 4)), ((4, 8), (0, 4)))],
    }
    assert sorted(slice_routes(owner, mirror)) == [(0, 2), (0, 3), (1, 2), (1, 3)]


def test_slice_routes_refuse_a_layout_that_does_not_cover_a_block():
    with pytest.raises(ValueError, match="covers 16 of the 32 elements"):
        slice_routes([(0, ((0, 4), (0, 4)))], [(1, ((0, 8), (0, 4)))])
