"""Resharding patterns: every element crosses once, each destination gets exactly its data,
the load is spread over source devices."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from h2jax.plan import bytes_crossing, reshard_pattern

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
