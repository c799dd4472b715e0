"""One reduction slot or mailbox and its chunks: the record that ``SlotStore`` keeps, the hang
doctor (``pending``) reads and the header checks (``slot_checks``) compare against."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from paramshard.protos import shard_pb2 as pb

__all__ = ["Chunk", "Slot"]


class Chunk:
    """One chunk of a slot: its running sum (or message), who contributed and who read it."""

    __slots__ = ("numel", "acc", "contributors", "readers", "head", "staged")

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.acc: Any = None
        self.contributors: set[int] = set()
        self.readers: set[int] = set()
        self.head = 0  # rank-order sums: the next contributor to add
        self.staged: dict[int, Any] = {}  # contributor -> its values, until ``head`` gets there

    def nbytes(self) -> int:
        held = 0 if self.acc is None else int(self.acc.nbytes)
        return held + sum(int(v.nbytes) for v in self.staged.values())


class Slot:
    """A reduction slot or mailbox: its header, chunks, waiting readers and why it ended."""

    def __init__(self, key: str) -> None:
        self.key = key
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

    def num_chunks(self) -> int:
        assert self.meta is not None
        m = self.meta
        return max(1, -(-m.total_numel // m.chunk_numel)) if m.chunk_numel else 1
