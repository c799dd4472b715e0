"""protos/slicing.py: AiDotNet's slice rule, pieces of ranges, chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramshard.protos.slicing import (
    SlicePiece,
    chunk_ranges,
    pieces,
    slice_bounds,
    slice_sizes,
    tensor_parallel_ranges,
)

SIZES = st.integers(0, 10**7)
COUNTS = st.integers(1, 64)


def test_slice_rule_examples() -> None:
    assert slice_sizes(10, 3) == [4, 3, 3]
    assert slice_sizes(11, 3) == [4, 4, 3]
    assert slice_sizes(12, 3) == [4, 4, 4]
    assert slice_sizes(2, 3) == [1, 1, 0]
    assert slice_sizes(0, 4) == [0, 0, 0, 0]
    assert slice_sizes(7, 1) == [7]
    assert [slice_bounds(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [slice_bounds(2, 3, i) for i in range(3)] == [(0, 1), (1, 2), (2, 2)]


@settings(max_examples=300, deadline=None)
@given(n=SIZES, count=COUNTS)
def test_hypothesis_slice_rule(n: int, count: int) -> None:
    sizes = slice_sizes(n, count)
    base, extra = divmod(n, count)
    assert len(sizes) == count
    assert sum(sizes) == n
    # the first n mod N slices get one extra element
    assert sizes == [base + 1] * extra + [base] * (count - extra)
    start = 0
    for i, size in enumerate(sizes):
        assert slice_bounds(n, count, i) == (start, start + size)
        start += size
    assert start == n


def test_slice_rule_errors() -> None:
    with pytest.raises(ValueError, match="positive"):
        slice_sizes(5, 0)
    with pytest.raises(ValueError, match=">= 0"):
        slice_sizes(-1, 2)
    with pytest.raises(ValueError, match="outside"):
        slice_bounds(5, 2, 2)
    with pytest.raises(ValueError, match="outside"):
        slice_bounds(5, 2, -1)


def test_pieces_examples() -> None:
    assert pieces(10, 3, 0, 10) == [
        SlicePiece(0, 0, 0, 4),
        SlicePiece(1, 0, 4, 3),
        SlicePiece(2, 0, 7, 3),
    ]
    assert pieces(10, 3, 3, 8) == [
        SlicePiece(0, 3, 3, 1),
        SlicePiece(1, 0, 4, 3),
        SlicePiece(2, 0, 7, 1),
    ]
    assert pieces(10, 3, 5, 5) == []
    assert pieces(0, 3, 0, 0) == []
    assert pieces(2, 3, 0, 2) == [SlicePiece(0, 0, 0, 1), SlicePiece(1, 0, 1, 1)]
    with pytest.raises(ValueError, match="outside"):
        pieces(10, 3, 4, 11)
    with pytest.raises(ValueError, match="outside"):
        pieces(10, 3, 5, 4)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(0, 10**6), count=COUNTS)
def test_hypothesis_pieces_cover_range_exactly(data: st.DataObject, n: int, count: int) -> None:
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    got = pieces(n, count, start, stop)
    position = start
    servers = []
    for p in got:
        assert p.numel > 0
        assert p.global_offset == position  # in order, no gap, no overlap
        lo, hi = slice_bounds(n, count, p.server)
        assert lo <= p.global_offset and p.global_offset + p.numel <= hi
        assert p.local_offset == p.global_offset - lo
        servers.append(p.server)
        position += p.numel
    assert position == stop
    assert servers == sorted(set(servers))


def test_chunk_ranges_examples() -> None:
    assert chunk_ranges(0, 4) == [(0, 0)]
    assert chunk_ranges(3, 4) == [(0, 3)]
    assert chunk_ranges(8, 4) == [(0, 4), (4, 4)]
    assert chunk_ranges(9, 4) == [(0, 4), (4, 4), (8, 1)]
    with pytest.raises(ValueError, match="positive"):
        chunk_ranges(9, 0)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), numel=st.integers(0, 10**6))
def test_hypothesis_chunk_ranges(data: st.DataObject, numel: int) -> None:
    chunk = data.draw(st.integers(max(1, numel // 2000), 10**5))  # at most ~2000 chunks
    got = chunk_ranges(numel, chunk)
    if numel == 0:
        assert got == [(0, 0)]
        return
    position = 0
    for offset, length in got:
        assert offset == position and offset % chunk == 0
        assert 0 < length <= chunk
        position += length
    assert position == numel
    assert len(got) == -(-numel // chunk)
    assert all(length == chunk for _, length in got[:-1])


def test_tensor_parallel_ranges_take_a_slice_of_each_packed_block():
    assert tensor_parallel_ranges(8, 2, 1) == [range(4, 8)]
    # q|k|v of 4 rows each over 2 ranks: rank 1 holds rows 2-3 of each block
    assert tensor_parallel_ranges(12, 2, 1, packed=3) == [range(2, 4), range(6, 8), range(10, 12)]
    covered = sorted(i for r in range(4) for rg in tensor_parallel_ranges(24, 4, r, 3) for i in rg)
    assert covered == list(range(24))  # the parts tile the whole dim exactly once
    with pytest.raises(ValueError, match="3 block"):
        tensor_parallel_ranges(10, 2, 0, packed=3)
    with pytest.raises(ValueError, match="part 2"):
        tensor_parallel_ranges(8, 2, 2)


def test_coverage_finds_overlaps_on_either_side_and_counts_disjoint_ranges() -> None:
    from paramshard.protos.slicing import Coverage

    c = Coverage()
    c.add(10, 5)  # [10, 15)
    c.add(0, 4)  # [0, 4)
    assert c.covered == 9 and c.starts == [0, 10] and c.numel_at(10) == 5
    assert c.numel_at(11) is None
    assert c.clash(3, 2) == (0, 4)  # reaches back into the range before
    assert c.clash(5, 6) == (10, 15)  # reaches into the range after
    assert c.clash(4, 6) is None and c.clash(12, 0) is None  # the gap; an empty chunk
    c.add(4, 6)
    assert c.covered == 15
