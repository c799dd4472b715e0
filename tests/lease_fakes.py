"""Stand-ins for the lease table's tests (tests/test_liveness.py, tests/test_late_renewals.py):
a clock the test moves, a stream that records what the table pushes, a rank's renewals."""

from __future__ import annotations

import numpy as np

from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives.leases import LeaseTable
from paramshard.server.collectives.slots import SlotStore

KILL_NOTICE_S = 5.0
"""A peer learns of a killed rank within this long: the stream's end, ``STREAM_GRACE_S`` (1 s)
and one renewal (1 s), with room for a loaded machine; the TTL is 30 s."""


def new_table() -> tuple[LeaseTable, Clock]:
    """A lease table on a fake clock, and the clock."""
    clock = Clock()
    return LeaseTable(SlotStore(), forget_s=600.0, clock=clock), clock


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Stream:
    """A stand-in for an open ``HoldLease`` stream: what the table pushes to it."""

    def __init__(self, run: str = "r", rank: int = 0) -> None:
        self.run, self.rank = run, rank
        self.pushed: list[pb.LeaseReply] = []
        self.stopped = False

    def push(self, reply: pb.LeaseReply) -> None:
        self.pushed.append(reply)

    def stop(self) -> None:
        self.stopped = True


def contribute(
    slots: SlotStore, key: str, contributor: int, expected: int = 2, readers: int = 0
) -> bool:
    """Adds ones to slot ``key`` as ``contributor`` of ``expected`` (read by ``readers``,
    default ``expected``); whether the store took it for a retry."""
    header = pb.SlotHeader(
        key=key,
        op=pb.SUM,
        expected=expected,
        readers=readers or expected,
        contributor=contributor,
        total_numel=4,
        chunk_numel=4,
        chunk=pb.Chunk(offset=0, numel=4, dtype=pb.FLOAT32),
    )
    return slots.contribute(header, memoryview(np.ones(4, dtype=np.float32)).cast("B"))


def lease(rank: int = 0, **kw) -> pb.LeaseRequest:
    return pb.LeaseRequest(run="r", rank=rank, world_size=2, **{"ttl_ms": 2000, **kw})


def keep(leases: LeaseTable, clock: Clock, seconds: float, rank: int) -> pb.LeaseReply:
    """``rank`` renews every second (the client's pace) for ``seconds``; the last reply."""
    end = clock.now + seconds
    while True:
        clock.now = min(clock.now + 1.0, end)
        reply = leases.renew(lease(rank))
        if clock.now >= end:
            return reply
