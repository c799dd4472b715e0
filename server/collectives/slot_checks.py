"""What a slot contribution must agree with: its header on its own, and the slot's first one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paramshard.protos import codec, slicing
from paramshard.protos import shard_pb2 as pb
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.request_bounds import check_key, check_shape

if TYPE_CHECKING:
    from paramshard.server.collectives.slot import Slot

__all__ = ["check_header", "check_same", "ordered", "slot_meta"]


def ordered(h: pb.SlotHeader) -> bool:
    """Whether the contributions of this slot are added in contributor order. Two need no
    order: a + b == b + a exactly in IEEE arithmetic; only the grouping of three or more can
    change a sum."""
    floats = h.chunk.dtype not in (pb.INT64, pb.INT32)
    return h.op in (pb.SUM, pb.MEAN) and floats and not h.arrival_order and h.expected > 2


def slot_meta(h: pb.SlotHeader) -> pb.SlotHeader:
    """What every reader's reply header repeats of the first contribution: the slot's own
    fields, listed, never a copy of the whole header. A copy would hand each reader the
    writer's shared segments (``shm``, ``reply_shm``), its contributor number and any unknown
    fields it sent."""
    return pb.SlotHeader(
        key=h.key,
        op=h.op,
        expected=h.expected,
        readers=h.readers,
        total_numel=h.total_numel,
        shape=h.shape,
        chunk_numel=h.chunk_numel,
        arrival_order=h.arrival_order,
    )


def check_header(h: pb.SlotHeader, max_chunk_bytes: int) -> None:
    """``max_chunk_bytes``: the largest chunk a contribution may carry (the server's message
    bound: a larger one could never arrive whole, and its readers would count its bytes
    while they wait)."""
    check_key(h.key, "Contribute")
    label = f"slot '{h.key}'"
    if h.expected == 0 or h.readers == 0:
        raise ShardError.invalid(f"{label}: expected contributors and readers must be >= 1")
    if h.op not in (pb.SUM, pb.MEAN, pb.MAX, pb.MIN, pb.SET):
        raise ShardError.invalid(f"{label}: unknown reduce op {h.op}")
    if h.op == pb.SET and h.expected != 1:
        raise ShardError.invalid(f"{label}: SET takes exactly one contributor, not {h.expected}")
    if h.contributor >= h.expected:
        raise ShardError.invalid(
            f"{label}: contributor {h.contributor} is outside 0..{h.expected - 1}"
        )
    if h.op == pb.MEAN and h.chunk.dtype in (pb.INT64, pb.INT32):
        raise ShardError.invalid(f"{label}: MEAN needs a floating dtype, got integers")
    c = h.chunk
    if h.total_numel and h.chunk_numel == 0:
        raise ShardError.invalid(f"{label}: chunk_numel must be positive")
    if h.total_numel and (c.offset % h.chunk_numel or c.offset >= h.total_numel):
        raise ShardError.invalid(
            f"{label}: offset {c.offset:,} does not start a chunk of {h.chunk_numel:,}"
            f" inside {h.total_numel:,} elements"
        )
    if h.shape:  # a tensor's, for readers that do not know it; empty: not given
        check_shape(h.shape, h.total_numel, label)
    largest = slicing.chunk_numel_at(h.total_numel, h.chunk_numel, 0)  # a slot's first, its largest
    try:
        chunk_bytes = largest * codec.numpy_dtype(c.dtype).itemsize
    except ValueError:
        chunk_bytes = 0  # an unknown dtype: refused with the payload
    if chunk_bytes > max_chunk_bytes:
        raise ShardError.invalid(
            f"{label}: chunks of {chunk_bytes:,} bytes; this server takes at most"
            f" {max_chunk_bytes:,} in a message (--max-receive-mb)"
        )
    want = slicing.chunk_numel_at(h.total_numel, h.chunk_numel, c.offset)
    if c.numel != want:
        raise ShardError.invalid(
            f"{label}: the chunk at offset {c.offset:,} has {want:,} elements, not {c.numel:,}"
        )


def check_same(slot: Slot, h: pb.SlotHeader) -> None:
    meta = slot.meta
    assert meta is not None
    fields = ("op", "expected", "readers", "total_numel", "chunk_numel", "arrival_order")
    mine = [(n, getattr(meta, n)) for n in fields]
    mine += [("shape", list(meta.shape)), ("dtype", slot.dtype)]
    theirs = [getattr(h, n) for n in fields] + [list(h.shape), h.chunk.dtype]
    for (name, old), new in zip(mine, theirs, strict=True):
        if old != new:
            raise ShardError.precondition(
                f"slot '{h.key}': {name} is {old} for earlier contributors, {new} for"
                f" contributor {h.contributor}"
            )
