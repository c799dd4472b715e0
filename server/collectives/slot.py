"""One reduction slot or mailbox and its chunks: the record that ``SlotStore`` keeps, the hang
doctor (``pending``) reads and the header checks (``slot_checks``) compare against."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from paramshard.protos import codec, slicing
from paramshard.protos import shard_pb2 as pb
from paramshard.server.runtime import arrays, backend
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.limits import MemoryBudget
from paramshard.server.runtime.turns import TurnWaits

__all__ = [
    "Chunk",
    "Slot",
    "SlotMemory",
    "missed",
    "array_charge",
    "slot_charge",
    "CHUNK_RECORD_BYTES",
    "ENTRY_RECORD_BYTES",
]

# What the slot store reserves for its records beside their arrays' bytes, so the memory
# bound holds for slots of few elements too (in review, 150,000 slots of none took 849 MiB
# and were charged nothing). Measured with CPython 3.11: a slot of no element with its chunk
# 4,054 bytes (16-character key) and 5,917 (1,000 characters); a chunk of one element 725.
SLOT_RECORD_BYTES = 4096
"""A slot's record (its lock and condition, counters, its entry in the store), key aside."""
CHUNK_RECORD_BYTES = 768
"""A chunk's record, its arrays aside."""
ARRAY_RECORD_BYTES = 128
"""An array's header: a chunk's accumulator or a contribution kept aside."""
ENTRY_RECORD_BYTES = 96
"""A number a slot keeps in a set: a chunk's reader, a freed chunk's offset (an int and its
set entry; 70-80 bytes each measured in review, with the set's growth)."""


class SlotMemory:
    """What the slots hold (values and records), against ``max_bytes`` (0: no bound of its
    own) and the server's memory budget, paid before anything is allocated.

    A slot's charges count against the caller (its token) that opened it, and one caller may
    hold at most half of the slots' bound (``max_bytes``, else the budget's limit), so the
    teams sharing a server cannot fill each other's room with mailboxes nobody reads, as
    runs and elastic jobs have a share per token. Calls without a token (None) have no share."""

    def __init__(self, max_bytes: int, budget: MemoryBudget) -> None:
        self.max_bytes, self.budget = max_bytes, budget
        self._lock = threading.Lock()
        self.held = 0
        self._by_owner: Counter[str] = Counter()

    def reserve(self, nbytes: int, key: str, owner: str | None = None) -> None:
        """Takes ``nbytes`` for slot ``key`` of ``owner`` or raises RESOURCE_EXHAUSTED
        (nothing taken)."""
        with self._lock:
            if self.max_bytes and self.held + nbytes > self.max_bytes:
                raise ShardError.exhausted(
                    f"slot '{key}': {nbytes:,} more bytes would exceed this server's slot memory"
                    f" limit of {self.max_bytes:,} bytes ({self.held:,} in use)"
                )
            share = (self.max_bytes or self.budget.limit) // 2
            if owner is not None and share and self._by_owner[owner] + nbytes > share:
                raise ShardError.exhausted(
                    f"slot '{key}': {nbytes:,} more bytes would exceed this caller's share of"
                    f" slot memory, {share:,} bytes (half of this server's"
                    f" {'--max-slot-mb' if self.max_bytes else '--max-memory'};"
                    f" {self._by_owner[owner]:,} held by the slots its token opened)"
                )
            self.budget.reserve(nbytes, "slots", f"slot '{key}'")
            self.held += nbytes
            if owner is not None:
                self._by_owner[owner] += nbytes

    def release(self, nbytes: int, owner: str | None = None) -> None:
        with self._lock:
            self.held -= nbytes
            self.budget.release(nbytes, "slots")
            if owner is not None:
                self._by_owner[owner] -= nbytes
                if not self._by_owner[owner]:
                    del self._by_owner[owner]


def slot_charge(key: str) -> int:
    """What a slot's record is charged: two bytes a character of its key beside it."""
    return SLOT_RECORD_BYTES + 2 * len(key)


def array_charge(values: Any) -> int:
    """What an array a chunk holds is charged: its bytes and its header."""
    return int(values.nbytes) + ARRAY_RECORD_BYTES


def missed(total_numel: int, chunk_numel: int, offset: int) -> str:
    """Why a read at ``offset`` of a slot of ``total_numel`` elements cut every ``chunk_numel``
    can never get a chunk (past the slot's end, or not where a chunk starts); "" if it may."""
    if offset >= max(total_numel, 1):
        return f"offset {offset:,} is past its {total_numel:,} elements"
    if chunk_numel and offset % chunk_numel:
        return f"offset {offset:,} does not start a chunk of {chunk_numel:,} elements"
    return ""


class Chunk:
    """One chunk of a slot: its running sum (or message), who contributed and who read it."""

    __slots__ = ("numel", "acc", "contributors", "readers", "head", "staged", "held_by")

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.acc: Any = None
        self.contributors: set[int] = set()
        self.readers: set[int] = set()
        self.head = 0  # rank-order sums: the next contributor to add
        self.staged: dict[int, Any] = {}  # contributor -> its values, until ``head`` gets there
        # the contributor whose own request ``acc`` still is (ContributeRead: no copy while its
        # call waits for the result; SlotStore replaces it before anything writes there)
        self.held_by: int | None = None

    def nbytes(self) -> int:
        held = 0 if self.acc is None else int(self.acc.nbytes)
        return held + sum(int(v.nbytes) for v in self.staged.values())

    def charged(self) -> int:
        """What the store reserved for this chunk: its record, its arrays' and its readers'."""
        arrays = (self.acc is not None) + len(self.staged)
        records = arrays * ARRAY_RECORD_BYTES + len(self.readers) * ENTRY_RECORD_BYTES
        return CHUNK_RECORD_BYTES + self.nbytes() + records

    def add(self, values: Any, op: int) -> None:
        """Reduces ``values`` into ``acc`` by ``op``: in place, or, while ``acc`` is still a
        contributor's own request (``held_by``), into a new array that becomes ``acc`` (the
        same values: one operation of the same two operands, either way)."""
        xp = backend.xp
        fn = xp.maximum if op == pb.MAX else xp.minimum if op == pb.MIN else xp.add
        if self.held_by is None:
            fn(self.acc, values, out=self.acc)
        else:
            self.acc, self.held_by = fn(self.acc, values), None

    def own(self) -> None:
        """``acc`` copied out of its contributor's request, if it is still that (the call
        ends: its memory goes back to the caller)."""
        if self.held_by is not None:
            self.acc, self.held_by = self.acc.copy(), None


class Slot:
    """A reduction slot or mailbox: its header, chunks, waiting readers and why it ended."""

    def __init__(self, key: str, owner: str | None = None) -> None:
        self.key = key
        self.owner = owner  # the caller (token) that opened it: its charges count against it
        self.meta: pb.SlotHeader | None = None  # from the first contribution, without its chunk
        self.dtype = 0  # wire dtype of every contribution and read
        self.chunks: dict[int, Chunk] = {}
        self.freed: set[int] = set()  # offsets of chunks read by all their readers
        self.cond = threading.Condition()
        self.since = time.monotonic()  # opened: its first contribution or read
        self.touched = self.since  # the last contribution or read
        self.waiting: Counter[int] = Counter()  # readers blocked in ReadSlot now
        self.ended: str | None = None  # why it expired or was dropped
        self.conflict: str | None = None  # a refused contribution's why: reads do not wait
        self.turn_waiters = 0  # contributions waiting for their turn (server/runtime/turns.py)
        self.forgotten = False  # its entry left the store: a call that found it looks again

    def complete(self, offset: int) -> bool:
        """Whether the chunk at ``offset`` has all its contributions (``cond`` held)."""
        chunk, meta = self.chunks.get(offset), self.meta
        return chunk is not None and meta is not None and len(chunk.contributors) == meta.expected

    def missed(self, offset: int) -> str:
        """Why a read at ``offset`` can never get a chunk; "" while it may (no contribution
        yet: nobody knows)."""
        m = self.meta
        return "" if m is None else missed(m.total_numel, m.chunk_numel, offset)

    def reply(self, offset: int, numel: int) -> pb.SlotHeader:
        """A read's reply header: the slot's own fields and the chunk at ``offset``, of
        ``numel`` elements (0: a guessed offset where the slot has none)."""
        assert self.meta is not None
        header = pb.SlotHeader()
        header.CopyFrom(self.meta)
        header.chunk.CopyFrom(pb.Chunk(offset=offset, numel=numel, dtype=self.dtype))
        return header

    def chunk_nbytes(self, offset: int) -> int | None:
        """The bytes of the chunk at ``offset`` in its wire dtype (the last chunk's are fewer);
        None before the first contribution. A peek, ``cond`` not held."""
        m = self.meta
        if m is None:
            return None
        numel = slicing.chunk_numel_at(m.total_numel, m.chunk_numel, offset)
        return numel * codec.numpy_dtype(self.dtype).itemsize

    def payload(self, chunk: Chunk) -> Any:
        """A complete chunk's values for a reply, in its wire dtype. It is never written
        again, so the reply may hold a view of it: the serialiser copies it once, straight
        into the message."""
        if self.meta is not None and self.meta.op == pb.SET:
            return backend.to_host(chunk.acc)
        return arrays.wire_array(chunk.acc, self.dtype)

    def wait_turn(self, turns: TurnWaits, h: pb.SlotHeader, nbytes: int, until: float) -> bool:
        """Waits (``cond`` held) until contributor ``h.contributor`` is next on its chunk,
        within the server's bounds (``turns``); True when it waited and the contribution
        should look again (it is then added from its own request, never copied; a slot that
        ended meanwhile fails it there), False when it is to be staged now: no wait was
        allowed, or the ranks disagree about the slot (``conflict``: contributions still
        count)."""
        offset = h.chunk.offset

        def done() -> bool:
            if self.ended is not None or self.conflict is not None or offset in self.freed:
                return True
            chunk = self.chunks.get(offset)
            return (chunk.head if chunk else 0) == h.contributor

        if not turns.wait(self.cond, done, nbytes, until, of=self):
            return False
        return self.conflict is None or self.ended is not None

    def num_chunks(self) -> int:
        assert self.meta is not None
        m = self.meta
        return max(1, -(-m.total_numel // m.chunk_numel)) if m.chunk_numel else 1
