"""Slice arithmetic: how a flat buffer of n elements is cut over N servers.

AiDotNet's rule (ShardedModelBase.InitializeSharding): split evenly, and the first
``n mod N`` servers get one extra element. Slice i lives on server i.

Tensor parallelism cuts whole tensors rather than flat buffers (Megatron's equal parts along
one dim, ``tensor_parallel_ranges``); that rule lives here too.

This is the one place for that arithmetic. The client, the server, the CLI and export
all import it; it depends on nothing but the standard library, so the server never
pulls in torch through it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "MAX_DIMS",
    "shape_elements",
    "is_shape_of",
    "SlicePiece",
    "slice_bounds",
    "slice_sizes",
    "pieces",
    "chunk_ranges",
    "chunk_numel_at",
    "Coverage",
    "tensor_parallel_ranges",
]


class SlicePiece(NamedTuple):
    """Part of a global range [start, stop) that falls on one server's slice."""

    server: int
    local_offset: int  # offset inside that server's slice
    global_offset: int  # offset inside the flat buffer
    numel: int


def slice_sizes(n: int, num_slices: int) -> list[int]:
    """Sizes of the ``num_slices`` slices of a buffer of ``n`` elements."""
    if num_slices <= 0:
        raise ValueError(f"num_slices must be positive, got {num_slices}")
    if n < 0:
        raise ValueError(f"buffer length must be >= 0, got {n}")
    base, extra = divmod(n, num_slices)
    return [base + 1 if i < extra else base for i in range(num_slices)]


def slice_bounds(n: int, num_slices: int, index: int) -> tuple[int, int]:
    """(start, stop) of slice ``index`` of a buffer of ``n`` elements."""
    if not 0 <= index < num_slices:
        raise ValueError(f"slice index {index} is outside 0..{num_slices - 1}")
    base, extra = divmod(n, num_slices)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def pieces(n: int, num_slices: int, start: int, stop: int) -> list[SlicePiece]:
    """The slices that hold the global range [start, stop), in order."""
    if not 0 <= start <= stop <= n:
        raise ValueError(f"range [{start}, {stop}) is outside a buffer of {n} elements")
    out = []
    for i in range(num_slices):
        lo, hi = slice_bounds(n, num_slices, i)
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            out.append(SlicePiece(i, a - lo, a, b - a))
    return out


def chunk_numel_at(total_numel: int, chunk_numel: int, offset: int) -> int:
    """Elements of the chunk at ``offset`` of a slot of ``total_numel`` cut every
    ``chunk_numel`` (0: one chunk): the last one's are fewer, none past the end. The server
    checks a contribution's chunk by it and sizes a read's reply; a reader checks the reply."""
    return min(chunk_numel or total_numel, max(0, total_numel - offset))


def chunk_ranges(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """Cut [0, numel) into (offset, length) chunks of at most ``chunk_numel``.

    Every rank cuts the same way, so chunks of the same tensor line up across ranks and a
    server can complete (and free) a reduction chunk by chunk.
    """
    if chunk_numel <= 0:
        raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
    if numel == 0:
        return [(0, 0)]
    return [(o, min(chunk_numel, numel - o)) for o in range(0, numel, chunk_numel)]


class Coverage:
    """Disjoint ranges [start, start + numel) received so far, kept sorted.

    Chunks of a slice (or of a replica's bytes) must cover it exactly once: counting their
    sizes alone would take [0, 6) and [1, 7) as 12 of 8 elements. ``clash`` finds an overlap
    before anything is recorded, ``add`` records a chunk, ``covered`` counts what is in.
    """

    def __init__(self) -> None:
        self.starts: list[int] = []
        self._ends: list[int] = []
        self.covered = 0

    def __bool__(self) -> bool:
        return bool(self.starts)

    def numel_at(self, offset: int) -> int | None:
        """The length of the range recorded at exactly ``offset``, None if there is none."""
        i = bisect.bisect_left(self.starts, offset)
        if i < len(self.starts) and self.starts[i] == offset:
            return self._ends[i] - offset
        return None

    def clash(self, offset: int, numel: int) -> tuple[int, int] | None:
        """A recorded range sharing an element with [offset, offset + numel), as
        (start, end); None if there is none."""
        if numel == 0:
            return None
        end = offset + numel
        i = bisect.bisect_left(self.starts, offset)
        for j in (i - 1, i):
            if 0 <= j < len(self.starts) and self.starts[j] < end and offset < self._ends[j]:
                return self.starts[j], self._ends[j]
        return None

    def add(self, offset: int, numel: int) -> None:
        """Records [offset, offset + numel); the caller has checked ``clash``."""
        if numel:
            i = bisect.bisect_left(self.starts, offset)
            self.starts.insert(i, offset)
            self._ends.insert(i, offset + numel)
            self.covered += numel


def tensor_parallel_ranges(
    size: int, parts: int, index: int, packed: int = 1, unit: int = 1
) -> list[range]:
    """The ranges along the split dim (of length ``size`` in the whole tensor) that
    tensor-parallel part ``index`` of ``parts`` holds, in order.

    The dim is ``packed`` equal blocks side by side (3 for a fused q|k|v projection; 1
    otherwise); each part takes its share of every block, so it holds ``packed`` ranges. A
    block is cut in whole ``unit``s (a head's width for attention projections) by the slice
    rule: equal parts when they divide (Megatron's split), else the first ``n mod parts``
    parts get one unit more. ``packed`` or ``unit`` 0 means 1.
    """
    packed, unit = packed or 1, unit or 1
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"tensor-parallel part {index} is outside 0..{parts - 1}")
    if size % packed or (size // packed) % unit:
        raise ValueError(
            f"a dim of {size} does not split into {packed} block(s) of whole units of {unit}"
        )
    block = size // packed
    lo, hi = slice_bounds(block // unit, parts, index)
    return [range(b * block + lo * unit, b * block + hi * unit) for b in range(packed)]


MAX_DIMS = 64
"""Dimensions of a tensor's shape that a request records (a parameter's, a collective's), or a
client takes from a server's word: as many as NumPy's arrays take (NPY_MAXDIMS)."""


def is_shape_of(shape: Sequence[int], numel: int) -> bool:
    """Whether ``shape`` has at most ``MAX_DIMS`` dims, none negative, and ``numel`` elements;
    checked in that order, so a long shape costs no loop over it."""
    return (
        len(shape) <= MAX_DIMS
        and all(d >= 0 for d in shape)
        and (shape_elements(shape, numel) == numel)
    )


def shape_elements(shape: Sequence[int], limit: int) -> int:
    """The elements of ``shape`` (dims >= 0), or -1 once the product passes ``limit``. Python
    ints do not overflow to 0 as int64 would; stopping early keeps a shape of many huge dims
    (a request's or a manifest's) from costing time quadratic in its length."""
    if 0 in shape:
        return 0
    n = 1
    for d in shape:
        n *= d
        if n > limit:
            return -1
    return n
