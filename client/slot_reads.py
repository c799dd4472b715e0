"""Reads of whole SET slots (an all-gather's parts, a message) whose size the reader may not
know.

A reader that knows nothing reads chunk 0, whose header tells the slot's size and how it is
cut, then the other chunks: two round trips. A reader that can guess (an all-gather's ranks
usually pass tensors of one shape and dtype, as torch.distributed.all_gather requires) reads
every chunk of its guess at once, in one round trip, with ``ReadSlotRequest.guess`` set: an
offset past the slot's end or off its chunk grid is then answered with the slot's header and
no elements, not refused. Every reply carries the slot's header, so each one shows whether the
guess held; when it did not (another size or dtype), the replies are kept and the chunks the
guess missed are read in a second round, as without a guess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from paramshard.client.rpc import Call
from paramshard.protos import codec, slicing
from paramshard.protos import shard_pb2 as pb

__all__ = ["Guess", "read_whole"]

Guess = tuple[int, int, int]
"""(elements, wire dtype, elements per chunk) of the slot a reader expects."""


class _Whole:
    """One slot being read: the array its replies go into, once its size is known."""

    def __init__(self, server: int, key: str, guess: Guess | None) -> None:
        self.server, self.key = server, key
        self.header: pb.SlotHeader | None = None  # chunk 0's reply's
        self.out: np.ndarray | None = None
        self.wire = -1
        if guess is not None:
            numel, self.wire, _ = guess
            self.out = np.empty(numel, dtype=codec.numpy_dtype(self.wire))
        self.got: set[int] = set()  # offsets whose elements are in ``out``
        self.odd: dict[int, bytes] = {}  # offset -> elements of a reply that missed the guess

    def fits(self, header: pb.SlotHeader) -> bool:
        out = self.out
        return (
            out is not None and header.total_numel == out.size and header.chunk.dtype == self.wire
        )

    def take(self, asked: int, guess: bool, reply: Any) -> None:
        """A read's ``on_result`` (the read of the chunk at ``asked``; ``guess``: a guessed
        one): its elements into ``out`` when the slot is as guessed, else kept (a copy: a
        reply in a shared segment is only lent) until its size is known. A reply must be the
        chunk asked for, of the slot chunk 0 described, whole (``codec.BadReply``): one of
        another offset or size left elements of ``out`` unwritten, ``np.empty``'s old bytes."""
        header, data = reply
        c = header.chunk
        if c.numel == 0 and guess:
            return  # a guessed offset where the slot has none (read again in ``rest`` if it has)
        first = self.header or header
        want = slicing.chunk_numel_at(first.total_numel, first.chunk_numel, asked)
        same = (header.total_numel, header.chunk_numel, c.dtype) == (
            first.total_numel, first.chunk_numel, first.chunk.dtype
        )  # fmt: skip
        if c.offset != asked or c.numel != want or not same:
            raise codec.BadReply(
                f"the read of offset {asked:,} got {c.numel:,} elements at offset {c.offset:,}"
                f" of a slot of {header.total_numel:,} (chunk 0: {first.total_numel:,} elements,"
                f" chunks of {first.chunk_numel:,}, dtype {first.chunk.dtype})"
            )
        if asked == 0:
            self.header = header
        values = codec.values_of(data, codec.numpy_dtype(c.dtype), c.numel)  # whole
        if self.fits(header):
            assert self.out is not None
            self.out[c.offset : c.offset + c.numel] = values
            self.got.add(c.offset)
        else:
            self.odd[c.offset] = bytes(data)

    def rest(self, reader: int) -> list[Call]:
        """The reads of the chunks not read yet; ``out`` made to the slot's size first if the
        guess missed it (or there was none), with the replies kept so far."""
        h = self.header
        assert h is not None, "chunk 0 is always read"
        if not self.fits(h):
            self.wire = h.chunk.dtype
            self.out = np.empty(h.total_numel, dtype=codec.numpy_dtype(self.wire))
            for offset, data in self.odd.items():
                got = np.frombuffer(data, dtype=self.out.dtype)
                self.out[offset : offset + got.size] = got
                self.got.add(offset)
        step = h.chunk_numel or max(h.total_numel, 1)
        calls = []
        for offset, numel in slicing.chunk_ranges(h.total_numel, step):
            if offset not in self.got:
                calls.append(self.read(offset, numel * self.out.itemsize, reader))
        return calls

    def read(self, offset: int, nbytes: int, reader: int, guess: bool = False) -> Call:
        """The read of the chunk at ``offset``, of ``nbytes`` (a guess, for the reply's
        buffer)."""
        request = pb.ReadSlotRequest(key=self.key, offset=offset, reader=reader, guess=guess)
        take = partial(self.take, offset, guess)
        return Call(self.server, "ReadSlot", request, take, reply_bytes=nbytes)

    def result(self) -> tuple[np.ndarray, tuple[int, ...], str]:
        assert self.out is not None and self.header is not None
        return self.out, tuple(self.header.shape), codec.dtype_name(self.wire)


def read_whole(
    run: Callable[[list[Call]], Any],
    reader: int,
    parts: Sequence[tuple[int, str]],
    before: Sequence[Call] = (),
    guess: Guess | None = None,
    hint: int = 0,
) -> list[tuple[np.ndarray, tuple[int, ...], str]]:
    """Reads the SET slots ``parts`` ((server, key) each) whole, as ``reader``: (elements,
    shape, dtype name) of each. ``before``: calls sent ahead of the first reads, in the same
    batch (an all-gather's own contribution). ``guess``: the size expected of every part;
    none: ``hint``, the likely bytes of the first chunk (a reply's buffer size)."""
    wholes = [_Whole(server, key, guess) for server, key in parts]
    calls = list(before)
    for w in wholes:
        if guess is None:
            calls.append(w.read(0, hint, reader))
            continue
        numel, wire, chunk_numel = guess
        itemsize = codec.numpy_dtype(wire).itemsize
        for offset, n in slicing.chunk_ranges(numel, chunk_numel):
            calls.append(w.read(offset, n * itemsize, reader, guess=offset > 0))
    run(calls)
    run([call for w in wholes for call in w.rest(reader)])
    return [w.result() for w in wholes]
